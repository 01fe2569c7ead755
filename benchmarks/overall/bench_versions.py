"""wfpass's headline comparisons on several torch releases: one row per
release, each cell wformat's speed against Inductor (``torch.compile``'s
default) on that same release.

Each release runs ``python -m wfpass bench`` in its own interpreter (a venv
per release, e.g. the ones ``bash tests/on_torch.sh VERSION`` makes), one
after the other, never side by side; the table is written from each run's
``bench.json``:

    python benchmarks/overall/bench_versions.py --threads 1 --out docs/results/torch_versions.md \\
        .venv/bin/python .venv-torch-2.11.0/bin/python .venv-torch-2.15.0/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def run_one(python: str, threads: int, rounds: int, out_dir: str) -> dict:
    cmd = [python, "-m", "wfpass", "bench", "--threads", str(threads), "--rounds", str(rounds),
           "--out", out_dir, "--no-plot"]
    t = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode not in (0, 1):  # 1: an output check failed, which the table shows
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    with open(os.path.join(out_dir, "bench.json")) as f:
        got = json.load(f)
    got["wall_s"] = time.perf_counter() - t
    return got


def table(runs: list, command: str) -> str:
    from wfpass.tools.doctor import cpu_words  # the page names its CPU: figures differ by vendor
    cells = [(r["model"], r["step"], r["size"]) for r in runs[0]["rows"]]
    head = ["torch"] + [f"{m}, {s} ({z})" for m, s, z in cells] + ["all outputs checked", "wall time"]
    releases = ", ".join(r["torch"] for r in runs)
    lines = ["# python -m wfpass bench on each supported torch release", "",
             f"Machine: {cpu_words()}; {os.cpu_count()} CPUs visible; {runs[0]['threads']} torch thread(s); torch {releases}.", "",
             f"Command: `{command}`  ",
             f"Python {sys.version.split()[0]}; each release in its own process, one after the other.",
             "",
             "Each cell: **x faster than Inductor** = Inductor's median time / wformat's median time on that "
             "release (above 1: wformat is faster), from `python -m wfpass bench` (its rounds are interleaved). "
             "A release's Inductor is its own: the ratio says whether wformat keeps its lead there, not "
             "whether a release got faster.",
             "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        by = {(x["model"], x["step"], x["size"]): x for x in r["rows"]}
        row = [r["torch"]] + [f"{by[c]['x_faster_than_inductor']:.2f}" if c in by else "-" for c in cells]
        row += ["yes" if all(x["ok"] for x in r["rows"]) else "no", f"{r['wall_s']:.0f} s"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Milliseconds per call (median), wformat / Inductor:", "",
              "| torch | " + " | ".join(f"{m}, {s}" for m, s, _ in cells) + " |", "|" + "---|" * (len(cells) + 1)]
    for r in runs:
        by = {(x["model"], x["step"], x["size"]): x for x in r["rows"]}
        lines.append("| " + r["torch"] + " | " + " | ".join(
            f"{by[c]['median_ms']['wformat']:.2f} / {by[c]['median_ms']['inductor']:.2f}" if c in by else "-"
            for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pythons", nargs="+", help="one Python interpreter per torch release, wfpass installed in each")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="docs/results/torch_versions.md")
    args = ap.parse_args()
    runs = []
    for py in args.pythons:
        with tempfile.TemporaryDirectory() as d:
            print(f"{py}: python -m wfpass bench ...", flush=True)
            runs.append(run_one(py, args.threads, args.rounds, d))
            print(f"  torch {runs[-1]['torch']}: {runs[-1]['wall_s']:.0f} s", flush=True)
    text = table(runs, "python benchmarks/overall/bench_versions.py " + " ".join(sys.argv[1:]))
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
