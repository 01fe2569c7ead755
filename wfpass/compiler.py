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
import hashlib
import logging
import pathlib
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch.fx as fx

from ._torch import aot as _aot, dynamo as _dynamo, dynamo_hooks as _hooks
from .core.bodies import run_in_bodies
from .capture import note_left_out, note_unasked_rnns
from .config import Config
from .core.graph import PassContext
from .core.history import last_report, set_last
from .builtin import run_passes
from .core.records import Report
from .core.runtime import file_report, guarded_call, new_params_check, rename, state_names
from . import native

__all__ = ["backend", "wformat", "last_report", "compile_with_report"]

log = logging.getLogger("wfpass")


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


@functools.lru_cache(maxsize=None)
def _cacheable_functions() -> Dict[str, str]:
    """The Python functions wfpass's rewrites put into graphs, for the
    compile caches, each keyed by a hash of wfpass's source: their traces
    depend on wfpass's code, which the caches do not see."""
    from .linear.kernel import fused_linear

    digest = hashlib.sha256()
    root = pathlib.Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    key = f"wfpass-{digest.hexdigest()[:16]}"
    return {f"{fused_linear.__module__}.{fused_linear.__name__}": key}


def _compile(config: Config, gm: fx.GraphModule, example_inputs: Sequence[Any], **compile_kwargs: Any) -> Callable:
    return compile_with_report(config, gm, example_inputs, **compile_kwargs)[0]


def compile_with_report(config: Config, gm: fx.GraphModule, example_inputs: Sequence[Any],
                         mode: Optional[str] = None, options: Optional[Dict[str, Any]] = None):
    """One compile of one graph: the formats over a copy of it, the report
    published, the inner compiler, then the parameters moved and the result
    wrapped in the per-call layout check. Returns (callable, report)."""
    # torch.compile(backend=..., mode=..., options=...) passes these on to
    # every backend; checked before any work.
    settings = inductor_settings(config.inner, mode, options)
    # ``allow_rnn`` set by the user after importing wfpass: from the next
    # trace on, RNNs of wformat traces are wfpass's again (``dynamo_hooks``).
    if _hooks.ensure_rnn_capture():
        note_unasked_rnns()
    # The graph as Dynamo traced it: the fallback for a call whose parameters
    # cannot be laid out for a group the rewritten graph reads as one block.
    original = _dynamo.clone_dynamo_graph(gm)
    gm = _dynamo.clone_dynamo_graph(gm)
    report = Report(f"wfpass report ({len(list(gm.graph.nodes))} nodes in the graph)", dry_run=config.dry_run)
    # wfpass's C++ kernels: built on the first compile on this machine (it
    # says so on stderr), loaded before any rewritten graph can call them.
    native.build()
    ctx = PassContext(gm, config, report, example_inputs=example_inputs)
    run_passes(gm, ctx)
    run_in_bodies(gm, ctx)
    if ctx.is_dynamo:
        # The nodes the formats added, with fake values as Dynamo's own have:
        # AOTAutograd's cache reads them (``_cacheable_functions``).
        _dynamo.fill_example_values(gm)
    module = None
    if not config.dry_run:  # ``wfpass.explain`` leaves ``last_report()`` and the model's records alone
        note_left_out(report)  # RNNs Dynamo left out for a backend that calls this one where wfpass did not see it
        module = _publish(report, ctx)
    with _aot.cacheable(_cacheable_functions()):
        compiled = _resolve_inner(config.inner, settings)(gm, ctx.compile_inputs())
    compiled = _settle(compiled, ctx, original)
    if module is not None:
        # The rows name the tensors as the module called does (the wrapper's
        # names for a wrapped model), after the moves that waited for the
        # inner compiler noted them under the graph's names.
        rename(report.records, state_names(module))
    return compiled, report


def _publish(report: Report, ctx: PassContext):
    """``report`` as ``last_report()``, and filed under the tensors it
    concerns (``wfpass.report(model)``); returns the ``nn.Module`` whose
    call Dynamo is compiling, or None."""
    origin, continues, call, module = _dynamo.compile_origin()
    set_last(report, origin, continues, call)
    # Parameters Dynamo kept as graph attributes (Inductor's freezing=True)
    # are not inputs; their records are filed under them too.
    attrs = {r.name: r.tensor for r in (ctx.resolve(n) for n in ctx.gm.graph.nodes if n.op == "get_attr")
             if r is not None and r.is_state}
    file_report(report, {**attrs, **{r.name: r.tensor for r in ctx.state_tensors()}})
    return module


def _settle(compiled: Callable, ctx: PassContext, original: fx.GraphModule) -> Callable:
    """After the inner compiler: the parameters moved into their formats
    (``ctx.run_deferred``; a move that changes a tensor's metadata waits for
    the first call), and the callable Dynamo gets."""
    ctx.run_deferred()
    at_call = ctx.take_first_call_moves()
    if at_call:
        # A format changes a tensor's dtype or strides, which the inner
        # compiler and Dynamo's guards specialised on. Do it on the first
        # call and run this graph eagerly (right for any metadata); Dynamo's
        # guards then see the change and recompile once, and that compile
        # finds the tensors already in format.
        log.info("wfpass: a format changes tensor metadata on the first call; this graph runs eagerly until Dynamo recompiles")
        compiled = _first_call_then(at_call, ctx.gm.forward)
    on_call = new_params_check(ctx.param_positions(), ctx.new_params)
    if not ctx.sites:
        return _keeping(compiled, ctx.kept, on_call) if ctx.kept or on_call else compiled
    call = guarded_call(compiled, ctx.sites, original.forward, ctx.tensor_inputs(), on_call)
    call._wfpass_report = ctx.report  # type: ignore[attr-defined]
    call._wfpass_kept = ctx.kept  # type: ignore[attr-defined]
    return call


def _keeping(compiled: Callable, kept: List[Any], on_call: Optional[Callable] = None) -> Callable:
    """``compiled``, holding ``kept`` (``PassContext.keep_alive``) for as
    long as Dynamo holds the compiled graph; ``on_call(args)`` before each call."""

    if on_call is None:
        def call(*args):
            return compiled(*args)
    else:
        def call(*args):
            on_call(args)
            return compiled(*args)

    call._wfpass_kept = kept  # type: ignore[attr-defined]
    return call


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
# As backends built by ``backend(...)`` do: the capture policy reads it.
wformat.config = _DEFAULT  # type: ignore[attr-defined]
