"""Fold Python loops of RNN cells into one RNN call.

Code that steps an ``nn.LSTMCell`` / ``nn.GRUCell`` / ``nn.RNNCell`` in a
Python loop reaches the backend unrolled: T cell calls sharing one set of
weights, each step's state threaded into the next. Compiled as is, every
step is a separate small GEMM and the compile time grows with T. The cell's
weights are exactly one layer of the RNN format's flat block, so the loop is
one ``torch.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` call over the
stacked step inputs, which ``fuse_rnn`` (the next pass) lowers and whose
weights it moves into one flat block.

Before (Dynamo graph of ``for t in range(3): h, c = cell(x[t], (h, c)); outs.append(h)``)::

    x0 = x[0];  s0 = lstm_cell(x0, (h, c), w_ih, w_hh, b_ih, b_hh);  h1 = s0[0];  c1 = s0[1]
    x1 = x[1];  s1 = lstm_cell(x1, (h1, c1), w_ih, w_hh, b_ih, b_hh);  h2 = s1[0];  c2 = s1[1]
    x2 = x[2];  s2 = lstm_cell(x2, (h2, c2), w_ih, w_hh, b_ih, b_hh);  h3 = s2[0]
    y = stack([h1, h2, h3])

After::

    r = lstm(x, (h.unsqueeze(0), c.unsqueeze(0)), [w_ih, w_hh, b_ih, b_hh], True, 1, 0.0, True, False, False)
    out = r[0];  h_n = r[1]
    y = out                     # stack of every step's h, in order: the output itself
    h3 = h_n[0]                 # (any other step's h: out[t]; the last c: c_n[layer])

Stacked cells in one loop (``h1 = c1(x[t], h1); h2 = c2(h1, h2)``) become one
multi-layer call when each layer reads only the layer below at the same step.

A chain is folded only when it is provably the same computation; otherwise
it is left exactly as it was, with a record saying why:

* a step input depends on an earlier step's state (attention decoders,
  feedback, autoregressive loops): ``fuse_rnn`` could not run the steps at once;
* the state passes through other operations between steps (masking, resets);
* consecutive steps use different weights;
* an intermediate cell state ``c`` is read outside the loop (the fused call
  returns only the last one);
* the loop has at most ``seq_threshold`` steps (the RNN format's unfused
  region: the cells are that path already);
* ``fuse_rnn`` would not take the RNN call (its own guards: dtype, autocast,
  weights that are not parameters...).

``wfpass.apply`` graphs (``symbolic_trace``) hold ``call_module`` cells with
no shapes: a folded loop there calls ``CellLoopCall``, which does what the
cells' ``forward`` did (unbatched steps, zero state) and picks the path per call.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from ..config import default_seq_threshold
from ..graph import PassContext, TensorRef, meta_value
from ..ops.rnn import RnnSpec, fused_path, measure_threshold, unfused_path
from ..pipeline import Format, Match
from .fuse_rnn import _new_group, _site_of, call_problem

__all__ = ["FoldCells", "CELL_FUNCTIONS", "CellLoopCall"]

#: Graph targets of one cell step -> RNN mode. ``torch.lstm_cell`` is what
#: Dynamo records for ``nn.LSTMCell`` (``torch._VF.lstm_cell`` is the same builtin).
CELL_FUNCTIONS: Dict[Any, str] = {
    torch.lstm_cell: "LSTM", torch.gru_cell: "GRU", torch.rnn_tanh_cell: "RNN_TANH", torch.rnn_relu_cell: "RNN_RELU",
}
_RNN_CALL = {"LSTM": torch.lstm, "GRU": torch.gru, "RNN_TANH": torch.rnn_tanh, "RNN_RELU": torch.rnn_relu}
_CELL_CLASS = {"LSTM": "LSTMCell", "GRU": "GRUCell", "RNN_TANH": "RNNCell", "RNN_RELU": "RNNCell"}
_CELL_MODULES = (nn.LSTMCell, nn.GRUCell, nn.RNNCell)


@dataclasses.dataclass
class _Cell:
    """One cell step in a Dynamo graph."""

    node: fx.Node
    mode: str
    x: Any
    state: Tuple[Any, ...]  # (h, c) for an LSTM, (h,) otherwise
    weight_nodes: Tuple[Any, ...]  # w_ih, w_hh[, b_ih, b_hh]
    refs: List[Optional[TensorRef]]
    h_outs: List[fx.Node]  # nodes that are this step's h
    c_outs: List[fx.Node]  # (LSTM) nodes that are this step's c
    problem: Optional[str] = None
    state_whole: Optional[fx.Node] = None  # symbolic_trace: an LSTM step's (h, c) passed on as one value
    module: Optional[nn.Module] = None  # symbolic_trace: the cell module

    @property
    def key(self) -> Tuple:
        return (self.mode, self.weight_nodes)


@dataclasses.dataclass
class _Chain:
    cells: List[_Cell]
    problem: Optional[str] = None
    below: Optional["_Chain"] = None  # the layer this one reads (stacked cells)
    above: Optional["_Chain"] = None

    @property
    def first(self) -> _Cell:
        return self.cells[0]


def _module_path(name: str) -> str:
    return name.rpartition(".")[0]


def _label(chains: Sequence[_Chain]) -> str:
    c = chains[0].first
    names = [_module_path(ch.first.refs[0].name) if ch.first.refs[0] is not None else "?" for ch in chains]
    what = f"nn.{_CELL_CLASS[c.mode]}"
    if len(chains) > 1:
        what = f"{len(chains)} stacked {what}s"
    return f"{', '.join(repr(n) for n in names)} ({what} loop, {len(chains[0].cells)} steps)"


def _params(chains: Sequence[_Chain]) -> List[str]:
    return [r.name for ch in chains for r in ch.first.refs if r is not None]


def _module_mode(mod: nn.Module) -> Optional[str]:
    if type(mod) is nn.LSTMCell:
        return "LSTM"
    if type(mod) is nn.GRUCell:
        return "GRU"
    if type(mod) is nn.RNNCell:
        return "RNN_TANH" if mod.nonlinearity == "tanh" else "RNN_RELU"
    return None


def _module_cell_of(ctx: PassContext, node: fx.Node) -> Optional[_Cell]:
    """A ``call_module`` of a cell (``symbolic_trace`` graphs): ``cell(x)`` or
    ``cell(x, hx)``, its weights named by the module's path."""
    mod = ctx.module_of(node)
    mode = _module_mode(mod) if mod is not None else None
    if mode is None:
        return None
    args, kw = list(node.args), dict(node.kwargs)
    x = args[0] if args else kw.get("input")
    hx = args[1] if len(args) > 1 else kw.get("hx")
    attrs = ("weight_ih", "weight_hh") + (("bias_ih", "bias_hh") if mod.bias else ())
    names = tuple(f"{node.target}.{a}" for a in attrs)
    refs = [TensorRef(n, getattr(mod, a), "parameter", None) for n, a in zip(names, attrs)]
    c = _Cell(node, mode, x, (), names, refs, [], [], module=mod)
    if len(args) > 2 or set(kw) - {"input", "hx"} or not isinstance(x, fx.Node):
        c.problem = "unexpected call form of the cell"
    if mode == "LSTM" and isinstance(hx, fx.Node):
        c.state_whole = hx
    elif hx is not None:
        c.state = tuple(hx) if isinstance(hx, (tuple, list)) else (hx,)
        if not all(isinstance(t, fx.Node) for t in c.state) or len(c.state) != (2 if mode == "LSTM" else 1):
            c.problem = c.problem or "the state is not a graph value"
    if mode == "LSTM":
        for u in node.users:
            if u.op == "call_function" and u.target is operator.getitem and u.args[1] in (0, 1):
                (c.h_outs if u.args[1] == 0 else c.c_outs).append(u)
            elif not (u.op == "call_module" and u.target == node.target and (u.args[1:2] == (node,) or u.kwargs.get("hx") is node)):
                c.problem = f"the step's (h, c) pair is used as a whole by {u.name}"
    else:
        c.h_outs = [node]
    return c


