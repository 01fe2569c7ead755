"""A conv + BatchNorm + 2-layer GRU/LSTM model (speechbrain's CRDNN shape)
trained under ``torch.autocast("cpu", bfloat16)``: training-step time of
eager, Inductor and wformat side by side, and each one's distance from
float32 training after the same SGD steps.

Each variant is its own deep copy with a ``forward`` of its own code object
(Dynamo's cache is per code object); the variants are timed round-robin,
``--rounds`` rounds of ``--steps`` steps, medians of the rounds, ratios to
eager autocast. A variant that raises (eager's oneDNN LSTM has no bf16
primitive on CPUs without AVX-512) is listed as failed.

    python benchmarks/rnn/bench_rnn_autocast.py --threads 1 --out docs/results/rnn_autocast_1thread.md
"""
from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch
import torch.nn as nn

import wfpass
from wfpass.tools.bench import own_code
from wfpass.tools.doctor import cpu_words


class CRDNN(nn.Module):
    def __init__(self, kind: str, feats: int, hidden: int):
        super().__init__()
        self.conv = nn.Conv1d(feats, 64, 3, padding=1)
        self.bn = nn.BatchNorm1d(64)
        self.rnn = getattr(nn, kind)(64, hidden, num_layers=2, batch_first=True)
        self.out = nn.Linear(hidden, 30)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))).transpose(1, 2)
        y, _ = self.rnn(h)
        return self.out(y)


def _step(model, fn, opt, x, R, autocast: bool):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fn(x)
    (out.float() * R).sum().backward()
    opt.step()
    return out


def run(kind: str, args) -> list:
    torch.manual_seed(0)
    base = CRDNN(kind, args.feats, args.hidden)
    x = torch.randn(args.batch, args.feats, args.T)
    R = torch.randn(args.batch, args.T, 30)
    variants = {
        "eager, float32": (False, None),
        "eager autocast": (True, None),
        "torch.compile autocast": (True, "inductor"),
        "wformat autocast": (True, "wformat"),
    }
    state = {}
    for name, (ac, backend) in variants.items():
        m = own_code(copy.deepcopy(base))
        fn = m if backend is None else torch.compile(m, backend=backend)
        opt = torch.optim.SGD(m.parameters(), lr=1e-5)  # small enough that 20+ steps stay on one trajectory
        try:
            outs = [_step(m, fn, opt, x, R, ac).detach().float() for _ in range(3)]  # compile, warm up
            state[name] = (m, fn, opt, ac, outs)
        except RuntimeError as e:
            state[name] = (None, None, None, ac, f"failed: {str(e).splitlines()[0][:80]}")
    times = {name: [] for name in state}
    for _ in range(args.rounds):
        for name, (m, fn, opt, ac, _outs) in state.items():
            if m is None:
                continue
            t0 = time.perf_counter()
            for _ in range(args.steps):
                _step(m, fn, opt, x, R, ac)
            times[name].append((time.perf_counter() - t0) / args.steps)
    ref_m, ref_outs = state["eager, float32"][0], state["eager, float32"][4]
    eager = statistics.median(times["eager autocast"]) if times["eager autocast"] else None
    rows = []
    for name, (m, _fn, _opt, _ac, outs) in state.items():
        if m is None:
            rows.append(f"| {kind} | {name} | {outs} | | | |")
            continue
        med = statistics.median(times[name])
        # Same 3 + rounds*steps SGD steps from the same start: distance from float32 training.
        dist = max((p - q).abs().max().item() / q.abs().max().item() for p, q in zip(m.parameters(), ref_m.parameters()))
        fwd = max((a - b).abs().max().item() / b.abs().max().item() for a, b in zip(outs, ref_outs))
        ratio = f"{eager / med:.2f}x" if eager else "-"
        rows.append(f"| {kind} | {name} | {med * 1e3:.2f} | {ratio} | {fwd:.2e} | {dist:.2e} |")
    report = wfpass.report(state["wformat autocast"][0])
    rnn = report.find("rnn")
    rows.append(f"| {kind} | wformat's RNN row | {rnn[0].action if rnn else 'none'} | | | |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--T", type=int, default=100)
    ap.add_argument("--feats", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--kinds", default="GRU,LSTM")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lines = [
        f"Command: `python benchmarks/rnn/bench_rnn_autocast.py --threads {args.threads}`",
        "",
        f"Machine: {cpu_words()}; {args.threads} thread(s); torch {torch.__version__}; Python {platform.python_version()}",
        "",
        f"Model: Conv1d({args.feats}, 64, 3) + BatchNorm1d + ReLU + 2-layer RNN({args.hidden}) + Linear(30); "
        f"batch {args.batch}, T {args.T}; a training step (forward under bf16 autocast, backward, SGD). "
        f"Median of {args.rounds} interleaved rounds of {args.steps} steps. Distances are relative to float32 "
        f"training from the same start after the same {3 + args.rounds * args.steps} steps.",
        "",
        "| RNN | variant | ms / step | x of eager autocast | forward vs fp32 (first 3 steps) | parameters vs fp32 |",
        "|---|---|---|---|---|---|",
    ]
    for kind in args.kinds.split(","):
        lines += run(kind, args)
    from benchmarks_out import emit  # noqa: E402  (benchmarks/_out.py, its folder on the path below)
    return emit(lines, args.out)


if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import _out as benchmarks_out  # noqa: E402

    sys.modules["benchmarks_out"] = benchmarks_out
    raise SystemExit(main())
