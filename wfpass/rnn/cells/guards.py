"""Why a cell loop is not folded: the guards of ``fold_cells``.

A chain is folded only when it is provably the same computation as one RNN
call, and when the RNN format would take that call (its own guards, asked
of a trial call). Every reason is a skip record; the loop is left exactly
as it was.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.fx as fx

from ...config import default_seq_threshold
from ...core.graph import PassContext, meta_value
from .match import RNN_CALL, Chain, depends_on
from ..guards import call_problem
from ..match import match_call

__all__ = ["refusal", "loop_problem", "rnn_format_refusal"]


def refusal(ctx: PassContext, layers: List[Chain]) -> Optional[str]:
    """Why this stack of chains is not folded as it stands, or None."""
    why = loop_problem(ctx, layers, depends_on(ctx.gm.graph, {c.node for l in layers for c in l.cells}))
    if why is None and not ctx.config.runs("fuse_rnn"):
        why = "folding hands the loop to the fuse_rnn format, which this config does not run"
    return why


def _fold_threshold(ctx: PassContext, device: torch.device) -> int:
    """The N at or below which a loop is left as cells (they are the unfused path)."""
    n = ctx.config.rnn.seq_threshold
    if n is None:
        return default_seq_threshold(device.type)
    return 0 if n == "auto" else n  # "auto": fuse_rnn measures per shape and may still take the loop


def loop_problem(ctx: PassContext, layers: List[Chain], dep: set) -> Optional[str]:
    """Why this stack of chains cannot be one RNN call, or None."""
    T = len(layers[0].cells)
    cells = [c for ch in layers for c in ch.cells]
    bad = next((c for c in cells if c.problem), None)
    if bad is not None:
        return bad.problem
    bad = next((ch for ch in layers if ch.problem), None)
    if bad is not None:
        return bad.problem
    first = layers[0].first
    biased = {len(ch.first.weight_nodes) == 4 for ch in layers}
    if len(biased) != 1:
        return "some stacked cells have biases and some do not"
    w0 = first.refs[0].tensor
    if not w0.is_floating_point():
        return f"weights are {w0.dtype}, not floating point"
    if len({(r.tensor.dtype, r.tensor.device) for ch in layers for r in ch.first.refs}) != 1:
        return "weights differ in dtype or device"
    if w0.device.type == "cuda" and ctx.config.rnn.cuda == "cudnn":
        pass  # folded into the same cuDNN call as a whole RNN on CUDA (rnn/cuda/cudnn.py)
    elif w0.device.type == "cuda":
        return ("weights on cuda: cell loops on CUDA are folded only with rnn={'cuda': 'cudnn'} "
                "(one cuDNN call); left as they are")
    elif w0.device.type != "cpu":
        return f"weights on {w0.device.type}: cell loops are folded on the CPU and CUDA only"
    n = _fold_threshold(ctx, w0.device)
    if T <= n:
        return f"{T} step(s) <= seq_threshold {n}: the cells are already the unfused path"
    # Each layer's inputs: the bottom one's must not depend on any step.
    for k, c in enumerate(layers[0].cells):
        if c.x in dep:
            return (f"step {k + 1}'s input depends on an earlier step's state (attention, feedback or an "
                    "autoregressive loop): the steps cannot run as one RNN")
    for ch in layers:
        for s in ch.first.state:
            if s in dep:
                return "the initial state depends on the loop"
    # What the fused call cannot give back: a lower layer's per-step h, or any
    # step's c but the last, read outside the loop.
    inside = {c.node for c in cells}
    for li, ch in enumerate(layers):
        for k, c in enumerate(ch.cells):
            last = k == T - 1
            readers = {u for h in c.h_outs for u in h.users} - inside
            if li < len(layers) - 1 and not last and readers:
                return f"layer {li + 1}'s h at step {k + 1} is read outside the loop (the fused call returns the top layer's)"
            if not last and any(set(co.users) - inside for co in c.c_outs):
                return f"the cell state c of step {k + 1} is read outside the loop (the fused call returns the last one)"
    return None


def rnn_format_refusal(ctx: PassContext, layers: List[Chain]) -> Optional[str]:
    """Dynamo graphs: what the RNN format's guards say of the call this
    stack would become, asked of a trial call inserted and erased here."""
    trial = _trial_call(ctx, layers)
    try:
        s = match_call(ctx, trial)
        return call_problem(s, ctx) if s is not None else "internal: the folded call is not an RNN call"
    finally:
        ctx.gm.graph.erase_node(trial)


def _trial_call(ctx: PassContext, layers: List[Chain]) -> fx.Node:
    """A throwaway RNN call over the first step's input, for fuse_rnn's guards."""
    g = ctx.gm.graph
    first = layers[0].first
    weights = [w for ch in layers for w in ch.first.weight_nodes]
    hx = [first.state[0], first.state[1]] if first.mode == "LSTM" else first.state[0]
    with g.inserting_before(first.node):
        xv = meta_value(first.x)
        n = g.call_function(RNN_CALL[first.mode],
                            (first.x, hx, weights, len(first.weight_nodes) == 4, len(layers), 0.0, True, False, False))
        if isinstance(xv, torch.Tensor):
            n.meta["example_value"] = xv.unsqueeze(0)
    return n
