"""Per-call cost of wfpass's layout check, per fused member.

Compiles a model of L blocks (q/k/v and gate/up each a fused group) with
``backend=wformat``, then times, interleaved over rounds, the returned
callable (checks + compiled graph) against the compiled graph alone
(``call.__wrapped_compiled__``), on the same arguments. The difference
divided by the number of fused members is the check's cost per member.

    python benchmarks/overall/bench_runtime.py --out docs/results/runtime_overhead.md
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn as nn

import wfpass
from wfpass.tools.tables import markdown_table
from wfpass.tools.doctor import cpu_words  # the page names its CPU: figures differ by vendor


class Block(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.gate, self.up = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)

    def forward(self, x):
        return self.q(x) + self.k(x) + self.v(x) + self.gate(x) * self.up(x)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="blocks in the model (2 fused groups, 8 members each)")
    ap.add_argument("--calls", type=int, default=2000, help="calls per timing")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds; the median is reported")
    ap.add_argument("--out", default=None, help="write a markdown table here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = nn.Sequential(*[Block() for _ in range(a.layers)])
    captured = {}
    be = wfpass.backend(inner="eager", linear={"path": "fused"})

    def grab(gm, ex):
        fn = be(gm, ex)
        captured["call"], captured["args"] = fn, None
        return fn

    torch.compile(model, backend=grab)(torch.randn(1, 64))
    call = captured["call"]
    sites = call._wfpass_sites
    members = sum(len(s.idx) for s in sites)
    # The arguments Dynamo passes to the backend's callable, captured once.
    args_holder = {}

    def spy_backend(gm, ex):
        fn = be(gm, ex)

        def spy(*xs):
            args_holder["args"] = xs
            return fn(*xs)

        return spy

    torch._dynamo.reset()
    torch.compile(model, backend=spy_backend)(torch.randn(1, 64))
    args = args_holder["args"]
    from wfpass.core.runtime import guarded_call

    checked = guarded_call(lambda *xs: None, sites, lambda *xs: None, [])
    bare = lambda *xs: None  # noqa: E731
    t_checked, t_bare = [], []
    for _ in range(a.rounds):
        for fn, acc in ((checked, t_checked), (bare, t_bare)):
            t0 = time.perf_counter()
            for _ in range(a.calls):
                fn(*args)
            acc.append((time.perf_counter() - t0) / a.calls)
    per_call = statistics.median(t_checked) - statistics.median(t_bare)
    rows = [
        ("fused groups checked per call", f"{len(sites)}"),
        ("members checked per call", f"{members}"),
        ("check cost per call (us, median of rounds)", f"{per_call * 1e6:.2f}"),
        ("check cost per member (us)", f"{per_call * 1e6 / members:.3f}"),
    ]
    table = markdown_table(["quantity", "value"], rows)
    text = (f"Per-call layout check, {a.layers} blocks, torch {torch.__version__}, {cpu_words()}, 1 thread.\n\n"
            f"Command: `python benchmarks/overall/bench_runtime.py {' '.join(argv or sys.argv[1:])}`\n\n{table}\n")
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
