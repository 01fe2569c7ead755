"""A cell loop replaced by one RNN call.

Dynamo flavour: the stacked step inputs (the original tensor where the
steps were ``x[t]``), the initial states stacked per layer, and
``torch.lstm`` / ``gru`` / ... over the cells' weights, which ``fuse_rnn``
lowers next; each step's h becomes ``out[t]``, the last h and c
``h_n[layer]`` / ``c_n[layer]``, and ``stack`` of every step's h the output
itself. ``symbolic_trace`` flavour: a ``CellLoopCall`` over the cells'
weights, with its group built here as ``fuse_rnn`` builds one for an
``nn.LSTM``.
"""
from __future__ import annotations

import operator
from typing import List, Optional, Tuple

import torch
import torch.fx as fx

from ...config import default_seq_threshold
from ...core.graph import PassContext, meta_value, static_int
from .match import RNN_CALL, Chain, depends_on
from ..eager import CellLoopCall
from ..rewrite import new_group
from ..spec import RnnSpec

__all__ = ["rewrite_loop", "module_group"]


def rewrite_loop(ctx: PassContext, layers: List[Chain], label: str, site=None) -> None:
    """Replace the steps of ``layers`` with one RNN call (``site``: the
    group of a ``symbolic_trace`` graph's ``CellLoopCall``)."""
    g = ctx.gm.graph
    lstm = layers[0].first.mode == "LSTM"
    cells = [c for ch in layers for c in ch.cells]
    states = [_initial_state(g, ch, lstm) for ch in layers]
    anchor, moved = _anchor(g, layers, states, cells)
    X, last = _stacked_input(ctx, g, [c.x for c in layers[0].cells], anchor)
    if ctx.is_dynamo:
        call = _rnn_call(g, layers, X, states, last, label)
    else:
        call = _loop_call(g, layers, X, states, last, site)
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in layers[0].first.node.meta:
            call.meta[key] = layers[0].first.node.meta[key]
    # The new call has no traced value of its own: whether it is
    # differentiated (what picks its kernel: rewrite.trains) is the steps'.
    step = layers[0].first.node.meta.get("example_value")
    first = step[0] if isinstance(step, (tuple, list)) and step else step
    call.meta["wfpass_trains"] = isinstance(first, torch.Tensor) and first.requires_grad
    out, hn, cn = _results(g, call, lstm, moved)
    _replace_outputs(g, layers, cells, out, hn, cn)
    _erase_steps(g, cells, lstm, label)


def _anchor(g: fx.Graph, layers: List[Chain], states: List[List[Optional[fx.Node]]],
            cells: list) -> Tuple[fx.Node, List[fx.Node]]:
    """Where the call goes: after the last of its inputs (the step inputs,
    the initial states, the weights). And the nodes between the first step
    and there that read the loop's results, which move after the call (none
    of them feeds a step input: cells_guards.loop_problem proved that), in
    their order."""
    order = {n: i for i, n in enumerate(g.nodes)}
    xs = [c.x for c in layers[0].cells]
    inputs = xs + [s for st in states for s in st if s is not None]
    inputs += [w for ch in layers for w in ch.first.weight_nodes if isinstance(w, fx.Node)]
    anchor = max(inputs, key=order.__getitem__)
    start = min(order[c.node] for c in cells)
    dep = depends_on(g, {c.node for c in cells})
    own = {c.node for c in cells} | {o for c in cells for o in c.h_outs + c.c_outs}
    moved = [n for n in g.nodes if start < order[n] <= order[anchor] and n in dep and n not in own]
    return anchor, moved


def _stacked_input(ctx: PassContext, g: fx.Graph, xs: List[fx.Node], anchor: fx.Node) -> Tuple[fx.Node, fx.Node]:
    """The call's input X, steps first, placed after ``anchor``: in a Dynamo
    graph, the tensor the steps indexed where they did (transposed when its
    steps are dim 1); else the step inputs stacked. Also the node the call
    goes after so far (``anchor`` when X is that tensor)."""
    src, dim = _step_inputs(g, xs, len(xs)) if ctx.is_dynamo else (None, None)
    with g.inserting_after(anchor):
        if src is not None:
            v = meta_value(src)
            X = src if dim == 0 else _call(g, torch.transpose, (src, 0, 1), v.transpose(0, 1))
        else:
            vals = [meta_value(x) for x in xs]
            val = torch.stack(vals, 0) if all(isinstance(v, torch.Tensor) for v in vals) else None
            X = _call(g, torch.stack, (xs, 0), val)
    return X, (anchor if X is src else X)


