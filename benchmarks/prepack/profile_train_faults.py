"""CPU training steps and glibc's allocator: the decoder training step of
``python -m wfpass bench`` (fp32, 8 tokens, SGD), one fresh process per
variant and run (a cold compile, Inductor's caches off), timed with glibc's
default malloc settings and with its mmap/trim thresholds raised, with the
minor page faults each step takes.

    python benchmarks/prepack/profile_train_faults.py --runs 2 --out docs/results/train_allocator.md

``--one VARIANT`` is what each process runs: 20 warm-up steps, then the
median of 7 rounds of 20 steps, 1 thread; minor faults from getrusage.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _out.py
from _out import emit  # noqa: E402

VARIANTS = ("eager", "inductor", "wformat")
RAISED = {"MALLOC_MMAP_THRESHOLD_": "1000000000", "MALLOC_TRIM_THRESHOLD_": "1000000000"}


def one(variant: str) -> None:
    import torch

    torch.set_num_threads(1)
    import wfpass  # noqa: F401  (the "wformat" backend and its passes)
    from wfpass._torch.aot import disable_compile_caches, stop_compile_workers
    from wfpass.tools.bench_cases import FULL, cases

    disable_compile_caches()
    case = next(c for c in cases(FULL, ("decoder",)) if c.step.startswith("training"))
    _, step, _ = case.build(variant)
    step()
    stop_compile_workers()
    for _ in range(20):
        step()
    times = []
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(20):
            step()
        times.append((time.perf_counter() - t0) / 20 * 1e3)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 140
    print(f"{statistics.median(times):.3f} {faults:.0f}")


def main(argv=None) -> int:
    from wfpass.tools.doctor import cpu_words  # the page names its CPU: figures differ by vendor
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.one:
        one(a.one)
        return 0
    rows = {}
    for run in range(a.runs):
        for setting, extra in (("glibc defaults", {}), ("thresholds raised", RAISED)):
            for v in VARIANTS:
                env = {k: val for k, val in os.environ.items() if k not in RAISED}
                env.update(extra)
                out = subprocess.run([sys.executable, __file__, "--one", v], env=env, capture_output=True,
                                     text=True, check=True).stdout.split()
                rows.setdefault((setting, v), []).append((float(out[-2]), float(out[-1])))
                print(setting, v, out[-2:], flush=True)
    import torch

    lines = ["# CPU training steps and the allocator", "",
             f"Machine: {cpu_words()}; {os.cpu_count()} CPUs visible; 1 torch thread; torch {torch.__version__}.", "",
             f"Command: `python benchmarks/prepack/profile_train_faults.py --runs {a.runs}" + (f" --out {a.out}`" if a.out else "`"),
             "", "The decoder training step of `python -m wfpass bench` (4 layers, d_model 256, fp32, 8 tokens, "
             "forward + backward + SGD step), each variant in a fresh process per run (a cold compile); ms per "
             "step (median of 7 rounds of 20 steps) and minor page faults per step, one entry per run. "
             "*thresholds raised*: `MALLOC_MMAP_THRESHOLD_=1000000000 MALLOC_TRIM_THRESHOLD_=1000000000`.", "",
             "| malloc | variant | ms per step | page faults per step |", "|---|---|---|---|"]
    for (setting, v), vals in rows.items():
        lines.append(f"| {setting} | {v} | {', '.join(f'{t:.1f}' for t, _ in vals)} | "
                     f"{', '.join(f'{f:.0f}' for _, f in vals)} |")
    return emit(lines, a.out)


if __name__ == "__main__":
    sys.exit(main())
