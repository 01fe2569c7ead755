"""The RNN format's matcher: whole-sequence RNN calls, in the two flavours
of graph, each an :class:`RnnCall` with what the guards and the rewrite need.

* Dynamo graphs: ``torch.lstm(x, (h0, c0), [weights], has_biases, layers,
  dropout, train, bidirectional, batch_first)`` (and ``gru`` / ``rnn_tanh`` /
  ``rnn_relu``), the weights placeholders;
* ``symbolic_trace`` graphs: ``call_module`` of an ``nn.LSTM/GRU/RNN``.

What the matcher already knows cannot be rewritten (a PackedSequence call, a
subclass with its own ``forward``, weights that are not the model's) is the
call's ``problem``, which the guards report first.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from ..core.graph import PassContext, TensorRef
from ..pipeline import Match
from ..core.runtime import GroupSite
from .varlen.sequence import PACKED_RNN as _PACKED_RNN
from .spec import RnnSpec, display_name, flat_weight_names, module_path, rnn_mode

__all__ = ["RNN_FUNCTIONS", "RnnCall", "RunState", "match_call"]

_aten = torch.ops.aten

#: Graph targets of a whole-sequence RNN call -> mode. ``torch.lstm`` is what
#: Dynamo records for ``nn.LSTM``; the aten overloads appear in aten graphs.
RNN_FUNCTIONS: Dict[Any, str] = {
    torch.lstm: "LSTM", torch.gru: "GRU", torch.rnn_tanh: "RNN_TANH", torch.rnn_relu: "RNN_RELU",
    _aten.lstm.input: "LSTM", _aten.gru.input: "GRU", _aten.rnn_tanh.input: "RNN_TANH", _aten.rnn_relu.input: "RNN_RELU",
}

#: The same calls over a PackedSequence's data and batch sizes.
_PACKED = {_aten.lstm.data, _aten.gru.data, _aten.rnn_tanh.data, _aten.rnn_relu.data}


@dataclasses.dataclass
class RunState:
    """What the calls matched in one run of the format share."""

    claimed: Dict[int, Tuple[Tuple[int, ...], GroupSite]]  # id(weight) -> (ids of its set, its group)
    written: Dict[fx.Node, str]  # weights written in place in the graph -> by what


class RnnCall(Match):
    """One RNN call, in either flavour, with what the guards and the rewrite need."""

    def __init__(self, node: fx.Node, mode: str):
        super().__init__()
        self.node, self.mode = node, mode
        self.spec: Optional[RnnSpec] = None  # set by the guards when they pass
        self.run: Optional[RunState] = None
        self.problem: Optional[str] = None
        self.x: Optional[fx.Node] = None
        self.hx: Optional[List[fx.Node]] = None  # Dynamo flavour: the state nodes
        self.weights: List[TensorRef] = []
        self.module: Optional[nn.Module] = None  # call_module flavour
        self.consts: Tuple = ()
        self.name = ""  # for messages: display_name, or the label of a folded cell loop
        self.batch_sizes: Optional[fx.Node] = None  # a packed batch's sizes (``wfpass::packed_rnn``)
        # Under autocast: (the dtype the call computes in, the dtype it returns) (``guards.autocast_cast``).
        self.cast: Optional[Tuple[torch.dtype, ...]] = None
        self.kernel_plan = None  # its ``plan.RnnPlan``, once the rewrite (or a dry run) decided it


def match_call(ctx: PassContext, node: fx.Node) -> Optional[RnnCall]:
    """The RNN call ``node`` is, or None if it is none."""
    if node.op == "call_function" and node.target in _PACKED_RNN:
        return _packed_call(ctx, node)
    if node.op == "call_function":
        if node.target in _PACKED:
            s = RnnCall(node, "LSTM")
            s.problem = "PackedSequence input: not supported yet (left to the inner compiler)"
            return s
        mode = RNN_FUNCTIONS.get(node.target)
        if mode is None:
            return None
        return _dynamo_call(ctx, node, mode)
    if node.op == "call_module":
        mod = ctx.module_of(node)
        mode = rnn_mode(mod) if mod is not None else None
        if mode is None:
            if isinstance(mod, nn.RNNBase):
                s = RnnCall(node, getattr(mod, "mode", "LSTM"))
                s.name = display_name(node.target, s.mode)
                s.problem = f"{type(mod).__name__} is a subclass of nn.RNNBase with its own forward: not rewritten"
                return s
            return None
        return _module_call(ctx, node, mod, mode)
    return None


def _dynamo_call(ctx: PassContext, node: fx.Node, mode: str) -> RnnCall:
    """``torch.lstm(x, hx, weights, *flags)`` and the like (the ``.input`` overloads)."""
    s = RnnCall(node, mode)
    args = node.args
    if node.kwargs or len(args) != 9:
        s.problem = f"unexpected call form of {node.target} ({len(args)} args, kwargs {list(node.kwargs)})"
        return s
    state_is_list = isinstance(args[1], (tuple, list)) if mode == "LSTM" else isinstance(args[2], (tuple, list))
    if not state_is_list:
        s.problem = "PackedSequence input (a batch_sizes argument): not supported yet (left to the inner compiler)"
        return s
    s.x = args[0]
    s.hx = list(args[1]) if mode == "LSTM" else [args[1]]
    consts = list(args[3:9])  # has_biases, num_layers, dropout, train, bidirectional, batch_first
    consts[2] = _lifted_float(ctx, consts[2])
    consts = tuple(consts)
    if any(isinstance(c, fx.Node) for c in consts) or not all(isinstance(h, fx.Node) for h in s.hx):
        s.problem = "RNN flags or state are not plain graph values"
        return s
    s.consts = consts
    _resolve_weights(ctx, s, args[2])
    if "wfpass_cells" in node.meta:  # a loop of cells that fold_cells folded into this call
        s.name = node.meta["wfpass_cells"]
    return s


def _lifted_float(ctx: PassContext, p):
    """The value of a float argument that ``dynamic=True`` lifted to a 0-d
    tensor input read with ``.item()`` (``self.dropout``), else ``p``.
    The value this compile sees is the graph's: Dynamo guards it (the RNN's
    fake specializes the float), so a later change recompiles."""
    if isinstance(p, fx.Node) and p.op == "call_method" and p.target == "item" and isinstance(p.args[0], fx.Node):
        ref = ctx.resolve(p.args[0])
        if ref is not None and ref.tensor.dim() == 0:
            return float(ref.tensor)
    # ``float(self.dropout)`` in traced code: ``torch.sym_float(item)``, or
    # ``torch.sym_float(0.3)`` once the value is guarded.
    if isinstance(p, fx.Node) and p.op == "call_function" and p.target is torch.sym_float and len(p.args) == 1:
        inner = _lifted_float(ctx, p.args[0])
        return float(inner) if isinstance(inner, (int, float)) else p
    return p


def _resolve_weights(ctx: PassContext, s: RnnCall, weights) -> None:
    """The call's name (from its first weight's module) and its weights as
    the model's tensors, or ``s.problem`` where one is not model state."""
    refs = [ctx.resolve(p) for p in weights]
    s.name = display_name(module_path(refs[0].name) if refs[0] is not None else "", s.mode)
    for r, p in zip(refs, weights):
        if r is None or not r.is_state:
            s.problem = f"weight {getattr(p, 'name', p)} is not a Parameter or buffer of the model (a functional call?)"
            return
    s.weights = refs


