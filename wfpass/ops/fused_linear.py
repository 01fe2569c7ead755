"""The fused sibling-linear format: one weight block, one GEMM, a split.

Graph after ``fuse_linears`` (Dynamo flavour; q: 16 rows, k: 8, v: 8)::

    w   = fused_linear_weight("g0", q_w, k_w, v_w)      # prologue: alias of the block
    b   = fused_linear_bias("g0.bias", q_b, None, v_b)  # prologue: k's slot is zero
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

__all__ = ["FusedLinear", "LinearLayout", "fused_linear", "fused_linear_weight", "fused_linear_bias", "linear_layout_check"]


def _offsets(sizes: Sequence[int], scale: int) -> Tuple[int, ...]:
    offs, acc = [], 0
    for s in sizes:
        offs.append(acc)
        acc += s * scale
    return tuple(offs)


class LinearLayout:
    """Static facts of one group, computed once at rewrite time: element
    offsets of each member's weight in the weight block and of each bias slot
    in the bias block."""

    def __init__(self, sizes: Sequence[int], has_bias: Sequence[bool], in_features: int):
        self.sizes, self.has_bias = tuple(sizes), tuple(has_bias)
        self.total, self.in_features = sum(sizes), in_features
        self.w_offsets = _offsets(sizes, in_features)
        self.b_slots = _offsets(sizes, 1)


def _base(g, ts: Sequence[Optional[torch.Tensor]], offsets: Sequence[int]) -> Optional[int]:
    return None if g.storage is None else g.storage.block_offset(ts, offsets)


def _cat_weights(gid: str, *ws: torch.Tensor) -> torch.Tensor:
    return torch.cat([w.detach() for w in ws], 0)


def _cat_biases(gid: str, *bs: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    lay: LinearLayout = group(gid).spec
    present = [(b, off) for b, off in zip(bs, lay.b_slots) if b is not None]
    if not present:
        return None
    ref = present[0][0]
    out = torch.zeros(lay.total, dtype=ref.dtype, device=ref.device)
    for b, off in present:
        out[off : off + b.numel()] = b.detach()
    return out


@prologue(example=_cat_weights)
def fused_linear_weight(gid: str, *ws: torch.Tensor) -> torch.Tensor:
    """The group's weight block ``[sum(out_i), in]`` without copying, if the
    members are still laid out in one buffer; otherwise re-fuse (counted) or,
    when that is unsafe, concatenate for this call (counted)."""
    g = group(gid)
    lay: LinearLayout = g.spec
    base = _base(g, ws, lay.w_offsets)
    if base is None and g.try_refuse(ws):
        base = _base(g, ws, lay.w_offsets)
    if base is None:
        g.record.bump("fallback_calls")
        return _cat_weights(gid, *ws)
    g.record.bump("fused_calls")
    return torch.as_strided(ws[0].detach(), (lay.total, lay.in_features), (lay.in_features, 1), base)


def _no_value(gid: str, *ws: torch.Tensor) -> torch.Tensor:
    return ws[0].new_empty(0)


@prologue(example=_no_value)
def linear_layout_check(gid: str, *ws: torch.Tensor) -> torch.Tensor:
    """The split path's per-call check: its GEMMs read each member's own
    tensor, so nothing needs the block, but a lost layout (``.to()``,
    ``param.data = ...``) is re-fused here (counted ``refused``) so the
    format comes back as on the fused path; when that is unsafe (a member's
    storage is shared) the call just goes on, counted ``unfused_layout_calls``.
    Returns an empty tensor nothing reads."""
    g = group(gid)
    lay: LinearLayout = g.spec
    if _base(g, ws, lay.w_offsets) is None and not g.try_refuse(ws):
        g.record.bump("unfused_layout_calls")
    return _no_value(gid, *ws)


@prologue(example=_cat_biases)
def fused_linear_bias(gid: str, *bs: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The group's bias vector (``gid`` is the bias group's). When every
    member has a bias: an alias of their one buffer, with layout checks,
    re-fusing and fallback as in :func:`fused_linear_weight`. Otherwise the
    biases stay independent (zero slots in a shared buffer would be saved in
    checkpoints) and the vector, with zeros for the members without a bias,
    is assembled per call (``bias_cat_calls``)."""
    g = group(gid)
    lay: LinearLayout = g.spec
    if not all(lay.has_bias):
        g.record.bump("bias_cat_calls")
        return _cat_biases(gid, *bs)
    base = _base(g, bs, lay.b_slots)
    if base is None and g.try_refuse([b for b in bs if b is not None]):
        base = _base(g, bs, lay.b_slots)
    if base is None:
        g.record.bump("bias_fallback_calls")
        return _cat_biases(gid, *bs)
    first = next(b for b in bs if b is not None)
    return torch.as_strided(first.detach(), (lay.total,), (1,), base)


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
