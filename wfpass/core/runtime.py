"""What runs between Dynamo and a compiled graph: one layout check per group.

A rewritten graph reads a fused block as an ordinary view of its first
member, computed in the graph (``as_strided`` of a parameter whose storage is
the block), so AOTAutograd and Inductor see the alias and every mutation of
it. What the graph cannot check is whether *this call's* parameters are laid
out that way: one compiled graph may run with many parameter sets (regional
compilation, Dynamo reusing a frame for every layer, a model whose
parameters were re-assigned). So the backend returns::

    def call(*args):
        for site in sites:                       # one per fused group
            fs = layout of args[site.idx[0]]     # O(1), a dict lookup by identity
            if fs.key != site.key or fs.ptrs != (args[i].data_ptr() for i in site.idx):
                fs = site.prepare(args)          # first sight: fuse this set; lost: re-fuse
            if fs is None and site.reads_block:  # cannot be fused (a tie, a shared storage)
                return fallback(*args)           # the graph before the rewrite, run eagerly
            count the call on the site's path    # a graph choosing per call: the path of this call's M
        return compiled(*args)

The check is address arithmetic against a block the layout keeps alive (see
``storage.FusedStorage``), so it is complete, and it allocates nothing.
Layouts and their records belong to the parameters (``storage.layout_of``):
nothing here outlives the model, and a graph that serves N layers finds N
layouts and moves none of them again.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from .notes import (file_report, model_report, note, note_provisional, rename, records_of, state_names, tracked_ids,
                    unnote)
from .records import Record
from .storage import FusedStorage, entry_by_id, first_sharing_problem, fuse, layout_of, layout_of_set, re_fuse

__all__ = ["GroupSite", "guarded_call", "Group", "Bound",
           # filed by tensor (``notes``), here for the formats that import them from the runtime
           "note", "note_provisional", "file_report", "unnote", "model_report", "rename", "records_of", "state_names",
           "tracked_ids"]


class GroupSite:
    """One fused group of one compiled graph (or one ``wfpass.apply`` graph).

    kind:        layout kind, e.g. ``"linear.weight"``, ``"rnn"``.
    key:         the layout key; a block is read only through a layout with this key.
    idx:         positions of the members among the graph's inputs (Dynamo graphs).
    names:       the members' names in the graph, for records and messages.
    offsets:     element offset of each member in the block; ``numel`` its size.
    record:      the record of the parameter set the pass saw; later sets get their own.
    counter:     the stats this site bumps on every call (its path is static per graph).
    reads_block: the compiled graph reads the block, so a call whose
                 parameters cannot be laid out must take the fallback.
    by_rows:     set where the graph picks its path per call (a symbolic row
                 count: ``linear.rewrite.ByRows``): then the counters of a
                 call are those of the path its row count takes.
    """

    def __init__(self, kind: str, key: Any, idx: Sequence[int], names: Sequence[str], offsets: Sequence[int],
                 numel: int, record: Record, counter: Sequence[str], reads_block: bool, partner: Optional["GroupSite"] = None):
        self.kind, self.key = kind, key
        self.idx = tuple(idx)
        self.names = list(names)
        self.offsets, self.numel = list(offsets), numel
        self.record, self.counter, self.reads_block = record, tuple(counter), reads_block
        self.by_rows: Any = None
        # A bias block's site: its layouts share the record of the weight
        # block's layout for the same call (one row per group in the report).
        self.partner = partner
        self._last: Optional["weakref.ref"] = None  # the layout this site served last
        # Tensors of the group that stay outside the block (a mixed group's
        # biases): filed under the same record, so the report names them.
        self.extra_idx: Tuple[int, ...] = ()
        self.extra_names: List[str] = []

    # -- the slow path: a set seen for the first time, or a lost layout -------
    def prepare(self, members: Sequence[torch.Tensor], others: Sequence[Tuple[str, torch.Tensor]] = (),
                args: Sequence[Any] = ()) -> Optional[FusedStorage]:
        """Make ``members`` a layout with this site's key, or say it cannot be (None)."""
        # None is not remembered: whatever blocks a move (an alias the user
        # holds) may be gone by the next call, which then fuses.
        fs = layout_of_set(members, self.key)
        if fs is not None:
            if fs.holds(members):
                return fs
            # Our own layout, lost: ``param.data = ...``, ``.to()`` and back.
            if self._movable(members, others) is None and re_fuse(fs, members):
                self.record_of(fs).bump("re_fused")
                return fs
            return None
        for m in members:
            other = layout_of(m)
            if other is not None and other.intact():
                # In another group's block (a different grouping in another
                # graph): moving it would make the two graphs fight over it.
                return None
        why = self._movable(members, others)
        if why is not None:
            self.record.detail.setdefault("unfusable", why)
            return None
        last = self._last() if self._last is not None else None
        replaced = last is not None and all(m is None for m in last.members)
        record = self._record_for(members, args)
        fs = fuse(self.kind, self.names, members, self.offsets, self.numel, key=self.key, record=record)
        if replaced:
            # The set this site ran with before is gone (``load_state_dict(
            # assign=True)`` brings new Parameter objects): that is a re-fuse.
            record.bump("re_fused")
        self._last = weakref.ref(fs)
        note(record, self.names, members)
        if self.extra_idx and args:
            note(record, self.extra_names, [args[i] for i in self.extra_idx])
        return fs

    def record_of(self, fs: FusedStorage) -> Record:
        """The record that counts this site's calls on the set in ``fs``:
        the layout's own record where it decided what this site decided,
        else the record of this site's decision for that set (one per
        decision and set: another compile that decided differently, e.g.
        another path, has its own row and counters)."""
        rec = fs.record
        if rec is None:
            fs.record = rec = self.record
        dec = self.record.decision
        if rec.decision is dec:
            return rec
        other = fs.records.get(dec)
        if other is None:
            members = fs.members
            other = self._record_for(members) if all(m is not None for m in members) else self.record
            other = fs.records.setdefault(dec, other)
            note(other, self.names, members)
        return other

    def _movable(self, members, others) -> Optional[str]:
        return first_sharing_problem(zip(self.names, members), others, allowed=members)

    def find(self, members: Sequence[torch.Tensor]) -> Optional[FusedStorage]:
        """``wfpass.apply`` graphs, which run eagerly and check in place: the
        layout ``members`` are in, or ``prepare``'s answer."""
        fs = layout_of(members[0])
        if fs is not None and fs.key == self.key and fs.holds(members):
            return fs
        self._check_sizes(members)
        return self.prepare(list(members), [])

    def _check_sizes(self, members: Sequence[torch.Tensor]) -> None:
        """A member whose size is no longer the one the graph was rewritten
        for (a parameter replaced by one of another shape after tracing):
        say which, instead of a shape error deep inside the fused call."""
        ends = self.offsets[1:] + [self.numel]
        for name, m, start, end in zip(self.names, members, self.offsets, ends):
            if m.numel() != end - start:
                raise RuntimeError(
                    f"wfpass: {name!r} has shape {tuple(m.shape)} ({m.numel()} elements), but the graph "
                    f"wfpass.apply rewrote reads {end - start} elements for it: the parameter changed shape after "
                    "the model was traced. Trace the model again (torch.fx.symbolic_trace) and apply wfpass to "
                    "the new graph.")

    def _record_for(self, members, args=()) -> Record:
        """The compile-time record for the set the pass fused; a new record for
        every other set (another layer through the same graph), so each
        parameter set's counters are its own."""
        if self.partner is not None and args:
            fs = layout_of(args[self.partner.idx[0]])
            if fs is not None and fs.record is not None:
                return fs.record
        first = self.record.detail.get("_first")
        if first is None or first() is None or first() is members[0]:
            return self.record
        rec = Record(self.record.pattern, self.record.action, self.record.reason, list(self.names),
                     detail={k: v for k, v in self.record.detail.items() if not k.startswith("_")})
        rec.decision = self.record.decision
        for k in self.record.stats:
            rec.stats.setdefault(k, 0)
        return rec

    def adopt(self, fs: FusedStorage, members: Sequence[torch.Tensor], extra: Sequence[Tuple[str, int, torch.Tensor]] = ()) -> None:
        """The pass fused ``members`` at compile time: this site starts from
        that layout. ``extra``: (name, input position, tensor) of the group's
        tensors that stay outside the block."""
        self.record.detail["_first"] = weakref.ref(members[0])
        self._last = weakref.ref(fs)
        note(self.record, self.names, members)
        if extra:
            self.extra_names = [n for n, _, _ in extra]
            self.extra_idx = tuple(i for _, i, _ in extra)
            note(self.record, self.extra_names, [t for _, _, t in extra])


