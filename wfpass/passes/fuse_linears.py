"""Sibling-linear fusion (Q/K/V, gate/up): one GEMM over one weight block.

Before (three linears reading the same ``x``)::

    q = linear(x, q_w, q_b); k = linear(x, k_w, None); v = linear(x, v_w, v_b)

After, when the group computes on the fused path (see ``fused_linear.py``)::

    w = as_strided(q_w, (dq + dk + dv, d_in), (d_in, 1), 0)    # the block: a view of q_w's storage
    b = bias_vector([dq, dk, dv], [True, False, True], q_b, v_b)   # k has no bias
    y = fused_linear(x, w, b, spec, q_w, k_w, v_w, q_b, v_b)
    q, k, v = split(y, [dq, dk, dv], -1)

The parameters are moved into the block when the graph is compiled; another
parameter set meeting the same graph is moved on its first call
(``runtime.guarded_call``).

On the split path (large M, where one GEMM gains nothing here) the graph is
left as it was; the storage is fused either way, which costs nothing and lets
each shape take the faster path.

Guards, each a skip record when it fails: the weight resolves to a model
Parameter/buffer; same dtype, device and in_features as the group; bias dtype
equal to the weight's; no member's weight or bias shared with another tensor
(ties stay tied); no member written in place inside the graph (a hook or
``clamp_`` in forward: ``graph.mutated_state``); no member depends on another
member's output (networkx proves the fused node creates no cycle); at least
``min_group_size`` left.
"""
from __future__ import annotations

import operator
from collections import defaultdict
from typing import Dict, List, Optional, Sequence

import networkx as nx
import torch
import torch.fx as fx

from ..graph import LinearSite, PassContext, linear_sites, rows_of
from ..ops.fused_linear import EagerBlock, EagerLayoutCheck, LinearLayout, bias_vector, fused_linear
from ..ops.linear_already_fused import report_already_fused as _report_already_fused
from ..runtime import GroupSite, note
from ..storage import FusedStorage, fuse, fused_storage_of, layout_of_set, re_fuse, sharing_problem

__all__ = ["fuse_linears"]

def _dependency_graph(gm: fx.GraphModule) -> nx.DiGraph:
    g = nx.DiGraph()
    for n in gm.graph.nodes:
        g.add_node(n)
        for u in n.users:
            g.add_edge(n, u)
    return g


def _fusion_keeps_dag(dep: nx.DiGraph, members: Sequence[fx.Node]) -> bool:
    """Would contracting ``members`` into one node create a cycle? It does iff
    some member reaches another through a path (a data dependence)."""
    contracted = dep.copy()
    keep = members[0]
    for m in members[1:]:
        contracted = nx.contracted_nodes(contracted, keep, m, self_loops=False, copy=False)
    return nx.is_directed_acyclic_graph(contracted)


def _member_problem(ctx: PassContext, site: LinearSite) -> Optional[str]:
    w = site.weight
    if w is None:
        return "weight is not a tensor the pass can resolve (computed in the graph?)"
    if not w.is_state:
        return f"weight {w.name} is not a Parameter or buffer of the model (a graph input or computed tensor)"
    if w.tensor.dim() != 2:
        return f"weight {w.name} is not 2-D"
    if site.has_bias:
        b = site.bias
        if b is None or not b.is_state:
            return "bias is not a Parameter or buffer of the model"
        if b.tensor.dtype != w.tensor.dtype or b.tensor.device != w.tensor.device:
            return f"bias {b.name} has dtype/device {b.tensor.dtype}/{b.tensor.device}, weight has {w.tensor.dtype}/{w.tensor.device}"
    return None


def _written(site: LinearSite, written) -> Optional[str]:
    for r in (site.weight, site.bias):
        if r is not None and r.node is not None and r.node in written:
            return (f"{r.name} is written in place inside the graph by {written[r.node]} (a hook or an in-place op "
                    f"in forward): the fused GEMM would read the block while the write goes to the parameter; left unfused")
    return None


def _skip(ctx: PassContext, why: str, sites: Sequence[LinearSite]) -> None:
    """A skip record, filed under the tensors it concerns (``wfpass.report(model)``)."""
    rec = ctx.report.add("linear", "skipped", why, _params(sites))
    refs = [r for s in sites for r in ((s.weight, s.bias) if s.has_bias else (s.weight,)) if r is not None]
    note(rec, [r.name for r in refs], [r.tensor for r in refs])


