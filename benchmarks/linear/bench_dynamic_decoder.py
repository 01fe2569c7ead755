"""The bench's LLaMA-like decoder after Dynamo's dynamic recompile,
wformat against torch.compile's default (Inductor), one process.

    python benchmarks/linear/bench_dynamic_decoder.py [--rounds 9] [--calls 30] [--threads 1] [--tokens 1 3 5 8]
                                               [--train] [--split] [--out FILE]
    python benchmarks/linear/bench_dynamic_decoder.py --group [--rounds 31]

What it measures: the decoder of ``python -m wfpass bench`` (4 layers,
d_model 256, 8 heads / 2 KV heads, SwiGLU 1376, batch 1; a smaller one with
``--quick``) compiled by each variant, then called at 1, 8, 8, 5, 8, 8, 3
tokens: the call at 1 compiles a static graph (Dynamo specializes a size of
1), the call at 8 makes Dynamo recompile with the length symbolic, and
every later length runs that symbolic graph. Then each variant is timed at
each of ``--tokens``: 1 token runs the static graph, every other length the
symbolic one. Forward under ``no_grad`` (the default), or with ``--train``
a training step: forward, ``(out * R).sum()`` with a fixed random R,
backward (the warm-up calls are training steps too).

Variants: ``inductor`` (``torch.compile``'s default), ``wformat`` (its
defaults: the sibling-linear format, then the packed-weight format) and
``wformat pack off`` (the sibling-linear format alone); with ``--split``
also ``wformat split``, the sibling-linear format alone with
``linear.path="split"``: one GEMM per member at every row count, which is
what the symbolic graph ran at every M before it chose per call (an A/B in
one process, printed as the per-round ratio of the two). Every variant has
classes of its own, compiled from the same source (``exec`` of the model
code per variant): Dynamo's cache and its recompile limit are per code
object across backends, so variants sharing ``Decoder.forward`` would
share (and fill) one cache. The weights are the same in all of them.

``--group``: the cost of the choice per call alone: one Q/K/V group
(64+32+32 rows over 64 inputs, no bias) after the same warm-up calls,
timed at 3 and 8 rows under Inductor, wformat (pack off, choosing per
call) and wformat with ``linear.path="split"``, microseconds per call
(the median over rounds of 300 calls each).

A cell is the median over ``--rounds`` rounds of the per-call median of
``--calls`` calls; within a round the variants are interleaved, so noise
from other processes on the machine falls on all of them alike; ``±`` is
half the interquartile range over rounds, in percent of the median. The
``inductor / variant`` columns (above 1: the variant is faster) are the
median over rounds of that round's ratio (the two times of one ratio were
taken moments apart), ± half its interquartile range. Also printed: the graphs Dynamo compiled per variant (a recompile per length
would show here), the largest difference from eager over the timed
lengths, and wformat's report rows for the first layer's Q/K/V group (the
path each row count took, and its counters).
"""
from __future__ import annotations

import argparse
import inspect
import os
import platform
import statistics
import sys
import time
from typing import Dict, List

import torch

import wfpass
from wfpass.tools import bench_models
from wfpass.tools.doctor import cpu_words  # the page names its CPU: figures differ by vendor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _out.py
from _out import emit  # noqa: E402

WARM = (1, 8, 8, 5, 8, 8, 3)
FULL = dict(d=256, layers=4, heads=8, kv_heads=2, ffn=1376)
QUICK = dict(d=64, layers=2, heads=4, kv_heads=2, ffn=172)


def fresh_decoder_class(tag: str):
    """``Decoder`` (and its layer and norm) compiled anew from the bench's
    source: classes whose ``forward`` code objects are this variant's own."""
    src = "\n\n".join(inspect.getsource(getattr(bench_models, n)) for n in ("RMSNorm", "DecoderLayer", "Decoder"))
    ns = {"torch": torch, "nn": torch.nn, "F": torch.nn.functional, "__name__": f"decoder_{tag}"}
    exec(compile("from __future__ import annotations\n" + src, f"<decoder {tag}>", "exec"), ns)
    return ns["Decoder"]


