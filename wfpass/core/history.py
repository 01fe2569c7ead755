"""What ``wfpass.last_report()`` shows: the report of the most recent
compile (every graph of it, where Dynamo split one call into several), or
the graph breaks noted since that left nothing compiled; and, with
``WFPASS_REPORT=1``, every report printed when the process exits."""
from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from typing import Any, List, Sequence

from .records import Report

__all__ = ["last_report", "set_last", "note_uncompiled", "print_at_exit_if_asked"]

_LAST: List[Report] = []
_LAST_ORIGIN: List[Any] = [None]
_LAST_CALL: List[Any] = [[]]
# Records of graph breaks that may leave nothing compiled, newer than the
# last compile: ``last_report`` shows them until the next graph compiles.
_UNCOMPILED: List[Any] = []


def note_uncompiled(record: Any) -> None:
    """A record about a graph break that may leave nothing compiled
    (``batchnorm.eager.note_item_break``): ``last_report()`` shows it until
    the next graph is compiled."""
    _UNCOMPILED.append(record)


def last_report() -> Report:
    """The report of what wfpass compiled or rewrote most recently: one graph,
    or, where Dynamo split one call into several graphs (a graph break, whose
    rest runs as a resume function; DDP's per-bucket subgraphs), all of them
    in order. Records are the live ones: their ``stats`` keep counting."""
    if _UNCOMPILED:
        # Dynamo broke the graph after the last compile and compiled nothing
        # since: say where, rather than show an older compile.
        out = Report("wfpass report (Dynamo compiled no graph since: a graph break ran the model eagerly)")
        out.records.extend(_UNCOMPILED)
        return out
    if not _LAST:
        return Report("wfpass report (nothing compiled yet)")
    if len(_LAST) == 1:
        return _LAST[0]
    merged = Report(f"wfpass report ({len(_LAST)} graphs of one call, split by Dynamo)")
    seen = set()
    for r in _LAST:
        for rec in r.records:
            if id(rec) not in seen:  # a group read by several graphs of the call: one row
                seen.add(id(rec))
                merged.records.append(rec)
    return merged


def set_last(report: Report, origin: Any = None, continues: bool = False, call: Sequence[Any] = ()) -> None:
    """``origin``: Dynamo's (compile context, attempt) (None outside Dynamo);
    ``continues``: this graph continues a call already under way (a nested
    frame or resume function after a graph break), whose tensor arguments are
    ``call``. A continuation joins the previous reports only if they came
    from the same call (the same argument objects, held weakly)."""
    _UNCOMPILED.clear()
    last = _LAST_ORIGIN[0]
    same = origin is not None and last is not None and origin[0] is last[0] and origin[1] == last[1]
    refs = _LAST_CALL[0]
    same_call = bool(call) and len(refs) == len(call) and all(r() is t for r, t in zip(refs, call))
    if _LAST and (same or (continues and same_call)):
        _LAST.append(report)
    else:
        _LAST[:] = [report]
    _LAST_ORIGIN[0] = origin
    _LAST_CALL[0] = [weakref.ref(t) for t in call]
    print_at_exit_if_asked(report)  # WFPASS_REPORT=1


# -- WFPASS_REPORT=1 ---------------------------------------------------------------------

_AT_EXIT: List[Report] = []


def print_at_exit_if_asked(report: Report) -> None:
    """With ``WFPASS_REPORT=1`` in the environment, print ``report`` to
    stderr when the process exits. At compile time every counter is still 0;
    at exit they say which path each call took."""
    if os.environ.get("WFPASS_REPORT", "") in ("", "0"):
        return
    with _AT_EXIT_LOCK:
        if not _AT_EXIT:
            atexit.register(_print_reports)
        if not any(r is report for r in _AT_EXIT):
            _AT_EXIT.append(report)


_AT_EXIT_LOCK = threading.Lock()


def _print_reports() -> None:
    for r in _AT_EXIT:
        print(r, end="\n\n", file=sys.stderr)