def _cell_of(ctx: PassContext, node: fx.Node) -> Optional[_Cell]:
    if node.op == "call_module":
        return _module_cell_of(ctx, node)
    mode = CELL_FUNCTIONS.get(node.target) if node.op == "call_function" else None
    if mode is None:
        return None
    args = list(node.args)
    if node.kwargs or len(args) not in (4, 6):
        c = _Cell(node, mode, None, (), (), [], [], [])
        c.problem = f"unexpected call form of {node.target.__name__} ({len(args)} args, kwargs {list(node.kwargs)})"
        return c
    x, hx, ws = args[0], args[1], tuple(args[2:])
    if len(ws) == 4 and (ws[2] is None) != (ws[3] is None):
        ws = (ws[0], ws[1], ws[2], ws[3])  # one bias only: rejected below
    state = tuple(hx) if isinstance(hx, (tuple, list)) else (hx,)
    c = _Cell(node, mode, x, state, ws, [ctx.resolve(w) if w is not None else None for w in ws], [], [])
    for u in node.users:
        if mode == "LSTM" and u.op == "call_function" and u.target is operator.getitem and u.args[1] in (0, 1):
            (c.h_outs if u.args[1] == 0 else c.c_outs).append(u)
        elif mode == "LSTM":
            c.problem = f"the step's (h, c) pair is used as a whole by {u.name}"
    if mode != "LSTM":
        c.h_outs = [node]
    if not isinstance(x, fx.Node) or not all(isinstance(s, fx.Node) for s in state) or len(state) != (2 if mode == "LSTM" else 1):
        c.problem = c.problem or "input or state is not a graph value"
    elif any(w is None for w in ws[:2]) or (len(ws) == 4 and (ws[2] is None) != (ws[3] is None)):
        c.problem = c.problem or "one bias given without the other"
    elif any(r is None or not r.is_state for r, w in zip(c.refs, ws) if w is not None):
        c.problem = c.problem or "a weight is not a Parameter or buffer of the model (a functional call?)"
    if len(ws) == 4 and ws[2] is None:
        c.weight_nodes = ws[:2]
        c.refs = c.refs[:2]
    return c


