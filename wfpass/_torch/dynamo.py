"""Dynamo's private API (torch 2.13.0): where graph inputs came from, the
frame being compiled, the compile in progress. The two config values that
call back into wfpass while Dynamo traces are in ``dynamo_hooks.py``.
"""
from __future__ import annotations

import contextlib
import re
import sys
import types
from typing import Optional

import torch

def dynamo_source_name(node: torch.fx.Node) -> Optional[str]:
    """Dynamo records where a placeholder came from in ``node.meta['grapharg']``
    (``GraphArg.source``, private; torch 2.13.0), e.g.
    ``L['self']._modules['q']._parameters['weight']``."""
    ga = node.meta.get("grapharg")
    src = getattr(ga, "source", None)
    if src is None:
        return None
    try:
        return src.name() if callable(getattr(src, "name", None)) else str(src.name)
    except Exception:  # pragma: no cover
        return None


_PART = re.compile(r"\.(?:_modules|_parameters|_buffers)\[['\"]([^'\"]+)['\"]\]|\.(\w+)|\[(\d+)\]")


def _source_parts(source: str) -> list:
    """The attribute names after the root object of a Dynamo source name:
    ``L['self']._modules['enc']._modules['0']._parameters['weight']`` ->
    ``['enc', '0', 'weight']`` (the ``_modules`` / ``_parameters`` /
    ``_buffers`` dicts of ``nn.Module`` dropped)."""
    head = source.find("]")  # drop the L['self'] / L['model'] root
    parts = [a or b or c for a, b, c in _PART.findall(source[head + 1 :])]
    return [p for p in parts if p not in ("_modules", "_parameters", "_buffers")]


def qualified_name_from_source(source: str) -> Optional[str]:
    """``L['self']._modules['enc']._modules['0']._parameters['weight']`` -> ``enc.0.weight``.

    Returns None for sources that are not attributes of a module (plain inputs).
    """
    if "_parameters[" not in source and "_buffers[" not in source:
        return None
    return ".".join(_source_parts(source)) or None


def module_name_from_source(source: str) -> str:
    """``L['self']._modules['enc']._modules['0']`` -> ``enc.0``; ``""`` for
    the root object itself (``L['rnn']``)."""
    return ".".join(_source_parts(source))


# ``L['self']``, or ``L['args'][0]``: a forward behind a decorator that
# takes ``*args`` (HF's ``@can_return_tuple``) has the module as its first
# positional argument.
_ROOT = re.compile(r"^([LG])\[['\"]([^'\"]+)['\"]\](?:\[(\d+)\])?")


def source_root(source: str):
    """The object a Dynamo source starts from: ``L['self']`` -> the frame's
    local ``self`` (the module being compiled), ``G['model']`` -> a global.
    Read from ``InstructionTranslator.current_tx()``'s ``f_locals`` /
    ``f_globals`` (private; torch 2.13.0), set while the backend runs; None
    anywhere else or when the source has another form."""
    m = _ROOT.match(source or "")
    if m is None:
        return None
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:
        return None
    if tx is None:
        return None
    scope = getattr(tx, "f_locals", None) if m.group(1) == "L" else getattr(tx, "f_globals", None)
    root = (scope or {}).get(m.group(2))
    if m.group(3) is not None:
        i = int(m.group(3))
        root = root[i] if isinstance(root, (tuple, list)) and i < len(root) else None
    return root


def source_root_key(source: str) -> Optional[str]:
    """``L['self']`` of ``L['self']._modules['q']._parameters['weight']``
    (``L['args'][0]`` of ``L['args'][0]._modules[...]...``)."""
    m = _ROOT.match(source or "")
    return m.group(0) if m else None


