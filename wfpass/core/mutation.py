"""Which parameters, buffers and graph inputs a graph writes in place
(``mutated_state``), directly or through a view: a fused group or a packed
copy whose member is written in the graph is skipped, since the rewrite
would read the block (or the copy) while the write goes to the member.

Separate from ``graph.py`` (the passes' view of a graph, ``PassContext``,
which re-exports ``mutated_state`` and asks it through
``PassContext.written_state``): this reads nothing but the FX nodes and
ATen's schemas, by the usual conventions of an in-place write; no tensor,
no config.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch.fx as fx

from .._torch.kernels import OpOverload

__all__ = ["mutated_state"]

#: Methods and functions that return a view of their first argument: a write
#: through the result writes the parameter. Longer than needed on purpose: an
#: op wrongly counted as a view only costs a skipped group.
_VIEW_NAMES = frozenset({
    "view", "view_as", "reshape", "reshape_as", "t", "T", "mT", "H", "mH", "transpose", "swapaxes", "swapdims",
    "permute", "movedim", "moveaxis", "expand", "expand_as", "narrow", "select", "squeeze", "unsqueeze", "flatten",
    "unflatten", "detach", "data", "getitem", "__getitem__", "unbind", "split", "split_with_sizes", "tensor_split",
    "hsplit", "vsplit", "dsplit", "chunk", "as_strided", "diagonal", "contiguous", "real", "imag", "unfold",
    "view_as_real", "view_as_complex", "alias", "_get_data_attr", "getattr", "type_as", "to", "float", "half",
    "bfloat16", "double", "requires_grad_", "set_grad_enabled",
})
_INPLACE_BINOPS = frozenset({"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor",
                             "ilshift", "irshift", "imatmul", "setitem"})


def _target_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    t = node.target
    if isinstance(t, OpOverload):
        return t._schema.name.split("::")[-1]
    return getattr(t, "__name__", str(t))


def _written_args(node: fx.Node) -> List[Any]:
    """The arguments ``node`` writes to (in place), by the usual conventions:
    a trailing underscore (``mul_``, ``clamp_``, ``copy_``), ``operator.i*`` /
    ``setitem``, ``out=``, ``inplace=True``, or an ATen schema that marks an
    argument written."""
    if node.op not in ("call_method", "call_function"):
        return []
    out: List[Any] = []
    t = node.target
    if isinstance(t, OpOverload):
        for i, a in enumerate(t._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                out.append(node.args[i] if i < len(node.args) else node.kwargs.get(a.name))
        return out
    name = _target_name(node)
    first = node.args[0] if node.args else None
    if (name.endswith("_") and not name.endswith("__") and name not in ("requires_grad_",)) or name in _INPLACE_BINOPS:
        out.append(first)
    if node.kwargs.get("inplace") is True:
        out.append(first)
    if "out" in node.kwargs:
        o = node.kwargs["out"]
        out.extend(o if isinstance(o, (tuple, list)) else [o])
    return out


def mutated_state(gm: fx.GraphModule) -> Dict[fx.Node, str]:
    """Graph inputs and attributes (parameters, buffers) that the graph writes
    in place, directly or through a view, mapped to the node that writes them.
    A fused group whose member is written here is skipped: the rewrite would
    read the block while the write goes to the member."""
    base: Dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            base[n] = n
        elif n.op in ("call_method", "call_function") and n.args and isinstance(n.args[0], fx.Node) and n.args[0] in base:
            if _target_name(n) in _VIEW_NAMES:
                base[n] = base[n.args[0]]
    written: Dict[fx.Node, str] = {}
    for n in gm.graph.nodes:
        for a in _written_args(n):
            if isinstance(a, fx.Node) and a in base:
                written.setdefault(base[a], f"{_target_name(n)} ({n.name})")
    return written
