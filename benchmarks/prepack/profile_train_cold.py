"""The bf16 decoder's training step after a cold compile: wformat against
Inductor, and what changes it.

    python benchmarks/prepack/profile_train_cold.py inductor --cold
    python benchmarks/prepack/profile_train_cold.py wformat --cold
    python benchmarks/prepack/profile_train_cold.py wformat --cold --rows 8,64,512 --steps 5
    python benchmarks/prepack/profile_train_cold.py wformat --cold --collect      # gc.collect() before timing
    python benchmarks/prepack/profile_train_cold.py wformat-nolinear --cold       # passes=["fuse_rnn"]: no sibling-linear fusion
    MALLOC_MMAP_THRESHOLD_=1000000000 MALLOC_TRIM_THRESHOLD_=1000000000 \\
        python benchmarks/prepack/profile_train_cold.py wformat --cold          # glibc malloc keeps freed memory

The HF LLaMA of bench_pack.py (d512, bf16), training step (forward,
``(h.float() * R).sum()`` backward, SGD step) at 8, 64 and 512 rows in that
order (a dynamic recompile after the first), then timed at the ``--rows``
given (default 8 and 64): median of ``--steps`` steps (default 9), 1 thread. ``--cold``: Inductor's caches off, so this
process compiles everything itself. One variant per process.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

import bench_pack  # beside this script

import wfpass
from wfpass._torch.aot import disable_compile_caches


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variant", choices=["inductor", "wformat", "wformat-nolinear"])
    ap.add_argument("--cold", action="store_true", help="Inductor's caches off")
    ap.add_argument("--collect", action="store_true", help="gc.collect() after compiling, before timing")
    ap.add_argument("--rows", default="8,64", help="the row counts timed, comma-separated, of 8, 64, 512 (default: 8,64)")
    ap.add_argument("--steps", type=int, default=9, help="steps timed per row count (median; default 9)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 64
    if a.cold:
        disable_compile_caches()
    model, _ = bench_pack._model(bench_pack.CONFIGS["d512-bf16"])
    model.train()
    backend = {"inductor": "inductor", "wformat": "wformat",
               "wformat-nolinear": wfpass.backend(passes=["fuse_rnn"])}[a.variant]
    fwd = torch.compile(model.model.forward, backend=backend)
    steps = bench_pack.train_steps(model, fwd)
    if a.collect:
        gc.collect()
    for rows in (int(r) for r in a.rows.split(",")):
        ts = []
        for _ in range(a.steps):
            t = time.perf_counter()
            steps[rows]()
            ts.append((time.perf_counter() - t) * 1e3)
        print(f"{a.variant}{' cold' if a.cold else ''}{' collect' if a.collect else ''} rows={rows}: "
              f"median {statistics.median(ts):.2f} ms, min {min(ts):.2f} ms", flush=True)


if __name__ == "__main__":
    sys.exit(main())
