"""Every packed-kernel decision of the bench decoder, timed afterwards on the
model's own calls: is any chosen kernel slower than the plain GEMM there?

A decision is timed at compile time on a weight of the linear's shape
cycling through copies (``wfpass/prepack/choose.py``). This checks it where
it counts: the bench's LLaMA-like decoder (4 layers, d 256, 8 heads / 2 KV
heads, FF 1376) compiled twice, each its own classes and code objects,
``wformat`` (its defaults: the packed kernels it chose) and ``wformat``
with ``prepack.mode="off"`` (the same graphs, every linear the plain GEMM),
both called at 1, 8, 8, 5, 8, 8, 3 tokens (a static graph for 1 token, then
Dynamo's recompile with the length symbolic), then timed at 1, 5 and 8
tokens under ``torch.profiler``. For each linear shape (weight rows x
inputs) and row count M, the time per decoder call of the top-level op that
computes it (``wfpass::packed_linear``, ``wfpass::linear_by_rows``,
``aten::mm`` / ``aten::addmm`` / ``aten::linear``; the 4 layers summed) in
both variants, in ``--rounds`` rounds alternating which variant runs first;
the ratio is the median of the per-round ratios (below 1: the chosen kernel
is faster on the real calls). The profiler adds its own cost per recorded
op to both sides; the packed op records a few more nested ops than the
plain GEMM, so the check leans against the packed kernel.

    python benchmarks/prepack/pack_real_calls.py [--rounds 9] [--calls 40] [--threads 1] [--out FILE]

The decisions are made in this process (``WFPASS_CACHE_DIR`` is set to a
fresh folder unless given), so the check is of this process's choices.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from typing import Dict, Tuple

if "WFPASS_CACHE_DIR" not in os.environ:  # decide afresh, in this process
    os.environ["WFPASS_CACHE_DIR"] = tempfile.mkdtemp(prefix="wfpass-real-calls-")

import torch
from torch.profiler import ProfilerActivity, profile

import wfpass
from wfpass.prepack import kernel as _pk
from wfpass.tools.doctor import cpu_words  # the page names its CPU: figures differ by vendor

_BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_BENCHMARKS, os.path.join(_BENCHMARKS, "linear")]  # _out.py; the decoder of linear/bench_dynamic_decoder.py
from _out import emit  # noqa: E402
from bench_dynamic_decoder import FULL, QUICK, WARM, fresh_decoder_class

#: The ops that compute a linear, outermost first: the first of them on an
#: event's path from the top is the one timed (its nested GEMMs are not).
LINEAR_OPS = ("wfpass::packed_linear", "wfpass::packed_linear_train", "wfpass::linear_by_rows", "aten::linear",
              "aten::addmm", "aten::mm", "aten::matmul")

Key = Tuple[int, int, int]  # (weight rows n, inputs k, rows M)


def _key(evt) -> Key:
    """(n, k, M) of one linear op from its recorded input shapes."""
    shapes = evt.input_shapes
    name = evt.name
    if name in ("aten::mm", "aten::matmul"):
        x, w = shapes[0], shapes[1]
        return w[-1], x[-1], _rows(x)
    if name == "aten::addmm":
        x, w = shapes[1], shapes[2]
        return w[-1], x[-1], _rows(x)
    x = shapes[0]
    if name == "wfpass::linear_by_rows":  # (x, w_block, b_block, sizes, max_rows)
        return shapes[1][0], x[-1], _rows(x)
    if name == "aten::linear":
        return shapes[1][0], x[-1], _rows(x)
    # wfpass ops: (x, weights, biases, rows, ...): the profiler records no
    # shapes for the weights' list, but the int ``rows`` (the output's
    # columns, n) among its concrete inputs.
    return int(evt.concrete_inputs[3]), x[-1], _rows(x)


def _rows(shape) -> int:
    return math.prod(shape[:-1])


def linear_us(prof, calls: int) -> Dict[Key, float]:
    """Microseconds per decoder call of each linear shape's top-level ops."""
    out: Dict[Key, float] = defaultdict(float)
    for evt in prof.events():
        if evt.name not in LINEAR_OPS:
            continue
        parent, nested = evt.cpu_parent, False
        while parent is not None:
            if parent.name in LINEAR_OPS:
                nested = True
                break
            parent = parent.cpu_parent
        if not nested:
            out[_key(evt)] += evt.cpu_time_total / calls
    return dict(out)


