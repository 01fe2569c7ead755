"""How stable the packed-kernel decisions are from one process to the next.

For the linear shapes of the bench's LLaMA-like decoder (d 256, 8 heads /
2 KV heads, FF 1376: the Q/K/V block 384x256, o 256x256, gate/up 2752x256,
down 256x1376) at M = 1, 5 and 8, it runs ``--procs`` fresh processes, each
timing every candidate as ``wfpass/prepack/choose.py`` does, and prints:

* per shape, the decisions of each process under wfpass's rule (the median
  round at most ``choose.MARGIN``) and, from the same rounds, under two
  others (a narrower margin, the median at most 0.97; the earlier rule, the
  second-worst round at most 0.97), with no decision file (each process
  measures);
* how many processes agree on every shape, under each rule;
* the same processes again sharing one decision file (``WFPASS_CACHE_DIR``):
  the first measures, the rest read;
* afterwards, each packed kernel in that file timed again against the plain
  GEMM with longer samples: is any chosen kernel slower?

``--busy`` runs a second process spinning on one core during the whole
measurement (the "busy machine" case).

    python benchmarks/prepack/choice_spread.py --procs 10 [--busy] [--threads 1] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from wfpass.prepack import choose

SHAPES = [(384, 256), (256, 256), (2752, 256), (256, 1376)]
ROWS = (1, 5, 8)

CHILD = r"""
import json, sys, torch
torch.set_num_threads(int(sys.argv[1]))
pool = int(sys.argv[2]) * 2**20
from wfpass.prepack import choose
out = {}
for n, k in %r:
    for m in %r:
        d = choose.decide(torch.float32, k, n, m, pool)
        out[f"{n}x{k} M={m}"] = {"clear": d.kernel, "source": d.source,
                                 "ratios": {c: [round(x, 3) for x in r] for c, r in d.ratios.items()}}
print("RESULT " + json.dumps(out))
""" % (SHAPES, ROWS)


# Afterwards: each packed kernel the decision file holds, timed again against
# the plain GEMM with longer samples (21 rounds of ~10 ms), the op's call included.
CHECK = r"""
import json, statistics, sys, torch
torch.set_num_threads(int(sys.argv[1]))
pool = int(sys.argv[2]) * 2**20
from wfpass.prepack import choose
out = {}
for n, k in %r:
    for m in %r:
        d = choose.decide(torch.float32, k, n, m, pool)
        if d.kernel == "plain":
            continue
        choose.ROUNDS, choose.SAMPLE_S = 21, 1e-2
        times, _ = choose._time_candidates(torch.float32, k, n, choose.bucket(m), choose.pool_mib(pool))
        op = choose.op_cost_s()
        rs = [(t + op) / p for t, p in zip(times[d.kernel], times["plain"])]
        out[f"{n}x{k} M={m}"] = {"kernel": d.kernel, "median": statistics.median(rs), "worst": max(rs)}