def variants(shape: dict, split: bool) -> Dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    base = bench_models.Decoder(**shape)
    out = {"eager": base}
    backends = {"inductor": "inductor", "wformat": "wformat", "wformat pack off": wfpass.backend(prepack={"mode": "off"})}
    if split:
        backends["wformat split"] = wfpass.backend(prepack={"mode": "off"}, linear={"path": "split"})
    for name, backend in backends.items():
        model = fresh_decoder_class(name.replace(" ", "_"))(**shape)
        model.load_state_dict(base.state_dict())
        out[name] = (model, torch.compile(model, backend=backend))
    return out


def step(fn, x, train: bool, r):
    if not train:
        with torch.no_grad():
            return fn(x)
    out = fn(x)
    (out * r).sum().backward()
    return out.detach()


def call_ms(fn, x, calls: int, train: bool, r) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        step(fn, x, train, r)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graphs_of(model) -> int:
    """The graphs Dynamo holds for this variant's ``Decoder.forward``."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(type(model).forward.__code__))


def spread(v: List[float]) -> str:
    q = statistics.quantiles(v, n=4) if len(v) >= 2 else [v[0]] * 3
    med = statistics.median(v)
    return f"{med:.3f} ±{(q[2] - q[0]) / 2 / med * 100:.0f}%"


GROUP_SRC = """
class Group(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(64, n, bias=False) for n in (64, 32, 32))

    def forward(self, x):
        return self.q(x).sum(-1) + self.k(x).sum(-1) + self.v(x).sum(-1)
