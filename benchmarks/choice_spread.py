"""How stable the packed-kernel decisions are from one process to the next.

For the linear shapes of the bench's LLaMA-like decoder (d 256, 8 heads /
2 KV heads, FF 1376: the Q/K/V block 384x256, o 256x256, gate/up 2752x256,
down 256x1376) at M = 1, 5 and 8, it runs ``--procs`` fresh processes, each
timing every candidate as ``wfpass/pack/choose.py`` does, and prints:

* per shape, the decisions of each process with the rule of the previous
  version (the median alone, ``--rule median``) and the current one (the
  second-worst of 7 interleaved rounds, ``--rule clear``), with no decision
  file (each process measures);
* how many processes agree on every shape, under each rule;
* the same processes again sharing one decision file (``WFPASS_CACHE_DIR``):
  the first measures, the rest read.

``--busy`` runs a second process spinning on one core during the whole
measurement (the "busy machine" case).

    python benchmarks/choice_spread.py --procs 10 [--busy] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

SHAPES = [(384, 256), (256, 256), (2752, 256), (256, 1376)]
ROWS = (1, 5, 8)

CHILD = r"""
import json, statistics, sys, torch
torch.set_num_threads(int(sys.argv[1]))
from wfpass.pack import choose
out = {}
for n, k in %r:
    for m in %r:
        d = choose.decide(torch.float32, k, n, m)
        # The previous rule: the medians' ratio, op cost included, against the margin.
        op = choose.op_cost_s()
        med = {c: (d.times[c] + op) / d.times["plain"] for c in d.times if c != "plain"}
        old = "plain"
        if "onednn" in med and med["onednn"] <= choose.MARGIN:
            old = "onednn"
        if "mkl" in med and med["mkl"] <= choose.MARGIN * min(1.0, med.get("onednn", 1.0)):
            old = "mkl"
        out[f"{n}x{k} M={m}"] = {"clear": d.kernel, "median": old, "source": d.source,
                                 "ratios": {c: [round(x, 3) for x in r] for c, r in d.ratios.items()}}
print("RESULT " + json.dumps(out))
""" % (SHAPES, ROWS)


def run(threads: int, cache_dir: str) -> dict:
    env = {**os.environ, "WFPASS_CACHE_DIR": cache_dir}
    r = subprocess.run([sys.executable, "-c", CHILD, str(threads)], env=env, capture_output=True, text=True,
                       timeout=600)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--busy", action="store_true", help="keep one core busy with a spinning process meanwhile")
    args = ap.parse_args()
    spinner = None
    if args.busy:
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        fresh = [run(args.threads, "off") for _ in range(args.procs)]
        shared_dir = tempfile.mkdtemp(prefix="wfpass-choices-")
        shared = [run(args.threads, shared_dir) for _ in range(args.procs)]
    finally:
        if spinner is not None:
            spinner.kill()
    keys = list(fresh[0])
    print(f"{args.procs} fresh processes, {args.threads} thread(s){', one core kept busy' if args.busy else ''}\n")
    print("| shape | median rule: decisions | clear rule: decisions | onednn ratio, all rounds, min-max |")
    print("|---|---|---|---|")
    for key in keys:
        med = [p[key]["median"] for p in fresh]
        clr = [p[key]["clear"] for p in fresh]
        rs = [x for p in fresh for x in p[key]["ratios"].get("onednn", [])]
        spread = f"{min(rs):.2f}-{max(rs):.2f}" if rs else "-"

        def counts(ds):
            return ", ".join(f"{d} {ds.count(d)}" for d in sorted(set(ds)))
        print(f"| {key} | {counts(med)} | {counts(clr)} | {spread} |")
    for rule in ("median", "clear"):
        same = sum(1 for p in fresh if all(p[k][rule] == fresh[0][k][rule] for k in keys))
        print(f"\n{rule} rule, no decision file: {same} of {args.procs} processes decide every shape as the first")
    same = sum(1 for p in shared if all(p[k]["clear"] == shared[0][k]["clear"] for k in keys))
    read = sum(1 for p in shared[1:] if all(p[k]["source"] == "file" for k in keys))
    print(f"clear rule, one decision file: {same} of {args.procs} identical; {read} of {args.procs - 1} later "
          "processes read every decision from the file")


if __name__ == "__main__":
    main()
