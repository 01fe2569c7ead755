"""The BatchNorm matcher both BatchNorm formats use: every batch norm of a
graph, in any flavour, with its tensors resolved (``batchnorm_sites``, a
``BNSite`` each).

Flavours: a call of ``F.batch_norm`` / ``torch.batch_norm`` /
``aten.batch_norm`` (Dynamo and ``symbolic_trace`` graphs), or the
``call_module`` of a ``torch.nn`` BatchNorm (``symbolic_trace`` keeps those
as leaves). The ``bn_fp32`` / ``bn_module_fp32`` wrappers ``fp32_batchnorm``
puts in front of a batch norm are looked through (``unwrap``), so
``fold_batchnorm`` after it, and a second run over the same graph, see the
batch norm itself.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch
import torch.fx as fx

from .._torch.kernels import BatchNorm as _BatchNorm
from ..core.graph import PassContext, TensorRef, node_arg, set_node_arg
from .kernels import ROLES, bn_fp32, bn_module_fp32

__all__ = ["BN_FUNCTIONS", "BNSite", "batchnorm_sites", "unwrap", "set_arg", "is_module_bn"]


# Positions of (input, running_mean, running_var, weight, bias, training, momentum, eps).
_F_POS = {"input": 0, "running_mean": 1, "running_var": 2, "weight": 3, "bias": 4, "training": 5, "momentum": 6, "eps": 7}
_ATEN_POS = {"input": 0, "weight": 1, "bias": 2, "running_mean": 3, "running_var": 4, "training": 5, "momentum": 6, "eps": 7}
_DEFAULTS = {"running_mean": None, "running_var": None, "weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}

BN_FUNCTIONS = {
    torch.nn.functional.batch_norm: _F_POS,
    torch.batch_norm: _ATEN_POS,
    torch.ops.aten.batch_norm.default: _ATEN_POS,
}


def is_module_bn(mod: Any) -> bool:
    # symbolic_trace keeps torch.nn's own modules as leaves; a user subclass is
    # traced through to F.batch_norm, so only torch.nn classes reach us here.
    return isinstance(mod, _BatchNorm) and type(mod).__module__.startswith("torch.nn")


@dataclasses.dataclass
class BNSite:
    """One batch norm in any flavour. ``x`` and the tensor args are the
    *underlying* nodes: a previous run's ``bn_fp32``/``bn_module_fp32``
    wrappers are looked through (``wrapped`` says which were)."""

    node: fx.Node
    x: fx.Node
    flavour: str  # "function" | "module"
    args: Dict[str, Any]  # role -> node (or None); function flavour only
    refs: Dict[str, Optional[TensorRef]]  # role -> resolved tensor (None: absent or unresolvable)
    present: Dict[str, bool]
    wrapped: Dict[str, bool]
    training: Any  # bool, or a node/unknown for a non-constant training argument
    momentum: Any
    eps: Any
    module: Optional[torch.nn.Module] = None
    module_name: Optional[str] = None
    x_wrapper: Optional[fx.Node] = None  # bn_module_fp32 node in front of a call_module BN

    @property
    def names(self) -> List[str]:
        return [r.name for r in self.refs.values() if r is not None]

    @property
    def label(self) -> str:
        if self.module_name is not None:
            return self.module_name
        for r in self.refs.values():
            if r is not None:
                return r.name.rpartition(".")[0] or r.name
        return self.node.name


def unwrap(arg: Any) -> Any:
    """The node a ``bn_fp32`` / ``bn_module_fp32`` wrapper wraps, else ``arg``."""
    if isinstance(arg, fx.Node) and arg.op == "call_function":
        fn = getattr(arg.target, "fn", None)  # a runtime.Bound target
        if fn is bn_fp32:
            return arg.args[1]
        if fn is bn_module_fp32:
            return arg.args[0]
    return arg


def _get(node: fx.Node, pos: Dict[str, int], name: str) -> Any:
    return node_arg(node, pos[name], name, _DEFAULTS.get(name))


def set_arg(node: fx.Node, name: str, value: Any) -> None:
    """Set the argument ``name`` (a role) of a function-flavour batch norm
    ``node``, where it was given: by position or by keyword."""
    set_node_arg(node, BN_FUNCTIONS[node.target][name], name, value)


def batchnorm_sites(ctx: PassContext) -> List[BNSite]:
    out: List[BNSite] = []
    for node in ctx.gm.graph.nodes:
        if node.op == "call_function" and node.target in BN_FUNCTIONS:
            pos = BN_FUNCTIONS[node.target]
            x = _get(node, pos, "input")
            if not isinstance(x, fx.Node):
                continue
            args, refs, present, wrapped = {}, {}, {}, {}
            for role in ROLES:
                a = _get(node, pos, role)
                args[role] = a
                present[role] = a is not None
                wrapped[role] = unwrap(a) is not a
                refs[role] = ctx.resolve(unwrap(a)) if a is not None else None
            out.append(BNSite(node, x, "function", args, refs, present, wrapped,
                              _get(node, pos, "training"), _get(node, pos, "momentum"), _get(node, pos, "eps")))
        elif node.op == "call_module":
            mod = ctx.module_of(node)
            if not is_module_bn(mod) or len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
                continue
            x = node.args[0]
            x_wrapper = x if unwrap(x) is not x else None
            refs, present = {}, {}
            for role in ROLES:
                t = getattr(mod, role, None)
                present[role] = t is not None
                kind = "parameter" if isinstance(t, torch.nn.Parameter) else "buffer"
                refs[role] = TensorRef(f"{node.target}.{role}", t, kind, None) if t is not None else None
            out.append(BNSite(node, unwrap(x), "module", {}, refs, present, {r: x_wrapper is not None for r in ROLES},
                              mod.training, mod.momentum, mod.eps, module=mod, module_name=node.target, x_wrapper=x_wrapper))
    return out
