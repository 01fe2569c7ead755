"""The bench decoder at one token (static decode) under Inductor and under
wformat with the default budget for packed copies, without a budget, with
packing off and with ``prepack.mode="always"``: every variant its own deep copy
and its own forward code object in one process, 9 interleaved rounds of
~0.2 s, medians and the median of per-round ratios; then what the report
says of the fused gate/up weight (its kernel and copy's bytes).

    python benchmarks/prepack/decode_budget.py
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import wfpass
from wfpass.tools.bench import own_code
from wfpass.tools.bench_models import Decoder


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = Decoder().eval()
    x = torch.randn(1, 1, 256)
    specs = {"inductor": "inductor", "wformat": "wformat",
             "wformat, no budget": wfpass.backend(prepack={"max_bytes": None}),
             "wformat, packing off": wfpass.backend(prepack={"mode": "off"}),
             "wformat, pack always": wfpass.backend(prepack={"mode": "always"})}
    variants = {}
    for name, be in specs.items():
        m = own_code(copy.deepcopy(base))  # a forward code object of its own
        variants[name] = (m, torch.compile(m, backend=be))
    res: dict = {name: [] for name in variants}
    with torch.no_grad():
        for _, fn in variants.values():
            for _ in range(3):
                fn(x)
        for r in range(9):
            for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                fn = variants[name][1]
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < 0.2:
                    fn(x)
                    n += 1
                res[name].append((time.perf_counter() - t0) / n * 1e3)
    print(f"torch {torch.__version__}, 1 thread, 9 interleaved rounds\n")
    print("| variant | ms per call | x faster than Inductor |\n|---|---|---|")
    for name in variants:
        x_ind = statistics.median(a / b for a, b in zip(res["inductor"], res[name]))
        print(f"| {name} | {statistics.median(res[name]):.3f} | {x_ind:.2f} |")
    for name in ("wformat", "wformat, no budget"):
        rows = [r for r in wfpass.report(variants[name][0]).find("prepack") if r.params[0].endswith("gate.weight")]
        print(f"\n{name}, the fused gate/up weights:")
        for r in rows:
            print(f"  {r.params[0]}: {r.action}; {r.reason.split('; M=1: ')[-1][:160]}")


if __name__ == "__main__":
    main()