def _links(cells: List[_Cell]) -> Dict[fx.Node, List[_Cell]]:
    """cell node -> the cells whose state is exactly this step's output."""
    by_h: Dict[fx.Node, _Cell] = {}
    by_node = {c.node: c for c in cells}
    for c in cells:
        for h in c.h_outs:
            by_h[h] = c
    succ: Dict[fx.Node, List[_Cell]] = {c.node: [] for c in cells}
    for c in cells:
        if c.state_whole is not None:
            prev = by_node.get(c.state_whole)
            if prev is not None:
                succ[prev.node].append(c)
            continue
        if not c.state:
            continue
        prev = by_h.get(c.state[0])
        if prev is None:
            continue
        if c.mode == "LSTM" and c.state[1] not in prev.c_outs:
            continue
        succ[prev.node].append(c)
    return succ


def _chains(cells: List[_Cell]) -> List[_Chain]:
    """Maximal runs of steps of one cell, each step's state the previous
    step's output. A step whose state comes from a step of another cell
    (different weights per step) starts a run of its own, with the reason."""
    succ = _links(cells)
    pred: Dict[fx.Node, _Cell] = {}
    for n, cs in succ.items():
        for c in cs:
            pred[c.node] = next(p for p in cells if p.node is n)
    out: List[_Chain] = []
    for c in cells:
        p = pred.get(c.node)
        if p is not None and p.key == c.key and len(succ[p.node]) == 1:
            continue  # inside a run that starts earlier
        chain = _Chain([c])
        if p is not None:
            chain.problem = (f"its state comes from a step of another cell or of a branching loop: different "
                             "weights per step, or several next steps: not one RNN")
        cur = c
        while True:
            nxt = succ[cur.node]
            if len(nxt) != 1:
                if len(nxt) > 1:
                    chain.problem = f"step {len(chain.cells)}'s state feeds {len(nxt)} next steps (a branching loop)"
                break
            n = nxt[0]
            if n.key != cur.key:
                chain.problem = (f"step {len(chain.cells) + 1} uses different weights than step {len(chain.cells)} "
                                 "(one cell per step): not one RNN")
                break
            chain.cells.append(n)
            cur = n
        out.append(chain)
    return out


def _depends(graph: fx.Graph, roots: set) -> set:
    """Every node computed (transitively) from ``roots``, roots included."""
    dep = set(roots)
    for n in graph.nodes:
        if n not in dep and any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    return dep


def _stack(chains: List[_Chain]) -> None:
    """Link chains that read, at every step, the h of another chain's same
    step: the layers of one multi-layer RNN."""
    by_h: Dict[fx.Node, Tuple[_Chain, int]] = {}
    for ch in chains:
        for k, c in enumerate(ch.cells):
            for h in c.h_outs:
                by_h[h] = (ch, k)
    for ch in chains:
        if ch.problem or ch.first.problem:
            continue
        hit = by_h.get(ch.first.x)
        if hit is None or hit[1] != 0:
            continue
        low = hit[0]
        if (low is ch or low.above is not None or low.problem or len(low.cells) != len(ch.cells)
                or low.first.mode != ch.first.mode):
            continue
        if all(by_h.get(c.x) == (low, k) for k, c in enumerate(ch.cells)):
            low.above, ch.below = ch, low


