"""The sibling-linear format's guards: which members of a group are left
out (``narrow_group``), whether the rest is fused (``group_problem``), and
on which path (``choose_path``). Each reason is the text of a ``skipped``
row; nothing here changes the graph or a tensor (a taken group gets its
path, sorted members and plan recorded on the match, for the rewrite).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

import networkx as nx
import torch.fx as fx

from ..core.graph import PassContext
from ..core.storage import first_sharing_problem, fused_storage_of
from .match import LinearGroup, LinearSite, rows_of, site_params
from .site import rows_reader, weight_not_2d, weight_ref_problem, written_in_place

__all__ = ["narrow_group", "group_problem", "choose_path", "fusion_keeps_dag"]


def fusion_keeps_dag(dep: nx.DiGraph, members: Sequence[fx.Node]) -> bool:
    """Would contracting ``members`` into one node create a cycle? It does iff
    some member reaches another through a path (a data dependence)."""
    contracted = dep.copy()
    keep = members[0]
    for m in members[1:]:
        contracted = nx.contracted_nodes(contracted, keep, m, self_loops=False, copy=False)
    return nx.is_directed_acyclic_graph(contracted)


def member_problem(ctx: PassContext, site: LinearSite) -> Optional[str]:
    w = site.weight
    why = weight_ref_problem(w)
    if why is not None:
        return why
    if w.tensor.dim() != 2:
        return weight_not_2d(w)
    if site.has_bias:
        b = site.bias
        if b is None or not b.is_state:
            return "bias is not a Parameter or buffer of the model"
        if b.tensor.dtype != w.tensor.dtype or b.tensor.device != w.tensor.device:
            return f"bias {b.name} has dtype/device {b.tensor.dtype}/{b.tensor.device}, weight has {w.tensor.dtype}/{w.tensor.device}"
    return None


def written_problem(site: LinearSite, written) -> Optional[str]:
    return written_in_place((site.weight, site.bias), written,
                            "the fused GEMM would read the block while the write goes to the parameter; left unfused")


def storage_problems(ctx: PassContext, sites: Sequence[LinearSite]) -> Dict[int, str]:
    """The members whose weight or bias shares storage with another tensor
    (a tie, an alias the user holds). Tensors already fused by wfpass are
    fine only where they sit in this very group's block (a re-run)."""
    others = ctx.named_state()
    group_tensors = [s.weight.tensor for s in sites] + [s.bias.tensor for s in sites if s.has_bias]
    problems = {}
    for i, s in enumerate(sites):
        for r in [s.weight] + ([s.bias] if s.has_bias else []):
            fs = fused_storage_of(r.tensor)
            if fs is not None and all(fs.is_member(t) for t in group_tensors
                                      if t.untyped_storage().data_ptr() == r.tensor.untyped_storage().data_ptr()):
                continue
            why = first_sharing_problem([(r.name, r.tensor)], others, allowed=group_tensors if fs is not None else ())
            if why:
                problems[i] = why
                break
    return problems


def per_call_problem(ctx: PassContext, x: fx.Node) -> Optional[str]:
    """Why a group over ``x``, whose row count is symbolic, cannot choose
    its path per call; None if it can."""
    # The choice is one op (``wfpass::linear_by_rows``) that reads M off its
    # input at run time: a checkpointed region replays it like any op, and
    # M may be any expression of the graph's sizes. The runtime check
    # counts each call on its path from the graph's inputs, so those must
    # give M.
    if rows_reader(x, ctx.example_inputs) is None:
        return "not read from the graph's inputs"
    return None


def choose_path(ctx: PassContext, x: fx.Node) -> tuple:
    mode = ctx.config.linear.path
    m = rows_of(x)
    if mode != "auto":
        return mode, f"linear.path={mode!r}"
    if m is None and not ctx.is_dynamo:
        # A traced graph without shapes (``wfpass.apply`` of symbolic_trace).
        return "fused", "rows unknown (no shapes in the graph): fused GEMM"
    if m is None:
        # A symbolic row count: one graph serves every M, so it picks per
        # call, as a static graph of that M would (``kernel.by_rows``), and
        # the backend counts each call on its path from the M it reads from
        # the call's inputs. Where it cannot (``per_call_problem``), the
        # graph keeps the separate GEMMs (over views of the block).
        why = per_call_problem(ctx, x)
        if why is not None:
            return "split", f"rows symbolic, {why}: one GEMM per member over views of the fused block"
        return "by_rows", (f"rows symbolic: chosen per call, one GEMM at M <= fused_max_rows="
                           f"{ctx.config.linear.fused_max_rows} (fused_calls), else one GEMM per member over views "
                           "of the fused block (split_calls)")
    if m <= ctx.config.linear.fused_max_rows:
        return "fused", f"M={m} <= fused_max_rows={ctx.config.linear.fused_max_rows}: one GEMM"
    return "split", f"M={m} > fused_max_rows={ctx.config.linear.fused_max_rows}: one GEMM per member over views of the fused block"


