"""What the packed-weight op costs beyond oneDNN's packed kernel, per call.

    python benchmarks/prepack/profile_pack.py [--rows 2752] [--k 512] [--dtype bfloat16] [--rounds 7]

One linear (no bias) compiled with ``prepack={"mode": "always"}``, one token;
interleaved in one process, medians over rounds, 1 thread:

* ``kernel``: oneDNN's packed linear called directly on the packed copy;
* ``Python kernel``: the Python function behind ``wfpass::packed_linear``
  (the stale check, the counters, the kernel), called directly;
* ``op``: ``torch.ops.wfpass.packed_linear`` as a compiled graph calls it:
  the C++ kernel (``wfpass/native``) when it is built, else the Python one
  behind the dispatcher (``WFPASS_NATIVE=0`` to see that);
* ``plain``: ``F.linear`` on the unpacked weight.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import wfpass
from wfpass._torch import kernels as _k
from wfpass.prepack import kernel as pk


def _per_call(fn, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2752, help="output features (default: a d512 gate/up block)")
    ap.add_argument("--k", type=int, default=512, help="input features")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, a.dtype)
    model = nn.Sequential(nn.Linear(a.k, a.rows, bias=False)).to(dtype).eval()
    compiled = torch.compile(model, backend=wfpass.backend(prepack={"mode": "always"}))
    x = torch.randn(1, 1, a.k, dtype=dtype)
    with torch.no_grad():
        compiled(x)
    (site,) = list(pk._SITES)  # the one packed call this process compiled
    ws = [model[0].weight]
    packed = _k.onednn_pack(ws[0].detach())
    fns = {
        "kernel": lambda: _k.onednn_linear(x, packed, None),
        "Python kernel": lambda: pk._packed_linear(x, ws, [], a.rows, site),
        "op": lambda: torch.ops.wfpass.packed_linear.default(x, ws, [], a.rows, site),
        "plain": lambda: F.linear(x, ws[0]),
    }
    res = {k: [] for k in fns}
    with torch.no_grad():
        for f in fns.values():
            f()
        for _ in range(a.rounds):
            for k, f in fns.items():
                res[k].append(_per_call(f, 500))
    med = {k: statistics.median(v) for k, v in res.items()}
    from wfpass import native as _native

    print(f"linear {a.rows}x{a.k} {a.dtype}, 1 row, 1 thread, median of {a.rounds} interleaved rounds (us per call); "
          f"the op runs {_native.status()}:")
    for k, v in med.items():
        print(f"  {k:14s} {v:7.1f}")
    print(f"  the op over the kernel: {med['op'] - med['kernel']:.1f} us; "
          f"the Python kernel over the kernel: {med['Python kernel'] - med['kernel']:.1f} us")

if __name__ == "__main__":
    main()
