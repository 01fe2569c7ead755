"""The rewrite report: one record per decision the passes take.

Records carry live runtime counters (``stats``): the kernels bump them on every
call, so printing the report after a few steps shows which path really ran.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["Record", "Report", "Stats", "terminal_width"]

log = logging.getLogger("wfpass")


#: ``"would rewrite"`` is a dry run's (``wfpass.explain``) word for ``"rewritten"``.
ACTIONS = ("rewritten", "skipped", "would rewrite")


class Stats(dict):
    """A record's counters: a dict that first adds what counters kept
    outside Python (the C++ kernels', ``wfpass/_torch/native``) hold, whenever it
    is read. ``pull`` adds such a source: a callable that returns
    ``{counter: calls since its last call}``, or None once its source is
    gone (then it is dropped)."""

    __slots__ = ("_pulls",)

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._pulls: list = []

    def pull(self, fn) -> None:
        self._pulls.append(fn)

    def add(self, counts: Dict[str, int]) -> None:
        """Add ``counts`` to the counters (without pulling first)."""
        for k, n in counts.items():
            if n:
                dict.__setitem__(self, k, dict.get(self, k, 0) + n)

    def _sync(self) -> None:
        if not self._pulls:
            return
        keep = []
        for fn in self._pulls:
            got = fn()
            if got is None:
                continue
            keep.append(fn)
            self.add(got)
        self._pulls[:] = keep

    def __getitem__(self, k):
        self._sync()
        return dict.__getitem__(self, k)

    def get(self, k, default=None):
        self._sync()
        return dict.get(self, k, default)

    def items(self):
        self._sync()
        return dict.items(self)

    def values(self):
        self._sync()
        return dict.values(self)

    def keys(self):
        self._sync()
        return dict.keys(self)

    def __iter__(self):
        self._sync()
        return dict.__iter__(self)

    def __eq__(self, other):
        self._sync()
        return dict.__eq__(self, other)

    __hash__ = None

    def __repr__(self) -> str:
        self._sync()
        return dict.__repr__(self)

    def copy(self) -> Dict[str, int]:
        self._sync()
        return dict(dict.items(self))

    def __reduce__(self):
        return (dict, (self.copy(),))


@dataclasses.dataclass
class Record:
    """One decision. ``action`` is one of ``ACTIONS``."""

    pattern: str
    action: str
    reason: str
    params: List[str]
    stats: Dict[str, int] = dataclasses.field(default_factory=Stats)
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
            "stats": dict(self.stats.items()),
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
        return self.render()

    def render(self, width: Optional[int] = None) -> str:
        """The report as a table ``width`` columns wide (default: the
        terminal's width, 120 when it is unknown). One row per record: the
        pattern, the action, then the parameters (their common prefix written
        once), the reason and the counters, one under the other. A name is
        never cut: a name longer than the line is the only thing that may
        overflow it. The cells are wrapped here (names whole, a common prefix
        once); ``tabulate`` lays out the grid."""
        if width is None:
            width = terminal_width()
        width = max(int(width), 40)
        if not self.records:
            return f"{self.title}: {_NOTHING_FOUND}"
        pw = max(len("pattern"), *(len(r.pattern) for r in self.records))
        aw = max(len("action"), *(len(r.action) for r in self.records))
        narrow = width - (pw + aw + 4) < 30  # a narrow terminal: details below each row, indented by 4
        avail = width - (4 if narrow else pw + aw + 4)
        lines = _wrap_words(f"{self.title}: {_action_counts(self.records)}".split(" "), width, "", "  ")
        calls = _calls_line(self.records)
        if calls:
            lines += _wrap_words(calls.split(" "), width, "", "  ")
        details = [_details(r, avail) for r in self.records]
        # The header and its rule are the grid's first rows of a "plain" table: tabulate's own header would pad
        # every column by two, and its rule would run past the line under a name that overflows it.
        grid = [["pattern", "action", "parameters / why / counters"], ["-" * pw, "-" * aw, "-" * max(avail, 10)]]
        grid += [[r.pattern, r.action, "" if narrow else "\n".join(d)] for r, d in zip(self.records, details)]
        table = _tabulate(grid, (), "plain").splitlines()
        if narrow:  # every row is one line: its details go below it
            table = table[:2] + [x for line, d in zip(table[2:], details) for x in [line] + ["    " + t for t in d]]
        return "\n".join(line.rstrip() for line in lines + table)

    __repr__ = __str__

    def to_markdown(self) -> str:
        """The report as a markdown table (for notebooks, bug reports and code
        reviews): the heading line, then one row per record with its
        parameters, reason and counters. Cells are written whole; markdown
        wraps them."""
        if not self.records:
            return f"**{self.title}**: {_NOTHING_FOUND}"
        head = f"**{self.title}**: {_action_counts(self.records)}"

        def cell(text: str) -> str:
            return text.replace("|", "\\|").replace("\n", " ")

        rows = [[r.pattern, r.action, cell(", ".join(f"`{p}`" for p in r.params) or "-"), cell(_short_reason(r.reason)),
                 cell(" ".join(f"{k}={v}" for k, v in r.stats.items()))] for r in self.records]
        table = _tabulate(rows, ["pattern", "action", "parameters", "why", "counters"], "github")
        return f"{head}\n\n{table}\n"

    def _repr_markdown_(self) -> str:  # Jupyter shows this instead of the terminal form
        return self.to_markdown()


# -- rendering -------------------------------------------------------------------------

#: Width used when the terminal's is unknown (output to a file or a pipe).
DEFAULT_WIDTH = 120


def terminal_width() -> int:
    """The terminal's width (``COLUMNS`` first, as ``shutil`` reads it), or
    ``DEFAULT_WIDTH`` when there is no terminal to ask."""
    return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns


def _calls_line(records: Sequence[Record]) -> str:
    """One line: how often each pattern's rewritten calls ran on each path,
    summed over its rows (``linear: fused_calls=38 split_calls=2; rnn:
    fused_calls=40``); empty before any call."""
    sums: Dict[str, Dict[str, int]] = {}
    for r in records:
        if r.action != "rewritten":
            continue
        for k, v in r.stats.items():
            if k.endswith("_calls") and isinstance(v, int) and v:
                d = sums.setdefault(r.pattern, {})
                d[k] = d.get(k, 0) + v
    if not sums:
        return ""
    return "calls so far: " + "; ".join(f"{p}: " + " ".join(f"{k}={v}" for k, v in d.items()) for p, d in sums.items())


#: What an empty report says after its title.
_NOTHING_FOUND = "no pattern of any registered format found"


def _tabulate(rows: Sequence[Sequence[str]], headers: Sequence[str], fmt: str) -> str:
    """``rows`` laid out by ``tabulate`` in format ``fmt`` (``"plain"`` for
    the terminal, ``"github"`` for markdown), every cell kept as the text it
    is (no number parsing)."""
    from tabulate import tabulate

    return tabulate([list(r) for r in rows], headers=list(headers), tablefmt=fmt, disable_numparse=True)


def _action_counts(records: Sequence[Record]) -> str:
    """``2 rewritten, 1 skipped``: the heading's counts, known actions first."""
    return ", ".join(f"{n} {a}" for a, n in _count_actions(records))


def _details(r: Record, width: int) -> List[str]:
    """A row's last cell, as lines of ``width``: its parameters, ``why:``
    its reason and, once it has any, ``counts:`` its counters."""
    lines = _param_lines(r.params, width)
    lines += _wrap_words(_short_reason(r.reason).split(" "), width, "why: ", " " * 5)
    if r.stats:
        lines += _wrap_words([f"{k}={v}" for k, v in r.stats.items()], width, "counts: ", " " * 8)
    return lines


def _count_actions(records: Sequence[Record]) -> List[Tuple[str, int]]:
    counts: Dict[str, int] = {}
    for r in records:
        counts[r.action] = counts.get(r.action, 0) + 1
    # Known actions in their usual order, any other after them as first seen.
    return sorted(counts.items(), key=lambda kv: ACTIONS.index(kv[0]) if kv[0] in ACTIONS else len(ACTIONS))


def _common_prefix(names: Sequence[str]) -> str:
    """The longest prefix, ending at a dot, that every name shares and that
    leaves every name a non-empty rest."""
    if len(names) < 2:
        return ""
    parts = [n.split(".") for n in names]
    prefix: List[str] = []
    for i, seg in enumerate(parts[0][:-1]):
        if all(len(p) > i + 1 and p[i] == seg for p in parts):
            prefix.append(seg)
        else:
            break
    return ".".join(prefix) + "." if prefix else ""


def _param_lines(names: Sequence[str], width: int) -> List[str]:
    """``prefix{a, b, c}``, filled into lines of ``width``; breaks only
    between names."""
    if not names:
        return ["(no parameters)"]
    prefix = _common_prefix(names)
    if prefix:
        members = [n[len(prefix):] for n in names]
        tokens = [prefix + "{"] + [m + ("," if i < len(members) - 1 else "}") for i, m in enumerate(members)]
        glue = [""] + [""] + [" "] * (len(members) - 1)  # no space after the brace
    else:
        tokens = [n + ("," if i < len(names) - 1 else "") for i, n in enumerate(names)]
        glue = [""] + [" "] * (len(names) - 1)
    cont = " " * min(len(prefix) + 1, 8) if prefix else "  "
    lines: List[str] = []
    cur = ""
    for tok, sep in zip(tokens, glue):
        if not cur:
            cur = tok
        elif len(cur) + len(sep) + len(tok) <= width:
            cur += sep + tok
        else:
            lines.append(cur)
            cur = cont + tok
    lines.append(cur)
    return lines


def _wrap_words(words: Sequence[str], width: int, first: str, cont: str) -> List[str]:
    lines: List[str] = []
    cur = first
    fresh = True
    for w in words:
        if not w:
            continue
        if fresh:
            cur += w
            fresh = False
        elif len(cur) + 1 + len(w) <= width:
            cur += " " + w
        else:
            lines.append(cur)
            cur = cont + w
    lines.append(cur)
    return lines


def _short_reason(reason: str) -> str:
    """The reason with clauses that repeat an earlier one word for word
    dropped (several steps may each add the same note)."""
    seen: List[str] = []
    for clause in reason.split("; "):
        if clause not in seen:
            seen.append(clause)
    return "; ".join(seen)