def _threshold(ctx: PassContext, device: torch.device) -> int:
    n = ctx.config.seq_threshold
    if n is None:
        return default_seq_threshold(device.type)
    return 0 if n == "auto" else n  # "auto": fuse_rnn measures per shape and may still take the loop


def _problem(ctx: PassContext, layers: List[_Chain], dep: set) -> Optional[str]:
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
    if w0.device.type != "cpu":
        # As for whole RNNs: PyTorch's cuDNN path runs them; the format is CPU-first.
        return f"weights on {w0.device.type}: cell loops are folded on the CPU only"
    n = _threshold(ctx, w0.device)
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
    try:
        if int(v.shape[dim]) != T:
            return None, None
    except (TypeError, ValueError, RuntimeError):
        return None, None
    return src, dim


def _call(g: fx.Graph, target, args, val=None) -> fx.Node:
    n = g.call_function(target, tuple(args))
    if val is not None:
        n.meta["example_value"] = val
    return n


def _initial_state(g: fx.Graph, ch: _Chain, lstm: bool) -> List[Optional[fx.Node]]:
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


def _rewrite(ctx: PassContext, layers: List[_Chain], label: str, site=None) -> None:
    g = ctx.gm.graph
    T = len(layers[0].cells)
    mode = layers[0].first.mode
    lstm = mode == "LSTM"
    cells = [c for ch in layers for c in ch.cells]
    states = [_initial_state(g, ch, lstm) for ch in layers]
    order = {n: i for i, n in enumerate(g.nodes)}
    xs = [c.x for c in layers[0].cells]
    inputs = xs + [s for st in states for s in st if s is not None]
    inputs += [w for ch in layers for w in ch.first.weight_nodes if isinstance(w, fx.Node)]
    anchor = max(inputs, key=order.__getitem__)
    start = min(order[c.node] for c in cells)
    # Nodes between the first step and the anchor that read the loop's
    # results move after the fused call (none of them feeds a step input:
    # _problem proved that), in their order.
    dep = _depends(g, {c.node for c in cells})
    own = {c.node for c in cells} | {o for c in cells for o in c.h_outs + c.c_outs}
    moved = [n for n in g.nodes if start < order[n] <= order[anchor] and n in dep and n not in own]

    src, dim = _step_inputs(g, xs, T) if ctx.is_dynamo else (None, None)
    with g.inserting_after(anchor):
        if src is not None:
            v = meta_value(src)
            X = src if dim == 0 else _call(g, torch.transpose, (src, 0, 1), v.transpose(0, 1))
        else:
            vals = [meta_value(x) for x in xs]
            val = torch.stack(vals, 0) if all(isinstance(v, torch.Tensor) for v in vals) else None
            X = _call(g, torch.stack, (xs, 0), val)
    last = anchor if X is src else X

    if ctx.is_dynamo:
        def state_stack(i: int) -> fx.Node:
            parts = [st[i] for st in states]
            vals = [meta_value(p) for p in parts]
            val = torch.stack(vals, 0) if all(isinstance(v, torch.Tensor) for v in vals) else None
            return _call(g, torch.stack, (parts, 0), val)

        with g.inserting_after(last):
            h0 = state_stack(0)
        with g.inserting_after(h0):
            hx = [h0, state_stack(1)] if lstm else h0
        last = hx[1] if lstm else hx
        weights = [w for ch in layers for w in ch.first.weight_nodes]
        has_b = len(layers[0].first.weight_nodes) == 4
        with g.inserting_after(last):
            call = _call(g, _RNN_CALL[mode], (X, hx, weights, has_b, len(layers), 0.0, True, False, False))
            call.meta["wfpass_cells"] = label
    else:
        names = [n for ch in layers for n in ch.first.weight_nodes]
        ws = []
        for n in reversed(names):
            with g.inserting_after(last):
                ws.insert(0, g.get_attr(n))
        last = ws[-1]
        with g.inserting_after(last):
            call = g.call_function(CellLoopCall(site, [ch.first.module for ch in layers]),
                                   (X, [st[0] for st in states], [st[-1] for st in states] if lstm else [], *ws))
    call.meta["wfpass_cell_steps"] = T
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in layers[0].first.node.meta:
            call.meta[key] = layers[0].first.node.meta[key]
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
    inside = {c.node for c in cells}

    def replace(old: fx.Node, make) -> None:
        users = [u for u in old.users if u not in inside]
        if not users:
            return
        with g.inserting_after(cn if cn is not None else hn):  # before every reader (moved ones included)
            new = make()
        for u in users:
            u.replace_input_with(old, new)

    top = len(layers) - 1
    # ``torch.stack`` of every top-layer h in step order is the output itself.
    top_h = [c.h_outs[0] if c.h_outs else None for c in layers[top].cells]
    for u in list({u: None for h in top_h if h is not None for u in h.users}):
        if (u.op == "call_function" and u.target is torch.stack and u.args and isinstance(u.args[0], (list, tuple))
                and list(u.args[0]) == top_h and len(u.args) + len(u.kwargs) <= 2):
            d = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim", 0)
            if d in (0, 1):
                with g.inserting_before(u):
                    new = out if d == 0 else _call(g, torch.transpose, (out, 0, 1))
                u.replace_all_uses_with(new)
                g.erase_node(u)
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
    # Last step first: each step's outputs are read only by the next step
    # (or the layer above), which is gone by then.
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


