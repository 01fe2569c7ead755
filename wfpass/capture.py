"""What Dynamo puts into the graph for a wformat backend: wfpass's decisions,
installed into the private-PyTorch layer (``wfpass._torch.dynamo_hooks``), which
calls them while Dynamo traces.

* **RNN capture**: Dynamo graph-breaks on ``nn.RNN/GRU/LSTM`` unless
  ``allow_rnn``; for a wformat backend whose config runs ``fuse_rnn``, on
  CPU modules, wfpass lets it in (``install_rnn_capture``, called when the
  ``fuse_rnn`` format is imported).
* **BatchNorm graph breaks**: which BatchNorm (``momentum=None``) is about to
  stop the compile (``install_item_break_probe``, called by
  ``fp32_batchnorm``).
* **Which backend is ours**: ``wformat_config`` finds the ``Config`` of a
  wformat backend through Dynamo's wrappers: every wformat backend (the
  registered ``wformat`` function too) carries it as ``.config``, so this
  module never imports ``wfpass.compiler``.
"""
from __future__ import annotations

import collections
import functools
import types
import weakref
from typing import Callable, Optional, Tuple

import torch

from ._torch import dynamo as _dynamo, dynamo_hooks as _hooks, rnn_fake as _rnn_fake
from .config import Config


def wformat_config(compiler_fn) -> Optional[Config]:
    """The ``Config`` of the wformat backend ``compiler_fn`` is or calls, or
    None. Dynamo holds a backend wrapped (``WrapBackendDebug`` around
    ``_TorchCompileWrapper`` around ours, torch 2.13.0); backends built by
    ``wfpass.backend(...)`` carry their ``Config`` as ``.config`` (kept by
    ``functools.wraps`` wrappers). A user's backend that calls one is
    searched for it (``_reachable``): where it holds it, however (a global
    or closure variable its code names, an attribute, a
    ``functools.partial`` argument, a callable object's ``__call__``)."""
    return _search(compiler_fn)[0]


def _search(root) -> Tuple[Optional[Config], bool]:
    """(the first ``Config`` a wformat backend reachable from ``root``
    carries, or None; whether anything reached is wfpass's: a backend that
    calls wfpass in a way not followed here). Breadth first, at most
    ``_BUDGET`` objects, so the nearest backend wins."""
    queue, seen, mentions = [(root, 0)], set(), False
    while queue and len(seen) < _BUDGET:
        obj, depth = queue.pop(0)
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        try:
            cfg = getattr(obj, "config", None) if callable(obj) else None
            if isinstance(cfg, Config):
                return cfg, True
            mentions = mentions or _is_wfpass(obj)
            if depth < _DEPTH:
                queue.extend((o, depth + 1) for o in _reachable(obj))
        except Exception:  # a user's object that refuses to be looked at: not ours
            continue
    return None, mentions


#: How many objects ``_search`` looks at from one backend, and how deep.
_BUDGET, _DEPTH = 400, 8
_SKIP = (torch.Tensor, torch.nn.Module, type, str, bytes, int, float, bool)


def _is_wfpass(obj) -> bool:
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    return isinstance(name, str) and (name == "wfpass" or name.startswith("wfpass."))