def ran_kernels(model) -> Dict[Key, set]:
    """(n, k, M) -> the kernels the packed sites of ``model`` ran at M (a
    shape no site packs is absent: the plain GEMM). Reads the sites the
    packed op keeps (``wfpass/prepack/kernel.py``) and their weights' shapes."""
    params = dict(model.named_parameters())
    out: Dict[Key, set] = defaultdict(set)
    for site in list(_pk._SITES.values()):
        ws = [params.get(name) for name in site.names]
        if not ws or any(w is None for w in ws):
            continue  # another model's site
        n, k = sum(w.shape[0] for w in ws), ws[0].shape[1]
        for m, kern in site.by_rows.items():
            out[(n, k, m)].add(kern)
    return dict(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=40, help="decoder calls profiled per variant, row count and round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 5, 8])
    ap.add_argument("--quick", action="store_true", help="the bench's small decoder (a smoke run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = QUICK if args.quick else FULL
    torch.manual_seed(0)
    base = fresh_decoder_class("base")(**shape).eval()
    variants = {}
    for name, backend in {"chosen": "wformat", "plain": wfpass.backend(prepack={"mode": "off"})}.items():
        model = fresh_decoder_class(name)(**shape).eval()
        model.load_state_dict(base.state_dict())
        variants[name] = (model, torch.compile(model, backend=backend))
    torch.manual_seed(1)
    xs = {n: torch.randn(1, n, shape["d"]) for n in set(WARM) | set(args.tokens)}
    with torch.no_grad():
        for _, fn in variants.values():
            for n in WARM:
                fn(xs[n])
        per: Dict[Tuple[str, int], list] = defaultdict(list)
        for r in range(args.rounds):
            for m in args.tokens:
                order = list(variants) if r % 2 == 0 else list(variants)[::-1]
                for name in order:
                    fn = variants[name][1]
                    for _ in range(3):
                        fn(xs[m])
                    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                        for _ in range(args.calls):
                            fn(xs[m])
                    per[(name, m)].append(linear_us(prof, args.calls))
    kernels = ran_kernels(variants["chosen"][0])
    lines = [
        f"Command: `python benchmarks/prepack/pack_real_calls.py {' '.join(sys.argv[1:] if argv is None else argv)}`  ",
        f"torch {torch.__version__}, {cpu_words()}, {torch.get_num_threads()} thread(s), decoder {shape}, batch 1, forward under "
        f"no_grad after calls at {', '.join(map(str, WARM))} tokens; {args.rounds} rounds of {args.calls} profiled "
        "calls per variant and length. us: per decoder call, the 4 layers' ops of that shape summed (median "
        "round); chosen / plain: the median of the per-round ratios, min-max over rounds.\n",
        "| linear (rows x inputs) | M | kernel chosen | plain GEMM, us | chosen, us | chosen / plain | min-max |",
        "|---|---|---|---|---|---|---|",
    ]
    slower = []
    packed = 0
    for m in args.tokens:
        keys = sorted(set().union(*per[("chosen", m)], *per[("plain", m)]), key=lambda k: (-k[0] * k[1], k))
        for key in keys:
            n, k, rows = key
            if rows != m:
                continue
            kern = "/".join(sorted(kernels.get(key, {"plain"})))
            a = [p.get(key, 0.0) for p in per[("chosen", m)]]
            b = [p.get(key, 0.0) for p in per[("plain", m)]]
            ratios = [x / y for x, y in zip(a, b) if y > 0]
            if not ratios:
                continue
            med = statistics.median(ratios)
            if kern != "plain":
                packed += 1
                if med > 1.0:
                    slower.append(f"{n}x{k} M={m} ({kern}, {med:.2f}x)")
            lines.append(f"| {n}x{k} | {m} | {kern} | {statistics.median(b):.1f} | {statistics.median(a):.1f} | "
                         f"{med:.2f} | {min(ratios):.2f}-{max(ratios):.2f} |")
    lines.append("")
    lines.append(f"Chosen kernels (packed or direct) slower than the plain GEMM on the real calls (median round): {len(slower)} of "
                 f"{packed}" + (": " + ", ".join(slower) if slower else ""))
    return emit(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())
