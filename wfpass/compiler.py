"""The ``wformat`` Dynamo backend: wfpass passes, then an inner compiler.

Registered through the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="wformat")`` works without importing wfpass.
``wfpass.backend(**options)`` builds one with options.

Per call, before the compiled graph runs, each fused group checks that this
call's parameters are views of their block (``runtime.guarded_call``): a
graph may serve many parameter sets, and each is fused once, the first time
it is seen. The graph itself reads the block as a view of a parameter, an
alias AOTAutograd and Inductor see.
"""
from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch.fx as fx

from . import capture as _capture
from ._torch import aot as _aot, dynamo as _dynamo
from .config import Config
from .bodies import BodyContext, hop_bodies
from .graph import PassContext
from .passes import run_passes
from .pipeline import registered, run_format
from .records import Report, print_at_exit_if_asked
from .runtime import _UNCOMPILED, file_report, guarded_call

__all__ = ["backend", "wformat", "last_report"]

log = logging.getLogger("wfpass")

_LAST: List[Report] = []
_LAST_ORIGIN: List[Any] = [None]
_LAST_CALL: List[Any] = [[]]


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
    for r in _LAST:
        merged.extend(r)
    return merged


def _set_last(report: Report, origin: Any = None, continues: bool = False, call: Sequence[Any] = ()) -> None:
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


