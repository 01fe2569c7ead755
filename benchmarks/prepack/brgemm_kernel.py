"""The linears' kernels side by side, per weight shape and row count: the
plain GEMM (``F.linear``, what eager and Inductor run), oneDNN's packed
linear (``mkldnn::_linear_pointwise`` on its reordered copy), wfpass's
``brgemm`` (oneDNN's small-GEMM ukernel over a copy in 64-column panels)
and wfpass's ``direct`` (dot products over the weight as it is, no copy;
float32 on AVX-512F), each called directly (no op around it); and what the
packed ones leave on the heap for a row count they have not run before (the
kernel the library compiles and keeps for it).

    python benchmarks/prepack/brgemm_kernel.py [--threads 1] [--rounds 9] [--shapes 384x256,2752x256] [--pool-mib 16]

Shapes are ``out x in`` (the bench decoder's by default). Each cell is the
median over ``--rounds`` interleaved rounds (plain, oneDNN, brgemm, direct
in one fixed order) of ~2 ms of calls each, in us per call. By default each
weight is timed alone (it stays in the core's caches: the kernels' own
cost); ``--pool-mib N`` cycles each call through copies of the weight (and
of its packed copies) that fill N MiB, so the weight comes from where a
model's calls find it, after the other weights went through the caches (how
``choose.py`` times a decision).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def per_call(fn, budget_s: float = 2e-3) -> float:
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < budget_s:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--rows", default="1,2,5,8,16,64,256")
    ap.add_argument("--shapes", default="384x256,256x256,2752x256,256x1376")
    ap.add_argument("--pool-mib", type=int, default=0, help="cycle through copies of each weight filling N MiB")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from wfpass import native
    from wfpass._torch import kernels as k
    from wfpass.native import ops as nops
    from wfpass.prepack import state

    if not nops.panel_packs(torch.float32):
        print(f"no brgemm kernel here: {native.status()}")
        return 1
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    direct = nops.direct_runs(torch.float32)
    where = f"each weight cycling through {args.pool_mib} MiB of copies" if args.pool_mib else "each weight alone"
    print(f"torch {torch.__version__}, {args.threads} thread(s), {where}; us per call, median of {args.rounds} "
          f"interleaved rounds; x = plain / kernel" + ("" if direct else "; no direct kernel here (-)"))
    print()
    print("| weight | M | plain | oneDNN packed | brgemm | direct | oneDNN x | brgemm x | direct x |")
    print("|---|---|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for n, kk in shapes:
        copies = max(1, min(64, args.pool_mib * 2**20 // (n * kk * 4))) if args.pool_mib else 1
        ws = [torch.randn(n, kk) for _ in range(copies)]
        b = torch.randn(n)
        ods, brs = [k.onednn_pack(w) for w in ws], [nops.panel_pack(w) for w in ws]
        for m in rows:
            x = torch.randn(m, kk)
            it = [0]

            def nxt() -> int:  # the next copy, the same for every kernel's call in turn
                it[0] = (it[0] + 1) % copies
                return it[0]

            fns = {"plain": lambda: F.linear(x, ws[nxt()], b), "onednn": lambda: k.onednn_linear(x, ods[nxt()], b),
                   "brgemm": lambda: nops.panel_linear(x, brs[nxt()], b, n)}
            if direct:
                fns["direct"] = lambda: nops.direct_linear(x, ws[nxt()], b)
            ref = F.linear(x, ws[0], b)
            for name in ("brgemm", "direct"):
                if name in fns:
                    it[0] = copies - 1  # the next call takes copy 0
                    torch.testing.assert_close(fns[name](), ref, rtol=1e-4, atol=1e-4 * kk ** 0.5)
            times = {name: [] for name in fns}
            for f in fns.values():
                f()
            for _ in range(args.rounds):
                for name, f in fns.items():
                    times[name].append(per_call(f) * 1e6)
            med = {name: statistics.median(v) for name, v in times.items()}
            d, dx = (f"{med['direct']:.1f}", f"{med['plain'] / med['direct']:.2f}") if direct else ("-", "-")
            print(f"| {n}x{kk} | {m} | {med['plain']:.1f} | {med['onednn']:.1f} | {med['brgemm']:.1f} | {d} | "
                  f"{med['plain'] / med['onednn']:.2f} | {med['plain'] / med['brgemm']:.2f} | {dx} |")
    if state._HEAP is None:
        return 0
    print()
    print("Heap left by a row count's first call (its output aside), KiB, 3 new row counts per weight:")
    print()
    print("| weight | oneDNN packed | brgemm |")
    print("|---|---|---|")
    for n, kk in shapes:
        w = torch.randn(n, kk)
        od, br = k.onednn_pack(w), nops.panel_pack(w)
        left = {"onednn": [], "brgemm": []}
        for m in (3, 6, 7):  # row counts the timing above did not run
            for name, f in (("onednn", lambda: k.onednn_linear(torch.randn(m, kk), od, None)),
                             ("brgemm", lambda: nops.panel_linear(torch.randn(m, kk), br, None, n))):
                x0 = state._HEAP()
                y = f()
                left[name].append((state._HEAP() - x0 - y.numel() * y.element_size()) / 1024)
        print(f"| {n}x{kk} | {', '.join(f'{v:.0f}' for v in left['onednn'])} | "
              f"{', '.join(f'{v:.0f}' for v in left['brgemm'])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
