"""Where the time of a folded eval forward goes: bf16 ResNet, Inductor.

``fold_batchnorm=True`` computes the folded conv weights in the compiled
graph, on every call, from the live running statistics. This benchmark
splits an eval forward into what folding saves and what it costs, with every
variant timed interleaved (round-robin, rotating who goes first) in one run:

* ``inductor``: Inductor default, BatchNorm not folded (it fuses the eval
  BatchNorm's multiply-add into the pointwise kernel after each conv).
* ``wformat``: wformat, not folded.
* ``wformat+fold``: wformat with ``fold_batchnorm=True``.
* ``folded_by_hand``: the same model with every BatchNorm folded into its
  conv once, outside the graph (``torch.nn.utils.fusion``), compiled with
  Inductor: the best a fold can do, with nothing recomputed per call.
* ``fold_only``: the graph's fold computation alone (``folded_params`` of
  every conv/BatchNorm pair), compiled with Inductor: what the fold costs
  per call.
* ``wformat[eager]``, ``wformat[eager]+fold``: wformat's passes with
  ``inner="eager"`` (no Inductor): there the eval BatchNorm is a separate
  pass over the activations, which folding removes.
* ``inductor+freezing`` (``--freezing``): Inductor with
  ``torch._inductor.config.freezing = True``, which treats parameters as
  constants, folds conv-BatchNorm itself and pre-packs the weights; the
  model's parameters can then no longer change.

    .venv/bin/python benchmarks/batchnorm/bench_fold.py --reps 100 --freezing --out docs/results/batchnorm_fold.md
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections import defaultdict
from typing import Callable, Dict, List

import torch

import wfpass
from wfpass.batchnorm.kernels import folded_params
from wfpass.tools.tables import markdown_table
from wfpass.tools.doctor import cpu_words  # the page names its CPU: figures differ by vendor

DT = torch.bfloat16


def build(width: int, depth: int, stages: int):
    from transformers import ResNetConfig, ResNetModel

    cfg = ResNetConfig(num_channels=3, embedding_size=width, hidden_sizes=[width * 2 ** i for i in range(stages)],
                       depths=[depth] * stages, layer_type="basic")
    torch.manual_seed(0)
    model = ResNetModel(cfg)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model.to(DT).eval()


def conv_bn_pairs(model):
    """(conv, bn) of every HF ResNetConvLayer (a conv followed by its BatchNorm)."""
    out = []
    for m in model.modules():
        conv, bn = getattr(m, "convolution", None), getattr(m, "normalization", None)
        if isinstance(conv, torch.nn.Conv2d) and isinstance(bn, torch.nn.BatchNorm2d):
            out.append((conv, bn))
    return out


def fold_by_hand(model):
    """Every BatchNorm folded into its conv once (fp32 arithmetic, as the pass)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for conv, bn in conv_bn_pairs(model):
            wf, bf = folded_params(bn.eps, conv.weight, conv.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias)
            conv.weight.copy_(wf)
            conv.bias = torch.nn.Parameter(bf)
            bn.reset_parameters()
            bn.running_var.fill_(1.0 - bn.eps)  # identity: (x - 0) / sqrt(1 - eps + eps) * 1 + 0
            bn.eps = 0.0
    # The identity BatchNorms stay in the graph as a multiply-add Inductor
    # fuses into the kernel after the conv, like ``inductor``'s own; replace
    # them so the graph holds the convs alone.
    for m in model.modules():
        if isinstance(getattr(m, "normalization", None), torch.nn.BatchNorm2d):
            m.normalization = torch.nn.Identity()
    return model


def time_interleaved(fns: Dict[str, Callable[[int], None]], reps: int) -> Dict[str, List[float]]:
    times: Dict[str, List[float]] = defaultdict(list)
    names = list(fns)
    for r in range(reps):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            t0 = time.perf_counter()
            fns[name](r)
            times[name].append(time.perf_counter() - t0)
    return times


def paired_ratio(times, name, base) -> float:
    """x faster: the median over rounds of (base's time / name's time) in the
    same round; above 1, ``name`` is faster than ``base``."""
    return statistics.median(b / a for a, b in zip(times[name], times[base]))