def traced_frame_modules() -> list:
    """The ``nn.Module`` objects the frame Dynamo is compiling can reach: its
    locals (``self`` of a ``forward``), the globals its code names and the
    module whose call runs it. For
    modules Dynamo did not put into the graph (a graph break runs them
    eagerly). ``InstructionTranslator.current_tx()`` and its ``f_locals`` /
    ``f_globals`` / ``f_code`` (private; torch 2.13.0) are set while the
    backend runs; anywhere else this returns ``[]``."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:
        return []
    if tx is None:
        return []
    found, seen = [], set()
    values = list(getattr(tx, "f_locals", {}).values())
    # A resume function (the rest of a frame after a graph break) holds only
    # stack values; the module whose forward it continues is the ``self`` of
    # the nearest ``nn.Module._call_impl`` on the Python stack
    # (torch/nn/modules/module.py, torch 2.13.0), which also holds for a
    # first compile: Dynamo compiles ``forward`` as ``_call_impl`` calls it.
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_call_impl" and isinstance(frame.f_locals.get("self"), torch.nn.Module):
            values.append(frame.f_locals["self"])
            break
        frame = frame.f_back
    del frame
    f_globals = getattr(tx, "f_globals", {}) or {}
    values += [f_globals[n] for n in getattr(getattr(tx, "f_code", None), "co_names", ()) if n in f_globals]
    for v in values:
        if isinstance(v, torch.nn.Module) and id(v) not in seen:
            seen.add(id(v))
            found.append(v)
    return found


def compile_origin() -> tuple:
    """((compile context, attempt), does this compile continue a call already under way?) of
    the Dynamo compile in progress, so ``last_report`` can hold every graph of
    one model call. DDPOptimizer compiles several subgraphs under one compile
    id. A graph break runs part of a frame eagerly: Dynamo then compiles
    nested frames it calls and a resume function for the rest, each while the
    user's frame is executing. A first compile of a call has only
    ``nn.Module`` call plumbing between Dynamo's ``compile_wrapper``
    (torch/_dynamo/eval_frame.py) and its frame callback
    (torch/_dynamo/convert_frame.py); a continuation has the user's code
    there. (Those file and function names, and ``CompileContext.
    current_compile_id``, are private; torch 2.13.0.) Third: the call's
    tensor arguments (positional and keyword), to check that a continuation
    belongs to the same call as the graphs before it; fourth: the
    ``nn.Module`` called (None for a function), whose names the report
    uses. ``(None, False, (), None)`` outside Dynamo."""
    import sys

    try:
        from torch._guards import CompileContext

        # The context object, not its id string: ids restart at "0/0" after
        # torch._dynamo.reset(). The caller keeps it, so it cannot be reused.
        cid = CompileContext.try_get()
    except Exception:
        return None, False, (), None
    frame, seen_callback, continues, call, module = sys._getframe(1), False, False, (), None
    while frame is not None:
        fname = frame.f_code.co_filename.replace("\\", "/")
        if fname.endswith("torch/_dynamo/convert_frame.py"):
            seen_callback, continues = True, False
        elif seen_callback:
            if fname.endswith("torch/_dynamo/eval_frame.py") and frame.f_code.co_name == "compile_wrapper":
                # The call's tensor arguments, positional and keyword (HF
                # models are called ``model(**inputs)``), tell two calls
                # apart (frame objects are not weak-referenceable and their
                # ids are reused); the module called, for its names.
                local = frame.f_locals
                call = tuple(_tensors_in((local.get("args") or (), local.get("kwargs") or {})))
                module = getattr(local.get("fn"), "__self__", None)
                module = module if isinstance(module, torch.nn.Module) else None
                break
            if not fname.endswith("torch/nn/modules/module.py"):
                continues = True
        frame = frame.f_back
    else:
        continues = False  # no compile_wrapper: not a torch.compile call we can place
    del frame
    # A restarted analysis (attempt + 1) compiles the same graph again: a new
    # report, not a second graph of the call.
    return ((cid, getattr(cid, "attempt", None)) if cid is not None else None), continues, call, module


def _tensors_in(obj, depth: int = 0):
    """The tensors in a call's arguments: in tuples, lists and dicts too."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _tensors_in(v, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, depth + 1)