def _reachable(obj) -> list:
    """What a backend ``obj`` may call its wformat backend through."""
    if isinstance(obj, _SKIP) or isinstance(obj, types.ModuleType):
        return []
    if isinstance(obj, dict):
        return list(obj.values())[:64]
    if isinstance(obj, (list, tuple)):
        return list(obj[:64])
    out = [getattr(obj, a, None) for a in ("_torchdynamo_orig_backend", "compiler_fn", "__wrapped__")]
    # DistributedDataParallel: Dynamo compiles through the bound method
    # DDPOptimizer.compile_fn, whose object holds the backend as
    # ``backend_compile_fn`` (torch/_dynamo/backends/distributed.py, 2.13.0).
    out.append(getattr(getattr(obj, "__self__", None), "backend_compile_fn", None))
    plain = isinstance(obj, (types.FunctionType, types.MethodType))
    origin = getattr(obj if plain else type(obj), "__module__", "")
    if isinstance(origin, str) and (origin == "torch" or origin.startswith("torch.")):
        return out  # PyTorch's own wrappers and backends: only the backend they wrap
    if _is_wfpass(obj) and isinstance(obj, types.FunctionType):  # wfpass's own helpers: what they close over
        return out + [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
    if isinstance(obj, functools.partial):
        return out + [obj.func, *obj.args, *obj.keywords.values()]
    if isinstance(obj, types.MethodType):
        return out + [obj.__func__, obj.__self__]
    if isinstance(obj, types.FunctionType):
        return out + _function_refs(obj)
    if callable(obj) and hasattr(obj, "__dict__"):  # a callable object: its attributes, its __call__'s names
        call = getattr(type(obj), "__call__", None)
        refs = _function_refs(call) if isinstance(call, types.FunctionType) else []
        return out + list(vars(obj).values())[:64] + refs
    return out


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def _function_refs(fn: types.FunctionType) -> list:
    """The objects ``fn``'s code can reach by name: its closure cells, the
    globals its code names (``co_names``, nested functions' too) and, for a
    module it names, those names as the module's attributes (``mod.backend``)."""
    out = [c.cell_contents for c in fn.__closure__ or () if _filled(c)]
    names, codes = [], [fn.__code__]
    while codes:
        code = codes.pop()
        names.extend(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    g = fn.__globals__
    found = [g[n] for n in names if n in g]
    for mod in (v for v in found if isinstance(v, types.ModuleType)):
        out.extend(getattr(mod, n) for n in names if n != mod.__name__ and hasattr(mod, n))
        if _is_wfpass(mod):
            out.append(mod)
    return out + [v for v in found if not isinstance(v, types.ModuleType)]


def rnn_capture_wanted(compiler_fn) -> bool:
    """Is ``compiler_fn`` a wformat backend whose config runs ``fuse_rnn``?"""
    cfg = wformat_config(compiler_fn)
    return cfg is not None and cfg.runs("fuse_rnn")


def cudnn_capture_wanted(compiler_fn) -> bool:
    """Is ``compiler_fn`` a wformat backend that puts CUDA RNNs on cuDNN?"""
    cfg = wformat_config(compiler_fn)
    return cfg is not None and cfg.runs("fuse_rnn") and cfg.rnn.cuda == "cudnn"


def _uncapturable_off_cpu(module: torch.nn.Module, config: Optional[Config]) -> str:
    """Why an RNN stays out of the graph, or "" where it goes in: CPU
    modules go in; CUDA modules go in as one cuDNN call
    (``wfpass.rnn.cuda.cudnn``) where ``rnn.cuda="cudnn"``; other devices stay
    out."""
    devices = {p.device.type for p in module.parameters()}
    if devices <= {"cpu"}:
        return ""
    if devices != {"cuda"}:
        return f"parameters on {', '.join(sorted(devices))}"
    if config is None or config.rnn.cuda != "cudnn":
        return "on CUDA PyTorch's cuDNN path runs it, as without wfpass (rnn={'cuda': 'cudnn'} puts it in the graph)"
    return ""


def install_rnn_capture(name_errors: Callable, note_seen: Callable) -> None:
    """Let Dynamo put RNNs into the graph for wformat backends that run
    ``fuse_rnn``. ``name_errors(module, path)`` gives the RNN Dynamo is
    wrapping errors that name it; ``note_seen(module, path)`` files the
    record that stands if the call never reaches a graph (both in
    ``wfpass.rnn.capture``)."""

    def policy(compiler_fn, module, source_name: str) -> bool:
        config, mentions = _search(compiler_fn)
        wanted = config is not None and config.runs("fuse_rnn")
        if module is None:
            return wanted
        path = _dynamo.module_name_from_source(source_name) if source_name else ""
        if config is None:
            _left_out(compiler_fn, module, path, mentions)
            return False
        if not wanted:
            return False
        try:
            name_errors(module, path)
            _hooks.refresh_flat_weight_refs(module)
        except Exception:  # never break a trace over this: capture it unnamed
            return wanted
        why = _uncapturable_off_cpu(module, config)
        if not config.dry_run:  # explain() files nothing
            note_seen(module, path, why)
        if why:
            # Left to a graph break: it runs eagerly, as without wfpass.
            return False
        return wanted

    _NOTE_SEEN[0] = note_seen
    _NAME_ERRORS[0] = name_errors
    _hooks.install_rnn_capture(policy)
    # pack_padded_sequence / pad_packed_sequence go into the graph for the
    # same backends (wfpass.rnn.varlen.sequence).
    _hooks.install_packed_capture(rnn_capture_wanted)
    # Their example values on CUDA keep a symbolic length symbolic.
    _rnn_fake.install_cuda_rnn_example_values(cudnn_capture_wanted)


#: Why the RNNs of a trace went unasked (``note_unasked_rnns``).
_ALLOW_RNN_LATE = (f"{_dynamo.ALLOW_RNN} was set to True after wfpass was imported, so Dynamo traced "
                   "this RNN's own forward, which graph-breaks on a PackedSequence; set it before importing wfpass "
                   "or leave it unset (wformat takes RNNs into the graph without it)")


def note_unasked_rnns() -> None:
    """The trace a wformat backend compiles now wrapped RNNs without asking
    wfpass (a plain ``allow_rnn = True`` set after import; the stand-in is
    back for later traces, ``dynamo_hooks.ensure_rnn_capture``). The RNNs
    the frame reaches get what the policy gives (``rnn_forward``, which
    counts their eager calls, and named errors) and a row saying why their
    packed calls of this frame run eagerly."""
    if _NOTE_SEEN[0] is None or _NAME_ERRORS[0] is None:
        return
    for root in _dynamo.traced_frame_modules():
        for path, module in root.named_modules():
            if isinstance(module, torch.nn.RNNBase) and "forward" not in module.__dict__:
                try:
                    _NAME_ERRORS[0](module, path)
                    _NOTE_SEEN[0](module, path, _ALLOW_RNN_LATE)
                except Exception:  # never fail a compile over a report row
                    continue


# -- RNNs left out for a backend that calls wformat where wfpass cannot see it --------

_NOTE_SEEN: list = [None]
_NAME_ERRORS: list = [None]
# (the backend Dynamo holds, the RNN, its path), held weakly, for RNNs Dynamo left
# out of a trace for a backend wfpass did not recognise; the newest few.
_LEFT_OUT: "collections.deque" = collections.deque(maxlen=64)


def _left_out(compiler_fn, module: torch.nn.Module, path: str, mentions: bool) -> None:
    """An RNN Dynamo leaves out of the graph for a backend in which no
    wformat backend was found. If that backend turns out to call one (it
    hands wfpass a graph: ``note_left_out``), or its code names wfpass,
    the RNN gets a row saying it ran eagerly and why."""
    try:
        held = weakref.ref(compiler_fn)
    except TypeError:  # not weakly referenceable: held while it is among the newest
        held = (lambda fn: lambda: fn)(compiler_fn)
    _LEFT_OUT.append((held, weakref.ref(module), path))
    if mentions and _NOTE_SEEN[0] is not None:
        _NOTE_SEEN[0](module, path, _unseen_why(compiler_fn))


def note_left_out(report) -> None:
    """Called by a wformat backend while it compiles: where Dynamo holds a
    backend that wfpass did not recognise as one that calls wformat (this
    call proves it does), the RNNs Dynamo left out of this trace for it get
    a ``skipped`` row, in ``report`` and ``wfpass.report(model)``."""
    fn = _dynamo.compiler_fn_of(_dynamo.current_tx())
    if fn is None or _NOTE_SEEN[0] is None or not _LEFT_OUT:
        return
    for held, ref, path in list(_LEFT_OUT):
        module = ref()
        if held() is fn and module is not None:
            rec = _NOTE_SEEN[0](module, path, _unseen_why(fn))
            if rec is not None and not any(r is rec for r in report.records):
                report.records.append(rec)


def _unseen_why(compiler_fn) -> str:
    fn = compiler_fn
    for _ in range(4):  # Dynamo's wrappers around the user's backend
        fn = getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None) or fn
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return (f"the torch.compile backend {name!r} calls a wformat backend that wfpass cannot find from it, so "
            "Dynamo was not told to take RNNs into the graph; give it the wformat backend's options "
            f"({name}.config = wformat_backend.config) or hold the wformat backend in a global, a closure, an "
            "attribute or a functools.partial (README, 'Your own backend')")


def install_item_break_probe(note_item_break: Callable) -> None:
    """Tell the user which BatchNorm (``momentum=None``) stops a compile for
    a wformat backend: ``note_item_break(module, path, config)``
    (``batchnorm.eager.note_item_break``)."""

    def hook(module, source_name: str, compiler_fn) -> None:
        config = wformat_config(compiler_fn)
        if config is not None:
            note_item_break(module, _dynamo.module_name_from_source(source_name) if source_name else "", config)

    _hooks.install_item_break_probe(hook)
