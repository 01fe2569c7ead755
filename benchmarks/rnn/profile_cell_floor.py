"""What a folded LSTMCell loop costs beyond the LSTM kernel it calls: the
loop compiled with wformat against the same weights in an eager
``nn.LSTM``, beside a one-linear model compiled with Inductor against the
same linear eagerly (the compiled call's own cost: Dynamo's guards, the
AOTAutograd wrappers and, in training, the compiled backward's), and the
folded loop with ``inner="eager"`` (no AOTAutograd or Inductor around the
one op the graph holds).

    python benchmarks/rnn/profile_cell_floor.py --out docs/results/cell_floor.md

One process, 1 thread; every variant its own module (its own forward code
object), timed with the bench's ``interleaved`` (9 rounds, the order
rotated each round, a sample of at least 0.1 s), medians. Training
= forward + ``sum().backward()``.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _out.py
from _out import emit  # noqa: E402
from wfpass.tools.doctor import cpu_words  # the page names its CPU: figures differ by vendor


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--lengths", default="32,128")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    import wfpass
    from wfpass.tools.bench import own_code
    from wfpass.tools.bench_timing import interleaved
    from wfpass.tools.bench_models import CellLoop

    rows = []
    for T in (int(t) for t in a.lengths.split(",")):
        torch.manual_seed(0)
        base = CellLoop(64, 128)
        x = torch.randn(T, 4, 64)
        lin = torch.nn.Linear(64, 128)
        variants = {
            "eager nn.LSTM (same weights)": base.as_rnn(),
            "LSTMCell loop, wformat": torch.compile(own_code(copy.deepcopy(base)), backend="wformat", dynamic=False),
            "LSTMCell loop, wformat, inner='eager'": torch.compile(
                own_code(copy.deepcopy(base)), backend=wfpass.backend(inner="eager"), dynamic=False),
            "one Linear, eager": lin,
            "one Linear, Inductor": torch.compile(own_code(copy.deepcopy(lin)), dynamic=False),
        }
        for train in (False, True):
            def step(m):
                if train:
                    return lambda: m(x).sum().backward()

                def f():
                    with torch.no_grad():
                        m(x)
                return f

            fns = {k: step(m) for k, m in variants.items()}
            for f in fns.values():  # compiled, and past Dynamo's first calls
                f()
                f()
            med = {k: t.median * 1e6 for k, t in interleaved(fns, rounds=9, min_s=0.1).items()}
            rows.append((T, "training" if train else "inference", med))
            print(T, train, {k: round(v, 1) for k, v in med.items()}, flush=True)
    names = list(rows[0][2])
    lines = [f"Command: `python benchmarks/rnn/profile_cell_floor.py" + (f" --out {a.out}`" if a.out else "`"), "",
             f"torch {torch.__version__}, {cpu_words()}, 1 thread. nn.LSTMCell(64, 128) stepped over T steps, batch 4; times in us "
             "per call (median of 9 interleaved rounds, a sample of at least 0.1 s each). *floor*: Inductor's one-Linear call minus the "
             "eager one, the cost of a compiled call with nothing to gain in it; *gap*: the folded loop minus the "
             "eager nn.LSTM.", "",
             "| T | step | " + " | ".join(names) + " | floor | gap | wformat / eager nn.LSTM |",
             "|---|---|" + "---|" * (len(names) + 3)]
    for T, step_name, med in rows:
        floor = med["one Linear, Inductor"] - med["one Linear, eager"]
        gap = med["LSTMCell loop, wformat"] - med["eager nn.LSTM (same weights)"]
        ratio = med["eager nn.LSTM (same weights)"] / med["LSTMCell loop, wformat"]
        lines.append(f"| {T} | {step_name} | " + " | ".join(f"{med[k]:.0f}" for k in names)
                     + f" | {floor:.0f} | {gap:.0f} | {ratio:.2f}x |")
    return emit(lines, a.out)


if __name__ == "__main__":
    sys.exit(main())
