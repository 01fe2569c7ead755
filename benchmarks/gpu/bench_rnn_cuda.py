"""RNN weight format on CUDA: time per call against the sequence length T,
side by side in one run, and the cuDNN crossover of the two paths.

Variants (one-layer ``nn.LSTM(hidden, hidden)``, input ``[T, batch, hidden]``):

  eager         nn.LSTM as is (cuDNN, its own flat buffer)
  wf-unfused    backend="wformat", every call on the unfused path (seq_threshold huge)
  wf-fused      every call on the fused path (seq_threshold=0): cuDNN over wfpass's block
  wf-N=2        N = 2, the CPU's default (CUDA's default is N = 0: wf-fused)
  wf-auto       seq_threshold="auto"

Each cell: median of interleaved rounds, each round timing a block of calls
between two ``torch.cuda.synchronize()``. The crossover table calls the two
paths of ``wfpass.rnn.paths`` directly (no compile, no per-call overhead).

    python benchmarks/gpu/bench_rnn_cuda.py --rounds 5 --out docs/results/rnn_cuda.md
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
import torch.nn as nn

import wfpass
from wfpass.rnn.paths import fused_path, unfused_path
from wfpass.rnn.spec import RnnSpec
from wfpass.tools.tables import markdown_table

VARIANTS = {"wf-unfused": 10**6, "wf-fused": 0, "wf-N=2": 2, "wf-auto": "auto"}


def _timed(fns, rounds, block):
    ts = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():  # interleaved: all see the same machine state
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(block):
                f()
            torch.cuda.synchronize()
            ts[k].append((time.perf_counter() - t0) / block)
    return {k: statistics.median(v) * 1e3 for k, v in ts.items()}


def per_call(batch, hidden, lengths, train, rounds, log):
    torch.manual_seed(0)
    base = nn.LSTM(hidden, hidden).cuda()
    models = {"eager": copy.deepcopy(base)}
    models["eager"].flatten_parameters()  # a deep copy loses cuDNN's flat buffer
    fns = {"eager": models["eager"]}
    for name, n in VARIANTS.items():
        models[name] = copy.deepcopy(base)
        fns[name] = torch.compile(models[name], backend=wfpass.backend(rnn={"seq_threshold": n}), dynamic=False)
    rows = {}
    for T in lengths:
        x = torch.randn(T, batch, hidden, device="cuda")

        def step(f, m):
            if train:
                def run():
                    m.zero_grad(set_to_none=True)
                    f(x)[0].sum().backward()
            else:
                def run():
                    with torch.no_grad():
                        f(x)
            return run

        steps = {k: step(fns[k], models[k]) for k in fns}
        for s in steps.values():  # compile and warm up
            s(), s()
        rows[T] = _timed(steps, rounds, 20 if T < 256 else 5)
        log(f"{'train' if train else 'fwd'} {batch}x{hidden} T={T} " + " ".join(f"{k}={v:.3f}" for k, v in rows[T].items()))
    return rows


def crossover(batch, hidden, lengths, train, rounds):
    torch.manual_seed(0)
    lstm = nn.LSTM(hidden, hidden).cuda()
    ws = [p.detach().requires_grad_(train) for p in lstm._flat_weights]
    spec = RnnSpec("lstm", "LSTM", hidden, hidden, 0, 1, False, False, True, 0.0, 0, (), 0)
    h = torch.zeros(1, batch, hidden, device="cuda")
    ratios = []
    for T in lengths:
        x = torch.randn(T, batch, hidden, device="cuda")

        def run(path):
            def go():
                if train:
                    out = path(spec, x, [h, h], ws, True, True, 0.0)[0]
                    torch.autograd.grad(out, ws, torch.ones_like(out))
                else:
                    with torch.no_grad():
                        path(spec, x, [h, h], ws, True, False, 0.0)
            return go

        fns = {"unfused": run(unfused_path), "fused": run(fused_path)}
        for f in fns.values():
            f(), f()
        t = _timed(fns, rounds, 20 if T < 256 else 5)
        ratios.append(t["fused"] / t["unfused"])  # x faster: the unfused path against the fused kernel
    return ratios


def _per_call_table(rows) -> str:
    """``rows[T][variant]`` (ms, eager first): every variant's ms, then eager's time / each other variant's."""
    names = list(next(iter(rows.values())))
    return markdown_table(["T", *(f"{n} ms" for n in names), *(f"{n} x faster" for n in names[1:])],
                          [[T, *(f"{r[n]:.3f}" for n in names), *(f"{r['eager'] / r[n]:.2f}" for n in names[1:])]
                           for T, r in rows.items()])


def _crossover_table(lengths, body) -> str:
    """``body``: per shape and mode, ``[batch x hidden, mode, x faster at every T..., largest T]``."""
    return markdown_table(["batch x hidden", "mode", *(f"T={T}" for T in lengths), "largest T with unfused not slower"],
                          body)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x64,16x256,64x512")
    ap.add_argument("--lengths", default="1,2,4,8,16,32,64,128,512")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_rnn_cuda.py needs CUDA")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    lengths = [int(v) for v in args.lengths.split(",")]
    lines = [
        "# RNN weight format on CUDA: measured results", "",
        f"Command: `python benchmarks/gpu/bench_rnn_cuda.py {' '.join(sys.argv[1:] if argv is None else argv)}`  ",
        f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}. "
        f"Median of {args.rounds} interleaved rounds, ms per call. **x faster** = eager's time / the variant's "
        "time (above 1: faster than eager).", "",
    ]
    start = time.perf_counter()
    for train in (False, True):
        mode = "training step (forward + backward)" if train else "forward (no_grad)"
        for batch, hidden in shapes:
            rows = per_call(batch, hidden, lengths, train, args.rounds, print)
            lines += [f"## {mode}, batch {batch}, hidden {hidden}", "", _per_call_table(rows), ""]
    lines += ["## cuDNN crossover: x faster = the fused kernel's time / the unfused path's time (above 1: unfused faster)", ""]
    body = []
    for batch, hidden in shapes:
        for train in (False, True):
            r = crossover(batch, hidden, lengths, train, args.rounds)
            n = 0
            for T, v in zip(lengths, r):
                if v < 1.0:
                    break
                n = T
            row = [f"{batch} x {hidden}", "fwd+bwd" if train else "fwd", *(f"{v:.2f}" for v in r), str(n)]
            print(f"crossover {row[0]} {row[1]}: " + " ".join(row[2:-1]) + f", largest T with unfused not slower {n}")
            body.append(row)
    lines += [_crossover_table(lengths, body), "", f"Total time {time.perf_counter() - start:.0f} s."]
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
