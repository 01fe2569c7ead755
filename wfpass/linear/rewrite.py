"""The sibling-linear format's rewrite: the group's weights (and biases)
moved into one block, its per-call layout check, and the graph's new call.

Dynamo flavour, fused path (one GEMM; the graph before and after is in
``wfpass/linear/format.py``): the block is an ``as_strided`` view of
the first member's storage, read by ``fused_linear``; split path: the graph
keeps its linears, which read views of the block; ``by_rows`` (a symbolic
row count): the fused path's graph, whose ``fused_linear`` picks one GEMM or
one per member per call (``kernel.by_rows``), each call counted on the path
it took (``ByRows``). ``symbolic_trace`` flavour: ``EagerBlock`` /
``EagerLayoutCheck`` make the same check in place.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ..core.graph import PassContext, meta_value
from ..core.records import Record, decision
from ..core.runtime import GroupSite
from ..core.storage import FusedStorage
from ..core.groups import find_layout, group_record, open_site
from .kernel import EagerBlock, EagerLayoutCheck, LinearLayout, bias_vector, fused_linear
from .match import LinearGroup
from .site import rows_reader

__all__ = ["rewrite_group"]


def _note_path(record, why: str, counter: str) -> None:
    """Add this graph's path to the record (``detail["paths"]``: the row
    count's condition -> what runs, and the counter that counts it) and
    write the record's text from all of them, so a row whose counters sum
    several graphs names every path they took."""
    cond, _, what = why.partition(": ")
    paths = record.detail.setdefault("paths", {})
    if counter:
        paths[cond] = f"{what} ({counter})" if what else f"({counter})"
    else:  # a path chosen per call names both counters itself
        paths[cond] = what
    text = record.detail.get("_text")
    if text is not None:
        _write_text(record, *text)


#: The path key of a graph that chooses per call (``guards.choose_path``).
_PER_CALL = "rows symbolic"


def _write_text(record, head: str, tail: str) -> None:
    """The record's text: its head, then every path its graphs took; after
    a graph that chooses per call, the row counts each path took so far."""
    seen = record.detail.get("rows_per_call") or {}
    parts = []
    for c, w in record.detail.get("paths", {}).items():
        part = f"{c}: {w}" if w[0] != "(" else f"{c} {w}"
        if c == _PER_CALL and seen:
            one = ", ".join(str(m) for m, p in seen.items() if p == "fused")
            per = ", ".join(str(m) for m, p in seen.items() if p == "split")
            took = ([f"one GEMM at M={one}"] if one else []) + ([f"one GEMM per member at M={per}"] if per else [])
            part += "; so far " + ", ".join(took)
        parts.append(part)
    record.reason = f"{head}; " + "; ".join(parts) + tail


class ByRows:
    """The per-call choice of a ``by_rows`` group, as ``runtime.guarded_call``
    counts it: ``rows(args)``, this call's M read from the compiled call's
    arguments (``site.rows_reader``); the counters of M <= ``max_rows``
    (``small``, the one GEMM) and above (``large``); ``note``, which adds a
    row count seen for the first time to the record it counts on (its
    detail's ``rows_per_call`` and its text). The graph decides the same
    way from the same M (``kernel.by_rows``)."""

    def __init__(self, rows: Callable[[Sequence[Any]], int], max_rows: int, small: Tuple[str, ...],
                 large: Tuple[str, ...], text: Optional[Tuple[str, str]]):
        self.rows, self.max_rows, self.small, self.large, self.text = rows, max_rows, small, large, text

    def note(self, record, m: int) -> None:
        seen = record.detail.get("_rows_seen")
        if seen is None:
            seen = record.detail["_rows_seen"] = set()
        seen.add(m)
        record.detail["rows_per_call"] = {k: "fused" if k <= self.max_rows else "split" for k in sorted(seen)}
        text = record.detail.get("_text") or self.text  # a later parameter set's record has no "_text"
        if text is not None:
            _write_text(record, *text)


def rewrite_group(ctx: PassContext, m: LinearGroup) -> None:
    """Move the group's weights (and biases) into one block and rewrite its
    calls; ``m`` has passed ``narrow`` and ``guard``, which set its path and
    sorted its members in graph order. The graph's flavour decides how the
    parameters are read: placeholders (Dynamo) or ``get_attr`` nodes
    (``symbolic_trace``)."""
    sites = m.sites
    layout = LinearLayout([s.out_features for s in sites], [s.has_bias for s in sites], sites[0].weight.tensor.shape[1])
    if ctx.is_dynamo:
        _rewrite_dynamo(ctx, m, layout)
    else:
        _rewrite_traced(ctx, m, layout)


def _rewrite_dynamo(ctx: PassContext, m: LinearGroup, layout: LinearLayout) -> None:
    """Dynamo flavour: the parameters are graph inputs, checked per call by
    the backend (``ctx.add_site``); the fused path reads the block as an
    ``as_strided`` view of the first member."""
    w_nodes = [s.weight.node for s in m.sites]
    b_nodes = [s.bias.node for s in m.sites if s.has_bias]
    wsite, bsite = _open_sites(ctx, m, layout, [ctx.placeholder_index(n) for n in w_nodes],
                               [ctx.placeholder_index(n) for n in b_nodes])
    for n in w_nodes + (b_nodes if m.fuse_biases else []):
        ctx.refakify(n)
    ctx.add_site(wsite)
    if bsite is not None:
        ctx.add_site(bsite)
    if m.path == "split":
        return  # the graph keeps one linear per member; they read views of the block
    g = m.run.gm.graph
    with g.inserting_before(m.sites[0].node):
        w_block = g.call_function(torch.as_strided, (w_nodes[0], (layout.total, layout.in_features), (layout.in_features, 1), 0))
        b_block = g.call_function(torch.as_strided, (b_nodes[0], (layout.total,), (1,), 0)) if m.fuse_biases else None
    max_rows = ctx.config.linear.fused_max_rows if m.path == "by_rows" else None
    _fused_call(m, layout, w_block, b_block, w_nodes, b_nodes, max_rows)


def _rewrite_traced(ctx: PassContext, m: LinearGroup, layout: LinearLayout) -> None:
    """``symbolic_trace`` flavour: the parameters are ``get_attr`` nodes,
    and the graph checks the layout in place: ``EagerLayoutCheck`` on the
    split path, ``EagerBlock`` (which also hands out the block) on the
    fused one."""
    wsite, bsite = _open_sites(ctx, m, layout)
    g = m.run.gm.graph
    first = m.sites[0].node  # the guard sorted them
    w_nodes = [s.weight.node if s.weight.node is not None else ctx.get_attr_node(s.weight.name, first) for s in m.sites]
    b_nodes = [s.bias.node if s.bias.node is not None else ctx.get_attr_node(s.bias.name, first)
               for s in m.sites if s.has_bias]
    with g.inserting_before(first):
        if m.path == "split":
            # The graph keeps one linear per member; they read views of the block.
            g.call_function(EagerLayoutCheck(wsite, "linear_layout_check"), tuple(w_nodes))
            if bsite is not None:
                g.call_function(EagerLayoutCheck(bsite, "linear_bias_layout_check"), tuple(b_nodes))
            return
        w_block = g.call_function(EagerBlock(wsite, layout.total, layout.in_features, "linear_weight_block"), tuple(w_nodes))
        b_block = None
        if bsite is not None:
            b_block = g.call_function(EagerBlock(bsite, layout.total, None, "linear_bias_block"), tuple(b_nodes))
    _fused_call(m, layout, w_block, b_block, w_nodes, b_nodes)


def _open_sites(ctx: PassContext, m: LinearGroup, layout: LinearLayout, w_idx: Sequence[int] = (),
                b_idx: Sequence[int] = ()) -> Tuple[GroupSite, Optional[GroupSite]]:
    """Both flavours: the group's record, its blocks (found, re-fused or
    fused now) and its per-call sites, the weights' and, when the biases are
    fused too, the biases'. ``w_idx`` / ``b_idx``: the members' positions
    among a Dynamo graph's inputs (none for ``symbolic_trace`` graphs)."""
    sites, path, fuse_biases = m.sites, m.path, m.fuse_biases
    weights = [s.weight.tensor for s in sites]
    biases = [s.bias.tensor for s in sites if s.has_bias]
    b_offsets = [o for o, hb in zip(layout.b_slots, layout.has_bias) if hb]
    fs = find_layout(weights, layout.weight_key)
    bfs = find_layout(biases, layout.bias_key) if fuse_biases else None
    record = _group_record(ctx, m, layout, fs, biases)
    wnames, bnames = [s.weight.name for s in sites], [s.bias.name for s in sites if s.has_bias]
    counters = {"fused": ("fused_calls",), "split": ("split_calls",), "by_rows": ("fused_calls", "split_calls")}[path]
    bias_cat = ("bias_cat_calls",) if biases and not fuse_biases and path != "split" else ()
    wsite = GroupSite("linear.weight", layout.weight_key, w_idx, wnames, layout.w_offsets,
                      layout.total * layout.in_features, record, counters + bias_cat, reads_block=path != "split")
    if path == "by_rows":
        # Each call counted on the path its M takes (the graph's
        # ``wfpass::linear_by_rows`` decides from the same M).
        wsite.by_rows = ByRows(rows_reader(m.x, ctx.example_inputs), ctx.config.linear.fused_max_rows,
                               ("fused_calls",) + bias_cat, ("split_calls",) + bias_cat, record.detail.get("_text"))
    extra = []
    if biases and not fuse_biases:
        extra = [(n, i, t) for n, i, t in zip(bnames, b_idx or [-1] * len(biases), biases)]
    open_site(ctx, wsite, fs, weights, extra)
    if not fuse_biases:
        return wsite, None
    bsite = GroupSite("linear.bias", layout.bias_key, b_idx, bnames, b_offsets, layout.total, record, (),
                      reads_block=path != "split", partner=wsite)
    return wsite, open_site(ctx, bsite, bfs, biases)