def clone_dynamo_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of Dynamo's GraphModule that the passes may rewrite.

    Dynamo reads its own graph again after the backend returns (it iterates
    the placeholders' ``meta['grapharg']``), so rewriting it in place breaks
    Dynamo. The copy must keep what AOTAutograd reads from Dynamo graphs
    (torch 2.13.0): ``gm.meta`` (``dynamo_compile_id``), the
    ``_param_name_to_source`` attribute and each placeholder's
    ``_dynamo_source``."""
    graph = torch.fx.Graph()
    env = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    for old, new in env.items():
        if old.op == "placeholder" and hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    new_gm = torch.fx.GraphModule(gm, graph)
    new_gm.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        new_gm._param_name_to_source = gm._param_name_to_source
    # Higher-order ops' bodies (activation checkpointing, wrap) are
    # submodules the new GraphModule shares with Dynamo's: copy them too, so
    # a rewrite inside a body changes neither Dynamo's graph nor the fallback.
    copied = set()
    for node in new_gm.graph.nodes:
        if node.op == "get_attr" and "." not in node.target and node.target not in copied:
            sub = getattr(new_gm, node.target, None)
            if isinstance(sub, torch.fx.GraphModule):
                copied.add(node.target)
                setattr(new_gm, node.target, clone_dynamo_graph(sub))
    return new_gm


def current_tx():
    """The translator of the frame Dynamo is tracing now
    (``InstructionTranslator.current_tx()``, private; torch 2.13.0), or None."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx()
    except Exception:
        return None


def compiler_fn_of(tx):
    """The backend the trace ``tx`` compiles for, as Dynamo holds it
    (``tx.output.compiler_fn``, private; torch 2.13.0)."""
    return getattr(getattr(tx, "output", None), "compiler_fn", None)


def lookup_backend(name):
    """A ``torch.compile`` backend by name (``torch._dynamo.backends.registry.
    lookup_backend``, private; torch 2.13.0)."""
    from torch._dynamo.backends.registry import lookup_backend as _lookup

    return _lookup(name)


def unbacked_sizes_allowed(t) -> bool:
    """Whether the fake mode ``t`` belongs to lets an op's fake create a
    size known only at run time (``ctx.new_dynamic_size()``): Dynamo's
    shape environment does only with
    ``torch._dynamo.config.capture_dynamic_output_shape_ops=True``
    (``ShapeEnv.allow_dynamic_output_shape_ops``, private; torch
    2.11.0-2.15.0); otherwise the fake raises
    ``DynamicOutputShapeException`` and the backend fails."""
    mode = getattr(t, "fake_mode", None)
    env = getattr(mode, "shape_env", None)
    return bool(env is not None and getattr(env, "allow_dynamic_output_shape_ops", False))


def eager_run_inside_compile() -> Optional[str]:
    """Where an eager call runs relative to ``torch.compile``: ``"limit"``
    inside a compiled function whose frame Dynamo now only runs eagerly (its
    recompile limit was reached: the frame's callback is ``False``, Dynamo's
    RUN_ONLY), ``"break"`` inside a compiled function that Dynamo traced
    until a graph break and runs this call eagerly (a callback is set), None
    outside any compiled function. ``torch._C._dynamo.eval_frame.
    get_eval_frame_callback`` is private (checked on 2.11.0, 2.13.0, 2.15.0).
    Call it only in eager code: Dynamo cannot trace it."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback

        cb = get_eval_frame_callback()
    except Exception:  # pragma: no cover - a torch without it: unknown, say nothing
        return None
    if cb is None:
        return None
    return "limit" if cb is False else "break"


#: Dynamo's config names, as messages to the user spell them.
RECOMPILE_LIMIT = "torch._dynamo.config.recompile_limit"
ALLOW_RNN = "torch._dynamo.config.allow_rnn"


def fill_example_values(gm: torch.fx.GraphModule) -> int:
    """Give each node a rewrite added to a Dynamo graph the fake value Dynamo
    gives its own (``node.meta["example_value"]``, private; torch
    2.11.0-2.15.0), computed under the graph's fake mode from its inputs'.
    AOTAutograd's cache refuses a graph where a method is called on a node
    without one ("Unsupported call_method target getitem"), and every
    process then traces the graph again. A node whose value cannot be
    computed (an input without one) is left without: the cache bypasses
    that graph, as before. ``ShapeEnv.ignore_fresh_unbacked_symbols``
    (private; torch 2.11.0-2.15.0) keeps a size made here out of Dynamo's
    pending list. Returns how many were filled."""
    mode = _fake_mode_of(gm)
    if mode is None:
        return 0
    missing = object()

    def value(a):
        if isinstance(a, torch.fx.Node):
            v = a.meta.get("example_value", missing)
            if v is missing:
                raise LookupError(a.name)
            return v
        return a

    # Only functions and ops: a callable object (an RNN's call carrying its
    # settings) is not cacheable anyway, and running it here would run its
    # path once more for nothing, or make sizes only its kernel knows
    # (unbacked symbols) that no output returns.
    plain = (types.FunctionType, types.BuiltinFunctionType, torch._ops.OpOverload, torch._ops.OpOverloadPacket)
    needed = _nodes_the_cache_checks(gm)
    filled = 0
    env = getattr(mode, "shape_env", None)
    quiet = getattr(env, "ignore_fresh_unbacked_symbols", None)
    with mode, (quiet() if quiet is not None else contextlib.nullcontext()):
        for node in gm.graph.nodes:
            if node not in needed or node.op not in ("call_function", "call_method"):
                continue
            if node.op == "call_function" and not isinstance(node.target, plain):
                continue
            try:
                args = torch.fx.node.map_aggregate(node.args, value)
                kwargs = torch.fx.node.map_aggregate(node.kwargs, value)
                if node.op == "call_method":
                    out = getattr(args[0], node.target)(*args[1:], **kwargs)
                else:
                    out = node.target(*args, **kwargs)
            except Exception:  # left without: the caches bypass this graph
                continue
            node.meta["example_value"] = out
            filled += 1
    return filled


def _fake_mode_of(gm: torch.fx.GraphModule):
    """The fake mode of the first placeholder's example value that has one, or None."""
    for node in gm.graph.find_nodes(op="placeholder"):
        mode = getattr(node.meta.get("example_value"), "fake_mode", None)
        if mode is not None:
            return mode
    return None


def _nodes_the_cache_checks(gm: torch.fx.GraphModule) -> set:
    """Only what the cache's check reads: the nodes without an example
    value that a method is called on, and the nodes their values need."""
    needed: set = set()

    def need(n) -> None:
        if isinstance(n, torch.fx.Node) and n not in needed and "example_value" not in n.meta:
            needed.add(n)
            for a in n.all_input_nodes:
                need(a)

    for node in gm.graph.nodes:
        if node.op == "call_method" and node.args:
            need(node.args[0])
    return needed


_END_CALLBACKS: dict = {}  # fn -> the end callback registered for it


def on_compile_end(fn) -> bool:
    """Have ``fn(failed)`` called after each Dynamo frame compile (``failed``:
    it raised; nothing of it is cached). Dynamo runs end callbacks in a
    ``finally`` (``callback_handler.install_callbacks``, torch 2.13.0),
    where the exception on its way out is ``sys.exc_info()``;
    ``torch._dynamo.reset()`` clears them, so this registers ``fn`` again
    where missing. False where this torch has no such hook."""
    handler = getattr(getattr(torch._dynamo, "callback", None), "callback_handler", None)
    if handler is None or not hasattr(handler, "register_end_callback"):
        return False
    end = _END_CALLBACKS.get(fn)
    if end is None:
        def end(_args) -> None:
            try:
                fn(sys.exc_info()[1] is not None)
            except Exception:  # never fail a compile over this
                pass
        _END_CALLBACKS[fn] = end
    if end not in getattr(handler, "end_callbacks", ()):
        handler.register_end_callback(end)
    return True