def new_params_check(positions: Sequence[int], fns: Sequence[Callable[[List[torch.Tensor]], None]]) -> Optional[Callable]:
    """A per-call check that hands ``fns`` the call's parameters (the graph
    inputs at ``positions``) the first time the graph runs with them; None
    where there is nothing to do. One compiled graph runs with several
    parameter sets under regional compilation (every layer of a model
    through one graph): what counts a model's weights must see them all.
    Per call: a dict lookup by the first parameter's identity."""
    if not positions or not fns:
        return None
    idx, i0 = list(positions), positions[0]
    # id -> weak reference, its entry dropped when the tensor dies: the
    # storage table's pattern (``storage.entry_by_id``). A
    # ``_tensors.weak_id_key_dict()`` lookup cost 3.4 us a call here against
    # 0.35 us for this one (a 2-core AMD EPYC without AVX-512).
    seen: dict = {}

    def check(args) -> None:
        p0 = args[i0]
        r = seen.get(id(p0))
        if r is not None and r() is p0:
            return
        for fn in fns:
            fn([args[i] for i in idx])
        key = id(p0)

        def gone(ref, key=key):
            if seen.get(key) is ref:
                del seen[key]

        try:
            seen[key] = weakref.ref(p0, gone)
        except TypeError:  # not weak-referenceable: checked again next call
            pass

    return check


