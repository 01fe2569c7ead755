"""The rewrite report: one record per decision the passes take.

Records carry live runtime counters (``stats``): the kernels bump them on every
call, so printing the report after a few steps shows which path really ran.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
from typing import Any, Dict, List, Optional

from tabulate import tabulate

__all__ = ["Record", "Report"]

log = logging.getLogger("wfpass")


#: ``"would rewrite"`` is a dry run's (``wfpass.explain``) word for ``"rewritten"``.
ACTIONS = ("rewritten", "skipped", "would rewrite")


@dataclasses.dataclass
class Record:
    """One decision. ``action`` is one of ``ACTIONS``."""

    pattern: str
    action: str
    reason: str
    params: List[str]
    stats: Dict[str, int] = dataclasses.field(default_factory=dict)
    detail: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"Record.action must be one of {ACTIONS}, got {self.action!r}")

    def bump(self, counter: str, n: int = 1) -> None:
        # Kernels call this on the hot path; a dict update under the GIL is
        # atomic enough for counters and far cheaper than a lock.
        self.stats[counter] = self.stats.get(counter, 0) + n

    def __getstate__(self):
        # Private detail (weak references to the tensors a record concerns)
        # does not pickle and means nothing in another process.
        state = dict(self.__dict__)
        state["detail"] = {k: v for k, v in self.detail.items() if not k.startswith("_")}
        return state

    def to_dict(self) -> Dict[str, Any]:
        return {
            "pattern": self.pattern,
            "action": self.action,
            "reason": self.reason,
            "params": list(self.params),
            "stats": dict(self.stats),
            "detail": _jsonable({k: v for k, v in self.detail.items() if not k.startswith("_")}),
        }


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


class Report:
    """All records of one compiled graph (or one :func:`wfpass.apply` call)."""

    def __init__(self, title: str = "wfpass report", dry_run: bool = False) -> None:
        self.title = title
        self.dry_run = dry_run  # a dry run's rows say "would rewrite"
        self.records: List[Record] = []
        self._lock = threading.Lock()

    def add(self, pattern: str, action: str, reason: str, params=(), **detail: Any) -> Record:
        if self.dry_run and action == "rewritten":
            action = "would rewrite"
        rec = Record(pattern, action, reason, list(params), detail=detail)
        with self._lock:
            self.records.append(rec)
        log.info("%s %s %s: %s", pattern, action, ", ".join(rec.params) or "-", reason)
        return rec

    def extend(self, other: "Report") -> None:
        with self._lock:
            self.records.extend(other.records)

    def find(self, pattern: Optional[str] = None, action: Optional[str] = None) -> List[Record]:
        return [r for r in self.records if (pattern is None or r.pattern == pattern) and (action is None or r.action == action)]

    @property
    def rewritten(self) -> List[Record]:
        """Rewritten records (in a dry run: those that would be)."""
        return [r for r in self.records if r.action in ("rewritten", "would rewrite")]

    @property
    def skipped(self) -> List[Record]:
        return self.find(action="skipped")

    def to_dict(self) -> Dict[str, Any]:
        return {"title": self.title, "records": [r.to_dict() for r in self.records]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self):
        return iter(self.records)

    def __str__(self) -> str:
        if not self.records:
            return f"{self.title}: no linear, RNN or BatchNorm pattern found"
        rows = []
        for r in self.records:
            params = ", ".join(r.params)
            if len(params) > 70:
                params = params[:67] + "..."
            stats = " ".join(f"{k}={v}" for k, v in sorted(r.stats.items()))
            rows.append([r.pattern, r.action, r.reason, params, stats])
        table = tabulate(rows, headers=["pattern", "action", "reason", "params", "stats"], tablefmt="github", maxcolwidths=[None, None, 60, 50, 40])
        return f"{self.title}\n{table}"

    __repr__ = __str__
