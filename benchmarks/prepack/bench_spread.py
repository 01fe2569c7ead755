"""The bench's decoder rows over several fresh processes: min / median / max.

One run of ``python -m wfpass bench`` gives each variant one process, so a
row's ratio is one process's luck: a kernel chosen while the machine was
busy, a process whose memory landed badly. This runs the decoder rows
(static decode and prefill, regional compilation, after a dynamic recompile
at 1, 5 and 8 tokens, a training step) and HF ``generate()`` ``--processes``
times, each time with every variant in a fresh process (``wfpass.tools.bench
.run``), and gives each row's "x faster" of wformat over Inductor (and over
the hand-fused model, or ``freezing=True`` for ``generate()``) as min /
median / max over those runs.

Each run keeps its packed-kernel decisions in a decision file of its own
(``WFPASS_CACHE_DIR``), so every run measures them afresh: the spread shown
includes the decisions' own. ``--shared-decisions`` gives all runs one
file, as a user's processes on one machine share one.

    python benchmarks/prepack/bench_spread.py --processes 5 --threads 1 --parts decoder,generate --json docs/results/data/bench_spread_1thread.json
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

import torch

from wfpass.tools.bench import run
from wfpass.tools.bench_cases import FULL, QUICK
from wfpass.tools.doctor import cpu_words  # the page names its CPU: figures differ by vendor


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=5, help="fresh runs of every variant")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    ap.add_argument("--parts", default="decoder,generate")
    ap.add_argument("--shared-decisions", action="store_true", help="one decision file for all runs")
    ap.add_argument("--out", default=None, help="folder for spread.md")
    ap.add_argument("--json", default=None, help="write every run's medians (us) per row and variant here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = dataclasses.replace(QUICK if args.quick else FULL)
    if args.rounds is not None:
        sizes.rounds = args.rounds
    parts = tuple(p for p in args.parts.split(",") if p)
    shared = tempfile.mkdtemp(prefix="wfpass-choices-")
    per_row: dict = {}
    raw: list = []  # per run: {row: {variant: median us}}
    t0 = time.perf_counter()
    for i in range(args.processes):
        # The variants' processes inherit it (spawn copies the environment).
        os.environ["WFPASS_CACHE_DIR"] = shared if args.shared_decisions else tempfile.mkdtemp(prefix="wfpass-choices-")
        results, _ = run(sizes, parts)
        raw.append({" / ".join(map(str, (r.case.model, r.case.step, r.case.size))):
                    {v: round(t.median * 1e6, 1) for v, t in r.times.items()} for r in results})
        for r in results:
            key = (r.case.model, r.case.step, r.case.size)
            t = r.times
            row = per_row.setdefault(key, {"inductor": [], "third": [], "ok": True, "third_name": ""})
            row["inductor"].append(t["inductor"].median / t["wformat"].median)
            third = next((v for v in ("hand-fused", "freezing") if v in t), None)
            if third is not None:
                row["third"].append(t[third].median / t["wformat"].median)
                row["third_name"] = third
            row["ok"] &= r.ok
        print(f"run {i + 1} of {args.processes} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)

    def mmm(xs):
        return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}" if xs else "-"

    lines = [f"# Decoder rows over {args.processes} fresh runs", "",
             f"`python benchmarks/prepack/bench_spread.py --processes {args.processes} --threads {args.threads}"
             f"{' --quick' if args.quick else ''}{' --shared-decisions' if args.shared_decisions else ''}`; "
             f"torch {torch.__version__}, {cpu_words()}, {args.threads} thread(s), {sizes.rounds} interleaved rounds per run, "
             f"every variant in a fresh process each run; decisions {'shared' if args.shared_decisions else 'measured afresh in each run'}. "
             f"x faster = the other's time / wformat's (above 1: wformat is faster); min / median / max over runs.", "",
             "| model | step | size | x faster than Inductor | x faster than the third | third | checked |",
             "|---|---|---|---|---|---|---|"]
    for (model, step, size), row in per_row.items():
        lines.append(f"| {model} | {step} | {size} | {mmm(row['inductor'])} | {mmm(row['third'])} | "
                     f"{row['third_name'] or '-'} | {'yes' if row['ok'] else 'NO'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "torch": torch.__version__, "runs": raw}, f, indent=1)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "spread.md"), "w") as f:
            f.write(text)
    return 0 if all(r["ok"] for r in per_row.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