def _group_record(ctx: PassContext, m: LinearGroup, layout: LinearLayout, fs: Optional[FusedStorage], biases) -> Record:
    """The group's record, its text naming the path this graph took. The
    same parameters in another graph compiled with the same options (a
    recompile, a graph break) keep one record, whose counters add up over
    every such graph, and whose text and ``detail["path"]`` name every path
    those graphs took."""
    bias_note = "" if m.fuse_biases or not biases else "; bias vector built per call (only some members have a bias)"
    counter = {"fused": "fused_calls", "split": "split_calls", "by_rows": ""}[m.path]  # by_rows: its text names both

    def new() -> Record:
        how = "weights already in one block (an earlier compile or run)" if fs is not None else "weights moved into one block"
        head = f"{len(m.sites)} linears ({'+'.join(map(str, layout.sizes))} rows): {how}"
        record = ctx.report.add("linear", "rewritten", f"{head}; {m.why}{bias_note}{m.region}", m.params, **m.detail)
        record.detail["_text"] = (head, bias_note + m.region)
        return record

    # One row per decision: compiles with the same options share it (their
    # row counts may take both paths: the row names each, with its
    # counter); another ``linear.path`` or ``fused_max_rows`` has its own.
    opts = ctx.config.linear
    decided = decision("linear", opts.path, opts.fused_max_rows if opts.path == "auto" else None,
                       m.detail.get("bias_layout"))
    record = group_record(ctx, fs, "linear", new, decided=decided, tensors=[s.weight.tensor for s in m.sites] + biases)
    _note_path(record, m.why, counter)
    taken = str(record.detail.get("path"))
    if m.path not in taken.split("+"):  # the paths this row's graphs took, in the order first taken
        record.detail["path"] = f"{taken}+{m.path}"
    rows = record.detail.get("rows")
    if m.detail["rows"] not in (rows if isinstance(rows, list) else [rows]):  # several graphs' row counts: all of them
        record.detail["rows"] = (rows if isinstance(rows, list) else [rows]) + [m.detail["rows"]]
    return record