def inductor_settings(inner: Any, mode: Optional[str] = None, options: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The Inductor settings ``torch.compile(..., mode=..., options=...)``
    asks for, as Inductor's own ``torch.compile`` entry applies them
    (``torch._inductor.list_mode_options``, then ``options``): e.g.
    ``mode="reduce-overhead"`` is ``{"triton.cudagraphs": True}``. They
    reach Inductor only: with another inner compiler they are an error,
    not silently dropped."""
    if mode in (None, "default") and not options:
        return {}
    if inner != "inductor":
        raise ValueError(f"torch.compile's mode/options reach Inductor only; wfpass option 'inner' is {inner!r}")
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"torch.compile's options must be a dict, got {type(options).__name__}")
    settings: Dict[str, Any] = {}
    if mode not in (None, "default"):
        modes = _aot.inductor_modes()
        if mode not in modes:
            raise ValueError(f"torch.compile mode must be one of {tuple(modes)}, got {mode!r}")
        settings.update(modes[mode])
    settings.update(options or {})
    return settings


def _resolve_inner(inner: Any, settings: Optional[Dict[str, Any]] = None) -> Callable:
    if callable(inner):
        return inner
    if inner == "inductor":
        return _aot.inductor_compile_fx(settings or None)

    return _dynamo.lookup_backend(inner)


def _compile(config: Config, gm: fx.GraphModule, example_inputs: Sequence[Any], **compile_kwargs: Any) -> Callable:
    return _compile_with_report(config, gm, example_inputs, **compile_kwargs)[0]


def _compile_with_report(config: Config, gm: fx.GraphModule, example_inputs: Sequence[Any],
                         mode: Optional[str] = None, options: Optional[Dict[str, Any]] = None):
    # torch.compile(backend=..., mode=..., options=...) passes these on to
    # every backend; checked before any work.
    settings = inductor_settings(config.inner, mode, options)
    # The graph as Dynamo traced it: the fallback for a call whose parameters
    # cannot be laid out for a group the rewritten graph reads as one block.
    original = _dynamo.clone_dynamo_graph(gm)
    gm = _dynamo.clone_dynamo_graph(gm)
    report = Report(f"wfpass report ({len(list(gm.graph.nodes))} nodes in the graph)", dry_run=config.dry_run)
    ctx = PassContext(gm, config, report, example_inputs=example_inputs)
    run_passes(gm, ctx)
    run_in_bodies(gm, ctx)
    if not config.dry_run:  # ``wfpass.explain`` leaves ``last_report()`` and the model's records alone
        _set_last(report, *_dynamo.compile_origin())
        # Parameters Dynamo kept as graph attributes (Inductor's freezing=True)
        # are not inputs; their records are filed under them too.
        attrs = {r.name: r.tensor for r in (ctx.resolve(n) for n in gm.graph.nodes if n.op == "get_attr")
                 if r is not None and r.is_state}
        file_report(report, {**attrs, **{r.name: r.tensor for r in ctx.state_tensors()}})
    inner = _resolve_inner(config.inner, settings)
    compiled = inner(gm, ctx.compile_inputs())
    ctx.run_deferred()
    at_call = ctx.take_first_call_moves()
    if at_call:
        # A format changes a tensor's dtype or strides, which the inner
        # compiler and Dynamo's guards specialised on. Do it on the first
        # call and run this graph eagerly (right for any metadata); Dynamo's
        # guards then see the change and recompile once, and that compile
        # finds the tensors already in format.
        log.info("wfpass: a format changes tensor metadata on the first call; this graph runs eagerly until Dynamo recompiles")
        compiled = _first_call_then(at_call, gm.forward)
    if not ctx.sites:
        if ctx.kept:
            compiled = _keeping(compiled, ctx.kept)
        return compiled, report
    call = guarded_call(compiled, ctx.sites, original.forward, ctx.tensor_inputs())
    call._wfpass_report = report  # type: ignore[attr-defined]
    call._wfpass_kept = ctx.kept  # type: ignore[attr-defined]
    return call, report


def _keeping(compiled: Callable, kept: List[Any]) -> Callable:
    """``compiled``, holding ``kept`` (``PassContext.keep_alive``) for as
    long as Dynamo holds the compiled graph."""

    def call(*args):
        return compiled(*args)

    call._wfpass_kept = kept  # type: ignore[attr-defined]
    return call


def run_in_bodies(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Run the formats that rewrite inside higher-order-op bodies
    (``Format.in_bodies``: activation checkpointing, ``wrap``) in every body
    of ``gm``, nested bodies too, and write a skip record, with the reason,
    for each pattern the other formats find there."""
    formats = [f for f in registered() if ctx.config.runs(f.name)]
    inside = [f for f in formats if f.in_bodies]
    for hop in hop_bodies(gm):
        sub = BodyContext(ctx, hop)
        if hop.problem is not None:
            _report_body_patterns(sub, formats, hop.problem)
            continue
        for fmt in inside:
            run_format(fmt, hop.body, sub)
        names = ", ".join(f.name for f in inside) or "no format"
        _report_body_patterns(sub, [f for f in formats if not f.in_bodies],
                              f"inside a {hop.op} region: wfpass runs only {names} there (this format is not "
                              f"applied inside it)")
        run_in_bodies(hop.body, sub)


def _report_body_patterns(ctx: BodyContext, formats, why: str) -> None:
    """A skip record per match of ``formats`` in ``ctx``'s body (and the
    bodies nested in it), so that nothing inside a region wfpass does not
    rewrite goes unmentioned. The matchers only find: nothing is decided or
    applied. Two formats of one pattern finding the same tensors (the
    BatchNorm formats) give one row."""
    seen = set()
    for fmt in formats:
        pattern = fmt.pattern or fmt.name
        for m in fmt.matches(ctx.gm, ctx):
            key = (pattern, tuple(m.params))
            if key not in seen:
                seen.add(key)
                ctx.report.add(pattern, "skipped", why, m.params, region=ctx.region)
    for hop in hop_bodies(ctx.gm):
        _report_body_patterns(BodyContext(ctx, hop), formats, why)


def _first_call_then(moves, fn: Callable) -> Callable:
    pending = list(moves)

    def call(*args):
        while pending:
            pending.pop(0)()
        return fn(*args)

    return call


def backend(**options: Any) -> Callable:
    """A ``torch.compile`` backend with options, e.g.
    ``torch.compile(m, backend=wfpass.backend(inner="aot_eager", linear_path="fused"))``.
    Unknown options or bad values raise ``ValueError``/``TypeError`` now."""
    config = Config.from_options(**options)
    fn = functools.partial(_compile, config)
    fn.__name__ = "wformat"  # type: ignore[attr-defined]
    fn.config = config  # type: ignore[attr-defined]
    return fn


def wformat(gm: fx.GraphModule, example_inputs: Sequence[Any], **compile_kwargs: Any) -> Callable:
    """The registered ``"wformat"`` backend with default options
    (``compile_kwargs``: ``torch.compile``'s ``mode`` and ``options``, for
    Inductor: ``inductor_settings``)."""
    return _compile(_DEFAULT, gm, example_inputs, **compile_kwargs)


_DEFAULT = Config()
# ``wformat`` carries no ``.config``: tell the capture policy which Config it runs.
_capture.register_default_backend(wformat, _DEFAULT)