def _state_stack(g: fx.Graph, states: List[List[Optional[fx.Node]]], i: int) -> fx.Node:
    """The layers' initial h (``i=0``) or c (``i=1``) stacked, one per layer."""
    parts = [st[i] for st in states]
    vals = [meta_value(p) for p in parts]
    val = torch.stack(vals, 0) if all(isinstance(v, torch.Tensor) for v in vals) else None
    return _call(g, torch.stack, (parts, 0), val)


def _rnn_call(g: fx.Graph, layers: List[Chain], X: fx.Node, states: List[List[Optional[fx.Node]]],
              last: fx.Node, label: str) -> fx.Node:
    """Dynamo flavour: the initial states stacked per layer, then
    ``torch.lstm`` / ``gru`` / ... over the cells' weights (which
    ``fuse_rnn`` lowers next), after ``last``."""
    mode = layers[0].first.mode
    lstm = mode == "LSTM"
    with g.inserting_after(last):
        h0 = _state_stack(g, states, 0)
    with g.inserting_after(h0):
        hx = [h0, _state_stack(g, states, 1)] if lstm else h0
    last = hx[1] if lstm else hx
    weights = [w for ch in layers for w in ch.first.weight_nodes]
    has_b = len(layers[0].first.weight_nodes) == 4
    with g.inserting_after(last):
        call = _call(g, RNN_CALL[mode], (X, hx, weights, has_b, len(layers), 0.0, True, False, False))
        call.meta["wfpass_cells"] = label
    return call


def _loop_call(g: fx.Graph, layers: List[Chain], X: fx.Node, states: List[List[Optional[fx.Node]]],
               last: fx.Node, site) -> fx.Node:
    """``symbolic_trace`` flavour: a ``CellLoopCall`` of ``site`` over the
    cells' weights, read by ``get_attr`` nodes placed after ``last``."""
    lstm = layers[0].first.mode == "LSTM"
    names = [n for ch in layers for n in ch.first.weight_nodes]
    ws = []
    for n in reversed(names):
        with g.inserting_after(last):
            ws.insert(0, g.get_attr(n))
    last = ws[-1]
    with g.inserting_after(last):
        return g.call_function(CellLoopCall(site),
                               (X, [st[0] for st in states], [st[-1] for st in states] if lstm else [], *ws))


def _results(g: fx.Graph, call: fx.Node, lstm: bool, moved: List[fx.Node]) -> Tuple[fx.Node, fx.Node, Optional[fx.Node]]:
    """The call's (out, h_n, c_n) as nodes (c_n: LSTMs only, else None),
    and the moved nodes placed after them, in their order."""
    with g.inserting_after(call):
        out = _call(g, operator.getitem, (call, 0))
    with g.inserting_after(out):
        hn = _call(g, operator.getitem, (call, 1))
    tail = hn
    cn = None
    if lstm:
        with g.inserting_after(hn):
            cn = tail = _call(g, operator.getitem, (call, 2))
    for n in moved:  # after the call, in order
        tail.append(n)
        tail = n
    return out, hn, cn


def _replace_outputs(g: fx.Graph, layers: List[Chain], cells: list, out: fx.Node, hn: fx.Node,
                     cn: Optional[fx.Node]) -> None:
    """The steps' results read outside the loop, read from the call
    instead: each step's h is ``out[t]``, the last step's h and c
    ``h_n[layer]`` / ``c_n[layer]``, and ``stack`` of the top layer's every
    h the output itself."""
    T = len(layers[0].cells)
    inside = {c.node for c in cells}

    def replace(old: fx.Node, make) -> None:
        users = [u for u in old.users if u not in inside]
        if not users:
            return
        with g.inserting_after(cn if cn is not None else hn):  # before every reader (moved ones included)
            new = make()
        for u in users:
            u.replace_input_with(old, new)

    _replace_stacked_h(g, layers[-1], out)
    for li, ch in enumerate(layers):
        for k, c in enumerate(ch.cells):
            for h in c.h_outs:
                if k == T - 1:
                    replace(h, lambda li=li: _call(g, operator.getitem, (hn, li)))
                else:
                    replace(h, lambda k=k: _call(g, operator.getitem, (out, k)))
            for co in c.c_outs:
                if k == T - 1:
                    replace(co, lambda li=li: _call(g, operator.getitem, (cn, li)))


def _replace_stacked_h(g: fx.Graph, top: Chain, out: fx.Node) -> None:
    """``torch.stack`` of every top-layer h in step order is the output
    itself (dim 0), or its transpose (dim 1)."""
    top_h = [c.h_outs[0] if c.h_outs else None for c in top.cells]
    for u in list({u: None for h in top_h if h is not None for u in h.users}):
        if (u.op == "call_function" and u.target is torch.stack and u.args and isinstance(u.args[0], (list, tuple))
                and list(u.args[0]) == top_h and len(u.args) + len(u.kwargs) <= 2):
            d = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim", 0)
            if d in (0, 1):
                with g.inserting_before(u):
                    new = out if d == 0 else _call(g, torch.transpose, (out, 0, 1))
                u.replace_all_uses_with(new)
                g.erase_node(u)