class _Loop(Match):
    """A stack of chains (one chain: a one-layer loop) to fold into one RNN call."""

    def __init__(self, layers: List[_Chain], claimed: dict):
        T = len(layers[0].cells)
        self.label = _label(layers)
        super().__init__(_params(layers), f"{self.label}: {T} cell steps -> one RNN call", steps=T)
        self.layers, self.claimed = layers, claimed


class FoldCells(Format):
    """Fold every foldable cell loop into one RNN call."""

    name, pattern = "fold_cells", "rnn"

    def matches(self, gm: fx.GraphModule, ctx: PassContext) -> Iterator[_Loop]:
        cells = [c for c in (_cell_of(ctx, n) for n in gm.graph.nodes) if c is not None]
        if not cells:
            return
        chains = _chains(cells)
        _stack(chains)
        # Chains of the same cell that are not linked step to step although
        # one's state is computed from another's: masking, resets, feedback.
        by_key: Dict[Tuple, List[_Chain]] = {}
        for ch in chains:
            by_key.setdefault(ch.first.key, []).append(ch)
        for key, group in by_key.items():
            if len(group) < 2:
                continue
            dep = _depends(gm.graph, {c.node for ch in group for c in ch.cells})
            if any(ch.problem is None and any(s in dep for s in ch.first.state) for ch in group):
                why = ("the state passes through other operations between steps (masking, resets or feedback): "
                       f"{len(group)} separate pieces of one loop, not folded")
                for ch in group:
                    ch.problem = ch.problem or why
        claimed: Dict[Tuple[int, ...], Any] = {}  # symbolic_trace: ids of a layer stack's weights -> its group
        for ch in chains:
            if ch.below is not None:
                continue  # matched with the layer below
            layers = [ch]
            while layers[-1].above is not None:
                layers.append(layers[-1].above)
            if len(layers) > 1 and not any(c.problem for l in layers for c in l.cells) and _refusal(ctx, layers):
                # Not as one stack: each layer by itself, bottom first.
                for l in layers:
                    l.below = l.above = None
                for l in layers:
                    yield _Loop([l], claimed)
                continue
            yield _Loop(layers, claimed)

    def guard(self, loop: _Loop, ctx: PassContext) -> Optional[str]:
        why = _refusal(ctx, loop.layers)
        if why is not None:
            return f"{loop.label}: {why}"
        if ctx.is_dynamo:
            # The RNN format's own guards, on the call the loop would become.
            g = ctx.gm.graph
            trial = _trial_call(ctx, loop.layers)
            s = _site_of(ctx, trial)
            why = call_problem(s, ctx) if s is not None else "internal: the folded call is not an RNN call"
            g.erase_node(trial)
            if why is not None:
                return f"{loop.label}: the RNN format would not take it ({why})"
        return None

    def apply(self, loop: _Loop, ctx: PassContext) -> None:
        if ctx.is_dynamo:
            _rewrite(ctx, loop.layers, loop.label)
        else:  # symbolic_trace graph: an eager call target, grouped here
            _rewrite(ctx, loop.layers, loop.label, _module_group(ctx, loop.layers, loop.label, loop.claimed))