def guarded_call(compiled: Callable, sites: Sequence[GroupSite], fallback: Callable,
                 tensor_inputs: Sequence[Tuple[str, int]], on_call: Optional[Callable] = None) -> Callable:
    """The callable the backend returns: per-call layout checks, then the
    compiled graph, or the fallback graph when a group that the compiled graph
    reads as a block cannot be laid out for this call. ``on_call(args)``
    (``new_params_check``) runs first."""
    plan = [(s, s.idx, s.idx[0], s.key, s.counter, s.reads_block, s.record.decision, s.by_rows) for s in sites]
    owner_get = entry_by_id

    def others(args):
        return [(n, args[i]) for n, i in tensor_inputs if isinstance(args[i], torch.Tensor)]

    def call(*args):
        if on_call is not None:
            on_call(args)
        ok = True
        for site, idx, i0, key, counter, reads, dec, by_rows in plan:
            if by_rows is not None:  # the graph picks its path from this call's row count
                m = by_rows.rows(args)
                counter = by_rows.small if m <= by_rows.max_rows else by_rows.large
            entry = owner_get(id(args[i0]))
            fs = entry[1] if entry is not None else None
            if fs is None or fs.key != key or fs.ptrs != tuple([args[i].data_ptr() for i in idx]):
                fs = site.prepare([args[i] for i in idx], others(args), args)
                if fs is None:
                    if reads:
                        ok = False
                        site.record.bump("fallback_calls")
                        continue
                    # The kernel still runs, reading the weights where they
                    # are (a tie keeps them there): its calls are counted too.
                    site.record.bump("unfused_layout_calls")
                    if counter:
                        for name in counter:
                            site.record.bump(name)
                    continue
            if counter:
                # Counted without a lock and without losing a call to another
                # thread: one ``next`` per counter (``stats.Stats.ticker``).
                rec = fs.record
                if rec is None or rec.decision is not dec:
                    rec = site.record_of(fs)
                stats = rec.stats
                ticks = stats.by_names.get(counter) or stats.tickers(counter)
                for t in ticks:
                    next(t)
                if by_rows is not None:
                    seen = rec.detail.get("_rows_seen")
                    if seen is None or m not in seen:  # a row count this record has not seen: its text names it
                        by_rows.note(rec, m)
        if ok:
            return compiled(*args)
        return fallback(*args)

    call._wfpass_sites = list(sites)  # type: ignore[attr-defined]
    return call


# -- eager call targets (``wfpass.apply`` graphs, hooks) ---------------------------


class Group:
    """Runtime state of one rewrite that an eagerly run graph or hook calls:
    its report record and format-specific spec. Owned by the call target that
    holds it (``Bound``), so it lives as long as the graph or hook does."""

    def __init__(self, record: Record, spec: Any = None):
        self.record, self.spec = record, spec


class Bound:
    """A graph call target ``fn(group, *args)`` carrying its group: FX accepts
    a callable object as a ``call_function`` target, so no global table of
    groups is needed to find it again."""

    def __init__(self, fn: Callable, group: Group, name: Optional[str] = None):
        self.fn, self.group = fn, group
        self.__name__ = self.__qualname__ = name or fn.__name__
        self.__module__ = fn.__module__
        if getattr(fn, "_wfpass_keep", False):
            self._wfpass_keep = True

    def __call__(self, *args):
        return self.fn(self.group, *args)

    def __repr__(self) -> str:
        return f"Bound({self.__name__})"
