"""A report record's counters (``Record.stats``), safe to bump from many threads.

Kernels count every call they take; several threads may run one compiled
model at once. ``d[k] = d.get(k, 0) + 1`` is a read, an add and a write: a
thread switch between the read and the write loses the other thread's call.
So a counter bumped by one is an ``itertools.count`` (``ticker``): ``next``
on it is one C call, which the interpreter does not interrupt, and it takes
no lock. Bumps by more than one (bytes, moved tensors) and the counts pulled
from the C++ kernels take the record's lock; they are off the per-call path.

A ``Stats`` reads as a dict ``{counter: count}``: what it holds (the counts
added under the lock) plus what each ticker has counted.
"""
from __future__ import annotations

import itertools
import threading
from typing import Callable, Dict, Optional, Tuple

import torch

__all__ = ["Stats"]


def _count_of(ticker: "itertools.count") -> int:
    """How often ``next`` ran on ``ticker`` (started at 0): its repr is ``count(n)``."""
    return int(repr(ticker)[6:-1])


def _compiling() -> bool:
    return torch.compiler.is_compiling()


class Stats(dict):
    """A record's counters. ``ticker(k)`` / ``tickers(names)`` give the
    lock-free counters of the per-call path; ``bump(k, n)`` counts ``n``;
    ``pull(fn)`` adds a source kept outside Python (the C++ kernels',
    ``wfpass/native``): a callable that returns ``{counter: calls
    since its last call}``, or None once its source is gone (then it is
    dropped); it is read whenever the counters are."""

    __slots__ = ("_pulls", "_ticks", "_lock", "by_names")

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._pulls: list = []
        self._ticks: Dict[str, "itertools.count"] = {}
        # Re-entrant: a C++ kernel's counts are added from a finalizer, which
        # may run while this thread holds the lock.
        self._lock = threading.RLock()
        #: names tuple -> its tickers (``tickers``), read on the per-call path.
        self.by_names: Dict[Tuple[str, ...], Tuple["itertools.count", ...]] = {}

    # -- counting ---------------------------------------------------------------
    def ticker(self, k: str) -> "itertools.count":
        """The lock-free counter of ``k``: ``next(stats.ticker(k))`` counts one call."""
        t = self._ticks.get(k)
        if t is None:
            with self._lock:
                t = self._ticks.get(k)
                if t is None:
                    dict.setdefault(self, k, 0)
                    t = self._ticks[k] = itertools.count()
        return t

    def tickers(self, names: Tuple[str, ...]) -> Tuple["itertools.count", ...]:
        """The tickers of ``names``, kept in ``by_names`` for the per-call path."""
        ts = self.by_names.get(names)
        if ts is None:
            ts = self.by_names.setdefault(names, tuple(self.ticker(k) for k in names))
        return ts

    def bump(self, k: str, n: int = 1) -> None:
        if _compiling():
            # Dynamo is tracing the caller (a BatchNorm's pre-hook, say): a
            # dict update, which it records and replays per call; torch 2.11
            # graph-breaks on ``next`` of a count object and on locks.
            dict.__setitem__(self, k, dict.get(self, k, 0) + n)
        elif n == 1:
            next(self.ticker(k))
        elif n:
            with self._lock:
                dict.__setitem__(self, k, dict.get(self, k, 0) + n)

    def pull(self, fn: Callable[[], Optional[Dict[str, int]]]) -> None:
        with self._lock:
            self._pulls.append(fn)

    def add(self, counts: Dict[str, int]) -> None:
        """Add ``counts`` to the counters (without pulling first)."""
        for k, n in counts.items():
            if n:
                self.bump(k, n)

    def _sync(self) -> None:
        if not self._pulls:
            return
        with self._lock:
            pulls = list(self._pulls)
        gone = []
        for fn in pulls:  # each call takes its source's counts: two readers never add the same calls
            got = fn()
            if got is None:
                gone.append(fn)
            else:
                self.add(got)
        if gone:
            with self._lock:
                self._pulls[:] = [f for f in self._pulls if not any(f is g for g in gone)]

    def _value(self, k: str) -> int:
        t = self._ticks.get(k)
        v = dict.__getitem__(self, k)
        return v if t is None else v + _count_of(t)

    # -- reading: a dict of the counts ----------------------------------------
    def __getitem__(self, k):
        self._sync()
        return self._value(k)

    def get(self, k, default=None):
        self._sync()
        return self._value(k) if dict.__contains__(self, k) else default

    def copy(self) -> Dict[str, int]:
        self._sync()
        return {k: self._value(k) for k in list(dict.keys(self))}

    def items(self):
        return self.copy().items()

    def values(self):
        return self.copy().values()

    def keys(self):
        return self.copy().keys()

    def __iter__(self):
        return iter(self.copy())

    def __eq__(self, other):
        return self.copy() == (other.copy() if isinstance(other, Stats) else other)

    def __ne__(self, other):
        return not self == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self.copy())

    def __reduce__(self):
        return (dict, (self.copy(),))

    def __deepcopy__(self, memo):
        # A deep-copied model's records count on their own (a plain dict
        # from __reduce__ would have no bump()).
        return Stats(self.copy())

    # -- writing (off the per-call path) --------------------------------------
    def __setitem__(self, k, v) -> None:
        with self._lock:
            t = self._ticks.get(k)
            dict.__setitem__(self, k, v - (_count_of(t) if t is not None else 0))

    def setdefault(self, k, default=None):
        with self._lock:
            dict.setdefault(self, k, default)
        return self.get(k)

    def pop(self, k, *default):
        with self._lock:
            if not dict.__contains__(self, k):
                if default:
                    return default[0]
                raise KeyError(k)
            v = self._value(k)
            dict.__delitem__(self, k)
            self._ticks.pop(k, None)
            self.by_names = {n: ts for n, ts in self.by_names.items() if k not in n}
            return v

    def __delitem__(self, k) -> None:
        self.pop(k)

    def update(self, other=(), **kw) -> None:
        for k, v in dict(other, **kw).items():
            self[k] = v

