"""The pipeline: every format wfpass runs, in one ordered list, and the
driver that runs each of them the same way.

A *format* is one entry of the pipeline: a pass over the FX graph that moves
some parameters into a layout and rewrites the calls that read them. The
built-in ones are listed once, in ``wfpass/builtin.py``; users'
formats (``wfpass.register_format``) are appended after them. Nothing in
this module imports the rest of wfpass: ``Config`` checks pass names
against it, and every layer above may use it.

A format either overrides ``run(gm, ctx) -> int`` (a whole pass, written as
one function), or gives the three steps the driver runs for it:

``matches(gm, ctx)``
    the candidates in the graph, each a :class:`Match` (its parameters'
    names, the details its report rows carry, and what a rewrite would do).
    A generator: the driver decides and applies each match before asking
    for the next, so a match sees the graph as the previous rewrites left it.
``narrow(match, ctx)`` (formats whose matches have several members)
    the members to leave out, each as a match of its own with the reason
    (its ``skipped`` row), and the match of the rest, or None when nothing
    is left to decide (the three linears of a Q/K/V group, one of them tied
    to another module: two go on). Decides; changes nothing.
``guard(match, ctx)``
    the reason to leave this match alone (the text of its ``skipped`` row),
    or None to take it. A guard decides: it changes nothing in the graph or
    the tensors; on a match it takes it may record what it decided (the
    plan, the path, the row's details) on the match, for ``apply``.
``apply(match, ctx)``
    the rewrite, and its ``rewritten`` row (which may be a record shared
    with another graph of the same parameters).

A dry run (``Config(dry_run=True)``, ``wfpass.explain``) is one branch, in
:func:`drive`: every match is guarded, and a taken one gets a row saying
what would be done; ``apply`` is never called.

Ordering constraints are declared on the formats (``before`` / ``after``:
names of other formats) and checked whenever the list changes, so a new
format cannot silently run before a format whose output it reads.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch.fx as fx

__all__ = ["Format", "Match", "drive", "run_format", "run_passes", "cleanup", "check_order", "install_builtins", "append_format", "remove_format",
           "registered", "registered_names"]

log = logging.getLogger("wfpass")


class Match:
    """One candidate a format found in the graph.

    params: names of the parameters and buffers it concerns (the report's rows).
    plan:   what the rewrite would do, in words: a dry run's row.
    detail: what every row of this match carries (e.g. ``steps=6``).
    Formats subclass it or set their own attributes on it.
    """

    def __init__(self, params: Sequence[str] = (), plan: str = "", **detail: Any):
        self.params = list(params)
        self.plan = plan
        self.detail: Dict[str, Any] = detail


class Format:
    """An entry of the pipeline. ``name`` is what ``Config(passes=...)`` and
    the report use; ``pattern`` the report's pattern column (the name if
    empty). ``before`` / ``after``: names of formats this one must run
    before / after (checked when the pipeline is built or extended).

    Implement either ``run(gm, ctx) -> int`` (patterns rewritten, decisions
    written into ``ctx.report``) or the steps ``matches`` / ``guard`` /
    ``apply`` (and ``narrow`` for matches of several members) that the
    default ``run`` drives (see the module docstring)."""

    name: str = ""
    pattern: str = ""
    before: Tuple[str, ...] = ()
    after: Tuple[str, ...] = ()
    #: Runs inside the bodies of higher-order ops (activation checkpointing,
    #: ``wrap``), whose parameters arrive as operands of the outer graph.
    #: Other formats only report the patterns their ``matches`` find there.
    in_bodies: bool = False

    def __init__(self, *, before: Sequence[str] = (), after: Sequence[str] = ()):
        # Constraints may be declared on the class or where the pipeline lists the format.
        if before:
            self.before = tuple(before)
        if after:
            self.after = tuple(after)

    def run(self, gm: fx.GraphModule, ctx) -> int:
        return drive(self, gm, ctx)

    def matches(self, gm: fx.GraphModule, ctx) -> Iterable[Match]:  # pragma: no cover - interface
        raise NotImplementedError(f"{type(self).__name__} implements neither run() nor matches()")

    def narrow(self, match: Match, ctx) -> Tuple[Optional[Match], List[Tuple[Match, str]]]:
        return match, []

    def guard(self, match: Match, ctx) -> Optional[str]:
        return None

    def skipped(self, match: Match, record: Any, ctx) -> None:
        """Called with each ``skipped`` row the driver files (e.g. to file it
        under the match's tensors as well as its names)."""

    def apply(self, match: Match, ctx) -> None:  # pragma: no cover - interface
        raise NotImplementedError(f"{type(self).__name__}.apply")

    def install(self) -> None:
        """Called once, when the format joins the pipeline: what it puts in
        place outside the graph (the RNN format's Dynamo capture policy)."""

    def restore(self, module: Any) -> None:
        """Called by ``wfpass.restore`` for every module of the model: drop
        what this format attached to ``module`` (hooks, derived copies of
        its tensors). Storage is given back by ``restore`` itself."""

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` if this format cannot be registered."""
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"{type(self).__name__} needs a non-empty string 'name'")
        for side in ("before", "after"):
            names = getattr(self, side)
            if isinstance(names, str) or not all(isinstance(n, str) for n in names):
                raise TypeError(f"{type(self).__name__}.{side} must be a tuple of format names, got {names!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def drive(fmt: Format, gm: fx.GraphModule, ctx) -> int:
    """Match, decide, apply: the one loop every staged format runs through.
    Returns how many matches were rewritten (in a dry run: would be)."""
    pattern = fmt.pattern or fmt.name

    def skip(m: Match, why: str) -> None:
        fmt.skipped(m, ctx.report.add(pattern, "skipped", why, m.params, **m.detail), ctx)

    done = 0
    for found in fmt.matches(gm, ctx):
        m, left_out = fmt.narrow(found, ctx)
        for part, why in left_out:
            skip(part, why)
        if m is None:
            continue
        why = fmt.guard(m, ctx)
        if why is not None:
            skip(m, why)
            continue
        done += 1
        if ctx.config.dry_run:
            ctx.report.add(pattern, "rewritten", f"{m.plan} [dry run]", m.params, **m.detail)
        else:
            fmt.apply(m, ctx)
    return done


# -- the ordered list ----------------------------------------------------------

_FORMATS: List[Format] = []
_BUILTIN: set = set()


def check_order(formats: Sequence[Format]) -> None:
    """Every declared constraint holds in ``formats``' order; a constraint
    naming a format that is not in the list is an error (a typo would
    otherwise switch the check off)."""
    where = {f.name: i for i, f in enumerate(formats)}
    for i, f in enumerate(formats):
        for side, ok in (("before", lambda j: i < j), ("after", lambda j: j < i)):
            for other in getattr(f, side):
                if other not in where:
                    raise ValueError(f"format {f.name!r} must run {side} {other!r}, which is not registered; "
                                     f"registered: {[g.name for g in formats]}")
                if not ok(where[other]):
                    raise ValueError(f"format {f.name!r} must run {side} {other!r}, but the pipeline order is "
                                     f"{[g.name for g in formats]} (a format registered later runs after the built-in ones)")


def install_builtins(formats: Sequence[Format]) -> None:
    """Put wfpass's own formats at the head of the pipeline, in this order
    (once, when ``wfpass.builtin`` is imported)."""
    for f in formats:
        f.validate()
    names = [f.name for f in formats]
    if len(set(names)) != len(names):
        raise ValueError(f"built-in format names repeat: {names}")
    users = [f for f in _FORMATS if f.name not in _BUILTIN]
    clash = [f.name for f in users if f.name in names]
    if clash:
        raise ValueError(f"formats {clash} are registered already")
    new = list(formats) + users
    check_order(new)
    _FORMATS[:] = new
    _BUILTIN.clear()
    _BUILTIN.update(names)
    for f in formats:
        f.install()


def append_format(fmt: Format) -> None:
    """Add a user's format at the end of the pipeline."""
    fmt.validate()
    for f in _FORMATS:
        if f.name == fmt.name:
            raise ValueError(f"a format named {fmt.name!r} is already registered ({f!r})")
    check_order(_FORMATS + [fmt])
    _FORMATS.append(fmt)
    fmt.install()


def remove_format(name: str) -> None:
    """Remove a user's format. The built-in ones stay: removing one would
    change the pipeline of every model compiled in the process afterwards."""
    if name in _BUILTIN:
        raise ValueError(f"{name!r} is a built-in format and cannot be unregistered (that would change every "
                         f"compile in this process); to leave it out of one compile, pass the formats to run: "
                         f"Config(passes=...), e.g. wfpass.backend(passes=(...))")
    for i, f in enumerate(_FORMATS):
        if f.name == name:
            rest = _FORMATS[:i] + _FORMATS[i + 1:]
            needed = [g.name for g in rest if name in g.before or name in g.after]
            if needed:
                raise ValueError(f"format {name!r} cannot be unregistered: {needed} declare an order relative to it")
            _FORMATS[:] = rest
            return
    raise ValueError(f"no format named {name!r}; registered: {registered_names()}")


def registered() -> List[Format]:
    """Every format, in the order the pipeline runs them."""
    return list(_FORMATS)


def registered_names() -> Tuple[str, ...]:
    """Every format's name, in pipeline order (what ``Config(passes=...)`` accepts)."""
    return tuple(f.name for f in _FORMATS)


# -- running it ----------------------------------------------------------------


def _keep(node: fx.Node) -> bool:
    # FX counts every call_method as pure, so DCE would drop Dynamo's
    # ``num_batches_tracked.add_(1)`` (no users): keep in-place methods.
    # A layout check in a ``wfpass.apply`` graph returns nothing and runs for its effect.
    return node.is_impure() or (node.op == "call_method" and str(node.target).endswith("_")) or getattr(
        node.target, "_wfpass_keep", False)


def cleanup(gm: fx.GraphModule) -> None:
    """After every format that rewrote something: dead code eliminated, the
    graph linted and recompiled."""
    gm.graph.eliminate_dead_code(is_impure_node=_keep)
    gm.graph.lint()
    gm.recompile()


def run_format(fmt: Format, gm: fx.GraphModule, ctx) -> int:
    """One format over ``gm`` (a whole graph, or a higher-order op's body),
    then the clean-up if it rewrote something; returns how many patterns."""
    n = fmt.run(gm, ctx)
    if n and not ctx.config.dry_run:
        cleanup(gm)
    log.debug("format %s rewrote %d pattern(s)", fmt.name, n)
    return n


def run_passes(gm: fx.GraphModule, ctx) -> Dict[str, int]:
    """Run the formats ``ctx.config`` selects, in pipeline order; returns
    how many patterns each rewrote."""
    return {fmt.name: run_format(fmt, gm, ctx) for fmt in registered() if ctx.config.runs(fmt.name)}
