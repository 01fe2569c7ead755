"""The fp32-state format's guard and rewrite for the graph's own batch norms
(``BatchNormCall``): which half-precision BatchNorms get fp32 weight, bias
and running statistics, and how each flavour's graph is made ready for them.
The format's steps and the graph before and after are described in
``wfpass/batchnorm/fp32_format.py``; the BatchNorms Dynamo runs eagerly are
``eager.py``'s, which shares ``ddp_problem`` from here.
"""
from __future__ import annotations

import weakref
from typing import Dict, Iterator, List, Optional

import torch
import torch.fx as fx

from .._torch import distributed as _distributed
from ..core.graph import PassContext, meta_value
from ..pipeline import Match
from ..core.runtime import Bound, Group, note
from ..core.storage import first_sharing_problem
from .kernels import HALF, ROLES, bn_fp32, bn_module_fp32, held_in_fp32, to_fp32
from .match import BNSite, batchnorm_sites, set_arg, unwrap

__all__ = ["BatchNormCall", "batchnorm_calls", "call_problem", "rewrite_call", "ddp_problem", "dtype_name"]


def dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def ddp_problem(tensors: List[torch.Tensor], held: set) -> Optional[str]:
    """Why these tensors' dtype must stay, if they belong to the
    DistributedDataParallel being compiled (``held``: ``_distributed.ddp_tensors()``,
    read once per pass)."""
    if not any(id(t) in held for t in tensors):
        return None
    return ("held by the DistributedDataParallel being compiled, which was built while they were half precision: "
            "its reducer hooks each Parameter's gradient accumulator, and changing the dtype replaces it, so the "
            "gradients would no longer be all-reduced. Take the format before wrapping (one compiled call of the "
            "model, then DDP(model)), or move the BatchNorm to fp32 yourself")


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
    and the graph's batch norms (read once per pass, not per BatchNorm)."""

    def __init__(self, sites: List[BNSite]):
        self.ddp_held = _distributed.ddp_tensors()
        self.bn_nodes = {site.node for site in sites}


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


def batchnorm_calls(ctx: PassContext) -> Iterator[BatchNormCall]:
    """Every batch norm of the graph (``batchnorm_sites``), one match each."""
    sites = batchnorm_sites(ctx)
    run = _Run(sites)
    for site in sites:
        yield BatchNormCall(site, run)


def call_problem(m: BatchNormCall, ctx: PassContext) -> Optional[str]:
    """Why ``m``'s tensors stay as they are, or None: then ``m`` holds the
    roles to move (or ``m.held``: already fp32 by wfpass), its plan and details."""
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
    m.detail["input_dtype"] = dtype_name(in_dtype) if in_dtype is not None else None
    if in_dtype is not None and in_dtype not in HALF:
        return f"input is {dtype_name(in_dtype)}: the fp32-statistics format is for fp16/bf16 inputs, nothing to do"
    half = [r for r in present if tensors[r].dtype in HALF]
    if not half:
        if all(held_in_fp32(t) for t in tensors.values()):
            # A recompile (or a second apply) after wfpass already moved them:
            # taken, its row says so (``rewrite_call``).
            m.held = True
            m.plan = "weight/bias/statistics already held in fp32 by wfpass (recompiled or re-run graph); mixed-precision kernel"
            m.detail = dict(idempotent=True, **m.detail)
            return None
        if dtypes == {torch.float32}:
            ctx_note = "under torch.autocast with fp32 parameters" if _under_autocast(ctx) else "the model keeps its BatchNorm in fp32"
            in_note = dtype_name(in_dtype) if in_dtype is not None else "its"
            return f"weight/bias/statistics are already float32 ({ctx_note}); the mixed kernel already runs with {in_note} input, nothing to change"
        return f"tensors are {sorted(dtype_name(d) for d in dtypes)}, not fp16/bf16: not this format"

    problem = first_sharing_problem([(site.refs[r].name, tensors[r]) for r in half], ctx.named_state())
    problem = problem or ddp_problem([tensors[r] for r in half], m.run.ddp_held)
    if problem:
        return problem
    if ctx.is_dynamo and site.flavour == "function" and not all(
            isinstance(site.args[r], fx.Node) and unwrap(site.args[r]).op == "placeholder" for r in half):
        return "a BatchNorm tensor is not an input of this Dynamo graph (get_attr): its dtype is baked into the compiled code"
    reader = _other_reader(ctx, site, half, m.run.bn_nodes)
    if reader:
        return reader

    src = dtype_name(tensors[half[0]].dtype)
    m.tensors, m.half = tensors, half
    m.ins = dtype_name(in_dtype) if in_dtype is not None else src
    extra = sum(tensors[r].numel() * 2 for r in half)  # fp32 is 2 bytes more per element
    m.detail.update(from_dtype=src, cast=[site.refs[r].name for r in half], extra_bytes=extra)
    m.plan = f"would hold {', '.join(half)} in float32 for {m.ins} input"
    return None


def rewrite_call(m: BatchNormCall, ctx: PassContext) -> None:
    """Hold the site's half tensors in fp32 (a deferred move) and make its
    graph ready for them (see ``wfpass/batchnorm/fp32_format.py``, per
    flavour); a match already held in fp32 gets its row only."""
    if m.held:
        ctx.report.add("batchnorm", "rewritten", m.plan, m.params, **m.detail)
        return
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
        # Dynamo: compile for fp32 inputs from the start (see
        # ``wfpass/batchnorm/fp32_format.py``); nothing runs per call.
        for r in half:
            ctx.compile_example(site.args[r], _fp32_example(tensors[r]))
        record.detail["compiled_for"] = "float32 inputs (no per-call work)"
        record.stats.pop("fp32_calls", None)
    else:
        grp = Group(record, spec=tuple(site.refs[r].name if site.refs[r] else r for r in ROLES))
        first = True
        for r in half:
            if site.wrapped[r]:
                continue
            with g.inserting_before(site.node):
                # the first wrapper of a batch norm bumps its call counter
                w = g.call_function(Bound(bn_fp32, grp), (ROLES.index(r), site.args[r], first))
            first = False
            set_arg(site.node, r, w)
