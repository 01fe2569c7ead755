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
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .stats import Stats

RENAMED_PATTERNS = {"pack": "prepack"}  #: earlier pattern names ("pack": prepacked weights) -> today's

__all__ = ["Record", "Report", "Stats", "decision", "terminal_width"]

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
    stats: Dict[str, int] = dataclasses.field(default_factory=Stats)
    detail: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"Record.action must be one of {ACTIONS}, got {self.action!r}")
        if not isinstance(self.stats, Stats):
            self.stats = Stats(self.stats)
        #: What this row decided (``decision(...)``): two compiles of the same
        #: parameters share a row only where they decided the same.
        self.decision: Any = None

    def bump(self, counter: str, n: int = 1) -> None:
        """Count ``n`` on ``counter``; safe from many threads (``stats.Stats``)."""
        self.stats.bump(counter, n)

    def named(self, names: Dict[int, str]) -> "Record":
        """A view of this record whose ``params`` are the names ``names``
        (``id(tensor) -> name``, a model's ``named_parameters``) gives the
        tensors it concerns, each tensor once; a name whose tensor is not
        known stays as it is. The view shares the live ``stats``."""
        tracked = self.detail.get("_tensors") or {}
        aliases = self.detail.get("_aliases") or {}  # FSDP2: the sharded Parameter of an unsharded one
        params: List[str] = []
        seen = set()
        for p in self.params:
            name, key = p, ("name", p)
            for refs in (tracked, aliases):
                r = refs.get(p)
                member = r() if r is not None else None
                if member is not None and id(member) in names:
                    name, key = names[id(member)], ("tensor", id(member))
                    break
            if key not in seen:
                seen.add(key)
                params.append(name)
        view = Record(self.pattern, self.action, self.reason, params,
                      detail={k: v for k, v in self.detail.items() if not k.startswith("_")})
        view.stats, view.decision = self.stats, self.decision  # the live counters, not a copy
        return view

    def __setstate__(self, state):
        self.__dict__.update(state)
        if not isinstance(self.stats, Stats):  # pickled as a plain dict
            self.stats = Stats(self.stats)

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


#: decision key -> itself: equal decisions are one object, compared with ``is``.
_DECISIONS: Dict[Any, Any] = {}


def decision(*parts: Any) -> Any:
    """The token of a decision made of ``parts`` (hashable, or dicts and
    lists of them): equal decisions give the same object, so the per-call
    path tells them apart with ``is``."""
    key = _frozen(parts)
    return _DECISIONS.setdefault(key, key)


def _frozen(obj: Any) -> Any:
    if isinstance(obj, dict):
        return tuple(sorted(((str(k), _frozen(v)) for k, v in obj.items()), key=lambda kv: kv[0]))
    if isinstance(obj, (list, tuple)):
        return tuple(_frozen(v) for v in obj)
    try:
        hash(obj)
    except TypeError:
        return repr(obj)
    return obj


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
        if pattern in RENAMED_PATTERNS:  # an earlier pattern name would silently find nothing
            warnings.warn(f"wfpass's report pattern {pattern!r} is now {RENAMED_PATTERNS[pattern]!r}; the old name "
                          "goes in the next release", DeprecationWarning, stacklevel=2)
            pattern = RENAMED_PATTERNS[pattern]
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
        copies = _copies_line(self.records)
        if copies:
            lines += _wrap_words(copies.split(" "), width, "", "  ")
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


def _copies_line(records: Sequence[Record]) -> str:
    """The bytes of the derived copies alive (packed weights), summed over
    the rows that hold some; empty where none does."""
    held = [r.stats.get("packed_bytes", 0) for r in records if r.action == "rewritten"]
    total = sum(v for v in held if isinstance(v, int))
    kernels = sum(v for v in (r.stats.get("kernel_bytes", 0) for r in records if r.action == "rewritten")
                  if isinstance(v, int))
    if not total and not kernels:
        return ""
    n = sum(1 for v in held if isinstance(v, int) and v)
    line = f"packed copies alive: {total / 2**20:.2f} MiB over {n} row(s) (each row's packed_bytes)"
    if kernels:
        # The kernel library's compiled kernels for them (prepack/state.py):
        # they count into the same budget.
        line += f"; kernels the library compiled for them: {kernels / 2**20:.2f} MiB (kernel_bytes)"
    return line


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
    if r.detail.get("ran_eagerly"):  # calls that ran eagerly inside a compiled function, and why
        lines += _wrap_words(str(r.detail["ran_eagerly"]).split(" "), width, "ran eagerly: ", " " * 13)
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
