"""The speech encoder of ``bench_rnn_speed.py`` (``--models encoder``), its
training step under wformat on both CPU kernels in ONE process: the C++
loop (``cpu_kernel="auto"``, which takes it at 1 thread) and oneDNN's layer
(``cpu_kernel="eager"``), each its own copy of the model and its own
``forward`` code object, rounds interleaved.

``bench_rnn_speed.py`` runs each variant in a process of its own, so each
also has its own allocator state (docs/results/rnn_speed.md: glibc's mmap threshold
decides whether oneDNN's fresh workspace pages fault on every call); here
both share one. Run it at glibc's defaults and with its thresholds raised:

    python benchmarks/rnn/encoder_two_kernels.py [--rounds 5] [--threads 1]
    MALLOC_MMAP_THRESHOLD_=1000000000 MALLOC_TRIM_THRESHOLD_=1000000000 python benchmarks/rnn/encoder_two_kernels.py

Prints ms per training step (forward, backward of ``(out * R).sum()``,
SGD step), the median over rounds of 10-step samples, and oneDNN's time /
the loop's (above 1: the loop is faster).
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import statistics
import sys
import time
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10, help="steps per sample")
    a = ap.parse_args(argv)
    import torch

    import wfpass
    from wfpass.tools.bench import own_code

    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("bench_rnn_speed", os.path.join(here, "bench_rnn_speed.py"))
    brs = importlib.util.module_from_spec(spec)
    sys.path.insert(0, here)
    spec.loader.exec_module(brs)
    torch.set_num_threads(a.threads)
    base = brs._encoder()
    torch.manual_seed(1)
    x = torch.randn(brs.ENC_BATCH, 80, brs.ENC_FRAMES)
    steps = {}
    for name, be in (("loop (auto)", "wformat"), ("oneDNN (cpu_kernel='eager')", wfpass.backend(rnn={"cpu_kernel": "eager"}))):
        m = own_code(copy.deepcopy(base))
        f = torch.compile(m, backend=be, dynamic=False)
        R = torch.randn(f(x).shape)
        opt = torch.optim.SGD(m.parameters(), lr=1e-6)

        def step(f=f, opt=opt, R=R):
            (f(x) * R).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        steps[name] = step
    times = {k: [] for k in steps}
    for _ in range(a.rounds):
        for k, fn in steps.items():
            t = time.perf_counter()
            for _ in range(a.steps):
                fn()
            times[k].append((time.perf_counter() - t) / a.steps * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    loop, onednn = med["loop (auto)"], med["oneDNN (cpu_kernel='eager')"]
    malloc = "raised" if os.environ.get("MALLOC_MMAP_THRESHOLD_") else "glibc's defaults"
    print(f"torch {torch.__version__}, {a.threads} thread(s), malloc thresholds: {malloc}, {a.rounds} rounds")
    for k, v in med.items():
        print(f"{k}: {v:.3f} ms per training step")
    print(f"oneDNN / loop: {onednn / loop:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
