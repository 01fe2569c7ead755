"""Python entry points of wfpass's own C++ linear kernels (``linear/direct.cpp``,
the ``brgemm`` panels of ``prepack/prepack.cpp``): whether they run here,
and their calls. No private PyTorch API."""
from __future__ import annotations

from typing import Optional

import torch

from . import fast_loop, loaded

__all__ = ["direct_runs", "direct_isa", "direct_amx", "direct_bf16dot", "direct_skew", "direct_linear", "panel_packs", "panel_pack", "panel_linear"]


def direct_runs(dtype: torch.dtype) -> bool:
    """Can the ``"direct"`` kernel run a linear of ``dtype`` here? float32,
    bfloat16 or float16 (a half weight widened to float32 as it streams in,
    summed in float32), where wfpass's C++ kernels are loaded on an x86-64
    CPU with AVX-512F, or AVX2 with FMA and F16C (and ``WFPASS_DIRECT`` is
    not off)."""
    return dtype in (torch.float32, torch.bfloat16, torch.float16) and direct_isa() != ""


def direct_isa() -> str:
    """The instruction set the ``"direct"`` kernel runs on here: ``"avx512f"``,
    ``"avx2"`` (also on an AVX-512 CPU with ``WFPASS_DIRECT=avx2``), or ``""``
    where it does not run."""
    if not loaded() or not hasattr(torch.ops.wfpass, "native_direct_isa"):
        return ""
    return str(torch.ops.wfpass.native_direct_isa())


def direct_amx() -> bool:
    """Does the ``"direct"`` kernel take bfloat16 weights at 4 or more input
    rows through AMX tiles here (on a CPU with AMX-BF16 whose kernel grants
    the tiles, with the AVX-512 build, unless ``WFPASS_DIRECT_AMX=0``)?"""
    if not loaded() or not hasattr(torch.ops.wfpass, "native_direct_amx"):
        return False
    return bool(torch.ops.wfpass.native_direct_amx())


def direct_bf16dot() -> bool:
    """Does the ``"direct"`` kernel take bfloat16 weights at 8 or more input
    rows through AVX-512 BF16 dot products here (a CPU with AVX-512 BF16
    where AMX is not in use, unless ``WFPASS_DIRECT_BF16DOT=0``)?"""
    if not loaded() or not hasattr(torch.ops.wfpass, "native_direct_bf16dot"):
        return False
    return bool(torch.ops.wfpass.native_direct_bf16dot())


def direct_skew() -> bool:
    """Does the ``"direct"`` kernel read each row of a half-precision weight
    whose rows are 4 KB apart from a line of its own at one and two input
    rows (``block_skew`` in direct_kernel.h; unless ``WFPASS_DIRECT_SKEW=0``)?"""
    if not loaded() or not hasattr(torch.ops.wfpass, "native_direct_skew"):
        return False
    return bool(torch.ops.wfpass.native_direct_skew())


def direct_linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, w, b)`` from the weight as it is, no copy: dot products
    of 16 outputs at a time in AVX-512 registers, 8 in AVX2's
    (wfpass/native/linear/direct.cpp)."""
    return torch.ops.wfpass._direct_linear(x, w, b)


def panel_packs(dtype: torch.dtype) -> bool:
    """Can the ``"brgemm"`` kernel run a linear of ``dtype`` here? float32,
    where wfpass's C++ kernels are loaded and oneDNN's fp32 small-GEMM
    ukernel answers on this CPU (``native.fast_loop``)."""
    return dtype == torch.float32 and fast_loop() and hasattr(torch.ops.wfpass, "_panel_linear")


def panel_pack(w: torch.Tensor) -> torch.Tensor:
    """``w`` ([out, in]) as ``[ceil(out / 64), in, 64]`` panels of ``w.T``'s
    columns (zero past ``out``): the copy the ``"brgemm"`` kernel reads,
    the weight's bytes (up to 63 padded columns more)."""
    return torch.ops.wfpass._panel_pack(w)


def panel_linear(x: torch.Tensor, panels: torch.Tensor, b: Optional[torch.Tensor], n: int) -> torch.Tensor:
    """``x @ w.T (+ b)`` from ``panel_pack(w)`` (``n`` = ``w``'s rows) on
    oneDNN's small-GEMM ukernel (wfpass/native/rnn/fast_rnn.cpp)."""
    return torch.ops.wfpass._panel_linear(x, panels, b, n)