def _refusal(ctx: PassContext, layers: List[_Chain]) -> Optional[str]:
    """Why this stack of chains is not folded as it stands, or None."""
    why = _problem(ctx, layers, _depends(ctx.gm.graph, {c.node for l in layers for c in l.cells}))
    if why is None and not ctx.config.runs("fuse_rnn"):
        why = "folding hands the loop to the fuse_rnn format, which this config does not run"
    return why


def _trial_call(ctx: PassContext, layers: List[_Chain]) -> fx.Node:
    """A throwaway RNN call over the first step's input, for fuse_rnn's guards."""
    g = ctx.gm.graph
    first = layers[0].first
    weights = [w for ch in layers for w in ch.first.weight_nodes]
    hx = [first.state[0], first.state[1]] if first.mode == "LSTM" else first.state[0]
    with g.inserting_before(first.node):
        xv = meta_value(first.x)
        n = g.call_function(_RNN_CALL[first.mode],
                            (first.x, hx, weights, len(first.weight_nodes) == 4, len(layers), 0.0, True, False, False))
        if isinstance(xv, torch.Tensor):
            n.meta["example_value"] = xv.unsqueeze(0)
    return n


def _module_group(ctx: PassContext, layers: List[_Chain], label: str, claimed: dict):
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
    thr = ctx.config.seq_threshold
    spec = RnnSpec(name=label, mode=first.mode, input_size=ws[0].shape[1], hidden_size=ws[1].shape[1], proj_size=0,
                   num_layers=len(layers), bidirectional=False, batch_first=False,
                   has_biases=len(first.weight_nodes) == 4, dropout=0.0,
                   threshold=default_seq_threshold(ws[0].device.type) if thr is None else thr,
                   offsets=tuple(offsets), numel=acc, options=ctx.config.rnn)
    T = len(layers[0].cells)
    how = f"{label}: {T} cell steps -> one RNN call"
    detail = dict(threshold=spec.threshold, mode=spec.mode, layers=spec.num_layers, steps=T, block_elements=acc)
    taken = {i for k in claimed for i in k}
    site = _new_group(ctx, spec, ws, names, how, detail, overlap=any(i in taken for i in ids))
    site.spec = spec
    claimed[ids] = site
    return site


class CellLoopCall:
    """A folded cell loop in a ``wfpass.apply`` graph, which runs eagerly:
    ``(stacked step inputs, initial h per layer, initial c per layer, *weights)
    -> (out, h_n[, c_n])``. Does what each ``nn.*Cell.forward`` did (unbatched
    1-D steps, a zero state where none was given), then one RNN call: the
    fused kernel above ``seq_threshold`` steps, the unfused path at or below."""

    __module__ = __name__

    def __init__(self, site, modules: Sequence[nn.Module]):
        self.site, self.spec = site, site.spec
        self.__name__ = self.__qualname__ = "cell_loop"

    def __call__(self, X, h0s, c0s, *weights):
        spec, site = self.spec, self.site
        lstm = spec.mode == "LSTM"
        if X.dim() not in (2, 3):
            raise ValueError(f"wfpass: {spec.name}: each step's input must be 1-D or 2-D, got {X.dim() - 1}-D")
        batched = X.dim() == 3
        if not batched:
            X = X.unsqueeze(1)
        B = X.shape[1]

        def state(parts):
            return torch.stack([X.new_zeros(B, spec.hidden_size) if p is None else (p if batched else p.unsqueeze(0))
                                for p in parts], 0)

        hx = [state(h0s), state(c0s)] if lstm else [state(h0s)]
        fs = site.find(weights)
        rec = site.record if fs is None else fs.record
        if fs is None:
            rec.bump("unfused_layout_calls")
        need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (X, *hx, *weights))
        n = measure_threshold(spec, rec, X, hx, weights, spec.has_biases, False, 0.0, need_grad)
        if X.shape[0] <= n:
            rec.bump("unfused_calls")
            outs = unfused_path(spec, X, hx, weights, spec.has_biases, False, 0.0)
        else:
            rec.bump("fused_calls")
            outs = fused_path(spec, X, hx, weights, spec.has_biases, False, 0.0)
        outs = list(outs)
        if not batched:
            outs = [outs[0].squeeze(1)] + [o.squeeze(1) for o in outs[1:]]
        return tuple(outs)
