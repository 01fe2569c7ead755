"""Cell loops, matched: every cell step, chains of steps of one cell, and
chains stacked into layers.

A *cell step* is one call of ``nn.LSTMCell`` / ``nn.GRUCell`` / ``nn.RNNCell``
(``torch.lstm_cell`` ... in Dynamo graphs, ``call_module`` in
``symbolic_trace`` graphs). A *chain* is a maximal run of steps of one cell,
each step's state the previous step's output; chains whose every step reads
the h of another chain's same step are the *layers* of one stack. What the
matcher already knows rules a chain out is its ``problem``.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from ...core.graph import PassContext, TensorRef
from ..spec import module_path

__all__ = ["CELL_FUNCTIONS", "RNN_CALL", "Cell", "Chain", "chains_in", "depends_on", "loop_label", "loop_params"]

#: Graph targets of one cell step -> RNN mode. ``torch.lstm_cell`` is what
#: Dynamo records for ``nn.LSTMCell`` (``torch._VF.lstm_cell`` is the same builtin).
CELL_FUNCTIONS: Dict[Any, str] = {
    torch.lstm_cell: "LSTM", torch.gru_cell: "GRU", torch.rnn_tanh_cell: "RNN_TANH", torch.rnn_relu_cell: "RNN_RELU",
}

RNN_CALL = {"LSTM": torch.lstm, "GRU": torch.gru, "RNN_TANH": torch.rnn_tanh, "RNN_RELU": torch.rnn_relu}

CELL_CLASS = {"LSTM": "LSTMCell", "GRU": "GRUCell", "RNN_TANH": "RNNCell", "RNN_RELU": "RNNCell"}


@dataclasses.dataclass
class Cell:
    """One cell step (``torch.lstm_cell(...)`` or a ``call_module`` of a cell)."""

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

    @property
    def key(self) -> Tuple:
        return (self.mode, self.weight_nodes)


@dataclasses.dataclass
class Chain:
    """Steps of one cell, each step's state the previous step's output."""

    cells: List[Cell]
    problem: Optional[str] = None
    below: Optional["Chain"] = None  # the layer this one reads (stacked cells)
    above: Optional["Chain"] = None
    # One of several pieces of one loop (``chains_in``): (pieces, steps of all of them).
    pieces: Optional[Tuple[int, int]] = None

    @property
    def first(self) -> Cell:
        return self.cells[0]


def loop_label(chains: Sequence[Chain]) -> str:
    """How records name a loop: ``'dec.cell' (nn.LSTMCell loop, 6 steps)``."""
    c = chains[0].first
    names = [module_path(ch.first.refs[0].name) if ch.first.refs[0] is not None else "?" for ch in chains]
    what = f"nn.{CELL_CLASS[c.mode]}"
    if len(chains) > 1:
        what = f"{len(chains)} stacked {what}s"
    pieces = chains[0].pieces
    if pieces is not None:
        count = f"{pieces[1]} steps in {pieces[0]} pieces"
    else:
        T = len(chains[0].cells)
        count = f"{T} step{'s' if T != 1 else ''}"
    return f"{', '.join(repr(n) for n in names)} ({what} loop, {count})"


def loop_params(chains: Sequence[Chain]) -> List[str]:
    """The weights' names, layer by layer: the record's parameters."""
    return [r.name for ch in chains for r in ch.first.refs if r is not None]


def cell_mode(mod: nn.Module) -> Optional[str]:
    """The RNN mode of an ``nn.LSTMCell`` / ``nn.GRUCell`` / ``nn.RNNCell`` (not a subclass), else None."""
    if type(mod) is nn.LSTMCell:
        return "LSTM"
    if type(mod) is nn.GRUCell:
        return "GRU"
    if type(mod) is nn.RNNCell:
        return "RNN_TANH" if mod.nonlinearity == "tanh" else "RNN_RELU"
    return None


def _module_cell_of(ctx: PassContext, node: fx.Node) -> Optional[Cell]:
    """A ``call_module`` of a cell (``symbolic_trace`` graphs): ``cell(x)`` or
    ``cell(x, hx)``, its weights named by the module's path."""
    mod = ctx.module_of(node)
    mode = cell_mode(mod) if mod is not None else None
    if mode is None:
        return None
    args, kw = list(node.args), dict(node.kwargs)
    x = args[0] if args else kw.get("input")
    hx = args[1] if len(args) > 1 else kw.get("hx")
    attrs = ("weight_ih", "weight_hh") + (("bias_ih", "bias_hh") if mod.bias else ())
    names = tuple(f"{node.target}.{a}" for a in attrs)
    refs = [TensorRef(n, getattr(mod, a), "parameter", None) for n, a in zip(names, attrs)]
    c = Cell(node, mode, x, (), names, refs, [], [])
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


