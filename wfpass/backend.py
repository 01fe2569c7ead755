"""The ``wformat`` Dynamo backend: wfpass passes, then an inner compiler.

Registered through the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="wformat")`` works without importing wfpass.
``wfpass.backend(**options)`` builds one with options.

Prologue hoisting: a fused format finds its block at run time by checking that
the parameters are still views of one buffer; the block is an alias of their
storage, which AOTAutograd cannot trace. So every prologue node is lifted out
of the graph: it becomes a new trailing placeholder, and the callable we return
computes it from the real arguments before calling the compiled graph::

    compiled = inner(gm_without_prologues, example_inputs + [blocks...])
    call(*args) = compiled(*args, *[prologue(args...) for each])
"""
from __future__ import annotations

import functools
import logging
import os
import weakref
from typing import Any, Callable, List, Sequence, Tuple

import torch
import torch.fx as fx

from . import _compat
from .config import Config
from .graph import PassContext
from .ops.runtime import is_prologue
from .passes import run_passes
from .report import Report

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
    if not _LAST:
        return Report("wfpass report (nothing compiled yet)")
    if len(_LAST) == 1:
        return _LAST[0]
    merged = Report(f"wfpass report ({len(_LAST)} graphs of one call, split by Dynamo)")
    for r in _LAST:
        merged.extend(r)
    return merged


def _last_graph_report() -> Report:
    """The most recent graph's report alone (``wfpass.explain`` collects them)."""
    return _LAST[-1] if _LAST else Report("wfpass report (nothing compiled yet)")


def _set_last(report: Report, origin: Any = None, continues: bool = False, call: Sequence[Any] = ()) -> None:
    """``origin``: Dynamo's (compile context, attempt) (None outside Dynamo);
    ``continues``: this graph continues a call already under way (a nested
    frame or resume function after a graph break), whose tensor arguments are
    ``call``. A continuation joins the previous reports only if they came
    from the same call (the same argument objects, held weakly)."""
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
    if os.environ.get("WFPASS_REPORT", "") not in ("", "0"):
        print(report)


def _resolve_inner(inner: Any) -> Callable:
    if callable(inner):
        return inner
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(inner)


_ArgSpec = Tuple[str, Any]  # ("arg", index) or ("const", value)


def _hoist_prologues(gm: fx.GraphModule, example_inputs: Sequence[Any]):
    """Lift prologue nodes into trailing placeholders. Returns the list of
    (fn, argspec) to compute per call, and the extended example inputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}
    hoisted: List[Tuple[Callable, List[_ArgSpec]]] = []
    extra_examples: List[Any] = []
    last = placeholders[-1] if placeholders else None
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not is_prologue(node.target):
            continue
        spec: List[_ArgSpec] = []
        for a in node.args:
            if isinstance(a, fx.Node):
                if a not in index:
                    raise RuntimeError(f"wfpass: prologue {node.name} reads {a.name}, which is not a graph input")
                spec.append(("arg", index[a]))
            else:
                spec.append(("const", a))
        # The example value only needs the right shape and dtype: use the
        # prologue's copying fallback so compiling bumps no runtime counter.
        make = getattr(node.target, "example", node.target)
        value = make(*[example_inputs[v] if k == "arg" else v for k, v in spec])
        with gm.graph.inserting_after(last) if last is not None else gm.graph.inserting_before(None):
            ph = gm.graph.placeholder(f"wfpass_{node.name}")
        ph.meta.update({k: v for k, v in node.meta.items() if k in ("val", "example_value")})
        _compat.mark_lifted_input(ph)
        last = ph
        node.replace_all_uses_with(ph)
        gm.graph.erase_node(node)
        hoisted.append((node.target, spec))
        extra_examples.append(value)
    if hoisted:
        gm.graph.lint()
        gm.recompile()
    return hoisted, list(example_inputs) + extra_examples


def _compile(config: Config, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    gm = _compat.clone_dynamo_graph(gm)
    report = Report(f"wfpass report ({len(list(gm.graph.nodes))} nodes in the graph)")
    ctx = PassContext(gm, config, report, example_inputs=example_inputs)
    run_passes(gm, ctx)
    _set_last(report, *_compat.compile_origin())
    hoisted, inputs = _hoist_prologues(gm, ctx.compile_inputs())
    inner = _resolve_inner(config.inner)
    compiled = inner(gm, inputs)
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
    if not hoisted:
        return compiled

    def call(*args):
        extra = [fn(*[args[v] if k == "arg" else v for k, v in spec]) for fn, spec in hoisted]
        return compiled(*args, *extra)

    call._wfpass_report = report
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


def wformat(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """The registered ``"wformat"`` backend with default options."""
    return _compile(_DEFAULT, gm, example_inputs)


_DEFAULT = Config()