def _params(sites: Sequence[LinearSite]) -> List[str]:
    out = []
    for s in sites:
        out.append(s.weight.name if s.weight else s.node.name)
        if s.has_bias and s.bias is not None:
            out.append(s.bias.name)
    return out


def _choose_path(ctx: PassContext, x: fx.Node) -> tuple:
    mode = ctx.config.linear_path
    m = rows_of(x)
    if mode != "auto":
        return mode, f"linear_path={mode!r}"
    if m is None and not ctx.is_dynamo:
        # A traced graph without shapes (``wfpass.apply`` of symbolic_trace).
        return "fused", "rows unknown (no shapes in the graph): fused GEMM"
    if m is None:
        # A symbolic row count: one graph serves every M. Measured on the
        # decoder benchmark (docs/targets.md), the one GEMM was not reliably
        # faster at M = 1 and lost at M = 8 to 64, so such a graph keeps the
        # separate GEMMs (over views of the block).
        return "split", "rows symbolic: one GEMM per member over views of the fused block"
    if m <= ctx.config.fused_max_rows:
        return "fused", f"M={m} <= fused_max_rows={ctx.config.fused_max_rows}: one GEMM"
    return "split", f"M={m} > fused_max_rows={ctx.config.fused_max_rows}: one GEMM per member over views of the fused block"


