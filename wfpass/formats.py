"""The format registry: how wfpass learns a layout, built-in or yours.

A format says how to move a layer's parameters into the backend's layout
(``to_format``), how to undo it (``from_format``) and how to compute with
it (the graph it leaves or the kernel it calls). wfpass's own formats
(fused sibling linears; cell loops folded, flat RNN weights; fp32
BatchNorm, BatchNorm folding) are the head of the same pipeline
(``wfpass/pipeline.py``); a registered format is appended after them.

A user format for one kind of node is a :class:`ParamFormat`::

    @wfpass.register_format
    class ChannelsLastConv(wfpass.ParamFormat):
        name = "channels_last_conv"
        targets = (torch.conv2d, torch.nn.functional.conv2d, torch.nn.Conv2d)
        roles = ("weight",)                      # which tensors move

        def to_format(self, t):   return t.contiguous(memory_format=torch.channels_last)
        def from_format(self, t): return t.contiguous()

:class:`ParamFormat` does the rest the same way for every such format, in
the pipeline's three steps: matches every call of a target, resolving its
tensors to the model's Parameters; guards it (skips, with a reason, anything
tied or shared, and what ``check`` refuses); applies it by moving
``tensor.data`` once (same objects) and recording how ``wfpass.restore``
undoes it. Every decision is one report record.
See examples/channels_last_conv.py.
"""
from __future__ import annotations

import inspect
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Type, Union

import torch
import torch.fx as fx

from . import pipeline
from .core.graph import TensorRef
from .pipeline import Format, Match
from .core.storage import move_problem, register_undo, undo_registered

__all__ = ["Format", "ParamFormat", "register_format", "unregister_format", "registered_formats"]


class _Call(Match):
    """A call of one of a ParamFormat's targets, its tensors resolved."""

    def __init__(self, node: fx.Node, refs: Dict[str, object]):
        super().__init__([r.name if isinstance(r, TensorRef) else str(r) for r in refs.values()],
                         "would move to this format")
        self.node, self.refs = node, refs


class ParamFormat(Format):
    """A format for the tensors of one kind of node, declared by a user.

    targets:     call_function targets and/or ``nn.Module`` classes (call_module).
    roles:       names of the tensors to move: argument names of the
                 function (``"weight"``, ``"bias"``) or the module's attributes.
    to_format:   returns the tensor's data in the new format (a new tensor
                 with the same values and shape). Required.
    from_format: returns it in the standard format again. Required.
    check:       optional; return a reason (str) to skip a node.
    kernel:      optional; a function the node calls instead of its target
                 (call_function nodes only), with the same signature.
    """

    targets: Tuple = ()
    roles: Tuple[str, ...] = ("weight",)
    kernel: Optional[Callable] = None

    def to_format(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}.to_format")

    def from_format(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}.from_format")

    def check(self, node: fx.Node, tensors: Dict[str, torch.Tensor]) -> Optional[str]:
        return None

    def validate(self) -> None:
        super().validate()
        if not self.targets:
            raise ValueError(f"{type(self).__name__}.targets is empty: name the functions or module classes it applies to")
        for m in ("to_format", "from_format"):
            if getattr(type(self), m) is getattr(ParamFormat, m):
                raise TypeError(f"{type(self).__name__} must define {m}()")

    # -- the pipeline's steps, the same for every ParamFormat -----------------
    def matches(self, gm: fx.GraphModule, ctx) -> Iterator[_Call]:
        for node in list(gm.graph.nodes):
            refs = self._tensors(node, ctx)
            if refs:
                yield _Call(node, refs)

    def guard(self, m: _Call, ctx) -> Optional[str]:
        bad = [role for role, r in m.refs.items() if not (isinstance(r, TensorRef) and r.is_state)]
        if bad:
            return f"{', '.join(bad)} of {m.node.name} is not a Parameter or buffer of the model"
        tensors = {role: r.tensor for role, r in m.refs.items()}
        if all(undo_registered(t) for t in tensors.values()):
            return "already in this format"
        others = ctx.named_state()
        # unmovable first: a DTensor/FSDP2 tensor never reaches the format's own check.
        return move_problem([(r.name, r.tensor) for r in m.refs.values()], others, lambda: self.check(m.node, tensors))

    def apply(self, m: _Call, ctx) -> None:
        node = m.node
        rec = ctx.report.add(self.pattern or self.name, "rewritten",
                             f"moved to {self.name}" + (f"; calls {self.kernel.__name__}" if self.kernel else ""), m.params)
        if self.kernel is not None and node.op == "call_function":
            node.target = self.kernel

        def move(ts=tuple(r.tensor for r in m.refs.values()), rec=rec) -> None:
            for t in ts:
                new = self.to_format(t.detach())
                if new.shape != t.shape:
                    raise ValueError(f"{type(self).__name__}.to_format changed the shape of a tensor from {tuple(t.shape)} to {tuple(new.shape)}")
                with torch.no_grad():
                    t.data = new
                register_undo(t, lambda t: _set_data(t, self.from_format(t.detach())))
            rec.bump("moved", len(ts))

        # Formats may change strides or dtype: that must wait for the call.
        ctx.defer(move, at_first_call=True)

    def _tensors(self, node: fx.Node, ctx) -> Optional[Dict[str, object]]:
        """The node's tensors by role (a TensorRef where the argument is one
        of the model's tensors), or None if the node is not a target."""
        if node.op == "call_module":
            mod = ctx.module_of(node)
            if not any(isinstance(mod, t) for t in self.targets if isinstance(t, type)):
                return None
            out = {}
            for role in self.roles:
                t = getattr(mod, role, None)
                if isinstance(t, torch.Tensor):
                    kind = "parameter" if isinstance(t, torch.nn.Parameter) else "buffer"
                    out[role] = TensorRef(f"{node.target}.{role}", t, kind, None)
            return out
        if node.op != "call_function" or node.target not in self.targets:
            return None
        try:
            sig = inspect.signature(node.target)
            bound = sig.bind_partial(*node.args, **node.kwargs).arguments
        except (TypeError, ValueError):
            # C builtins (torch.conv2d) have no signature: by convention the
            # tensor arguments follow the input: (input, weight, bias, ...).
            bound = dict(zip(("input", "weight", "bias"), node.args))
            bound.update(node.kwargs)
        out = {}
        for role in self.roles:
            if role in bound:
                ref = ctx.resolve(bound[role])
                out[role] = ref if ref is not None else bound[role]
        return out


def _set_data(t: torch.Tensor, data: torch.Tensor) -> None:
    with torch.no_grad():
        t.data = data


def register_format(fmt: Union[Format, Type[Format]]) -> Union[Format, Type[Format]]:
    """Register a format (an instance, or a class: used as a decorator). Its
    ``name`` must be new; it runs after the built-in formats and those
    registered before it. Returns its argument."""
    inst = fmt() if isinstance(fmt, type) else fmt
    if not isinstance(inst, Format):
        raise TypeError(f"register_format expects a wfpass.Format (sub)class or instance, got {type(inst).__name__}")
    pipeline.append_format(inst)
    return fmt


def unregister_format(name: str) -> None:
    """Remove a format you registered. The built-in ones cannot be removed
    (that would change every compile in the process): use
    ``Config(passes=...)`` to leave one out of a single compile."""
    pipeline.remove_format(name)


def registered_formats() -> List[Format]:
    """Every registered format, in the order the pipeline runs them."""
    return pipeline.registered()
