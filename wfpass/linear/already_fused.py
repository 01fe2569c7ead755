"""The linear format's report for layers that already compute several
projections with one weight (``nn.MultiheadAttention``'s ``in_proj_weight``,
GPT-2's ``Conv1D``, a linear whose output is split): a ``skipped`` record
marked ``already_fused``, so such models do not read as "no pattern found".
``fuse_linears`` yields these matches after its groups; its guard refuses
each with the reason it carries."""
from __future__ import annotations

import operator
from typing import Iterator, Sequence

import torch
import torch.fx as fx

from ..core.graph import LINEAR_TARGETS, PassContext, TensorRef
from ..pipeline import Match

__all__ = ["AlreadyFused", "already_fused"]

LINEAR_TARGETS_SET = frozenset(LINEAR_TARGETS)


# -- layers that already hold Q/K/V in one weight ------------------------------------

_SPLITS = frozenset({"split", "chunk", "tensor_split", "unbind", "split_with_sizes", "unflatten"})
_RESHAPES = frozenset({"view", "reshape", "contiguous", "transpose", "unflatten"})


def _split_parts(node: fx.Node, depth: int = 3) -> int:
    """How many parts ``node``'s output is split into (through views and
    reshapes), 0 if it is not split."""
    for u in node.users:
        name = getattr(u.target, "__name__", str(u.target)) if u.op == "call_function" else str(u.target)
        if name in _SPLITS and u.op in ("call_method", "call_function"):
            n = sum(1 for g in u.users if g.op == "call_function" and g.target is operator.getitem)
            if n >= 2:
                return n
        if name in _RESHAPES and depth > 0:
            n = _split_parts(u, depth - 1)
            if n:
                return n
    return 0


class AlreadyFused(Match):
    """A layer that already computes several projections with one weight,
    or MHA's separate projections: found, reported, never rewritten."""

    def __init__(self, reason: str, refs: Sequence[TensorRef]):
        self.ref_list = [r for r in refs if r is not None]
        super().__init__([r.name for r in self.ref_list], already_fused=reason.startswith("already fused"))
        self.reason = reason

    def refs(self) -> list:
        return self.ref_list


def already_fused(gm: fx.GraphModule, ctx: PassContext, grouped) -> Iterator[AlreadyFused]:
    """A match for every layer that already computes several projections
    with one weight, so that such models do not read as "no pattern found":
    ``nn.MultiheadAttention`` (``in_proj_weight``, Q/K/V in one matrix; its
    call stays ``F.multi_head_attention_forward`` in Dynamo graphs),
    GPT-2's ``Conv1D`` (``c_attn``: one ``addmm`` split three ways) and a
    linear whose output is split (a hand-fused ``qkv_proj``)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", "")
        if name == "multi_head_attention_forward":
            # (query, key, value, embed_dim, num_heads, in_proj_weight, in_proj_bias, ...)
            w = ctx.resolve(node.args[5]) if len(node.args) > 5 else None
            b = ctx.resolve(node.args[6]) if len(node.args) > 6 else None
            sep = node.kwargs.get("use_separate_proj_weight", False)
            if sep:
                refs = [ctx.resolve(node.kwargs.get(k)) for k in ("q_proj_weight", "k_proj_weight", "v_proj_weight")]
                yield AlreadyFused("nn.MultiheadAttention with separate q/k/v projection weights: they are used inside "
                                   "F.multi_head_attention_forward, which wfpass does not rewrite", [r for r in refs if r is not None])
            elif w is not None:
                refs = [r for r in (w, b) if r is not None]
                yield AlreadyFused(f"already fused: nn.MultiheadAttention holds Q/K/V in one in_proj_weight "
                                   f"({w.tensor.shape[0]} rows) and computes them with one GEMM; nothing to fuse", refs)
        elif node.target in (torch.addmm, torch.ops.aten.addmm.default) and len(node.args) >= 3:
            w = ctx.resolve(node.args[2])
            parts = _split_parts(node)
            if w is not None and w.is_state and parts:
                b = ctx.resolve(node.args[0])
                refs = [r for r in (w, b) if r is not None and r.is_state]
                yield AlreadyFused(f"already fused: one weight of shape {tuple(w.tensor.shape)} computes {parts} outputs "
                                   f"with one GEMM (a Conv1D / addmm layer, as GPT-2's c_attn); nothing to fuse", refs)
        elif node.target in LINEAR_TARGETS_SET and node.args and node.args[0] not in grouped:
            w = ctx.resolve(node.args[1] if len(node.args) > 1 else node.kwargs.get("weight"))
            parts = _split_parts(node)
            if w is not None and w.is_state and parts:
                b = ctx.resolve(node.args[2]) if len(node.args) > 2 else None
                refs = [r for r in (w, b) if r is not None and r.is_state]
                yield AlreadyFused(f"already fused: one linear ({w.tensor.shape[0]} rows) whose output is split into "
                                   f"{parts} parts computes them with one GEMM; nothing to fuse", refs)