"""


def group_cost(rounds: int) -> List[str]:
    """``--group``: one Q/K/V group, each variant its own class."""
    def make(tag):
        ns = {"nn": torch.nn}
        exec(compile(GROUP_SRC, f"<group {tag}>", "exec"), ns)
        return ns["Group"]()

    torch.manual_seed(0)
    base = make("base")
    backends = {"inductor": "inductor", "wformat pack off": wfpass.backend(prepack={"mode": "off"}),
                "wformat split": wfpass.backend(prepack={"mode": "off"}, linear={"path": "split"})}
    fns = {}
    for name, backend in backends.items():
        m = make(name.replace(" ", "_"))
        m.load_state_dict(base.state_dict())
        fns[name] = torch.compile(m, backend=backend)
    xs = {n: torch.randn(1, n, 64) for n in set(WARM)}
    out = []
    with torch.no_grad():
        for f in fns.values():
            for n in WARM:
                f(xs[n])
        for n in (3, 8):
            per = {k: [] for k in fns}
            for _ in range(rounds):
                for k, f in fns.items():
                    t = time.perf_counter()
                    for _ in range(300):
                        f(xs[n])
                    per[k].append((time.perf_counter() - t) / 300 * 1e6)
            out.append(f"M={n}: " + ", ".join(f"{k} {statistics.median(v):.1f} us" for k, v in per.items())
                       + f"; per-call choice minus split, median of per-round differences: "
                       f"{statistics.median([a - b for a, b in zip(per['wformat pack off'], per['wformat split'])]):.1f} us")
    return out


def ratio_cell(v: List[float]) -> str:
    q = statistics.quantiles(v, n=4) if len(v) >= 2 else [v[0]] * 3
    return f"{statistics.median(v):.2f}x ±{(q[2] - q[0]) / 2:.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 3, 5, 8])
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--quick", action="store_true", help="the bench's small decoder (a smoke run)")
    ap.add_argument("--split", action="store_true", help="also wformat with linear.path='split' (pack off)")
    ap.add_argument("--group", action="store_true", help="the cost of the choice on one Q/K/V group")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.group:
        return emit([f"Command: `python benchmarks/linear/bench_dynamic_decoder.py {' '.join(sys.argv[1:] if argv is None else argv)}`  ",
                     f"torch {torch.__version__}, {torch.get_num_threads()} torch thread(s), one Q/K/V group "
                     "(64+32+32 rows over 64 inputs), forward under no_grad.\n"] + group_cost(args.rounds), args.out)
    shape = QUICK if args.quick else FULL
    vs = variants(shape, args.split)
    eager = vs.pop("eager")
    d = shape["d"]
    torch.manual_seed(1)
    r = {n: torch.randn(1, n, d) for n in set(WARM) | set(args.tokens)}
    xs = {n: torch.randn(1, n, d) for n in set(WARM) | set(args.tokens)}
    if args.train:
        eager.train()
        for model, _ in vs.values():
            model.train()
    else:
        eager.eval()
        for model, _ in vs.values():
            model.eval()
    compile_s = {}
    for name, (model, fn) in vs.items():
        t0 = time.perf_counter()
        for n in WARM:
            step(fn, xs[n], args.train, r[n])
        compile_s[name] = time.perf_counter() - t0
        if args.train:
            model.zero_grad(set_to_none=True)
    worst = {name: 0.0 for name in vs}
    with torch.set_grad_enabled(args.train):  # the graph the timing runs
        for n in args.tokens:
            want = eager(xs[n])
            for name, (_, fn) in vs.items():
                got = fn(xs[n])
                worst[name] = max(worst[name], float((got - want).abs().max() / want.abs().max()))
        for model in [eager] + [model for model, _ in vs.values()]:
            model.zero_grad(set_to_none=True)
    graphs_after_warm = {name: graphs_of(model) for name, (model, _) in vs.items()}
    per = {(n, name): [] for n in args.tokens for name in vs}
    for _ in range(args.rounds):
        for n in args.tokens:
            for name, (_, fn) in vs.items():
                per[(n, name)].append(call_ms(fn, xs[n], args.calls, args.train, r[n]))
    graphs_after = {name: graphs_of(model) for name, (model, _) in vs.items()}

    what = "training step (forward, (out * R).sum() backward)" if args.train else "forward under no_grad"
    lines = [
        f"Command: `python benchmarks/linear/bench_dynamic_decoder.py {' '.join(sys.argv[1:] if argv is None else argv)}`  ",
        f"torch {torch.__version__}, {cpu_words()}, {torch.get_num_threads()} torch thread(s), "
        f"Python {platform.python_version()}. Decoder {shape}, batch 1, {what}, after calls at "
        f"{', '.join(map(str, WARM))} tokens. ms per call: median over {args.rounds} interleaved rounds of the "
        f"per-call median of {args.calls} calls, ± half the interquartile range over rounds; inductor / variant: "
        f"the median of the per-round ratios, ± half their interquartile range.\n",
        "| tokens | " + " | ".join(vs) + " | " + " | ".join(f"inductor / {n}" for n in vs if n != "inductor") + " |",
        "|---" * (1 + len(vs) + len(vs) - 1) + "|",
    ]
    for n in args.tokens:
        ratios = {name: [a / b for a, b in zip(per[(n, "inductor")], per[(n, name)])] for name in vs}
        lines.append(f"| {n} | " + " | ".join(spread(per[(n, name)]) for name in vs) + " | "
                     + " | ".join(ratio_cell(ratios[name]) for name in vs if name != "inductor") + " |")
    if "wformat split" in vs:
        lines.append("\nwformat split / wformat pack off (the same format, one GEMM per member at every M against "
                     "the choice per call; above 1: the choice per call is faster), median of the per-round ratios: "
                     + ", ".join(f"{n} tokens {ratio_cell([a / b for a, b in zip(per[(n, 'wformat split')], per[(n, 'wformat pack off')])])}"
                                 for n in args.tokens))
    lines.append("")
    lines.append("Graphs Dynamo compiled (after the warm-up / after timing): "
                 + ", ".join(f"{name} {graphs_after_warm[name]} / {graphs_after[name]}" for name in vs))
    lines.append("Largest |variant - eager| / max |eager| at the timed lengths: "
                 + ", ".join(f"{name} {worst[name]:.1e}" for name in vs))
    lines.append("Warm-up calls (compiles included), s: " + ", ".join(f"{name} {compile_s[name]:.1f}" for name in vs))
    for name in ("wformat", "wformat pack off"):
        model = vs[name][0]
        rows = [row for row in wfpass.report(model).find("linear", "rewritten")
                if any(p.startswith("layers.0.") for p in row.params)]
        for row in rows:
            counts = {k: v for k, v in row.stats.items() if k.endswith("_calls") and v}
            lines.append(f"\n{name}, {row.params[0].rsplit('.', 2)[0]} group: {row.reason} ({counts})")
    return emit(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())