def match_cell(ctx: PassContext, node: fx.Node) -> Optional[Cell]:
    """The cell step ``node`` is, or None if it is none."""
    if node.op == "call_module":
        return _module_cell_of(ctx, node)
    mode = CELL_FUNCTIONS.get(node.target) if node.op == "call_function" else None
    if mode is None:
        return None
    args = list(node.args)
    if node.kwargs or len(args) not in (4, 6):
        c = Cell(node, mode, None, (), (), [], [], [])
        c.problem = f"unexpected call form of {node.target.__name__} ({len(args)} args, kwargs {list(node.kwargs)})"
        return c
    x, hx, ws = args[0], args[1], tuple(args[2:])
    if len(ws) == 4 and (ws[2] is None) != (ws[3] is None):
        ws = (ws[0], ws[1], ws[2], ws[3])  # one bias only: rejected below
    state = tuple(hx) if isinstance(hx, (tuple, list)) else (hx,)
    c = Cell(node, mode, x, state, ws, [ctx.resolve(w) if w is not None else None for w in ws], [], [])
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


def _links(cells: List[Cell]) -> Dict[fx.Node, List[Cell]]:
    """cell node -> the cells whose state is exactly this step's output."""
    by_h: Dict[fx.Node, Cell] = {}
    by_node = {c.node: c for c in cells}
    for c in cells:
        for h in c.h_outs:
            by_h[h] = c
    succ: Dict[fx.Node, List[Cell]] = {c.node: [] for c in cells}
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


def _chains(cells: List[Cell]) -> List[Chain]:
    """Maximal runs of steps of one cell, each step's state the previous
    step's output. A step whose state comes from a step of another cell
    (different weights per step) starts a run of its own, with the reason."""
    succ = _links(cells)
    pred: Dict[fx.Node, Cell] = {}
    for n, cs in succ.items():
        for c in cs:
            pred[c.node] = next(p for p in cells if p.node is n)
    out: List[Chain] = []
    for c in cells:
        p = pred.get(c.node)
        if p is not None and p.key == c.key and len(succ[p.node]) == 1:
            continue  # inside a run that starts earlier
        chain = Chain([c])
        if p is not None:
            chain.problem = ("its state comes from a step of another cell or of a branching loop: different "
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


def depends_on(graph: fx.Graph, roots: set) -> set:
    """Every node computed (transitively) from ``roots``, roots included."""
    dep = set(roots)
    for n in graph.nodes:
        if n not in dep and any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    return dep


def _stack_layers(chains: List[Chain]) -> None:
    """Link chains that read, at every step, the h of another chain's same
    step: the layers of one multi-layer RNN."""
    by_h: Dict[fx.Node, Tuple[Chain, int]] = {}
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


def chains_in(ctx: PassContext, gm: fx.GraphModule) -> List[Chain]:
    """Every chain of cell steps in ``gm``, stacked layers linked, and a
    ``problem`` on each chain whose state is computed from another chain of
    the same cell (masking, resets, feedback: pieces of one loop)."""
    cells = [c for c in (match_cell(ctx, n) for n in gm.graph.nodes) if c is not None]
    if not cells:
        return []
    chains = _chains(cells)
    _stack_layers(chains)
    by_key: Dict[Tuple, List[Chain]] = {}
    for ch in chains:
        by_key.setdefault(ch.first.key, []).append(ch)
    for group in by_key.values():
        if len(group) < 2:
            continue
        dep = depends_on(gm.graph, {c.node for ch in group for c in ch.cells})
        if any(ch.problem is None and any(s in dep for s in ch.first.state) for ch in group):
            why = ("the state passes through other operations between steps (masking, resets or feedback): "
                   f"{len(group)} separate pieces of one loop, not folded")
            steps = sum(len(ch.cells) for ch in group)
            for ch in group:
                ch.problem = ch.problem or why
                ch.pieces = (len(group), steps)  # the row counts the whole loop, not the piece
    return chains