def narrow_group(m: LinearGroup, ctx: PassContext) -> Tuple[Optional[LinearGroup], List[Tuple[LinearGroup, str]]]:
    """The members left out of ``m``, each with its reason, and the group of
    the rest (None when none is left). Decides; changes nothing."""
    out: List[Tuple[LinearGroup, str]] = []

    def leave(sites: Sequence[LinearSite], why: str) -> None:
        out.append((m.part(sites), why))

    ok: List[LinearSite] = []
    for s in m.sites:
        why = member_problem(ctx, s) or written_problem(s, m.run.written)
        if why:
            leave([s], why)
        else:
            ok.append(s)
    # The same Parameter twice in one group cannot sit at two offsets.
    seen: Dict[int, LinearSite] = {}
    dup = set()
    for s in ok:
        if id(s.weight.tensor) in seen:
            dup.add(id(s.weight.tensor))
        seen.setdefault(id(s.weight.tensor), s)
    for s in [s for s in ok if id(s.weight.tensor) in dup]:
        leave([s], f"the same weight {s.weight.name} is used by two linears of this group; left unfused so the tie stays")
    ok = [s for s in ok if id(s.weight.tensor) not in dup]

    # Partition by what one GEMM needs to agree on.
    buckets: Dict[tuple, List[LinearSite]] = defaultdict(list)
    for s in ok:
        w = s.weight.tensor
        buckets[(w.dtype, w.device, w.shape[1])].append(s)
    ok = max(buckets.values(), key=len) if buckets else []
    for key, b in buckets.items():
        if b is not ok:
            w = ok[0].weight.tensor
            leave(b, f"dtype/device/in_features {key[0]}/{key[1]}/{key[2]} differ from the siblings' {w.dtype}/{w.device}/{w.shape[1]}")

    # Data dependence: add members greedily while the contraction stays a DAG.
    if len(ok) >= 2:
        chosen: List[LinearSite] = []
        for s in ok:
            if fusion_keeps_dag(m.run.dep, [c.node for c in chosen] + [s.node]):
                chosen.append(s)
            else:
                leave([s], "depends on the output of a sibling linear (fusing would create a cycle)")
        ok = chosen
    if len(ok) < ctx.config.linear.min_group_size:
        return (m.part(ok) if ok else None), out

    problems = storage_problems(ctx, ok)
    for i, why in problems.items():
        leave([ok[i]], why)
    ok = [s for i, s in enumerate(ok) if i not in problems]
    return (m.part(ok, "the sharing checks") if ok else None), out


def group_problem(m: LinearGroup, ctx: PassContext) -> Optional[str]:
    """Why the group left after ``narrow_group`` is not fused, or None; a
    taken group gets its path (one GEMM or one per member), its row's
    detail and its dry-run plan."""
    if len(m.sites) < ctx.config.linear.min_group_size:
        return f"group of {len(m.sites)} left after {m.checked}; min_group_size={ctx.config.linear.min_group_size}"
    if ctx.is_dynamo and any(r.node is None or r.node.op != "placeholder" for r in m.refs()):
        # The per-call layout check reads the parameters from the call's
        # arguments; a parameter baked into the graph as an attribute
        # (torch._dynamo.config.inline_inbuilt_nn_modules=False) has none.
        return ("parameters are attributes of the Dynamo graph, not inputs (Inductor's freezing=True, or "
                "inline_inbuilt_nn_modules=False): the per-call layout check cannot see them")
    # Keep graph order so the block's rows read like the model's attributes.
    order = {n: i for i, n in enumerate(m.run.gm.graph.nodes)}
    m.sites.sort(key=lambda s: order[s.node])
    m.params = site_params(m.sites)
    sizes = tuple(s.out_features for s in m.sites)
    has_bias = tuple(s.has_bias for s in m.sites)
    m.path, m.why = choose_path(ctx, m.x)
    # Biases share one buffer only when every member has one. Zero slots for
    # the others inside that buffer would be written by torch.save (it writes
    # a view's whole storage) and make every checkpoint larger than the plain
    # model's; so a mixed group keeps its biases where they are and its
    # graph builds the bias vector per call (counted as bias_cat_calls).
    m.fuse_biases = all(has_bias)
    zero_slots = sum(sz for sz, hb in zip(sizes, has_bias) if not hb) if any(has_bias) else 0
    m.detail = dict(path=m.path, rows=rows_of(m.x), sizes=list(sizes), zero_bias_slots=zero_slots, extra_bytes=0,
                    bias_layout="one buffer" if m.fuse_biases else ("per call" if any(has_bias) else "none"))
    m.region = ""
    if ctx.region is not None:
        # Inside a higher-order op's body (activation checkpointing): the
        # block is read in the body, so its recomputation in the backward
        # reads the same block.
        m.detail["region"] = ctx.region
        m.region = f"; inside a {ctx.region} region" + (
            " (recomputed in the backward from the same block)" if ctx.region == "tag_activation_checkpoint" else "")
    m.plan = f"would fuse {len(m.sites)} linears ({'+'.join(map(str, sizes))} rows); {m.why}{m.region}"
    return None