def run_config(args, width, stages, batch, size, log):
    from torch._inductor.compile_fx import compile_fx

    base = build(width, args.depth, stages)
    pairs = conv_bn_pairs(base)
    weight_bytes = sum(c.weight.numel() * c.weight.element_size() for c, _ in pairs)
    xs = [torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(i)).to(DT) for i in range(4)]
    models = {n: copy.deepcopy(base) for n in ("inductor", "wformat", "wformat+fold")}
    models["folded_by_hand"] = fold_by_hand(base)
    models["wformat[eager]"], models["wformat[eager]+fold"] = copy.deepcopy(base), copy.deepcopy(base)
    fns = {
        "inductor": torch.compile(models["inductor"], backend=compile_fx),
        "wformat": torch.compile(models["wformat"], backend=wfpass.backend()),
        "wformat+fold": torch.compile(models["wformat+fold"], backend=wfpass.backend(fold_batchnorm=True)),
        "folded_by_hand": torch.compile(models["folded_by_hand"], backend=compile_fx),
        "wformat[eager]": torch.compile(models["wformat[eager]"], backend=wfpass.backend(inner="eager")),
        "wformat[eager]+fold": torch.compile(models["wformat[eager]+fold"], backend=wfpass.backend(inner="eager", fold_batchnorm=True)),
    }
    fold_src = [(bn.eps, c.weight, c.bias, bn.running_mean.float(), bn.running_var.float(), bn.weight.float(), bn.bias.float())
                for c, bn in conv_bn_pairs(models["wformat+fold"])]

    def fold_all(srcs):
        return [folded_params(*s) for s in srcs]

    fold_only = torch.compile(fold_all, backend=compile_fx)
    calls = {name: (lambda fn: lambda r: fn(xs[r % 4]))(fn) for name, fn in fns.items()}
    calls["fold_only"] = lambda r: fold_only(fold_src)
    if args.freezing:
        import torch._inductor.config as ic

        models["inductor+freezing"] = copy.deepcopy(base)
        with ic.patch(freezing=True):
            frozen = torch.compile(models["inductor+freezing"], backend=compile_fx)
            with torch.no_grad():
                frozen(xs[0])
        calls["inductor+freezing"] = lambda r: frozen(xs[r % 4])
    with torch.no_grad():
        ref = base(xs[1]).last_hidden_state.float()
        errs = {}
        for name, fn in list(fns.items()) + ([("inductor+freezing", frozen)] if args.freezing else []):
            out = fn(xs[1]).last_hidden_state.float()
            errs[name] = ((out - ref).norm() / ref.norm()).item()
        for c in calls.values():  # warm-up
            c(0)
        log(f"  timing {len(calls)} variants x {args.reps} interleaved reps")
        t = time_interleaved(calls, args.reps)
    med = {n: statistics.median(v) * 1e3 for n, v in t.items()}
    ratios = {n: paired_ratio(t, n, "inductor") for n in t}
    eager_fold = paired_ratio(t, "wformat[eager]+fold", "wformat[eager]")  # x faster folded than unfolded
    return dict(width=width, stages=stages, batch=batch, size=size, pairs=len(pairs), weight_bytes=weight_bytes,
                med=med, ratios=ratios, errs=errs, eager_fold=eager_fold)


def _table(rows: List[dict], names: List[str]) -> str:
    """One line per config: ms per call and x faster than Inductor for every variant in ``names``."""
    return markdown_table(
        ["width, stages, input", "conv weights (bytes)", *names],
        [[f"{r['width']}, {r['stages']}, {r['batch']}x3x{r['size']}x{r['size']}", f"{r['weight_bytes']:,}",
          *(f"{r['med'][n]:.2f} ms ({r['ratios'][n]:.3f}x)" for n in names)] for r in rows])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="32x4x8x32,32x4x8x64,32x4x1x32,64x4x8x32",
                   help="comma-separated WIDTHxSTAGESxBATCHxSIZE")
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--freezing", action="store_true", help="also time Inductor with freezing=True")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for cfg in args.configs.split(","):
        w, s, b, sz = (int(v) for v in cfg.split("x"))
        print(f"config width {w}, {s} stages, input {b}x3x{sz}x{sz}")
        torch._dynamo.reset()
        rows.append(run_config(args, w, s, b, sz, print))
    names = list(rows[0]["med"])
    lines = ["# Folded eval BatchNorm under Inductor: what it saves, what it costs\n",
             "Command (from the repository root):\n",
             "```\n.venv/bin/python benchmarks/batchnorm/bench_fold.py " + " ".join(sys.argv[1:] if argv is None else argv) + "\n```\n",
             f"Machine: {cpu_words()}, {os.cpu_count()} CPUs visible, torch {torch.__version__} "
             f"({torch.get_num_threads()} thread(s)), shared with other jobs. Model: transformers `ResNetModel` "
             f"(basic blocks, depth {args.depth} per stage), bf16, eval, `no_grad`. {args.reps} interleaved rounds; "
             "ms per call is the median. **x faster** (in brackets) = Inductor's time / the variant's time, the median "
             "over rounds of that ratio in the same round: above 1, the variant is faster than Inductor's unfolded model; "
             "for `fold_only` (the fold computed alone), how many times that computation fits in Inductor's whole forward.\n",
             _table(rows, names), ""]
    lines.append("Without Inductor, x faster folded than unfolded (`wformat[eager]` time / `wformat[eager]+fold` time, "
                 "median of per-round ratios): " + "; ".join(f"{r['width']}/{r['batch']}x{r['size']}: {r['eager_fold']:.3f}x" for r in rows) + "\n")
    lines.append("Output relative difference to the unfolded eager model (bf16): " + "; ".join(
        f"{r['width']}/{r['batch']}x{r['size']}: " + ", ".join(f"{n} {e:.1e}" for n, e in r["errs"].items()) for r in rows) + "\n")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
