"""One linear call as both linear formats see it: the sibling-linear format
(``fuse_linears``) groups these calls, the packed-weight format
(``prepack_linears``) packs their weights, and both match them here.

``linear_sites`` finds every linear call, in Dynamo graphs
(``torch._C._nn.linear``, ``F.linear``) and in ``symbolic_trace`` graphs
(``call_module`` of an ``nn.Linear``); ``weight_block_of`` says whether a
weight is a member of an intact block ``fuse_linears`` laid out, without
the other format spelling that layout's key. The refusals both formats
give about one call's own tensors are written here once
(``weight_ref_problem``, ``weight_not_2d``, ``written_in_place``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
import torch.fx as fx

from .._torch import tensors as _tensors
from ..core.graph import LINEAR_TARGETS, PassContext, TensorRef, meta_value, node_arg, static_int
from ..core.storage import FusedStorage, layout_of
from .kernel import LinearLayout

__all__ = ["LinearSite", "linear_sites", "rows_of", "rows_reader", "weight_block_of", "weight_ref_problem",
           "weight_not_2d", "written_in_place"]


def rows_of(x: fx.Node) -> Optional[int]:
    """M, the number of rows a linear over ``x`` multiplies; None if unknown or symbolic."""
    v = meta_value(x)
    shape = getattr(v, "shape", None)
    if shape is None:
        return None
    dims = [static_int(s) for s in shape[:-1]]
    return None if any(d is None for d in dims) else int(math.prod(dims))  # None: a symbolic size


def rows_reader(x: fx.Node, inputs: Optional[Sequence[Any]]) -> Optional[Callable[[Sequence[Any]], int]]:
    """A symbolic M read per call: a function of a compiled graph's
    arguments (``inputs``: Dynamo's examples of them) that gives the M of
    a linear over ``x`` in that call, e.g. ``def read(a): s0 = a[0]; return
    s0`` where the graph's first input is the symbol ``s0`` (Dynamo passes
    each symbol of the input sizes as an int), or a tensor input's size
    (``_torch.tensors.size_product_reader``). None where a symbol of M is
    bound by no input (a size computed from data), or ``x`` has no shape."""
    shape = getattr(meta_value(x), "shape", None)
    if shape is None or inputs is None:
        return None
    return _tensors.size_product_reader(shape[:-1], inputs)


@dataclasses.dataclass
class LinearSite:
    """A linear call ``y = x @ W.T + b`` in any flavour. ``bias_arg`` is the
    call's bias argument as the graph has it (a function call; None for a
    module call, whose bias is its attribute)."""

    node: fx.Node
    x: fx.Node
    weight: Optional[TensorRef]
    bias: Optional[TensorRef]
    has_bias: bool
    bias_arg: Any = None

    @property
    def out_features(self) -> int:
        return self.weight.tensor.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.tensor.shape[1]


def linear_sites(ctx: PassContext) -> Iterable[LinearSite]:
    """Every linear in the graph whose input is a node, in graph order.
    Weights that cannot be resolved to a tensor come back with
    ``weight=None`` so the pass can report why."""
    for node in ctx.gm.graph.nodes:
        if node.op == "call_function" and node.target in LINEAR_TARGETS:
            x, w, b = (node_arg(node, i, n) for i, n in enumerate(("input", "weight", "bias")))
            if not isinstance(x, fx.Node):
                continue
            yield LinearSite(node, x, ctx.resolve(w), ctx.resolve(b), b is not None, b)
        elif node.op == "call_module":
            mod = ctx.module_of(node)
            if type(mod) is torch.nn.Linear and len(node.args) == 1 and not node.kwargs and isinstance(node.args[0], fx.Node):
                w = TensorRef(f"{node.target}.weight", mod.weight, "parameter", None)
                b = TensorRef(f"{node.target}.bias", mod.bias, "parameter", None) if mod.bias is not None else None
                yield LinearSite(node, node.args[0], w, b, mod.bias is not None)


def weight_block_of(t: torch.Tensor) -> Optional[FusedStorage]:
    """The intact weight block of a sibling group ``t`` is a member of (the
    layout ``fuse_linears`` made, its key the group's ``LinearLayout``
    weight key), or None."""
    fs = layout_of(t)
    if fs is None or not fs.intact() or not fs.shapes or any(len(s) != 2 for s in fs.shapes):
        return None
    layout = LinearLayout([s[0] for s in fs.shapes], [False] * len(fs.shapes), fs.shapes[0][1])
    return fs if fs.key == layout.weight_key else None


# -- the refusals both formats give about one call's tensors ----------------------


def weight_ref_problem(w: Optional[TensorRef]) -> Optional[str]:
    """A weight the pass cannot resolve to a tensor, or one that is not a
    Parameter or buffer of the model; None if neither."""
    if w is None:
        return "weight is not a tensor the pass can resolve (computed in the graph?)"
    if not w.is_state:
        return f"weight {w.name} is not a Parameter or buffer of the model (a graph input or computed tensor)"
    return None


def weight_not_2d(w: TensorRef) -> str:
    """The refusal of a weight that is not a matrix."""
    return f"weight {w.name} is not 2-D"


def written_in_place(refs: Sequence[Optional[TensorRef]], written: Mapping[fx.Node, str], then: str) -> Optional[str]:
    """The first of ``refs`` (None ones skipped) that the graph writes in
    place (``written``: node -> the writer), and ``then``, what the format's
    rewrite would do with that write; None if none is written."""
    for r in refs:
        if r is not None and r.node is not None and r.node in written:
            return (f"{r.name} is written in place inside the graph by {written[r.node]} (a hook or an in-place op "
                    f"in forward): {then}")
    return None
