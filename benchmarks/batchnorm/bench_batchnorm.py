"""BatchNorm in a bf16 CNN: eager, Inductor default and wformat, side by side.

A small HuggingFace ``transformers`` ResNet built from a ``ResNetConfig`` (no
download), cast to bf16. In one run:

1. running statistics: N training-mode steps (forward + backward, weights
   fixed so that only the statistics differ) on a stream whose per-channel
   means and spread drift slowly; relative error of every BatchNorm's
   running_var/running_mean against an fp32 copy fed the same bf16 inputs.
2. training step (forward, backward, SGD step): median time per variant.
3. eval forward under ``no_grad``: median time, plus wformat with
   ``fold_batchnorm=True``.

Timings interleave the variants round-robin (the machine is shared) and report
medians and ratios to Inductor. Writes a markdown table (``--out``).

    .venv/bin/python benchmarks/batchnorm/bench_batchnorm.py --out docs/results/batchnorm.md
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

DT = torch.bfloat16


def build(args):
    from transformers import ResNetConfig, ResNetModel

    cfg = ResNetConfig(num_channels=3, embedding_size=args.width, hidden_sizes=[args.width * m for m in (1, 2, 4, 8)],
                       depths=[args.depth] * 4, layer_type="basic")
    torch.manual_seed(0)
    model = ResNetModel(cfg)
    with torch.no_grad():  # start from non-trivial statistics, like a model that has trained a while
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model.to(DT)


def stream(args, i: int, steps: int) -> torch.Tensor:
    """Batch ``i`` of a fixed random stream whose channel means drift slowly."""
    g = torch.Generator().manual_seed(1000 + i)
    t = i / max(1, steps)
    mean = torch.tensor([0.2, -0.1, 0.4]) + 1.5 * t
    std = 1.0 + 0.8 * t
    x = torch.randn(args.batch, 3, args.size, args.size, generator=g) * std + mean.view(1, 3, 1, 1)
    return x.to(DT)


def loss_of(out) -> torch.Tensor:
    return out.last_hidden_state.float().pow(2).mean() + out.pooler_output.float().mean()


class Counter:
    """A backend wrapper that counts compiled graphs (compiles + recompiles)."""

    def __init__(self, be: Callable):
        self.be, self.graphs = be, 0

    def __call__(self, gm, ex):
        self.graphs += 1
        return self.be(gm, ex)


def inductor_backend():
    from torch._inductor.compile_fx import compile_fx

    return compile_fx


def bns(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm()).item()


def time_interleaved(fns: Dict[str, Callable[[int], None]], reps: int) -> Dict[str, List[float]]:
    times: Dict[str, List[float]] = defaultdict(list)
    names = list(fns)
    for r in range(reps):
        order = names[r % len(names):] + names[: r % len(names)]  # rotate who goes first
        for name in order:
            t0 = time.perf_counter()
            fns[name](r)
            times[name].append(time.perf_counter() - t0)
    return times


def paired_ratio(times: Dict[str, List[float]], name: str, base: str) -> float:
    """Median over repetitions of t[name] / t[base] within the same round: the
    variants of one round run back to back, so a slow drift in machine load
    cancels out of the ratio."""
    return statistics.median(a / b for a, b in zip(times[name], times[base]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--stat-steps", type=int, default=100)
    p.add_argument("--reps", type=int, default=30, help="interleaved training-step repetitions")
    p.add_argument("--eval-reps", type=int, default=200, help="interleaved eval-forward repetitions")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: less exposed to other jobs on a shared machine)")
    p.add_argument("--out", default=None)
    p.add_argument("--warm-cache", action="store_true",
                   help="keep Inductor's on-disk caches (default: off, so first-call times are cold compiles)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.warm_cache:
        from wfpass._torch import aot as _torch_aot

        _torch_aot.disable_compile_caches()

    base = build(args)
    n_bn = len(bns(base))
    n_params = sum(p.numel() for p in base.parameters())
    log = print

    # Variants. Each owns a deep copy (wformat changes its model's BatchNorm dtype).
    models = {name: copy.deepcopy(base) for name in ("eager", "inductor", "wformat")}
    counters = {"inductor": Counter(inductor_backend()), "wformat": Counter(wfpass.backend())}
    fns = {
        "eager": models["eager"],
        "inductor": torch.compile(models["inductor"], backend=counters["inductor"]),
        "wformat": torch.compile(models["wformat"], backend=counters["wformat"]),
    }
    ref32 = copy.deepcopy(base).float()
    mixed = copy.deepcopy(base)  # eager with the BatchNorms moved to fp32 by hand: the ideal
    for _, m in bns(mixed):
        m.float()

    # 1. running statistics -------------------------------------------------------
    log(f"[1/3] running statistics: {args.stat_steps} training-mode steps (fwd+bwd, weights fixed)")
    compile_s = {}
    for m in list(models.values()) + [ref32, mixed]:
        m.train()
    for i in range(args.stat_steps):
        x = stream(args, i, args.stat_steps)
        for name, fn in list(fns.items()) + [("fp32", ref32), ("mixed_eager", mixed)]:
            t0 = time.perf_counter()
            out = fn(x.float() if name == "fp32" else x)
            loss_of(out).backward()
            if i == 0:
                compile_s[name] = time.perf_counter() - t0
        for m in list(models.values()) + [ref32, mixed]:
            m.zero_grad(set_to_none=True)
    stat_rows = []
    for name, model in list(models.items()) + [("mixed_eager", mixed)]:
        ev = [rel(m.running_var, r.running_var) for (_, m), (_, r) in zip(bns(model), bns(ref32))]
        em = [rel(m.running_mean, r.running_mean) for (_, m), (_, r) in zip(bns(model), bns(ref32))]
        dtype = bns(model)[0][1].running_var.dtype
        stat_rows.append((name, str(dtype).replace("torch.", ""), statistics.median(ev), max(ev), statistics.median(em), max(em)))
        log(f"  {name:12s} stats {dtype}: running_var rel err median {statistics.median(ev):.2e} max {max(ev):.2e}; "
            f"running_mean median {statistics.median(em):.2e} max {max(em):.2e}")
    wf_report = str(wfpass.last_report())
    train_graphs = dict((k, c.graphs) for k, c in counters.items())

    # 2. training step --------------------------------------------------------------
    log(f"[2/3] training step (fwd+bwd+SGD), {args.reps} interleaved reps")
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    batches = [stream(args, i, args.reps) for i in range(4)]

    def train_step(name):
        def run(r):
            opts[name].zero_grad(set_to_none=True)
            loss_of(fns[name](batches[r % 4])).backward()
            opts[name].step()
        return run

    for name in fns:  # warm-up
        train_step(name)(0)
    train_t = time_interleaved({name: train_step(name) for name in fns}, args.reps)
    train_graphs2 = dict((k, c.graphs) for k, c in counters.items())

    # 3. eval forward ---------------------------------------------------------------
    log(f"[3/3] eval forward (no_grad), {args.eval_reps} interleaved reps")
    fold_model = copy.deepcopy(models["wformat"])  # trained the same steps; BN already fp32
    counters["wformat+fold"] = Counter(wfpass.backend(fold_batchnorm=True))
    fns["wformat+fold"] = torch.compile(fold_model, backend=counters["wformat+fold"])
    models["wformat+fold"] = fold_model
    # Where folding has something to save: without Inductor, whose eval graph
    # already fuses the BatchNorm into the pointwise kernel after the conv.
    for name, fold in (("wformat[eager]", False), ("wformat[eager]+fold", True)):
        models[name] = copy.deepcopy(models["wformat"])
        counters[name] = Counter(wfpass.backend(inner="eager", fold_batchnorm=fold))
        fns[name] = torch.compile(models[name], backend=counters[name])
    for m in models.values():
        m.eval()
    eval_compile_s = {}
    with torch.no_grad():
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn(batches[0])
            eval_compile_s[name] = time.perf_counter() - t0
        fold_report = wfpass.last_report()
        ref_out = models["wformat"](batches[1]).last_hidden_state.float()
        fold_out = fns["wformat+fold"](batches[1]).last_hidden_state.float()
        wf_out = fns["wformat"](batches[1]).last_hidden_state.float()
        fold_err = rel(fold_out, ref_out)
        wf_err = rel(wf_out, ref_out)

        def fwd(name):
            return lambda r: fns[name](batches[r % 4])

        eval_t = time_interleaved({name: fwd(name) for name in fns}, args.eval_reps)
    n_folded = len([r for r in fold_report.find("batchnorm") if r.detail.get("folded")])
    fold_bytes = sum(r.detail.get("extra_bytes", 0) for r in fold_report.find("batchnorm") if r.detail.get("folded"))

    # Report --------------------------------------------------------------------------
    med = lambda ts: statistics.median(ts) * 1e3  # noqa: E731
    lines = []
    cmd = "OMP_NUM_THREADS=%s " % os.environ["OMP_NUM_THREADS"] if "OMP_NUM_THREADS" in os.environ else ""
    lines.append("# BatchNorm in a bf16 ResNet: eager vs Inductor vs wformat\n")
    lines.append("Command (from the repository root):\n")
    lines.append("```\n" + cmd + ".venv/bin/python benchmarks/batchnorm/bench_batchnorm.py " + " ".join(sys.argv[1:] if argv is None else argv) + "\n```\n")
    from wfpass.tools import doctor

    lines.append(f"Machine: {doctor.cpu_words()}, {os.cpu_count()} CPUs visible, torch {torch.__version__} "
                 f"({torch.get_num_threads()} thread(s)), CPU only, shared with other jobs: timings are noisy, "
                 f"so medians (and minima) of interleaved runs are given: {args.reps} training steps and "
                 f"{args.eval_reps} eval forwards per variant, rotating which variant goes first. First-call times are "
                 f"{'with warm Inductor caches' if args.warm_cache else 'cold compiles (Inductor/AOTAutograd caches off)'}.\n")
    lines.append(f"Model: transformers `ResNetModel` (basic blocks, widths {[args.width * m for m in (1, 2, 4, 8)]}, "
                 f"depth {args.depth} per stage; {n_params / 1e6:.2f} M parameters, {n_bn} BatchNorm2d), bf16, "
                 f"input {args.batch}x3x{args.size}x{args.size}.\n")
    lines.append(f"## Running statistics after {args.stat_steps} training-mode steps\n")
    lines.append("Forward + backward in training mode, weights fixed (so only the statistics differ), on a stream "
                 "whose channel means and spread drift slowly. Relative (norm-wise) error against an fp32 copy "
                 "given the same bf16 inputs; median and max over the BatchNorm layers. `mixed_eager` is eager "
                 "PyTorch with the BatchNorms moved to fp32 by hand: the floor that bf16 activations leave.\n")
    lines.append("| variant | stats dtype | running_var err (median) | (max) | running_mean err (median) | (max) |")
    lines.append("|---|---|---|---|---|---|")
    for name, d, vm, vx, mm, mx in stat_rows:
        lines.append(f"| {name} | {d} | {vm:.2e} | {vx:.2e} | {mm:.2e} | {mx:.2e} |")
    lines.append("")
    lines.append("## Speed (ms per call: median, and min in brackets)\n")
    lines.append("**x faster = Inductor default's time / the variant's time** (above 1: faster than Inductor), "
                 "from the median over rounds of the per-round time ratio, so machine noise that hits a round "
                 "hits both.\n")
    lines.append("`wformat[eager]` rows: wformat's passes with `inner=\"eager\"` (no Inductor), eval only.\n")
    lines.append("| variant | train step | x faster | eval forward | x faster | first call, train (s) | first call, eval (s) | graphs compiled |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for name in fns:
        if name in train_t:
            tr = med(train_t[name])
            trs = f"{tr:.1f} ({min(train_t[name]) * 1e3:.1f}) | {1 / paired_ratio(train_t, name, 'inductor'):.3f}"
        else:
            trs = "- | -"
        ev = med(eval_t[name])
        graphs = counters[name].graphs if name in counters else "-"
        lines.append(f"| {name} | {trs} | {ev:.2f} ({min(eval_t[name]) * 1e3:.2f}) | {1 / paired_ratio(eval_t, name, 'inductor'):.3f} | "
                     f"{f'{compile_s[name]:.1f}' if name in compile_s else '-'} | {eval_compile_s[name]:.1f} | {graphs} |")
    lines.append("")
    lines.append(f"Graphs compiled during the {args.stat_steps} statistics steps: {train_graphs} "
                 f"(after the timed training steps: {train_graphs2}); one training graph each means "
                 "the fp32 cast after wformat's first compile caused no recompile. The eval runs add one graph each (train->eval, grad->no_grad).\n")
    lines.append(f"Folding: {n_folded} of {n_bn} BatchNorms folded into the conv before them, "
                 f"{fold_bytes} bytes of new folded weights; eval output relative difference folded vs. "
                 f"unfolded eager: {fold_err:.2e} (wformat unfolded vs eager: {wf_err:.2e}).\n")
    ratio_train = paired_ratio(train_t, "wformat", "inductor")
    ratio_eval = paired_ratio(eval_t, "wformat", "inductor")
    ratio_fold = paired_ratio(eval_t, "wformat+fold", "inductor")
    wf_var = [r for r in stat_rows if r[0] == "wformat"][0]
    mixed_var = [r for r in stat_rows if r[0] == "mixed_eager"][0]
    ind_var = [r for r in stat_rows if r[0] == "inductor"][0]
    lines.append("## In short\n")
    lines.append(f"- Running statistics: wformat's running_var error (median {wf_var[2]:.1e}) against the floor "
                 f"of BatchNorms moved to fp32 by hand ({mixed_var[2]:.1e}) and plain bf16 Inductor ({ind_var[2]:.1e}).")
    lines.append(f"- Speed: wformat {1 / ratio_train:.3f}x faster than Inductor default for a training step, "
                 f"{1 / ratio_eval:.3f}x for an eval forward.")
    ratio_fold_eager = paired_ratio(eval_t, "wformat[eager]+fold", "wformat[eager]")
    ratio_fold_wf = paired_ratio(eval_t, "wformat+fold", "wformat")
    lines.append(f"- Folded eval: {1 / ratio_fold:.3f}x faster than Inductor default; folded against unfolded "
                 f"wformat, {1 / ratio_fold_wf:.3f}x under Inductor and {1 / ratio_fold_eager:.3f}x without it "
                 "(inner=\"eager\").\n")
    lines.append("<details><summary>wformat report of the training graph</summary>\n\n```\n" + wf_report + "\n```\n</details>\n")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
