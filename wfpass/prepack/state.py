"""The kernel library's own memory behind the packed kernels: bounded by
``prepack.max_bytes`` beside the packed copies, and shown in the report.

oneDNN compiles a kernel (a *primitive*: JIT code and its descriptors) for
every weight shape, dtype and **row count** its packed linear runs, and keeps
it in a process-wide cache (1024 entries unless
``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` says otherwise) that nothing outside
oneDNN can empty: torch exports no call to it. Measured on torch 2.13 (AMD
EPYC with AVX-512, float32 and bfloat16, weights from 64x64 to 2752x256):
0.55-0.59 MiB of heap per new (shape, row count), nothing on later calls
(torch 2.11's CUDA build: 0.43 MB for a shape's first, about 40 KB after);
MKL's packed SGEMM kept about 1.3 MiB at its first call at 5 rows. A model
compiled with a symbolic row count (prefill of varied prompt lengths) made
one such kernel per length per packed shape: called at every length from 1
to 200, the bench decoder grew by 250.7 MB (219 MB of kernels, 12.2 MB of
packed copies) against Inductor's 24.6 MB
(``benchmarks/prepack/decoder_memory.py --warm --sweep 200``). So ``prepack.max_bytes`` bounds
these kernels too, on their own: the copies within it, and the kernels
within it (one budget for both took the bench decoder's kernels for its
dynamic row counts, and its 5-token call fell from 1.91x to 0.82x of
Inductor).

wfpass's own ``brgemm`` kernel (oneDNN's small-GEMM ukernel over panels,
``native/rnn/fast_rnn.cpp``) is counted the same way: about 16 KiB per
new (shape, row count), so a decoder's dynamic row counts fit the budget
(0.2 MiB for the bench decoder's calls, against 5.0 MiB with oneDNN's).

How it is counted: the first call of each (kernel, dtype, shape, row count,
bias) in the process reads the heap in use before and after it (glibc's
``mallinfo2``), less the output's bytes; later calls cost nothing. Where
``mallinfo2`` is missing (another C library, glibc before 2.33) the charge
is ``estimate``'s. The total only grows: the kernels stay in oneDNN's cache
after the model that made them is gone (a later model of the same shapes
reuses them at no charge).

How a kernel not made yet is estimated, to be refused before it is made
(``estimate``): the largest charge measured in the process for its class,
a kernel for a weight shape the library has not run yet or one more row
count of a shape it has, times ``MARGIN``. The classes differ tenfold on
torch 2.11's CUDA build (0.43 MB, 40 KB) and the heap read includes what
else the call allocated: estimated from the last charge alone, a 20 KB
kernel came in 2 KB over it and took a budget past its bound.
"""
from __future__ import annotations

import ctypes
from typing import Callable, Dict, Optional, Set, Tuple

import torch

__all__ = ["GUESS", "MARGIN", "total", "known", "estimate", "run_first", "key_of"]

#: The charge of a first call where nothing of its class was measured yet,
#: per kernel (measured as above; MKL's rounded up).
GUESS: Dict[str, int] = {"onednn": 600 << 10, "mkl": 1536 << 10, "brgemm": 32 << 10}

#: The estimate's headroom over the largest charge of its class.
MARGIN = 1.25

_SEEN: Set[tuple] = set()
_TOTAL = [0]
# (kernel, dtype, weight shape) the library has run a kernel for.
_SHAPES: Set[tuple] = set()
# (kernel, a new weight shape?) -> the largest charge measured.
_LARGEST: Dict[Tuple[str, bool], int] = {}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _heap_reader() -> Optional[Callable[[], int]]:
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2

    def read() -> int:
        m = fn()
        return m.uordblks + m.hblkhd  # bytes in use: from the arenas and mmap'd

    return read


_HEAP = _heap_reader()


def total() -> int:
    """Bytes the kernel library keeps for the packed kernels this process ran."""
    return _TOTAL[0]


def key_of(kernel: str, x: torch.Tensor, n: int, bias: bool) -> tuple:
    """What one compiled kernel is made for."""
    return (kernel, x.dtype, n, x.shape[-1], x.numel() // max(1, x.shape[-1]), bias)


def known(key: tuple) -> bool:
    return key in _SEEN


def _shape(key: tuple) -> tuple:
    return key[:4]  # (kernel, dtype, n, k) of key_of's (kernel, dtype, n, k, m, bias)


def estimate(key: tuple) -> int:
    """The charge expected for the kernel ``key`` (``key_of``'s), before it
    is made: an upper bound, so that refusing the kernels over a budget
    keeps their total within it (module docstring)."""
    kernel, new_shape = key[0], _shape(key) not in _SHAPES
    largest = _LARGEST.get((kernel, new_shape))
    if largest is None:
        # Nothing of this class measured: a new shape's is the guess (the
        # larger class); another row count's is at most its shape's first.
        largest = GUESS.get(kernel, 0) if new_shape else _LARGEST.get((kernel, True), GUESS.get(kernel, 0))
    return int(largest * MARGIN)


def run_first(key: tuple, call: Callable[[], torch.Tensor]) -> Tuple[torch.Tensor, int]:
    """``call()``; on the first call of ``key`` in the process, also what
    it left on the heap (its output aside), counted into ``total()``.
    Returns the output and the bytes charged (0 after the first)."""
    if key in _SEEN:
        return call(), 0
    before = _HEAP() if _HEAP is not None else None
    y = call()
    cls = (key[0], _shape(key) not in _SHAPES)
    if before is not None:
        charged = max(0, _HEAP() - before - y.numel() * y.element_size())
        if charged:  # 0: the kernel was made before, outside this count (another caller's)
            _LARGEST[cls] = max(charged, _LARGEST.get(cls, 0))
    else:
        charged = estimate(key)
    _SEEN.add(key)
    _SHAPES.add(_shape(key))
    _TOTAL[0] += charged
    return y, charged
