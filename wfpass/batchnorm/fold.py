"""The fold's guard and rewrite: an eval-mode batch norm folded into the
conv/linear in front of it (``FoldSite``). The format's steps and the graph
before and after are described in ``wfpass/batchnorm/fold_format.py``.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Iterator, Optional, Union

import torch
import torch.fx as fx

from ..core.graph import LINEAR_TARGETS, PassContext, meta_value, node_arg, set_node_arg
from ..pipeline import Match
from ..core.runtime import Bound, Group, note
from ..core.storage import first_sharing_problem, first_unmovable, sharing_problem
from .kernels import FoldSpec, bn_module_fp32, fold_bias, fold_module_call, fold_weight, folded_params
from .match import BNSite, batchnorm_sites, unwrap

__all__ = ["FoldSite", "fold_sites", "refusal", "fold"]


CONV_TARGETS = (torch.conv1d, torch.conv2d, torch.conv3d)
CONV_MODULES = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def _only_user_is(producer: fx.Node, site: BNSite) -> bool:
    """The conv/linear output feeds the batch norm and nothing else (looking
    through the fp32 pass's pass-through wrapper)."""
    users = list(producer.users)
    if len(users) != 1:
        return False
    u = users[0]
    if u is site.node:
        return True
    return u.op == "call_function" and getattr(u.target, "fn", None) is bn_module_fp32 and list(u.users) == [site.node]


def _grad_enabled(ctx: PassContext, producer: fx.Node) -> bool:
    v = meta_value(producer)
    if v is not None and getattr(v, "requires_grad", False):
        return True
    return torch.is_grad_enabled() and v is None


def _tied(ctx: PassContext, others, t: torch.Tensor, name: str, node: Optional[fx.Node]) -> Optional[str]:
    """Is the conv/linear tensor shared: the same object under another name
    (``conv2.weight = conv1.weight``), read by another node of the graph, or
    sharing storage with another tensor?"""
    for oname, o in others:
        if o is t and oname != name:
            return f"{name} is also {oname}"
    if isinstance(node, fx.Node) and node.op == "placeholder" and len(node.users) > 1:
        return f"{name} is read by {len(node.users)} nodes of the graph"
    return sharing_problem(t, name, others)


_BN_TENSORS = ("running_mean", "running_var", "weight", "bias")


class _Run:
    """What one run's matches share: the tensors the graph writes in place
    (read before any fold)."""

    def __init__(self, ctx: PassContext):
        self.written = ctx.written_state()


class FoldSite(Match):
    """A batch norm and the node in front of it: ``kind`` is "conv" or
    "linear" when that node is one (else None, and the guard says so)."""

    def __init__(self, site: BNSite, kind: Optional[str], run: _Run):
        super().__init__(site.names, folded=False, flavour=site.flavour)
        self.site, self.prod, self.kind, self.run = site, site.x, kind, run
        # The conv/linear's tensors, set by the guard:
        self.layer: Optional[torch.nn.Module] = None  # call_module flavour
        self.w_t = self.b_t = None
        self.w_name = self.b_name = None
        self.w_node = self.b_node = None  # function flavour
        self.reason = ""  # the rewritten row's


def _kind(ctx: PassContext, prod: fx.Node) -> Optional[str]:
    if prod.op == "call_function" and prod.target in CONV_TARGETS:
        return "conv"
    if prod.op == "call_function" and prod.target in LINEAR_TARGETS:
        return "linear"
    if prod.op == "call_module":
        mod = ctx.module_of(prod)
        if type(mod) in CONV_MODULES:
            return "conv"
        if type(mod) is torch.nn.Linear:
            return "linear"
    return None


def fold_sites(ctx: PassContext) -> Iterator[FoldSite]:
    """Every batch norm of the graph (``batchnorm_sites``) with the kind of
    node in front of it."""
    run = _Run(ctx)
    for site in batchnorm_sites(ctx):
        yield FoldSite(site, _kind(ctx, site.x), run)


def _batchnorm_problem(m: FoldSite, ctx: PassContext) -> Optional[str]:
    """Why the batch norm itself cannot be folded: no conv/linear in front,
    training mode, a non-constant eps, no running statistics, grad enabled,
    other users of the layer's output, statistics that are not model state."""
    site, prod, kind = m.site, m.prod, m.kind
    if kind is None:
        what = prod.target if prod.op != "placeholder" else "a graph input"
        return f"its input is not a conv1d/2d/3d or linear output ({getattr(what, '__name__', what)})"
    if site.training is not False:
        return ("BatchNorm in training mode (folding is inference only: eval mode and no grad)" if site.training is True
                else "training flag is not a constant")
    if not isinstance(site.eps, (int, float)) or isinstance(site.eps, bool):
        return "eps is not a constant"
    if not (site.present["running_mean"] and site.present["running_var"]):
        return "no running statistics (track_running_stats=False): eval uses batch statistics"
    if site.flavour == "function" and ctx.is_dynamo and _grad_enabled(ctx, prod):
        return "grad is enabled (folding is inference only: run under torch.no_grad() or inference_mode())"
    if not _only_user_is(prod, site):
        return f"the {kind} output has other users ({len(prod.users)}); folding would change what they see"
    unresolved = [r for r in _BN_TENSORS if site.present[r] and (site.refs[r] is None or not site.refs[r].is_state)]
    if unresolved:
        return f"BatchNorm {', '.join(unresolved)} not a Parameter or buffer of the model"
    return None


@dataclasses.dataclass
class _Layer:
    """The conv/linear's weight and bias: tensors, names and (function
    flavour) the graph nodes that read them."""

    w_t: torch.Tensor
    b_t: Optional[torch.Tensor]
    w_name: str
    b_name: Optional[str]
    w_node: Any = None
    b_node: Any = None


def _layer_tensors(m: FoldSite, ctx: PassContext) -> Union[_Layer, str]:
    """The conv/linear's weight and bias (a module call sets ``m.layer``),
    or why they cannot be had: extra arguments, tensors that are not model
    state, a layer and a batch norm of different flavours."""
    site, prod, kind = m.site, m.prod, m.kind
    if site.flavour == "module" and prod.op == "call_module":
        if len(prod.args) != 1 or prod.kwargs:
            return f"the {kind} module is called with extra arguments"
        m.layer = layer = ctx.module_of(prod)
        return _Layer(layer.weight, layer.bias, f"{prod.target}.weight", f"{prod.target}.bias")
    if prod.op == "call_function" and site.flavour == "function":
        w_node, b_node = node_arg(prod, 1, "weight"), node_arg(prod, 2, "bias")
        w_ref = ctx.resolve(w_node)
        b_ref = ctx.resolve(b_node) if b_node is not None else None
        if w_ref is None or not w_ref.is_state or (b_node is not None and (b_ref is None or not b_ref.is_state)):
            return f"the {kind}'s weight/bias is not a Parameter or buffer of the model"
        return _Layer(w_ref.tensor, (b_ref.tensor if b_ref else None), w_ref.name, b_ref.name if b_ref else None,
                      w_node, b_node)
    return "conv/linear and BatchNorm in different flavours (module vs functional call)"


def _layer_problem(m: FoldSite, ctx: PassContext, layer: _Layer) -> Optional[str]:
    """Why the layer's output cannot take the fold: a transposed conv; in a
    function-flavour graph, an output of unknown rank, a tensor written in
    place in the graph, or (Dynamo) tensors that are not graph inputs."""
    site, prod, kind, w_t = m.site, m.prod, m.kind, layer.w_t
    if kind == "conv" and (w_t.dim() < 3 or (prod.op == "call_module" and m.layer.transposed)):
        return "transposed or unexpected conv weight"
    if site.flavour != "function":
        return None
    # BatchNorm normalizes dim 1; the fold scales the layer's output
    # channels (conv: dim 1 when batched; linear: the last dim).
    v = meta_value(prod)
    want = 2 if kind == "linear" else w_t.dim()
    if v is None or v.dim() != want:
        what = "2-D" if kind == "linear" else f"a batched {w_t.dim() - 2}-d conv output"
        return f"the {kind} output is not known to be {what} (BatchNorm over its output channels)"
    srcs = [layer.w_node, layer.b_node] + [site.args[r] for r in _BN_TENSORS]
    written = m.run.written
    hit = next((unwrap(n) for n in srcs if isinstance(n, fx.Node) and unwrap(n) in written), None)
    if hit is not None:
        # The fold is computed in front of the conv; a write between
        # them (a BatchNorm pre-hook, clamp_ in forward) would come after it.
        return f"{hit.name} is written in place inside the graph by {written[hit]}: the fold would read it before the write"
    if ctx.is_dynamo and any(isinstance(n, fx.Node) and unwrap(n).op != "placeholder" for n in srcs):
        return "the conv/BatchNorm tensors are not all inputs of this Dynamo graph"
    return None


def _sharing_problem(m: FoldSite, ctx: PassContext, layer: _Layer) -> Optional[str]:
    """Why the tensors cannot be replaced: one that cannot be moved (a
    DTensor, a subclass), or one tied to another tensor. From here on the
    rows name the layer's tensors too (sets ``m.params``)."""
    site, w_t, b_t, w_name, b_name = m.site, layer.w_t, layer.b_t, layer.w_name, layer.b_name
    layer_names = [w_name] + ([b_name] if b_t is not None else [])
    others = ctx.named_state()
    # A DTensor, another subclass or an FSDP2 parameter: not a tie, and
    # never folded (the fold would compute on one rank's shard).
    bn_tensors = [(site.refs[r].name, site.refs[r].tensor) for r in _BN_TENSORS if site.present[r]]
    m.params = layer_names + site.names  # the rows from here on name the layer's tensors too
    problem = first_unmovable([(w_name, w_t), (b_name, b_t)] + bn_tensors)
    if problem:
        return problem
    for name, t, n in [(w_name, w_t, layer.w_node), (b_name, b_t, layer.b_node)]:
        if t is not None:
            problem = _tied(ctx, others, t, name, n)
            if problem:
                break
    problem = problem or first_sharing_problem(bn_tensors, others)
    if problem:
        return f"tied weights: {problem}"
    return None


def _take(m: FoldSite, ctx: PassContext, layer: _Layer) -> None:
    """Record on a folded ``m`` the layer's tensors, its details, the
    ``rewritten`` row's reason and the dry run's plan."""
    site, kind, w_t, b_t, w_name = m.site, m.kind, layer.w_t, layer.b_t, layer.w_name
    m.w_t, m.b_t, m.w_name, m.b_name = w_t, b_t, w_name, layer.b_name
    m.w_node, m.b_node = layer.w_node, layer.b_node
    out_ch = w_t.shape[0]
    extra = w_t.numel() * w_t.element_size() + out_ch * (b_t.element_size() if b_t is not None else w_t.element_size())
    into = w_name.rpartition(".")[0] or w_name
    m.detail.update(folded=True, into=into, kind=kind, extra_bytes=extra)
    when = "eval, no grad" if site.flavour == "function" else "eval now; train/eval and grad checked per call"
    m.reason = (f"folded into {kind} {into} ({when}): weight and bias recomputed in fp32 and cast to "
                f"{str(w_t.dtype).replace('torch.', '')}; new tensors, +{extra} bytes")
    if ctx.is_dynamo:
        # Measured (docs/fold_results.md): recomputing the fold on every
        # call costs more than the BatchNorm it removes.
        m.reason += ("; computed on every call, which measured slower than not folding (bf16 ResNet: "
                     "0.60-0.93x as fast with Inductor, 0.35-0.81x without; docs/batchnorm.md)")
    m.plan = f"would be {m.reason}"


def refusal(m: FoldSite, ctx: PassContext) -> Optional[str]:
    """Why ``m`` is not folded (a row naming the conv/linear's tensors sets
    ``m.params``), or None: then ``m`` holds the layer's tensors, the row's
    reason and details. The batch norm is checked first, then the layer's
    tensors are found and checked, then whether they can be replaced."""
    why = _batchnorm_problem(m, ctx)
    if why is not None:
        return why
    layer = _layer_tensors(m, ctx)
    if isinstance(layer, str):
        return layer
    why = _layer_problem(m, ctx, layer)
    if why is None:
        why = _sharing_problem(m, ctx, layer)
    if why is not None:
        return why
    _take(m, ctx, layer)
    return None


def fold(m: FoldSite, ctx: PassContext) -> None:
    """The rewrite of a folded ``m`` and its ``rewritten`` row."""
    site, prod, kind = m.site, m.prod, m.kind
    w_t, b_t, w_name, b_name = m.w_t, m.b_t, m.w_name, m.b_name
    record = ctx.report.add("batchnorm", "rewritten", m.reason, m.params, **m.detail)
    refs = [r for r in site.refs.values() if r is not None]
    note(record, [w_name] + ([b_name] if b_t is not None else []) + [r.name for r in refs],
         [w_t] + ([b_t] if b_t is not None else []) + [r.tensor for r in refs])
    record.stats.setdefault("folded_calls", 0)
    g = ctx.gm.graph

    if site.flavour == "module":
        grp = Group(record, spec=FoldSpec(site.eps, kind, (m.layer, site.module)))
        x_in = prod.args[0]
        with g.inserting_before(site.node):
            y = g.call_function(Bound(fold_module_call, grp), (x_in,))
        y.meta.update({k: v for k, v in site.node.meta.items() if k in ("nn_module_stack", "stack_trace")})
        site.node.replace_all_uses_with(y)
        wrapper = site.x_wrapper
        g.erase_node(site.node)
        if wrapper is not None and not wrapper.users:
            g.erase_node(wrapper)
        if not prod.users:
            g.erase_node(prod)
        return

    grp = Group(record, spec=FoldSpec(site.eps, kind))

    def src(n: Any) -> Any:
        # A get_attr may sit after the conv (symbolic_trace puts them just
        # before their first use): fetch it again in front of the conv.
        n = unwrap(n)
        if isinstance(n, fx.Node) and n.op == "get_attr":
            return ctx.get_attr_node(n.target, prod)
        return n

    fargs = (src(m.w_node), src(m.b_node), src(site.args["running_mean"]), src(site.args["running_var"]),
             src(site.args["weight"]), src(site.args["bias"]))
    with g.inserting_before(prod):
        if ctx.is_dynamo:
            # In the graph: a few elementwise ops on the weight that the
            # compiler sees and fuses, recomputed per call from the live
            # statistics; nothing cached outside the graph.
            pair = g.call_function(folded_params, (site.eps, *fargs))
            wf = g.call_function(operator.getitem, (pair, 0))
            bf = g.call_function(operator.getitem, (pair, 1))
            record.stats.pop("folded_calls", None)
            record.detail["computed"] = "in the graph, per call"
        else:
            wf = g.call_function(Bound(fold_weight, grp), fargs)
            bf = g.call_function(Bound(fold_bias, grp), fargs)
    set_node_arg(prod, 1, "weight", wf)
    # The folded bias goes into the conv/linear even where it had none:
    # the kernel adds it to the fp32 accumulator before rounding once (an
    # add after a bf16 output would round ``y * s`` first, then cancel
    # most of it against ``-mean * s``). Inductor's channels-last oneDNN
    # conv took the bias at no measurable cost here.
    set_node_arg(prod, 2, "bias", bf)
    site.node.replace_all_uses_with(prod)
    g.erase_node(site.node)
