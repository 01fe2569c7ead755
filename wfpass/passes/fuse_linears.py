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

The steps ``pipeline.drive`` runs:

- ``matches``: the linears reading one input (at least two), then the
  layers that already compute several projections with one weight
  (``ops/linear_already_fused.py``), which are reported and left alone.
- ``narrow``: the members left out of a group, each with its skip row: the
  weight resolves to a model Parameter/buffer; bias dtype equal to the
  weight's; not written in place inside the graph (a hook or ``clamp_`` in
  forward: ``graph.mutated_state``); not the same weight twice; same dtype,
  device and in_features as the largest part of the group; not depending on
  another member's output (networkx proves the fused node creates no cycle);
  no weight or bias shared with another tensor (ties stay tied).
- ``guard``: at least ``min_group_size`` left; the parameters are inputs of
  a Dynamo graph (not attributes baked in by ``freezing=True``); picks the
  path (one GEMM or one per member) from the row count.
- ``apply``: moves the weights into the block and rewrites the graph.
"""
from __future__ import annotations

import operator
from collections import defaultdict
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import networkx as nx
import torch
import torch.fx as fx

from ..graph import LinearSite, PassContext, linear_sites, mutated_state, rows_of
from ..ops.fused_linear import EagerBlock, EagerLayoutCheck, LinearLayout, bias_vector, fused_linear
from ..ops.linear_already_fused import AlreadyFused, already_fused
from ..pipeline import Format, Match
from ..runtime import GroupSite, note
from ..storage import FusedStorage, first_sharing_problem, fuse, fused_storage_of, layout_of_set, re_fuse

__all__ = ["FuseLinears", "LinearGroup"]


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


class _Run:
    """What the groups of one run share: the state written in place in the
    graph, and the graph's dependencies (built when first needed, dropped
    when a rewrite changes the graph)."""

    def __init__(self, gm: fx.GraphModule):
        self.gm, self.written, self._dep = gm, mutated_state(gm), None

    @property
    def dep(self) -> nx.DiGraph:
        if self._dep is None:
            self._dep = _dependency_graph(self.gm)
        return self._dep

    def changed(self) -> None:
        self._dep = None


class LinearGroup(Match):
    """Linears reading the same input ``x``: the members of one block."""

    def __init__(self, x: fx.Node, sites: Sequence[LinearSite], run: _Run, checked: str = "the checks"):
        super().__init__(_params(sites))
        self.x, self.sites, self.run = x, list(sites), run
        # Which checks the members passed, for the min_group_size row.
        self.checked = checked

    def part(self, sites: Sequence[LinearSite], checked: Optional[str] = None) -> "LinearGroup":
        return LinearGroup(self.x, sites, self.run, checked or self.checked)

    def refs(self) -> list:
        return [r for s in self.sites for r in ((s.weight, s.bias) if s.has_bias else (s.weight,)) if r is not None]


class FuseLinears(Format):
    """The sibling-linear format (see the module docstring)."""

    name, pattern = "fuse_linears", "linear"

    def matches(self, gm: fx.GraphModule, ctx: PassContext) -> Iterator[Match]:
        by_input: Dict[fx.Node, List[LinearSite]] = defaultdict(list)
        for site in linear_sites(ctx):
            by_input[site.x].append(site)
        run = _Run(gm)
        grouped = {x for x, sites in by_input.items() if len(sites) >= 2}
        for x in grouped:  # a lone linear is not a pattern: nothing to report
            yield LinearGroup(x, by_input[x], run)
        # Asked after the groups are rewritten: the graph as they left it.
        yield from already_fused(gm, ctx, grouped)

    def narrow(self, m: Match, ctx: PassContext) -> Tuple[Optional[Match], List[Tuple[Match, str]]]:
        if not isinstance(m, LinearGroup):
            return m, []
        out: List[Tuple[Match, str]] = []

        def leave(sites: Sequence[LinearSite], why: str) -> None:
            out.append((m.part(sites), why))

        ok: List[LinearSite] = []
        for s in m.sites:
            why = _member_problem(ctx, s) or _written(s, m.run.written)
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
                if _fusion_keeps_dag(m.run.dep, [c.node for c in chosen] + [s.node]):
                    chosen.append(s)
                else:
                    leave([s], "depends on the output of a sibling linear (fusing would create a cycle)")
            ok = chosen
        if len(ok) < ctx.config.min_group_size:
            return (m.part(ok) if ok else None), out

        problems = _storage_problems(ctx, ok)
        for i, why in problems.items():
            leave([ok[i]], why)
        ok = [s for i, s in enumerate(ok) if i not in problems]
        return (m.part(ok, "the sharing checks") if ok else None), out

    def guard(self, m: Match, ctx: PassContext) -> Optional[str]:
        if isinstance(m, AlreadyFused):
            return m.reason
        if len(m.sites) < ctx.config.min_group_size:
            return f"group of {len(m.sites)} left after {m.checked}; min_group_size={ctx.config.min_group_size}"
        if ctx.is_dynamo and any(r.node is None or r.node.op != "placeholder" for r in m.refs()):
            # The per-call layout check reads the parameters from the call's
            # arguments; a parameter baked into the graph as an attribute
            # (torch._dynamo.config.inline_inbuilt_nn_modules=False) has none.
            return ("parameters are attributes of the Dynamo graph, not inputs (Inductor's freezing=True, or "
                    "inline_inbuilt_nn_modules=False): the per-call layout check cannot see them")
        # Keep graph order so the block's rows read like the model's attributes.
        order = {n: i for i, n in enumerate(m.run.gm.graph.nodes)}
        m.sites.sort(key=lambda s: order[s.node])
        m.params = _params(m.sites)
        sizes = tuple(s.out_features for s in m.sites)
        has_bias = tuple(s.has_bias for s in m.sites)
        m.path, m.why = _choose_path(ctx, m.x)
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

    def skipped(self, m: Match, record, ctx: PassContext) -> None:
        # Filed under the tensors too: ``wfpass.report(model)`` finds it by identity.
        refs = m.refs()
        note(record, [r.name for r in refs], [r.tensor for r in refs])

    def apply(self, m: Match, ctx: PassContext) -> None:
        _rewrite_group(m.run.gm, ctx, m)
        m.run.changed()


def _storage_problems(ctx: PassContext, sites: Sequence[LinearSite]) -> Dict[int, str]:
    """The members whose weight or bias shares storage with another tensor
    (a tie, an alias the user holds). Tensors already fused by wfpass are
    fine only where they sit in this very group's block (a re-run)."""
    others = [(r.name, r.tensor) for r in ctx.state_tensors()]
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


