"""One view of the graphs wfpass rewrites.

Two flavours reach the passes:

* Dynamo graphs: parameters and buffers are ``placeholder`` nodes; the real
  tensors are the backend's ``example_inputs`` and Dynamo's ``grapharg`` names
  the module attribute each came from.
* ``torch.fx.symbolic_trace`` graphs: ``call_module`` nodes and ``get_attr``.

Either may call layers functionally (``F.linear``, ``torch._C._nn.linear``).

:class:`PassContext` resolves any node argument to a :class:`TensorRef` (the
real tensor plus its qualified name) so a pass never needs to know the flavour.
What a graph writes in place (``mutated_state``, re-exported here) is
``mutation.py``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from .._torch import aot as _aot, distributed as _distributed, dynamo as _dynamo
from .._torch.kernels import linear as _aten_linear
from ..config import Config
from .mutation import mutated_state  # re-exported: the formats' matchers import it from here
from .records import Report

__all__ = ["PassContext", "TensorRef", "LINEAR_TARGETS", "getattr_path", "meta_value", "static_int", "same_size", "mutated_state", "node_arg",
           "set_node_arg"]

#: What Dynamo and symbolic_trace graphs call for ``nn.Linear`` / ``F.linear``
#: (the sibling-linear matcher, the BatchNorm fold and the report of layers
#: that already hold Q/K/V in one weight read calls of these).
LINEAR_TARGETS = (_aten_linear, F.linear, torch.ops.aten.linear.default)


@dataclasses.dataclass
class TensorRef:
    """A node argument resolved to the real tensor behind it."""

    name: str
    tensor: torch.Tensor
    kind: str  # "parameter" | "buffer" | "tensor"
    node: fx.Node

    @property
    def is_state(self) -> bool:
        """A Parameter or buffer of the model: something whose storage we may own."""
        return self.kind in ("parameter", "buffer")


class PassContext:
    """What every pass receives next to the graph.

    ``example_inputs`` is given for Dynamo graphs, ``root`` (the GraphModule's
    own submodules and attributes) for traced graphs.
    """

    def __init__(self, gm: fx.GraphModule, config: Config, report: Report, example_inputs: Optional[Sequence[Any]] = None):
        self.gm = gm
        self.config = config
        self.report = report
        self.example_inputs = list(example_inputs) if example_inputs is not None else None
        self._placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._state_cache: Optional[List[TensorRef]] = None
        self._deferred: List[Callable[[], None]] = []
        self._at_call: List[Callable[[], None]] = []
        self._compile_examples: Dict[int, Any] = {}
        self._root_names: Dict[str, Dict[int, str]] = {}  # source root -> id(tensor) -> state_dict name
        self.sites: List[Any] = []  # runtime.GroupSite of every fused group (Dynamo graphs)
        self.kept: List[Any] = []  # runtime state the rewritten graph's calls need alive (``keep_alive``)
        #: Called with a call's parameters the first time the compiled graph runs with them (``on_new_params``).
        self.new_params: List[Callable[[List[torch.Tensor]], None]] = []

    def defer(self, move: Callable[[], None], at_first_call: bool = False) -> None:
        """Queue a storage move (fuse, cast). Dynamo's fake tensors recorded
        each input's storage offset and dtype at trace time and AOTAutograd
        checks them again, so the backend runs these after the inner compile;
        ``wfpass.apply`` runs them at once. A dtype change can run here if the
        pass also gives the inner compiler an example of the new dtype
        (``compile_example``): Dynamo builds its guards from the live tensors
        after the backend returns. A stride change cannot: Dynamo's stride
        guards come from trace time and are checked right after the backend
        returns, so such a move waits for the first call (``at_first_call``)."""
        (self._at_call if at_first_call else self._deferred).append(move)

    def run_deferred(self) -> None:
        moves, self._deferred = self._deferred, []
        for move in moves:
            move()

    def take_first_call_moves(self) -> List[Callable[[], None]]:
        moves, self._at_call = self._at_call, []
        return moves

    def compile_example(self, placeholder: fx.Node, value: Any, same_layout: bool = True) -> None:
        """Dynamo graphs: hand the inner compiler ``value`` (a new tensor, the
        format's dtype) as ``placeholder``'s example, for a deferred move that
        gives the real tensor that dtype before the first call. AOTAutograd
        fakifies a new object afresh, so the compiled code expects the new
        dtype; Dynamo builds its guards after the backend returns, from the
        moved tensors: no recompile. ``resolve`` still gives the real tensor.

        ``value`` is fakified with the input's own symbols (``same_layout``:
        its sizes, strides and offset are those Dynamo saw) or with static
        sizes, never with fresh symbols that no input binds
        (``_torch.aot.static_example``)."""
        if isinstance(value, torch.Tensor):
            i = self._placeholders.index(placeholder)
            like = self.example_inputs[i] if same_layout and self.example_inputs is not None and i < len(self.example_inputs) else None
            _aot.static_example(value, placeholder.name, like if isinstance(like, torch.Tensor) else None)
        self._compile_examples[self._placeholders.index(placeholder)] = value

    def compile_inputs(self) -> List[Any]:
        """The example inputs the inner compiler gets (see ``compile_example``)."""
        out = list(self.example_inputs or ())
        for i, v in self._compile_examples.items():
            out[i] = v
        return out

    def placeholder_index(self, node: fx.Node) -> int:
        return self._placeholders.index(node)

    def add_site(self, site: Any) -> None:
        """A fused group the backend checks on every call (``runtime.guarded_call``)."""
        self.sites.append(site)

    def keep_alive(self, obj: Any) -> None:
        """``obj`` lives as long as the compiled graph (or the GraphModule of
        ``wfpass.apply``): state an op of the graph finds by id (a packed
        linear's site), which must not outlive the graph either."""
        self.kept.append(obj)

    def on_new_params(self, fn: Callable[[List[torch.Tensor]], None]) -> None:
        """Call ``fn`` with the graph's parameters whenever the compiled graph
        runs with a parameter set it has not run with before (another layer
        through the same graph under regional compilation, new Parameters
        after ``load_state_dict(assign=True)``), the first one included.
        Dynamo graphs only: a traced GraphModule reads its own parameters."""
        if fn not in self.new_params:
            self.new_params.append(fn)

    def param_positions(self) -> List[int]:
        """Positions of the graph inputs that are parameters (Dynamo graphs)."""
        if self.example_inputs is None:
            return []
        out = []
        for i, n in enumerate(self._placeholders):
            r = self.resolve(n)
            if r is not None and r.kind == "parameter":
                out.append(i)
        return out

    def refakify(self, placeholder: fx.Node) -> None:
        """After a compile-time move of ``placeholder``'s tensor into a block,
        hand the inner compiler a new alias of it as the example. Dynamo
        fakified the tensor before the move; AOTAutograd would reuse that
        fake (its storage the old one) and not know the members share the
        block. A new object is fakified afresh, with the block's storage,
        shared by all members: the aliasing is then the compiler's to see."""
        t = self.example_inputs[self.placeholder_index(placeholder)]
        if isinstance(t, torch.nn.Parameter):
            alias = torch.nn.Parameter(t.detach(), requires_grad=t.requires_grad)
        else:
            alias = t.detach().requires_grad_(t.requires_grad)
        # The move changed the member's storage offset: the symbols Dynamo
        # cached for the tensor before the move would be stale.
        self.compile_example(placeholder, alias, same_layout=False)

    def tensor_inputs(self) -> List[tuple]:
        """(name, position) of every tensor input: what a per-call sharing check compares against."""
        out = []
        for i, n in enumerate(self._placeholders):
            r = self.resolve(n)
            if r is not None:
                out.append((r.name, i))
        return out

    @property
    def is_dynamo(self) -> bool:
        return self.example_inputs is not None

    @property
    def region(self) -> Optional[str]:
        """The higher-order op whose body this context rewrites (``bodies.BodyContext``); None for a whole graph."""
        return None

    # -- resolving ----------------------------------------------------------
    def resolve(self, arg: Any) -> Optional[TensorRef]:
        if not isinstance(arg, fx.Node):
            return None
        if arg.op == "placeholder" and self.example_inputs is not None:
            idx = self._placeholders.index(arg)
            if idx >= len(self.example_inputs):
                return None
            t = self.example_inputs[idx]
            if not isinstance(t, torch.Tensor):
                return None
            src = _dynamo.dynamo_source_name(arg)
            qual = _dynamo.qualified_name_from_source(src) if src else None
            if qual is not None:
                qual = self._model_name(t, src) or qual
            if isinstance(t, torch.nn.Parameter):
                kind = "parameter"
            elif qual is not None and "_buffers[" in (src or ""):
                kind = "buffer"
            else:
                kind = "tensor"
            return TensorRef(qual or arg.name, t, kind, arg)
        if arg.op == "get_attr":
            t = getattr_path(self.gm, arg.target)
            if not isinstance(t, torch.Tensor):
                return None
            kind = "parameter" if isinstance(t, torch.nn.Parameter) else ("buffer" if self._is_buffer(arg.target) else "tensor")
            return TensorRef(arg.target, t, kind, arg)
        return None

    def _model_name(self, t: torch.Tensor, source: str) -> Optional[str]:
        """``t``'s name in ``named_parameters()`` / ``named_buffers()`` of the
        module the source starts from (the model whose ``forward`` Dynamo
        compiles): the ``state_dict()`` key. The source path itself is not
        always one: a wrapper that keeps the model in its ``__dict__`` (PEFT's
        ``PeftModel``/``LoraModel``) gives ``__dict__.__dict__.encoder...``."""
        key = _dynamo.source_root_key(source)
        if key is None:
            return None
        names = self._root_names.get(key)
        if names is None:
            root = _dynamo.source_root(source)
            ddp = _distributed.active_ddp()
            if ddp is not None and isinstance(root, torch.nn.Module) and ddp.module is root:
                # Dynamo compiles the module DDP wraps; the model the user
                # compiled is the DDP, whose names start with ``module.``.
                root = ddp
            names = {}
            if isinstance(root, torch.nn.Module):
                for n, v in list(root.named_parameters(remove_duplicate=False)) + list(root.named_buffers(remove_duplicate=False)):
                    names.setdefault(id(v), n)
            self._root_names[key] = names
        return names.get(id(t))

    def module_of(self, node: fx.Node) -> Optional[torch.nn.Module]:
        if node.op != "call_module":
            return None
        return self.gm.get_submodule(node.target)

    def _is_buffer(self, target: str) -> bool:
        mod_path, _, attr = target.rpartition(".")
        mod = self.gm.get_submodule(mod_path) if mod_path else self.gm
        return attr in getattr(mod, "_buffers", {})

    # -- everything that may share storage ----------------------------------
    def state_tensors(self) -> List[TensorRef]:
        """Every parameter/buffer the graph can see: the whole root module for
        traced graphs, every tensor input for Dynamo graphs."""
        if self._state_cache is None:
            out: List[TensorRef] = []
            if self.example_inputs is not None:
                for n in self._placeholders:
                    r = self.resolve(n)
                    if r is not None:
                        out.append(r)
            else:
                for name, p in self.gm.named_parameters(remove_duplicate=False):
                    out.append(TensorRef(name, p, "parameter", None))
                for name, b in self.gm.named_buffers(remove_duplicate=False):
                    out.append(TensorRef(name, b, "buffer", None))
            self._state_cache = out
        return self._state_cache

    def named_state(self) -> List[tuple]:
        """``(name, tensor)`` of every ``state_tensors()`` entry: the
        "others" every sharing check compares a tensor against."""
        return [(r.name, r.tensor) for r in self.state_tensors()]

    def written_state(self) -> Dict[fx.Node, str]:
        """Graph inputs and attributes this graph writes in place (``mutated_state``)."""
        return mutated_state(self.gm)

    def get_attr_node(self, qualname: str, before: fx.Node) -> fx.Node:
        """A ``get_attr`` node for ``qualname`` placed before ``before``."""
        with self.gm.graph.inserting_before(before):
            return self.gm.graph.get_attr(qualname)


def getattr_path(root: torch.nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def node_arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    """Argument ``i`` of a call, named ``name`` when passed by keyword."""
    return node.args[i] if i < len(node.args) else node.kwargs.get(name, default)


def set_node_arg(node: fx.Node, i: int, name: str, value: Any) -> None:
    """Replace argument ``i`` (``name`` by keyword) where the call passed it,
    or add it as a keyword."""
    if i < len(node.args):
        node.update_arg(i, value)
    else:
        node.update_kwarg(name, value)


def meta_value(node: Any) -> Any:
    """The fake/example value FX or Dynamo recorded for a node, if any."""
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("val", node.meta.get("example_value"))


def static_int(s: Any) -> Optional[int]:
    """``s`` as an int where it is one at compile time; None for a symbolic
    size. Never ``int(s)`` on a SymInt: that specializes it, adding a guard
    to Dynamo's shape environment, so the graph compiled for dynamic shapes
    is then good for this one size only and the next size recompiles (after
    8 sizes Dynamo gives up and runs the frame eagerly)."""
    if isinstance(s, bool):
        return None
    if isinstance(s, int):
        return s
    if isinstance(s, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import is_concrete_int

        return int(s) if is_concrete_int(s) else None
    return None


def same_size(a: Any, b: Any) -> bool:
    """``a == b`` where that is known without a guard (equal ints, or the
    same symbolic expression); False where it would need one."""
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a == b))
    return a == b
