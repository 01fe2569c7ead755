"""Timing the candidate kernels of one linear shape: each candidate's
seconds per call in interleaved rounds beside the plain GEMM, and the bytes
of its copy.

Separate from ``choose.py``, which decides from these times and keeps the
decisions: this module only makes the weights and their packed copies,
runs the kernels and reads the clock. It knows no rule and no file;
``choose._time_candidates`` passes it the kernels this process has and the
rounds' count and length (``choose.ROUNDS``, ``choose.SAMPLE_S``, which a
benchmark may change), so what a decision rests on stays in one place.

**Timed among the model's weights.** Where ``pool`` (MiB, ``choose.pool_mib``)
is not 0, each call takes the next of as many copies of the weight (and of
its packed copy) as fill it, at most ``POOL_MAX_COPIES``, so the weight
comes from where the model's calls find it, after the others went through
the caches, not from the core's L2 (``choose``'s docstring gives the
measurements).
"""
from __future__ import annotations

import itertools
import math
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .._torch import aot as _aot, kernels as _k
from ..native import ops as _nops
from . import state as _state

__all__ = ["POOL_MAX_COPIES", "POOL_MAX_MIB", "time_candidates"]

#: At most this many copies of one weight, and this many MiB of copies.
POOL_MAX_COPIES = 64
POOL_MAX_MIB = 64

#: One candidate as built for the rounds: its copy's bytes, one call per
#: copy of the weight (None: not a candidate here), and its first call (the
#: one that makes the library's kernel for this shape and row count; None
#: for a kernel that makes none).
_Built = Tuple[int, Optional[List[Callable[[], object]]], Optional[Callable[[], object]]]


def _timer(fn: Callable[[], object]) -> Callable[[int], float]:
    def run(n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n

    return run


def _cycle(fns: List[Callable[[], object]]) -> Callable[[], object]:
    """One call of the next of ``fns`` each time (one: itself)."""
    if len(fns) == 1:
        return fns[0]
    it = itertools.cycle(fns)
    return lambda: next(it)()


def _direct(x: torch.Tensor, ws: List[torch.Tensor], n: int, mb: int) -> _Built:
    # It reads the weight itself: no copy, and no library kernel to make.
    return 0, [lambda w=w: _nops.direct_linear(x, w, None) for w in ws], None


def _brgemm(x: torch.Tensor, ws: List[torch.Tensor], n: int, mb: int) -> _Built:
    ps = [_nops.panel_pack(w) for w in ws]
    return (ps[0].numel() * ps[0].element_size(), [lambda p=p: _nops.panel_linear(x, p, None, n) for p in ps],
            lambda: _nops.panel_linear(x, ps[0], None, n))


def _onednn(x: torch.Tensor, ws: List[torch.Tensor], n: int, mb: int) -> _Built:
    ps = [_k.onednn_pack(w) for w in ws]
    return (_k.onednn_nbytes(ps[0]), [lambda p=p: _k.onednn_linear(x, p, None) for p in ps],
            lambda: _k.onednn_linear(x, ps[0], None))


def _mkl(x: torch.Tensor, ws: List[torch.Tensor], n: int, mb: int) -> _Built:
    p = _k.mkl_pack(ws[0], mb)
    nbytes = _k.onednn_nbytes(p) if p.is_mkldnn else p.numel() * p.element_size()
    copies = len(ws)
    if copies > 1 and copies * nbytes > POOL_MAX_MIB * 2**20 * 2:
        return nbytes, None, None  # MKL's copies (about 4x the weight) would not fit: not a candidate here
    ps = [p] + [_k.mkl_pack(w, mb) for w in ws[1:]]
    return (nbytes, [lambda p=p, w=w: _k.mkl_linear(x, p, w, None, mb) for p, w in zip(ps, ws)],
            lambda: _k.mkl_linear(x, ps[0], ws[0], None, mb))


#: How each candidate beside the plain GEMM is built for the rounds.
_BUILD: Dict[str, Callable[..., _Built]] = {"direct": _direct, "brgemm": _brgemm, "onednn": _onednn, "mkl": _mkl}


def _weights(dtype: torch.dtype, k: int, n: int, mb: int, pool: int) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """The copies of a random ``n x k`` weight that fill ``pool`` MiB (one
    where ``pool`` is 0), and an ``mb``-row input."""
    wbytes = n * k * torch.empty((), dtype=dtype).element_size()
    copies = max(1, min(POOL_MAX_COPIES, math.ceil(pool * 2**20 / wbytes))) if pool else 1
    ws = [torch.randn(n, k).to(dtype) for _ in range(copies)]
    return ws, torch.randn(mb, k).to(dtype)


def _interleaved_rounds(runs: Dict[str, Callable[[int], float]], copies: int, rounds: int,
                        sample_s: float) -> Dict[str, List[float]]:
    """Each of ``runs``' seconds per call in ``rounds`` rounds of about
    ``sample_s`` each, after two warm-up calls."""
    for _ in range(2):  # warm up (and the first reorder)
        first = {name: run(1) for name, run in runs.items()}
    # Enough calls per round for ~sample_s (at most 200 calls).
    per = max(first.values())
    reps = max(1, min(200, int(sample_s / max(per, 1e-7))))
    # Cycling copies: each round goes through them all a few times, so
    # no round is one lucky or unlucky pass over the caches.
    reps = max(reps, 4 * copies) if copies > 1 else reps
    times: Dict[str, List[float]] = {name: [] for name in runs}
    # One fixed order, round after round: no candidate ever runs twice in
    # a row. Rule 6 reversed every other round (plain, oneDNN, MKL, then
    # MKL, oneDNN, plain), so each round boundary ran one candidate twice
    # and its second run found its copies still in the last-level cache:
    # with a 2752x256 weight cycling through 16 MiB, the rounds where the
    # plain GEMM ran twice gave oneDNN 0.9-1.5x of its time, the others
    # 0.45-0.6x, and the measurement could not decide.
    for _ in range(rounds):
        for name, run in runs.items():
            times[name].append(run(reps))
    return times


def time_candidates(dtype: torch.dtype, k: int, n: int, mb: int, pool: int,
                    kernels: Callable[[torch.dtype, int], List[str]], rounds: int,
                    sample_s: float) -> Tuple[Dict[str, List[float]], Dict[str, int]]:
    """Each candidate's seconds per call in ``rounds`` interleaved rounds of
    about ``sample_s``, and its copy's bytes: the plain GEMM and
    ``kernels(dtype, mb)`` (asked here, outside fake mode: it may probe a
    kernel). ``pool``: see the module's docstring."""
    with _aot.outside_fake_mode(), torch.no_grad():
        ws, x = _weights(dtype, k, n, mb, pool)
        runs: Dict[str, Callable[[int], float]] = {
            "plain": _timer(_cycle([lambda w=w: F.linear(x, w) for w in ws]))}
        nbytes: Dict[str, int] = {}
        firsts: List[Tuple[str, Callable[[], object]]] = []
        for kern in kernels(dtype, mb):
            nbytes[kern], calls, first = _BUILD[kern](x, ws, n, mb)
            if calls is not None:
                runs[kern] = _timer(_cycle(calls))
            if calls is not None and first is not None:
                firsts.append((kern, first))
        # The first packed call makes the library's kernel for this shape and
        # row count, which stays in its cache: counted (state.py).
        for kern, first in firsts:
            _state.run_first(_state.key_of(kern, x, n, False), first)
        times = _interleaved_rounds(runs, len(ws), rounds, sample_s)
    return times, nbytes