def _erase_steps(g: fx.Graph, cells: list, lstm: bool, label: str) -> None:
    """Erase the steps and their outputs, last step first: each step's
    outputs are read only by the next step (or the layer above), which is
    gone by then. A step left in the graph is a bug, raised."""
    for c in reversed(cells):
        for o in c.c_outs + (c.h_outs if lstm else []):
            if not o.users:
                g.erase_node(o)
        if not c.node.users:
            g.erase_node(c.node)
    alive = set(g.nodes)
    left = [c.node.name for c in cells if c.node in alive]
    if left:
        raise RuntimeError(f"wfpass: folding {label} left steps {left} in the graph")


def _step_inputs(g: fx.Graph, xs: List[fx.Node], T: int) -> Tuple[Optional[fx.Node], Optional[int]]:
    """(x, time dim) when the step inputs are ``x[t]`` / ``x[:, t]`` / ``x.unbind(d)[t]``
    for t = 0..T-1 of one tensor with T steps on that dim; else (None, None)."""
    src, dim = None, None
    for t, n in enumerate(xs):
        if n.op != "call_function" or n.target is not operator.getitem:
            return None, None
        base, idx = n.args
        if isinstance(base, fx.Node) and base.op in ("call_method", "call_function") and (
                base.target in ("unbind", torch.unbind)):
            d = base.args[1] if len(base.args) > 1 else base.kwargs.get("dim", 0)
            s, i = base.args[0], idx
        elif isinstance(idx, int):
            s, d, i = base, 0, idx
        elif isinstance(idx, tuple) and len(idx) == 2 and idx[0] == slice(None) and isinstance(idx[1], int):
            s, d, i = base, 1, idx[1]
        else:
            return None, None
        if i != t or (src is not None and (s is not src or d != dim)):
            return None, None
        src, dim = s, d
    v = meta_value(src)
    if not isinstance(v, torch.Tensor) or v.dim() != 3 or dim not in (0, 1):
        return None, None
    if static_int(v.shape[dim]) != T:
        return None, None
    return src, dim


def _call(g: fx.Graph, target, args, val=None) -> fx.Node:
    n = g.call_function(target, tuple(args))
    if val is not None:
        n.meta["example_value"] = val
    return n


def _initial_state(g: fx.Graph, ch: Chain, lstm: bool) -> List[Optional[fx.Node]]:
    """The first step's (h, c) or (h,) as nodes, None where the cell starts
    from zeros (``cell(x)`` without a state)."""
    c = ch.first
    if c.state_whole is not None:
        with g.inserting_after(c.state_whole):
            h = g.call_function(operator.getitem, (c.state_whole, 0))
        with g.inserting_after(h):
            cc = g.call_function(operator.getitem, (c.state_whole, 1))
        return [h, cc]
    if c.state:
        return list(c.state)
    return [None, None] if lstm else [None]


def module_group(ctx: PassContext, layers: List[Chain], label: str, claimed: dict):
    """symbolic_trace flavour: the RNN spec and the fused group (record, flat
    block) of a stack of cell modules, as ``fuse_rnn`` builds them for an
    ``nn.LSTM``; one group per weight set however many loops call it."""
    refs = [r for ch in layers for r in ch.first.refs]
    ws, names = [r.tensor for r in refs], [r.name for r in refs]
    ids = tuple(id(w) for w in ws)
    if ids in claimed:
        return claimed[ids]
    first = layers[0].first
    offsets, acc = [], 0
    for w in ws:
        offsets.append(acc)
        acc += w.numel()
    thr = ctx.config.rnn.seq_threshold
    spec = RnnSpec(name=label, mode=first.mode, input_size=ws[0].shape[1], hidden_size=ws[1].shape[1], proj_size=0,
                   num_layers=len(layers), bidirectional=False, batch_first=False,
                   has_biases=len(first.weight_nodes) == 4, dropout=0.0,
                   threshold=default_seq_threshold(ws[0].device.type) if thr is None else thr,
                   offsets=tuple(offsets), numel=acc, options=ctx.config.rnn)
    T = len(layers[0].cells)
    how = f"{label}: {T} cell steps -> one RNN call"
    detail = dict(threshold=spec.threshold, mode=spec.mode, layers=spec.num_layers, steps=T, block_elements=acc)
    taken = {i for k in claimed for i in k}
    site = new_group(ctx, spec, ws, names, how, detail, overlap=any(i in taken for i in ids))
    site.spec = spec
    claimed[ids] = site
    return site
