"""BatchNorm in half-precision models: fp32 weight, bias and running statistics.

Dynamo flavour: the graph does not change::

    add_ = num_batches_tracked.add_(1)
    y = batch_norm(x_bf16, running_mean, running_var, weight, bias, True, 0.1, 1e-5)

but the inner compiler gets new fp32 example tensors for the four
placeholders (``ctx.compile_example``), and after it has run the real
Parameter/buffer objects get fp32 data (a deferred move). Why not cast first:
Dynamo traced with bf16 fake tensors memoised per real tensor object, and
AOTAutograd would reuse them; a new example object is fakified afresh, so the
compiled code is built for fp32 statistics and updates them in place, from
the first call on. Dynamo builds its guards from the live tensors after the
backend returns, so they see fp32: no recompile (measured, torch 2.13.0), and
nothing runs per call. A later ``model.to(bf16)`` fails those guards; the
recompile casts again.

``symbolic_trace`` flavours (``wfpass.apply``) run in place, so a cheap
check before each batch norm restores the format if it was lost (counted)::

    y = batch_norm(x, rm, rv, w, b, ...)   ->   y = batch_norm(x, bn_fp32("bn0", 0, rm, True), ...)
    y = bn(x)                              ->   x2 = bn_module_fp32("bn0", x); y = bn(x2)

A ``call_module`` BatchNorm keeps running its own forward (train/eval switches
after the pass, ``num_batches_tracked``, ``momentum=None``: all as eager); its
tensors are fp32.

The steps (``Fp32BatchNorm``): ``matches`` yields every batch norm of the
graph (``batchnorm_sites``, a ``BatchNormCall`` each), then, in Dynamo
graphs, the BatchNorms Dynamo runs eagerly (below); ``guard`` decides and
``apply`` rewrites. A batch norm whose tensors a previous run already holds in
fp32 (a recompile, a second ``wfpass.apply``) is taken with nothing to
rewrite: its ``rewritten`` row says so (``idempotent=True``).

Guards, each a skip record when it fails: the input is fp16/bf16 (fp32 input:
nothing to do); the tensors are not already fp32 (autocast with fp32
parameters runs the mixed kernel already); every tensor resolves to a
Parameter/buffer of the model; none shares storage with another tensor;
none belongs to a DistributedDataParallel whose forward is being compiled
(its reducer's hooks would be lost with the dtype: ``_ddp_problem``); nothing
but batch norms reads them in this graph (it would see fp32).

BatchNorms Dynamo runs eagerly. A BatchNorm with ``momentum=None`` in
training mode is not in any graph: Dynamo (torch 2.13.0) graph-breaks on
``float(self.num_batches_tracked)`` and calls that module eagerly. While the
backend compiles a graph of the same frame, the format finds such modules among
the modules the frame can reach (``_torch.dynamo.traced_frame_modules``): matches
of their own kind, ``EagerBatchNorm``, found, guarded and applied by
``wfpass.ops.batchnorm_eager``. It moves their half tensors to fp32 (eager's
BatchNorm then runs the mixed kernel with fp32 statistics, as in the graphs)
and adds a forward pre-hook that keeps the format (``bn_eager_pre_hook``, the same check as ``bn_module_fp32``). The
record is ``rewritten`` with ``flavour="eager"``, and says how many training
calls the module ran in half precision before a graph of its frame was
compiled (when it is the first thing its frame runs, that is one).
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.fx as fx

from ..graph import PassContext, TensorRef, meta_value
from ..pipeline import Format, Match
from .. import capture as _capture
from .._torch import distributed as _distributed
from ..ops.batchnorm import HALF, ROLES, bn_fp32, bn_module_fp32, held_in_fp32, to_fp32
from ..ops.batchnorm_eager import (
    EagerBatchNorm, ddp_problem as _ddp_problem, dtype_name as _dtype_name, eager_apply, eager_batchnorms as _eager_batchnorms,
    eager_guard, is_module_bn as _is_module_bn, note_item_break,
)
from ..runtime import Bound, Group, note
from ..storage import first_sharing_problem

__all__ = ["Fp32BatchNorm", "BatchNormCall", "BNSite", "batchnorm_sites", "unwrap"]


# Positions of (input, running_mean, running_var, weight, bias, training, momentum, eps).
_F_POS = {"input": 0, "running_mean": 1, "running_var": 2, "weight": 3, "bias": 4, "training": 5, "momentum": 6, "eps": 7}
_ATEN_POS = {"input": 0, "weight": 1, "bias": 2, "running_mean": 3, "running_var": 4, "training": 5, "momentum": 6, "eps": 7}
_DEFAULTS = {"running_mean": None, "running_var": None, "weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}

BN_FUNCTIONS = {
    torch.nn.functional.batch_norm: _F_POS,
    torch.batch_norm: _ATEN_POS,
    torch.ops.aten.batch_norm.default: _ATEN_POS,
}


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
    i = pos[name]
    if i < len(node.args):
        return node.args[i]
    return node.kwargs.get(name, _DEFAULTS.get(name))


def _set(node: fx.Node, pos: Dict[str, int], name: str, value: Any) -> None:
    i = pos[name]
    if i < len(node.args):
        node.update_arg(i, value)
    else:
        node.update_kwarg(name, value)


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
            if not _is_module_bn(mod) or len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
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


def _under_autocast(ctx: PassContext) -> bool:
    if torch.is_autocast_enabled("cpu") or (torch.cuda.is_available() and torch.is_autocast_enabled("cuda")):
        return True
    return any(n.op == "call_function" and "autocast" in getattr(n.target, "__name__", "") for n in ctx.gm.graph.nodes)


def _input_dtype(site: BNSite) -> Optional[torch.dtype]:
    v = meta_value(site.x)
    return getattr(v, "dtype", None)


def _fp32_example(t: torch.Tensor) -> torch.Tensor:
    """A new fp32 tensor like ``t`` for the inner compiler (a Parameter stays a
    Parameter: AOTAutograd treats those as static inputs)."""
    e = t.detach().float()
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(e, requires_grad=t.requires_grad)
    return e


def _other_reader(ctx: PassContext, site: BNSite, roles: List[str], bn_nodes) -> Optional[str]:
    """Does anything but a batch norm read one of these tensors in this graph?
    It would then see fp32 where the model computed in half precision."""
    names = {site.refs[r].name: r for r in roles}
    for node in ctx.gm.graph.nodes:
        is_ours = (node.op == "placeholder" and ctx.is_dynamo and any(site.args.get(r) is node for r in roles)) or (
            node.op == "get_attr" and node.target in names)
        if not is_ours:
            continue
        for u in node.users:
            if u in bn_nodes or (u.op == "call_function" and getattr(u.target, "fn", None) is bn_fp32):
                continue
            label = names.get(node.target) if node.op == "get_attr" else next(r for r in roles if site.args.get(r) is node)
            return f"{label} is also read by {u.name} ({u.op} {getattr(u.target, '__name__', u.target)}), which would see float32 instead of the model's dtype"
    return None


class _Run:
    """What one run's matches share: the DistributedDataParallel's tensors
    and the graph's batch norms (read once per pass, not per BatchNorm), and
    every named tensor (read when the first match needs it)."""

    def __init__(self, sites: List[BNSite]):
        self.ddp_held = _distributed.ddp_tensors()
        self.bn_nodes = {site.node for site in sites}
        self._others: Optional[list] = None

    def others(self, ctx: PassContext) -> list:
        if self._others is None:
            self._others = [(r.name, r.tensor) for r in ctx.state_tensors()]
        return self._others


class BatchNormCall(Match):
    """One batch norm of the graph, in any flavour (``site``)."""

    def __init__(self, site: BNSite, run: _Run):
        mode = "training" if site.training is True else ("eval" if site.training is False else "train/eval at run time")
        super().__init__(site.names or [site.label], flavour=site.flavour, mode=mode, folded=False)
        self.site, self.run = site, run
        # Set by the guard of a taken match:
        self.held = False  # already fp32 by wfpass: a row saying so, nothing to rewrite
        self.tensors: Dict[str, torch.Tensor] = {}
        self.half: List[str] = []  # the roles to move
        self.ins = ""  # the input dtype's name


class Fp32BatchNorm(Format):
    """Keep every half-precision BatchNorm's tensors in fp32: the graph's
    batch norms (``BatchNormCall``), then, in Dynamo graphs, the BatchNorms
    Dynamo runs eagerly (``EagerBatchNorm``, ``wfpass.ops.batchnorm_eager``)."""

    name, pattern = "fp32_batchnorm", "batchnorm"

    def matches(self, gm: fx.GraphModule, ctx: PassContext) -> Iterator[Match]:
        sites = batchnorm_sites(ctx)
        run = _Run(sites)
        for site in sites:
            yield BatchNormCall(site, run)
        if ctx.is_dynamo and ctx.region is None:
            # BatchNorms Dynamo runs eagerly belong to the frame, not to a
            # region inside its graph.
            yield from _eager_batchnorms(ctx)

    def guard(self, m: Match, ctx: PassContext) -> Optional[str]:
        if isinstance(m, EagerBatchNorm):
            return eager_guard(m)
        site = m.site
        present = [r for r in ROLES if site.present[r]]
        if not present:
            return "affine=False and track_running_stats=False: no weight, bias or statistics to keep in fp32"
        unresolved = [r for r in present if site.refs[r] is None or not site.refs[r].is_state]
        if unresolved:
            return f"{', '.join(unresolved)} not a Parameter or buffer of the model (a graph input or computed tensor): wfpass cannot own its dtype"

        tensors = {r: site.refs[r].tensor for r in present}
        dtypes = {t.dtype for t in tensors.values()}
        in_dtype = _input_dtype(site)
        m.detail["input_dtype"] = _dtype_name(in_dtype) if in_dtype is not None else None
        if in_dtype is not None and in_dtype not in HALF:
            return f"input is {_dtype_name(in_dtype)}: the fp32-statistics format is for fp16/bf16 inputs, nothing to do"
        half = [r for r in present if tensors[r].dtype in HALF]
        if not half:
            if all(held_in_fp32(t) for t in tensors.values()):
                # A recompile (or a second apply) after wfpass already moved them:
                # taken, its row says so (``apply``).
                m.held = True
                m.plan = "weight/bias/statistics already held in fp32 by wfpass (recompiled or re-run graph); mixed-precision kernel"
                m.detail = dict(idempotent=True, **m.detail)
                return None
            if dtypes == {torch.float32}:
                ctx_note = "under torch.autocast with fp32 parameters" if _under_autocast(ctx) else "the model keeps its BatchNorm in fp32"
                in_note = _dtype_name(in_dtype) if in_dtype is not None else "its"
                return f"weight/bias/statistics are already float32 ({ctx_note}); the mixed kernel already runs with {in_note} input, nothing to change"
            return f"tensors are {sorted(_dtype_name(d) for d in dtypes)}, not fp16/bf16: not this format"

        problem = first_sharing_problem([(site.refs[r].name, tensors[r]) for r in half], m.run.others(ctx))
        problem = problem or _ddp_problem([tensors[r] for r in half], m.run.ddp_held)
        if problem:
            return problem
        if ctx.is_dynamo and site.flavour == "function" and not all(
                isinstance(site.args[r], fx.Node) and unwrap(site.args[r]).op == "placeholder" for r in half):
            return "a BatchNorm tensor is not an input of this Dynamo graph (get_attr): its dtype is baked into the compiled code"
        reader = _other_reader(ctx, site, half, m.run.bn_nodes)
        if reader:
            return reader

        src = _dtype_name(tensors[half[0]].dtype)
        m.tensors, m.half = tensors, half
        m.ins = _dtype_name(in_dtype) if in_dtype is not None else src
        extra = sum(tensors[r].numel() * 2 for r in half)  # fp32 is 2 bytes more per element
        m.detail.update(from_dtype=src, cast=[site.refs[r].name for r in half], extra_bytes=extra)
        m.plan = f"would hold {', '.join(half)} in float32 for {m.ins} input"
        return None

    def apply(self, m: Match, ctx: PassContext) -> None:
        if isinstance(m, EagerBatchNorm):
            eager_apply(m, ctx)
        elif m.held:
            ctx.report.add("batchnorm", "rewritten", m.plan, m.params, **m.detail)
        else:
            _rewrite(m, ctx)


def _rewrite(m: BatchNormCall, ctx: PassContext) -> None:
    """Hold the site's half tensors in fp32 (a deferred move) and make its
    graph ready for them (see the module docstring, per flavour)."""
    site, tensors, half, ins = m.site, m.tensors, m.half, m.ins
    stats_note = "; running statistics update in fp32" if site.present["running_mean"] and site.training is not False else ""
    record = ctx.report.add("batchnorm", "rewritten", f"{', '.join(half)} held in float32 for {ins} input: mixed-precision kernel, output stays {ins}{stats_note}", m.params, **m.detail)
    record.stats.setdefault("fp32_calls", 0)
    moved = [tensors[r] for r in half]
    note(record, [site.refs[r].name for r in ROLES if site.refs.get(r)], [site.refs[r].tensor for r in ROLES if site.refs.get(r)])
    ctx.defer(lambda moved=moved: [to_fp32(t) for t in moved])

    g = ctx.gm.graph
    if site.flavour == "module":
        grp = Group(record, spec=weakref.ref(site.module))
        if site.x_wrapper is None:
            with g.inserting_before(site.node):
                x2 = g.call_function(Bound(bn_module_fp32, grp), (site.x,))
            site.node.replace_input_with(site.x, x2)
    elif ctx.is_dynamo:
        # Dynamo: compile for fp32 inputs from the start (see the module
        # docstring); nothing runs per call.
        for r in half:
            ctx.compile_example(site.args[r], _fp32_example(tensors[r]))
        record.detail["compiled_for"] = "float32 inputs (no per-call work)"
        record.stats.pop("fp32_calls", None)
    else:
        grp = Group(record, spec=tuple(site.refs[r].name if site.refs[r] else r for r in ROLES))
        pos = BN_FUNCTIONS[site.node.target]
        first = True
        for r in half:
            if site.wrapped[r]:
                continue
            with g.inserting_before(site.node):
                # the first wrapper of a batch norm bumps its call counter
                w = g.call_function(Bound(bn_fp32, grp), (ROLES.index(r), site.args[r], first))
            first = False
            _set(site.node, pos, r, w)


_capture.install_item_break_probe(note_item_break)
