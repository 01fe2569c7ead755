"""A fused group's layout, record and per-call site, as every grouped
format sets them up (``linear/rewrite.py``, ``rnn/rewrite.py``).

``find_layout``: the layout these very tensors already have (a recompile,
an idempotent re-run, a lost layout fused again); ``group_record``: that
layout's record, which every graph rewriting the same parameters shares, or
a new one; ``open_site``: the site's counters, and the layout it starts
from, adopted, or the members fused (now, after the inner compile, or not).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch

from .graph import PassContext
from .records import Record
from .runtime import GroupSite, note
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


def group_record(ctx: PassContext, fs: Optional[FusedStorage], pattern: str, new: Callable[[], Record]) -> Record:
    """The group's record: the record of its layout ``fs`` when that is one
    of ``pattern`` (the same parameters in another graph: a recompile, a
    graph break; one record, whose counters add up over every graph), listed
    in this graph's report too; else ``new()``."""
    if fs is not None and fs.record is not None and fs.record.pattern == pattern:
        ctx.report.records.append(fs.record)
        return fs.record
    return new()


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
        fs.record = record
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