def fuse_linears(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Fuse sibling linears in ``gm``; returns the number of groups rewritten."""
    by_input: Dict[fx.Node, List[LinearSite]] = defaultdict(list)
    for site in linear_sites(ctx):
        by_input[site.x].append(site)

    dep = None
    rewritten = 0
    written = ctx.written_state()
    for x, sites in by_input.items():
        if len(sites) < 2:
            continue  # a lone linear is not a pattern: nothing to report
        ok: List[LinearSite] = []
        for s in sites:
            why = _member_problem(ctx, s) or _written(s, written)
            if why:
                _skip(ctx, why, [s])
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
            _skip(ctx, f"the same weight {s.weight.name} is used by two linears of this group; left unfused so the tie stays", [s])
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
                _skip(ctx, f"dtype/device/in_features {key[0]}/{key[1]}/{key[2]} differ from the siblings' {w.dtype}/{w.device}/{w.shape[1]}", b)

        # Data dependence: add members greedily while the contraction stays a DAG.
        if len(ok) >= 2:
            dep = dep if dep is not None else _dependency_graph(gm)
            chosen: List[LinearSite] = []
            for s in ok:
                if _fusion_keeps_dag(dep, [c.node for c in chosen] + [s.node]):
                    chosen.append(s)
                else:
                    _skip(ctx, "depends on the output of a sibling linear (fusing would create a cycle)", [s])
            ok = chosen

        if len(ok) < ctx.config.min_group_size:
            if ok:
                _skip(ctx, f"group of {len(ok)} left after the checks; min_group_size={ctx.config.min_group_size}", ok)
            continue
        if _rewrite_group(gm, ctx, x, ok, dep):
            rewritten += 1
            dep = None  # the graph changed
    _report_already_fused(gm, ctx, {x for x, sites in by_input.items() if len(sites) >= 2})
    return rewritten


def _storage_problems(ctx: PassContext, sites: Sequence[LinearSite]) -> Dict[int, str]:
    others = [(r.name, r.tensor) for r in ctx.state_tensors()]
    group_tensors = [s.weight.tensor for s in sites] + [s.bias.tensor for s in sites if s.has_bias]
    problems = {}
    for i, s in enumerate(sites):
        refs = [s.weight] + ([s.bias] if s.has_bias else [])
        for r in refs:
            fs = fused_storage_of(r.tensor)
            if fs is not None:
                # Already ours: fine only if it is this very group (idempotence).
                if all(fs.is_member(t) for t in group_tensors if t.untyped_storage().data_ptr() == r.tensor.untyped_storage().data_ptr()):
                    continue
            why = sharing_problem(r.tensor, r.name, others, allowed=group_tensors if fs is not None else ())
            if why:
                problems[i] = why
                break
    return problems


def _reuse(tensors: Sequence[torch.Tensor], key) -> Optional[FusedStorage]:
    """The layout of these very tensors, if they have one: intact (a
    recompile, an idempotent re-run), or lost (``param.data = ...``, a cast and
    back) and fused again now, counted on its record, which stays the group's
    record. The sharing checks have run."""
    fs = layout_of_set(tensors, key)
    if fs is None or fs.intact():
        return fs
    if fs.holds(tensors) or not re_fuse(fs, tensors):
        return None
    if fs.record is not None:
        fs.record.bump("refused")
    return fs


def _rewrite_group(gm: fx.GraphModule, ctx: PassContext, x: fx.Node, sites: List[LinearSite], dep) -> bool:
    problems = _storage_problems(ctx, sites)
    for i, why in problems.items():
        _skip(ctx, why, [sites[i]])
    sites = [s for i, s in enumerate(sites) if i not in problems]
    if len(sites) < ctx.config.min_group_size:
        if sites:
            _skip(ctx, f"group of {len(sites)} left after the sharing checks; min_group_size={ctx.config.min_group_size}", sites)
        return False

    # Keep graph order so the block's rows read like the model's attributes.
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    sites.sort(key=lambda s: order[s.node])
    sizes = tuple(s.out_features for s in sites)
    has_bias = tuple(s.has_bias for s in sites)
    path, why = _choose_path(ctx, x)
    weights = [s.weight.tensor for s in sites]
    layout = LinearLayout(sizes, has_bias, weights[0].shape[1])
    w_offsets = layout.w_offsets
    biases = [s.bias.tensor for s in sites if s.has_bias]
    b_offsets = [o for o, hb in zip(layout.b_slots, has_bias) if hb]
    zero_slots = sum(sz for sz, hb in zip(sizes, has_bias) if not hb) if any(has_bias) else 0
    # Biases share one buffer only when every member has one. Zero slots for
    # the others inside that buffer would be written by torch.save (it writes
    # a view's whole storage) and make every checkpoint larger than the plain
    # model's; so a mixed group keeps its biases where they are and its
    # graph builds the bias vector per call (counted as bias_cat_calls).
    fuse_biases = bool(biases) and all(has_bias)
    params = _params(sites)
    detail = dict(path=path, rows=rows_of(x), sizes=list(sizes), zero_bias_slots=zero_slots,
                  extra_bytes=0, bias_layout="one buffer" if fuse_biases else ("per call" if biases else "none"))
    region = ""
    if ctx.region is not None:
        # Inside a higher-order op's body (activation checkpointing): the
        # block is read in the body, so its recomputation in the backward
        # reads the same block.
        detail["region"] = ctx.region
        region = f"; inside a {ctx.region} region" + (
            " (recomputed in the backward from the same block)" if ctx.region == "tag_activation_checkpoint" else "")

    if ctx.config.dry_run:
        ctx.report.add("linear", "rewritten", f"would fuse {len(sites)} linears ({'+'.join(map(str, sizes))} rows); {why}{region} [dry run]", params, **detail)
        return True

    dynamo = ctx.is_dynamo
    w_nodes = [s.weight.node for s in sites]
    b_nodes = [s.bias.node for s in sites if s.has_bias]
    if dynamo and any(n is None or n.op != "placeholder" for n in w_nodes + b_nodes):
        # The per-call layout check reads the parameters from the call's
        # arguments; a parameter baked into the graph as an attribute
        # (torch._dynamo.config.inline_inbuilt_nn_modules=False) has none.
        ctx.report.add("linear", "skipped", "parameters are attributes of the Dynamo graph, not inputs "
                       "(Inductor's freezing=True, or inline_inbuilt_nn_modules=False): the per-call layout check "
                       "cannot see them", params)
        return False

    fs = _reuse(weights, layout.weight_key)
    bfs = _reuse(biases, layout.bias_key) if fuse_biases else None
    bias_note = "" if fuse_biases or not biases else "; bias vector built per call (only some members have a bias)"
    if fs is not None and fs.record is not None and fs.record.pattern == "linear":
        # The same parameters in another graph (a recompile, a graph break):
        # one record, whose counters add up over every graph.
        record = fs.record
        ctx.report.records.append(record)
    else:
        note = "storage already fused (idempotent re-run)" if fs is not None else "weights moved into one block"
        record = ctx.report.add("linear", "rewritten", f"{len(sites)} linears ({'+'.join(map(str, sizes))} rows): {note}; {why}{bias_note}{region}", params, **detail)
    wnames, bnames = [s.weight.name for s in sites], [s.bias.name for s in sites if s.has_bias]
    if fs is None:
        fs = fuse("linear.weight", wnames, weights, w_offsets, layout.total * layout.in_features,
                  key=layout.weight_key, record=record)
    if fuse_biases and bfs is None:
        bfs = fuse("linear.bias", bnames, biases, b_offsets, layout.total, key=layout.bias_key, record=record)
    fs.record = record
    if bfs is not None:
        bfs.record = record
    counters = {"fused": ("fused_calls",), "split": ("split_calls",)}[path]
    if biases and not fuse_biases and path == "fused":
        counters += ("bias_cat_calls",)
    for c in counters + ("fallback_calls", "refused"):
        record.stats.setdefault(c, 0)
    wsite = GroupSite("linear.weight", layout.weight_key, [ctx.placeholder_index(n) for n in w_nodes] if dynamo else (),
                      wnames, w_offsets, layout.total * layout.in_features, record, counters, reads_block=path == "fused")
    extra = []
    if biases and not fuse_biases:
        extra = [(s.bias.name, ctx.placeholder_index(s.bias.node) if dynamo else -1, s.bias.tensor) for s in sites if s.has_bias]
    wsite.adopt(fs, weights, extra)
    bsite = None
    if fuse_biases:
        bsite = GroupSite("linear.bias", layout.bias_key, [ctx.placeholder_index(n) for n in b_nodes] if dynamo else (),
                          bnames, b_offsets, layout.total, record, (), reads_block=path == "fused", partner=wsite)
        bsite.adopt(bfs, biases)
    if dynamo:
        for n in w_nodes + (b_nodes if fuse_biases else []):
            ctx.refakify(n)
        ctx.add_site(wsite)
        if bsite is not None:
            ctx.add_site(bsite)

    g = gm.graph
    first = min((s.node for s in sites), key=lambda n: order[n])
    if not dynamo:
        w_nodes = [s.weight.node if s.weight.node is not None else ctx.get_attr_node(s.weight.name, first) for s in sites]
        b_nodes = [s.bias.node if s.bias.node is not None else ctx.get_attr_node(s.bias.name, first) for s in sites if s.has_bias]
    if path == "split":
        # The graph keeps one linear per member; they read views of the block.
        if not dynamo:
            with g.inserting_before(first):
                g.call_function(EagerLayoutCheck(wsite, "linear_layout_check"), tuple(w_nodes))
                if bsite is not None:
                    g.call_function(EagerLayoutCheck(bsite, "linear_bias_layout_check"), tuple(b_nodes))
        return True

    with g.inserting_before(first):
        if dynamo:
            w_block = g.call_function(torch.as_strided, (w_nodes[0], (layout.total, layout.in_features), (layout.in_features, 1), 0))
        else:
            w_block = g.call_function(EagerBlock(wsite, layout.total, layout.in_features, "linear_weight_block"), tuple(w_nodes))
        b_block = None
        if fuse_biases:
            if dynamo:
                b_block = g.call_function(torch.as_strided, (b_nodes[0], (layout.total,), (1,), 0))
            else:
                b_block = g.call_function(EagerBlock(bsite, layout.total, None, "linear_bias_block"), tuple(b_nodes))
        elif biases:
            b_block = g.call_function(bias_vector, (list(sizes), list(has_bias), *b_nodes))
        y = g.call_function(fused_linear, (x, w_block, b_block, (sizes, has_bias), *w_nodes, *b_nodes))
        parts = g.call_function(torch.split, (y, list(sizes), -1))
        outs = [g.call_function(operator.getitem, (parts, i)) for i in range(len(sites))]
    for s, out in zip(sites, outs):
        out.meta.update({k: v for k, v in s.node.meta.items() if k in ("nn_module_stack", "stack_trace")})
        s.node.replace_all_uses_with(out)
        g.erase_node(s.node)
    return True