def _rewrite_group(gm: fx.GraphModule, ctx: PassContext, m: LinearGroup) -> None:
    """Move the group's weights (and biases) into one block and rewrite its
    calls; ``m`` has passed ``narrow`` and ``guard``, which set its path."""
    sites, x, path, why, region, fuse_biases = m.sites, m.x, m.path, m.why, m.region, m.fuse_biases
    params, detail = m.params, m.detail
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    sizes = tuple(s.out_features for s in sites)
    has_bias = tuple(s.has_bias for s in sites)
    weights = [s.weight.tensor for s in sites]
    layout = LinearLayout(sizes, has_bias, weights[0].shape[1])
    w_offsets = layout.w_offsets
    biases = [s.bias.tensor for s in sites if s.has_bias]
    b_offsets = [o for o, hb in zip(layout.b_slots, has_bias) if hb]
    dynamo = ctx.is_dynamo
    w_nodes = [s.weight.node for s in sites]
    b_nodes = [s.bias.node for s in sites if s.has_bias]

    fs = _reuse(weights, layout.weight_key)
    bfs = _reuse(biases, layout.bias_key) if fuse_biases else None
    bias_note = "" if fuse_biases or not biases else "; bias vector built per call (only some members have a bias)"
    if fs is not None and fs.record is not None and fs.record.pattern == "linear":
        # The same parameters in another graph (a recompile, a graph break):
        # one record, whose counters add up over every graph.
        record = fs.record
        ctx.report.records.append(record)
    else:
        how = "storage already fused (idempotent re-run)" if fs is not None else "weights moved into one block"
        record = ctx.report.add("linear", "rewritten", f"{len(sites)} linears ({'+'.join(map(str, sizes))} rows): {how}; {why}{bias_note}{region}", params, **detail)
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
        return

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