print("RESULT " + json.dumps(out))
""" % (SHAPES, ROWS)


def run(threads: int, cache_dir: str, child: str = CHILD, pool_mib: int = 0) -> dict:
    env = {**os.environ, "WFPASS_CACHE_DIR": cache_dir}
    r = subprocess.run([sys.executable, "-c", child, str(threads), str(pool_mib)], env=env, capture_output=True, text=True,
                       timeout=600)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])


def _other(p: dict, stat, margin: float, mkl_margin: float) -> str:
    """Another rule's decision from one process's rounds: a kernel whose
    ``stat`` of rounds is at most ``margin`` (MKL: ``mkl_margin``, over
    oneDNN too)."""
    r = p["ratios"]
    best = "plain"
    if "onednn" in r and stat(r["onednn"]) <= margin:
        best = "onednn"
    if "mkl" in r and stat(r["mkl"]) <= mkl_margin:
        if best == "plain" or stat([a / b for a, b in zip(r["mkl"], r["onednn"])]) <= mkl_margin:
            best = "mkl"
    return best


RULES = {
    "wfpass's rule": lambda p: p["clear"],
    "median <= 0.97": lambda p: _other(p, statistics.median, 0.97, 0.97),
    "second-worst <= 0.97 (the earlier rule)": lambda p: _other(p, lambda rs: sorted(rs, reverse=True)[1], 0.97, 0.97),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--busy", action="store_true", help="keep one core busy with a spinning process meanwhile")
    ap.add_argument("--json", default=None, help="write every process's rounds here")
    ap.add_argument("--pool-mib", type=int, default=0,
                    help="the weights the graph reads per call, in MiB (the decoder's: 18): each shape is timed "
                         "with its weight cycling through that many MiB of copies, as wformat times it")
    args = ap.parse_args()
    spinner = None
    if args.busy:
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        fresh = [run(args.threads, "off", pool_mib=args.pool_mib) for _ in range(args.procs)]
        shared_dir = tempfile.mkdtemp(prefix="wfpass-choices-")
        shared = [run(args.threads, shared_dir, pool_mib=args.pool_mib) for _ in range(args.procs)]
        check = run(args.threads, shared_dir, CHECK, pool_mib=args.pool_mib)
    finally:
        if spinner is not None:
            spinner.kill()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "busy": args.busy, "fresh": fresh, "shared": shared,
                       "check": check}, f)
    keys = list(fresh[0])
    print(f"{args.procs} fresh processes, {args.threads} thread(s){', one core kept busy' if args.busy else ''}, "
          f"{choose.ROUNDS} rounds of ~{choose.SAMPLE_S * 1e3:.0f} ms per candidate"
          + (f", each weight cycling through {choose.pool_mib(args.pool_mib * 2**20)} MiB of copies"
             if args.pool_mib else "") + "\n")
    cands = [c for c in ("direct", "brgemm", "onednn") if any(c in p[k]["ratios"] for p in fresh for k in keys)]
    print("| shape | " + " | ".join(f"{name}: decisions" for name in RULES)
          + "".join(f" | {c} / plain, median round per process, min-max" for c in cands) + " |")
    print("|---|" + "---|" * (len(RULES) + len(cands)))
    for key in keys:
        cells = []
        for rule in RULES.values():
            ds = [rule(p[key]) for p in fresh]
            cells.append(", ".join(f"{d} {ds.count(d)}" for d in sorted(set(ds))))
        spreads = []
        for c in cands:
            meds = [statistics.median(p[key]["ratios"][c]) for p in fresh if c in p[key]["ratios"]]
            spreads.append(f"{min(meds):.2f}-{max(meds):.2f}" if meds else "-")
        print(f"| {key} | " + " | ".join(cells + spreads) + " |")
    print()
    for name, rule in RULES.items():
        same = sum(1 for p in fresh if all(rule(p[k]) == rule(fresh[0][k]) for k in keys))
        print(f"{name}, no decision file: {same} of {args.procs} processes decide every shape as the first")
    noisy = sum(1 for p in fresh for k in keys if p[k]["source"] == "noisy")
    print(f"wfpass's rule: {noisy} of {len(fresh) * len(keys)} decisions too noisy to tell (the plain GEMM, kept marked noisy)")
    same = sum(1 for p in shared if all(p[k]["clear"] == shared[0][k]["clear"] for k in keys))
    read = sum(1 for p in shared[1:] if all(p[k]["source"] == "file" for k in keys))
    print(f"wfpass's rule, one decision file: {same} of {args.procs} identical; {read} of {args.procs - 1} later "
          "processes read every decision from the file")
    print("\nAfterwards, each packed kernel of the file timed again against the plain GEMM (21 rounds of ~10 ms, "
          "the op's call included; below 1: faster):")
    for key, c in check.items():
        print(f"  {key}: {c['kernel']} {c['median']:.2f}x the plain GEMM's time in the median round, "
              f"{c['worst']:.2f}x in the worst")
    slower = [k for k, c in check.items() if c["median"] >= 1.0]
    print(f"  chosen kernels slower than the plain GEMM in the median: {len(slower)} of {len(check)}"
          + (f" ({', '.join(slower)})" if slower else ""))


if __name__ == "__main__":
    main()