def _fused_call(m: LinearGroup, layout: LinearLayout, w_block: fx.Node, b_block: Optional[fx.Node],
                w_nodes: List[fx.Node], b_nodes: List[fx.Node], max_rows: Optional[int] = None) -> None:
    """The fused path, both flavours: one ``fused_linear`` over the blocks
    (or over a bias vector built per call, when only some members have a
    bias), split into the members' outputs, which replace their calls. With
    ``max_rows`` (the ``by_rows`` path) the call runs one GEMM up to that
    many rows and one per member above, chosen per call."""
    sites, g = m.sites, m.run.gm.graph
    sizes, has_bias = layout.sizes, layout.has_bias
    spec = (sizes, has_bias) if max_rows is None else (sizes, has_bias, max_rows)
    with g.inserting_before(sites[0].node):
        if b_block is None and b_nodes:
            b_block = g.call_function(bias_vector, (list(sizes), list(has_bias), *b_nodes))
        y = g.call_function(fused_linear, (m.x, w_block, b_block, spec, *w_nodes, *b_nodes))
        # Whether the graph computes a gradient through the block: the
        # members' recorded values say (grad mode and inputs included); a
        # later format (pack) must not take a call that trains for one that
        # does not.
        vals = [meta_value(s.node) for s in sites]
        if all(isinstance(v, torch.Tensor) for v in vals):
            y.meta["wfpass_requires_grad"] = any(v.requires_grad for v in vals)
        parts = g.call_function(torch.split, (y, list(sizes), -1))
        outs = [g.call_function(operator.getitem, (parts, i)) for i in range(len(sites))]
    for s, out in zip(sites, outs):
        out.meta.update({k: v for k, v in s.node.meta.items() if k in ("nn_module_stack", "stack_trace")})
        s.node.replace_all_uses_with(out)
        g.erase_node(s.node)
