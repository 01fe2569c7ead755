"""Which kernel a linear of one shape runs: measured once per shape on this
machine, kept for the process.

Candidates: ``"plain"`` (``F.linear`` on the parameter, what eager and
Inductor run: oneDNN or MKL reorders the weight inside every call),
``"onednn"`` (oneDNN's packed layout, one copy for every row count) and,
for float32 with at most ``EXACT_ROWS`` rows, ``"mkl"`` (MKL's packed SGEMM,
whose copy is made for one row count and is several MB larger than the
weight). A packed kernel is taken only where it beats the plain GEMM by
``MARGIN``, MKL only where it beats oneDNN by that margin too: a copy costs
memory, and a tie is not worth it.

Row counts above ``EXACT_ROWS`` are measured at the next power of two
(one measurement serves every M up to it). The times are kept
(``measured``) so the report can say what was measured.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

from .._torch import aot as _aot, kernels as _k, native as _native

__all__ = ["MARGIN", "OP_COST_NATIVE_S", "OP_COST_PYTHON_S", "op_cost_s", "EXACT_ROWS", "bucket", "measure", "measured", "kernels_for_dtype"]

#: A packed kernel must take at most this fraction of the plain GEMM's time.
MARGIN = 0.97

#: What a call of the packed op costs beyond its kernel, added to every
#: packed candidate's time before the comparison: the plain GEMM runs inside
#: the compiled graph, the packed kernel behind an op that checks its copy.
#: Measured with ``benchmarks/profile_pack.py`` (one row, 1 thread, torch
#: 2.13.0): 0.5-2.5 us with the C++ kernel (``wfpass/_torch/native``), 15-29 us
#: with the Python one; the high end of the first, the low end of the
#: second, so a kernel that wins by more is still taken.
OP_COST_NATIVE_S = 3e-6
OP_COST_PYTHON_S = 15e-6


def op_cost_s() -> float:
    """The op's own cost per call in this process (C++ or Python kernel)."""
    return OP_COST_NATIVE_S if _native.loaded() else OP_COST_PYTHON_S


#: Row counts measured exactly; above it, at the next power of two.
EXACT_ROWS = 8

# (dtype, in, out, bucket, threads) -> {kernel: median seconds}
_TIMES: Dict[tuple, Dict[str, float]] = {}


def bucket(m: int) -> int:
    return m if m <= EXACT_ROWS else 1 << (m - 1).bit_length()


def kernels_for_dtype(dtype: torch.dtype, m: int) -> List[str]:
    """The packed kernels this CPU and build have for ``dtype`` at ``m`` rows."""
    out = []
    if _k.onednn_packs(dtype):
        out.append("onednn")
    if _k.mkl_packs(dtype) and m <= EXACT_ROWS:
        out.append("mkl")
    return out


def _timer(fn: Callable[[], object]) -> Callable[[int], float]:
    def run(n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n

    return run


def measure(dtype: torch.dtype, k: int, n: int, m: int) -> Dict[str, float]:
    """Median seconds per call of each candidate at this shape (``m``
    rounded by ``bucket``), interleaved in rounds; measured once per
    process and thread count."""
    mb = bucket(m)
    key = (dtype, k, n, mb, torch.get_num_threads())
    got = _TIMES.get(key)
    if got is not None:
        return got
    with _aot.outside_fake_mode(), torch.no_grad():
        w = torch.randn(n, k).to(dtype)
        x = torch.randn(mb, k).to(dtype)
        runs: Dict[str, Callable[[int], float]] = {"plain": _timer(lambda: F.linear(x, w))}
        for kern in kernels_for_dtype(dtype, mb):
            if kern == "onednn":
                p = _k.onednn_pack(w)
                runs[kern] = _timer(lambda p=p: _k.onednn_linear(x, p, None))
            else:
                p = _k.mkl_pack(w, mb)
                runs[kern] = _timer(lambda p=p: _k.mkl_linear(x, p, w, None, mb))
        first = {name: run(1) for name, run in runs.items()}  # warm up (and the first reorder)
        first = {name: run(1) for name, run in runs.items()}
        # Enough calls per round for ~1 ms; 5 rounds (3 for slow shapes).
        per = max(first.values())
        reps = max(1, min(50, int(1e-3 / max(per, 1e-7))))
        rounds = 5 if per < 2e-3 else 3
        times: Dict[str, List[float]] = {name: [] for name in runs}
        for _ in range(rounds):
            for name, run in runs.items():
                times[name].append(run(reps))
    got = _TIMES[key] = {name: statistics.median(ts) for name, ts in times.items()}
    return got


def measured(dtype: torch.dtype, k: int, n: int, m: int) -> Tuple[str, Dict[str, float]]:
    """The kernel to run at this shape, and the times that chose it."""
    times = measure(dtype, k, n, m)
    plain = times["plain"]
    op = op_cost_s()
    cost = {k: t + op for k, t in times.items() if k != "plain"}
    best = "plain"
    if "onednn" in cost and cost["onednn"] <= MARGIN * plain:
        best = "onednn"
    if "mkl" in cost and cost["mkl"] <= MARGIN * min(plain, cost.get("onednn", plain)):
        best = "mkl"
    return best, times
