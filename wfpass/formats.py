"""The format registry: how wfpass learns a layout, built-in or yours.

In the spirit of the weight-format proposal (shared/seeds/000): a format says
how to move a layer's parameters into the backend's layout (``to_format``),
how to undo it (``from_format``) and how to compute with it (the graph it
leaves or the kernel it calls). wfpass's own formats, fused sibling linears,
flat RNN weights and fp32 BatchNorm, are registered here the same way, as
whole passes; the pipeline runs every registered format in order.

A user format for one kind of node is a :class:`ParamFormat`::

    @wfpass.register_format
    class ChannelsLastConv(wfpass.ParamFormat):
        name = "channels_last_conv"
        targets = (torch.conv2d, torch.nn.functional.conv2d, torch.nn.Conv2d)
        roles = ("weight",)                      # which tensors move

        def to_format(self, t):   return t.contiguous(memory_format=torch.channels_last)
        def from_format(self, t): return t.contiguous()

The registry does the rest the same way for every format: resolves the
node's tensors to the model's Parameters, skips (with a reason) anything tied
or shared, moves ``tensor.data`` once (same objects), records how
``wfpass.restore`` undoes it, and writes one report record per decision.
See examples/channels_last_conv.py.
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.fx as fx

__all__ = ["Format", "ParamFormat", "register_format", "unregister_format", "registered_formats"]

log = logging.getLogger("wfpass")


class Format:
    """A registered format. ``name`` is what ``Config(passes=...)`` and the
    report use. Subclasses implement ``run(gm, ctx) -> int`` (patterns
    rewritten), writing their decisions into ``ctx.report``."""

    name: str = ""
    pattern: str = ""

    def run(self, gm: fx.GraphModule, ctx) -> int:  # pragma: no cover - interface
        raise NotImplementedError


class PassFormat(Format):
    """A built-in format implemented as a whole pass (see wfpass/passes/)."""

    def __init__(self, name: str, pattern: str, fn: Callable[[fx.GraphModule, object], int]):
        self.name, self.pattern, self._fn = name, pattern, fn

    def run(self, gm, ctx) -> int:
        return self._fn(gm, ctx)

    def __repr__(self) -> str:
        return f"PassFormat({self.name!r})"


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

    # -- the machinery every ParamFormat shares -----------------------------
    def _tensors(self, node: fx.Node, ctx) -> Optional[Dict[str, object]]:
        from .graph import TensorRef

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
        import inspect

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

    def run(self, gm: fx.GraphModule, ctx) -> int:
        from .graph import TensorRef
        from .storage import register_undo, sharing_problem, undo_registered, unmovable

        pattern = self.pattern or self.name
        others = [(r.name, r.tensor) for r in ctx.state_tensors()]
        done = 0
        for node in list(gm.graph.nodes):
            refs = self._tensors(node, ctx)
            if not refs:
                continue
            names = [r.name if isinstance(r, TensorRef) else str(r) for r in refs.values()]
            bad = [role for role, r in refs.items() if not (isinstance(r, TensorRef) and r.is_state)]
            if bad:
                ctx.report.add(pattern, "skipped", f"{', '.join(bad)} of {node.name} is not a Parameter or buffer of the model", names)
                continue
            tensors = {role: r.tensor for role, r in refs.items()}
            if all(undo_registered(t) for t in tensors.values()):
                ctx.report.add(pattern, "skipped", "already in this format", names)
                continue
            # unmovable first: a DTensor/FSDP2 tensor never reaches the format's own check.
            why = (
                next((w for w in (unmovable(r.tensor, r.name) for r in refs.values()) if w), None)
                or self.check(node, tensors)
                or next((w for w in (sharing_problem(r.tensor, r.name, others) for r in refs.values()) if w), None)
            )
            if why:
                ctx.report.add(pattern, "skipped", why, names)
                continue
            if ctx.config.dry_run:
                ctx.report.add(pattern, "rewritten", "would move to this format [dry run]", names)
                done += 1
                continue
            rec = ctx.report.add(pattern, "rewritten", f"moved to {self.name}" + (f"; calls {self.kernel.__name__}" if self.kernel else ""), names)
            if self.kernel is not None and node.op == "call_function":
                node.target = self.kernel

            def move(ts=tuple(tensors.values()), rec=rec) -> None:
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
            done += 1
        return done

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _set_data(t: torch.Tensor, data: torch.Tensor) -> None:
    with torch.no_grad():
        t.data = data


_REGISTRY: Dict[str, Format] = {}


def register_format(fmt: Union[Format, Type[Format]]) -> Union[Format, Type[Format]]:
    """Register a format (an instance, or a class: used as a decorator). Its
    ``name`` must be new. Returns its argument."""
    inst = fmt() if isinstance(fmt, type) else fmt
    if not isinstance(inst, Format):
        raise TypeError(f"register_format expects a wfpass.Format (sub)class or instance, got {type(inst).__name__}")
    if not inst.name or not isinstance(inst.name, str):
        raise ValueError(f"{type(inst).__name__} needs a non-empty string 'name'")
    if inst.name in _REGISTRY:
        raise ValueError(f"a format named {inst.name!r} is already registered ({_REGISTRY[inst.name]!r})")
    if isinstance(inst, ParamFormat):
        if not inst.targets:
            raise ValueError(f"{type(inst).__name__}.targets is empty: name the functions or module classes it applies to")
        for m in ("to_format", "from_format"):
            if getattr(type(inst), m) is getattr(ParamFormat, m):
                raise TypeError(f"{type(inst).__name__} must define {m}()")
    _REGISTRY[inst.name] = inst
    return fmt


def unregister_format(name: str) -> None:
    """Remove a format (built-in ones too; use ``Config(passes=...)`` to
    switch one off for a single compile instead)."""
    if name not in _REGISTRY:
        raise ValueError(f"no format named {name!r}; registered: {list(_REGISTRY)}")
    del _REGISTRY[name]


def registered_formats() -> List[Format]:
    """Every registered format, in the order the pipeline runs them."""
    return list(_REGISTRY.values())
