"""The fused sibling-linear format: one weight block, one GEMM, a split.

Graph after ``fuse_linears`` (Dynamo flavour; q: 16 rows, k: 8, v: 8)::

    w   = fused_linear_weight("g0", q_w, k_w, v_w)      # prologue: alias of the block
    b   = fused_linear_bias("g0", q_b, None, v_b)       # prologue: k's slot is zero
    y   = fused_linear(x, w, b, spec, q_w, k_w, v_w, q_b, v_b)
    q, k, v = y.split([16, 8, 8], -1)

``q_w, k_w, v_w`` are passed to ``FusedLinear`` only so autograd can route each
its own gradient; the forward reads the block.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .runtime import group, prologue

__all__ = ["FusedLinear", "fused_linear", "fused_linear_weight", "fused_linear_bias"]


def _views_of_one_block(ts: Sequence[torch.Tensor], offsets: Sequence[int]) -> Optional[int]:
    """Base storage offset if every ``ts[i]`` is a contiguous view at ``base +
    offsets[i]`` of one storage, else None. Cheap: no data is touched."""
    first = ts[0]
    ptr = first.untyped_storage().data_ptr()
    base = first.storage_offset() - offsets[0]
    for t, off in zip(ts, offsets):
        if t.untyped_storage().data_ptr() != ptr or t.storage_offset() != base + off or not t.is_contiguous():
            return None
    return base


def _row_offsets(ws: Sequence[torch.Tensor]) -> Tuple[int, ...]:
    offs, acc = [], 0
    for w in ws:
        offs.append(acc)
        acc += w.numel()
    return tuple(offs)


def _cat_weights(gid: str, *ws: torch.Tensor) -> torch.Tensor:
    return torch.cat([w.detach() for w in ws], 0)


def _cat_biases(gid: str, *bs: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    sizes, _ = group(gid).spec
    present = [(b, off) for b, off in zip(bs, _slot_offsets(sizes)) if b is not None]
    if not present:
        return None
    ref = present[0][0]
    out = torch.zeros(sum(sizes), dtype=ref.dtype, device=ref.device)
    for b, off in present:
        out[off : off + b.numel()] = b.detach()
    return out


@prologue(example=_cat_weights)
def fused_linear_weight(gid: str, *ws: torch.Tensor) -> torch.Tensor:
    """The group's weight block ``[sum(out_i), in]`` without copying, if the
    members are still laid out in one buffer; otherwise re-fuse (counted) or,
    when that is unsafe, concatenate for this call (counted)."""
    g = group(gid)
    offsets = _row_offsets(ws)
    total, in_f = sum(w.shape[0] for w in ws), ws[0].shape[1]
    base = _views_of_one_block(ws, offsets)
    if base is None and g.try_refuse(ws):
        base = _views_of_one_block(ws, offsets)
    if base is not None:
        g.record.bump("fused_calls")
        return ws[0].detach().as_strided((total, in_f), (in_f, 1), base)
    g.record.bump("fallback_calls")
    return _cat_weights(gid, *ws)


@prologue(example=_cat_biases)
def fused_linear_bias(gid: str, *bs: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The group's bias block, with zero slots for members without a bias.
    Layout checks, re-fusing and fallback as in :func:`fused_linear_weight`."""
    sizes, _ = group(gid).spec
    present = [(b, off) for b, off in zip(bs, _slot_offsets(sizes)) if b is not None]
    if not present:
        return None
    tensors, offsets = [b for b, _ in present], [o for _, o in present]
    base = _views_of_one_block(tensors, offsets)
    if base is None and group(gid + ".bias").try_refuse(tensors):
        base = _views_of_one_block(tensors, offsets)
    if base is not None:
        return present[0][0].detach().as_strided((sum(sizes),), (1,), base)
    group(gid).record.bump("bias_fallback_calls")
    return _cat_biases(gid, *bs)


def _slot_offsets(sizes: Sequence[int]) -> Tuple[int, ...]:
    offs, acc = [], 0
    for s in sizes:
        offs.append(acc)
        acc += s
    return tuple(offs)


class FusedLinear(torch.autograd.Function):
    """``y = x @ W_block.T + b_block`` with each member's gradient sent to its
    own Parameter.

    Inputs: ``x, w_block, b_block, spec, *weights, *present_biases`` where
    ``spec = (sizes, has_bias)``. Written in aten ops only, so AOTAutograd
    traces it and Inductor compiles the GEMM and the bias add like any other.
    """

    @staticmethod
    def forward(x, w_block, b_block, spec, *params):
        return F.linear(x, w_block, b_block)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w_block, _b_block, spec, *_params = inputs
        ctx.save_for_backward(x, w_block)
        ctx.spec = spec

    @staticmethod
    def backward(ctx, gy):
        x, w_block = ctx.saved_tensors
        sizes, has_bias = ctx.spec
        n = len(sizes)
        needs = ctx.needs_input_grad
        gx = gy @ w_block if needs[0] else None
        gy2 = gy.reshape(-1, gy.shape[-1])
        w_grads: list = [None] * n
        if any(needs[4 : 4 + n]):
            x2 = x.reshape(-1, x.shape[-1])
            w_grads = list((gy2.t() @ x2).split(list(sizes), 0))
        b_grads = []
        if any(has_bias):
            gb = gy2.sum(0).split(list(sizes), 0)
            b_grads = [g for g, hb in zip(gb, has_bias) if hb]
        return (gx, None, None, None, *w_grads, *b_grads)


def fused_linear(x, w_block, b_block, spec, *params):
    """Graph-level entry point (FX cannot name ``FusedLinear.apply`` in code)."""
    return FusedLinear.apply(x, w_block, b_block, spec, *params)