def _packed_call(ctx: PassContext, node: fx.Node) -> RnnCall:
    """``wfpass.packed_rnn(data, batch_sizes, hx, weights, mode, has_biases,
    num_layers, dropout, train, bidirectional, proj_size)``: an RNN over a
    packed batch, as ``rnn/packed/sequence.py`` puts it into Dynamo's graph."""
    data, batch_sizes, hx, weights, mode, has_biases, num_layers, dropout, train, bidirectional, _proj = node.args
    s = RnnCall(node, mode)
    s.x, s.batch_sizes, s.hx = data, batch_sizes, list(hx)
    s.consts = (has_biases, num_layers, _lifted_float(ctx, dropout), train, bidirectional, False)  # time-major rows
    if isinstance(s.consts[2], fx.Node):
        s.problem = "dropout is not a plain number"
    _resolve_weights(ctx, s, weights)
    return s


def _module_call(ctx: PassContext, node: fx.Node, mod: nn.Module, mode: str) -> RnnCall:
    """``rnn(x)`` / ``rnn(x, hx)`` of a ``call_module`` node; the weights are the module's own."""
    s = RnnCall(node, mode)
    s.module = mod
    s.name = display_name(node.target, mode)
    args, kwargs = list(node.args), dict(node.kwargs)
    if len(args) > 2 or set(kwargs) - {"hx", "input"}:
        s.problem = "unexpected call form of the module"
        return s
    s.x = args[0] if args else kwargs.get("input")
    if not isinstance(s.x, fx.Node):
        s.problem = "input is not a graph value"
        return s
    s.consts = (mod.bias, mod.num_layers, float(mod.dropout), mod.training, mod.bidirectional, mod.batch_first)
    s.weights = [TensorRef(f"{node.target}.{n}", getattr(mod, n, None), "parameter", None) for n in flat_weight_names(mod)]
    if any(not isinstance(r.tensor, torch.Tensor) for r in s.weights):
        s.problem = "a weight of the module is not a tensor"
    return s
