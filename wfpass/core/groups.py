"""A fused group's layout, record and per-call site, as every grouped
format sets them up (``linear/rewrite.py``, ``rnn/rewrite.py``).

``find_layout``: the layout these very tensors already have (a recompile,
an idempotent re-run, a lost layout fused again); ``group_record``: the
record of the same decision on these parameters, which every graph that
decides so shares, or a new one; ``open_site``: the site's counters, and the
layout it starts from, adopted, or the members fused (now, after the inner
compile, or not).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

import torch

from .graph import PassContext
from .records import Record, decision
from .runtime import GroupSite, note, records_of, tracked_ids
from .storage import FusedStorage, fuse, layout_of_set, re_fuse

__all__ = ["find_layout", "group_record", "open_site"]


def _re_fuse_counted(fs: FusedStorage, tensors: Sequence[torch.Tensor]) -> bool:
    """Re-fuse a lost layout; a re-fuse is counted on its record."""
    if not re_fuse(fs, tensors):
        return False
    if fs.record is not None:
        fs.record.bump("re_fused")
    return True


def find_layout(tensors: Sequence[torch.Tensor], key,
                defer: Optional[Callable[[Callable[[], None]], None]] = None) -> Optional[FusedStorage]:
    """The layout of these very tensors under ``key``, if they have one:
    intact (a recompile, an idempotent re-run), or lost (``param.data =
    ...``, a cast and back) and fused again, counted on its record, which
    stays the group's record. The sharing checks have run.

    Without ``defer`` the re-fuse runs now, and a lost layout that cannot be
    re-fused is None (the caller fuses the tensors anew). With ``defer``
    (``ctx.defer``) it runs after the inner compile, which sees the storage
    offsets Dynamo traced, and the layout is returned as it is."""
    fs = layout_of_set(tensors, key)
    if fs is None:
        return None
    if defer is not None:
        if not fs.holds(tensors):
            defer(lambda: _re_fuse_counted(fs, tensors))
        return fs
    if fs.intact():
        return fs
    if fs.holds(tensors) or not _re_fuse_counted(fs, tensors):
        return None
    return fs


def group_record(ctx: PassContext, fs: Optional[FusedStorage], pattern: str, new: Callable[[], Record],
                 decided: Any = None, tensors: Sequence[torch.Tensor] = ()) -> Record:
    """The group's record: the record that made the same decision on the
    same parameters (in another graph: a recompile, a graph break; before
    ``wfpass.restore``), one record whose counters add up over every graph,
    listed in this graph's report too; else ``new()``. ``decided``: what
    this graph decided (``records.decision``); by default the pattern, the
    action and the new record's detail as ``new()`` writes it, so compiles
    with other options (a threshold, a path) get rows of their own.
    ``tensors``: the group's (by default, those ``new()``'s params name)."""
    rec = None
    if decided is None:
        rec = new()
        decided = decision(rec.pattern, rec.action, _public(rec.detail))
    cands = [fs.record, *fs.records.values()] if fs is not None else []
    if not tensors and rec is not None:
        state = dict(ctx.named_state())
        tensors = [state[n] for n in rec.params if n in state]
    if tensors:  # the layout may be gone (wfpass.restore): the rows filed under the tensors
        ids = {id(t) for t in tensors}
        cands += [r for r in records_of(tensors[0]) if tracked_ids(r) == ids]
    for cand in cands:
        if cand is not None and cand.pattern == pattern and cand.decision is decided:
            if rec is not None:  # the same decision: the row there is, not a new one
                ctx.report.records[:] = [r for r in ctx.report.records if r is not rec]
            ctx.report.records.append(cand)
            return cand
    if rec is None:
        rec = new()
    rec.decision = decided
    return rec


def _public(detail: dict) -> dict:
    return {k: v for k, v in detail.items() if not k.startswith("_")}


def open_site(ctx: PassContext, site: GroupSite, fs: Optional[FusedStorage], members: Sequence[torch.Tensor],
              extra: Sequence[Tuple[str, int, torch.Tensor]] = (), move: str = "now") -> GroupSite:
    """Set up the per-call ``site`` of a group: its record's counters start
    at zero (the site's own, ``fallback_calls``, ``re_fused``); the layout
    found (``fs``) becomes the record's and the site starts from it; with
    none, the members are fused: ``move="now"``, or after the inner compile
    (``"later"``: the graph reads each member by itself, and the examples
    Dynamo fakified keep their storage offsets), or not at all (``"never"``:
    they stay where they are, the record filed under them). ``extra``: as
    for ``GroupSite.adopt``."""
    record = site.record
    for c in site.counter + ("fallback_calls", "re_fused"):
        record.stats.setdefault(c, 0)
    if fs is not None:
        if fs.record is None or fs.record.decision is record.decision or fs.record.pattern != record.pattern:
            fs.record = record
        else:  # the layout's record decided otherwise: this decision's row beside it
            fs.records[record.decision] = record
        site.adopt(fs, members, extra)
    elif move == "never":
        note(record, site.names, members)
    elif move == "later":
        ctx.defer(lambda: site.adopt(_fuse(site, members), members, extra))
    else:
        site.adopt(_fuse(site, members), members, extra)
    return site


def _fuse(site: GroupSite, members: Sequence[torch.Tensor]) -> FusedStorage:
    """``members`` moved into a new block of ``site``'s layout, on its record."""
    return fuse(site.kind, site.names, members, site.offsets, site.numel, key=site.key, record=site.record)
