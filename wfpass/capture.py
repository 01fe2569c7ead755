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

from typing import Callable, Optional

import torch

from ._torch import dynamo as _dynamo, dynamo_hooks as _hooks
from .config import Config


def wformat_config(compiler_fn) -> Optional[Config]:
    """The ``Config`` of the wformat backend ``compiler_fn`` is, or None.
    Dynamo holds a backend wrapped (``WrapBackendDebug`` around
    ``_TorchCompileWrapper`` around ours, torch 2.13.0); backends built by
    ``wfpass.backend(...)`` carry their ``Config`` as ``.config`` (kept by
    ``functools.wraps`` wrappers)."""
    fn = compiler_fn
    for _ in range(8):
        if fn is None:
            return None
        cfg = getattr(fn, "config", None)
        if isinstance(cfg, Config):
            return cfg
        fn = (
            getattr(fn, "_torchdynamo_orig_backend", None)
            or getattr(fn, "compiler_fn", None)
            or getattr(fn, "__wrapped__", None)
            # DistributedDataParallel: Dynamo compiles through the bound method
            # DDPOptimizer.compile_fn, whose object holds our backend as
            # ``backend_compile_fn`` (torch/_dynamo/backends/distributed.py, 2.13.0).
            or getattr(getattr(fn, "__self__", None), "backend_compile_fn", None)
            # A plain function wrapping a wformat backend (``wfpass.explain``'s
            # collector): the backend it closes over.
            or _closed_over_backend(fn)
        )
    return None


def rnn_capture_wanted(compiler_fn) -> bool:
    """Is ``compiler_fn`` a wformat backend whose config runs ``fuse_rnn``?"""
    cfg = wformat_config(compiler_fn)
    return cfg is not None and cfg.runs("fuse_rnn")


def _closed_over_backend(fn):
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            c = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(c) and isinstance(getattr(c, "config", None), Config):
            return c
    return None


def _uncapturable_off_cpu(module: torch.nn.Module, config: Optional[Config]) -> str:
    """Why an RNN stays out of the graph, or "" where it goes in: CPU
    modules go in; CUDA modules go in as one cuDNN call
    (``wfpass.rnn.cudnn``) where ``rnn.cuda="cudnn"``; other devices stay
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
        wanted = rnn_capture_wanted(compiler_fn)
        if not wanted or module is None:
            return wanted
        path = _dynamo.module_name_from_source(source_name) if source_name else ""
        try:
            name_errors(module, path)
            _hooks.refresh_flat_weight_refs(module)
        except Exception:  # never break a trace over this: capture it unnamed
            return wanted
        config = wformat_config(compiler_fn)
        why = _uncapturable_off_cpu(module, config)
        if config is not None and not config.dry_run:  # explain() files nothing
            note_seen(module, path, why)
        if why:
            # Left to a graph break: it runs eagerly, as without wfpass.
            return False
        return wanted

    _hooks.install_rnn_capture(policy)
    # pack_padded_sequence / pad_packed_sequence go into the graph for the
    # same backends (wfpass.rnn.packed).
    _hooks.install_packed_capture(rnn_capture_wanted)


def install_item_break_probe(note_item_break: Callable) -> None:
    """Tell the user which BatchNorm (``momentum=None``) stops a compile for
    a wformat backend: ``note_item_break(module, path, config)``
    (``batchnorm.eager.note_item_break``)."""

    def hook(module, source_name: str, compiler_fn) -> None:
        config = wformat_config(compiler_fn)
        if config is not None:
            note_item_break(module, _dynamo.module_name_from_source(source_name) if source_name else "", config)

    _hooks.install_item_break_probe(hook)
