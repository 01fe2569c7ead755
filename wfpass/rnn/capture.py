"""When Dynamo captures an RNN for a wformat backend: its argument errors
name it, and a record stands until the pass files its own. (Whether Dynamo
captures it at all is decided in ``wfpass.capture``, the ``allow_rnn``
hook, which calls these.)"""
from __future__ import annotations

import functools
import weakref

import torch.nn as nn

from .._torch import dynamo as _dynamo
from ..core.runtime import note_provisional
from .varlen.sequence import install_forward, uninstall_forward
from .spec import display_name, flat_weight_names, overrides_forward, rnn_mode

__all__ = ["name_errors", "unname_errors", "note_seen"]


def _named_check_forward_args(module: nn.Module, name: str, input, hx, batch_sizes) -> None:
    """``nn.RNNBase.check_forward_args`` with the RNN's name in its errors:
    same exception type, message ``"'enc' (nn.LSTM): <eager's message>"``."""
    try:
        type(module).check_forward_args(module, input, hx, batch_sizes)
    except (RuntimeError, ValueError, TypeError) as e:
        raise type(e)(f"{name}: {e}") from None


def name_errors(module: nn.Module, path: str) -> None:
    """Make ``module``'s argument-check errors name it (wrong input size,
    hidden state shape, dtype).

    Why an instance attribute: under ``torch.compile`` a bad input makes the
    check raise while Dynamo traces ``nn.LSTM.forward``; Dynamo then runs the
    frame eagerly and eager's check raises, before any graph (or this pass)
    is involved. The ``forward`` of ``nn.LSTM/GRU/RNN`` looks the check up
    as ``self.check_forward_args``, so an instance attribute is the one
    place both Dynamo's trace and that eager run read. It is a
    ``functools.partial`` of a module-level function, so ``copy.deepcopy``
    and pickling keep working; ``wfpass.restore`` removes it.
    ``wfpass.capture`` calls this when Dynamo first wraps the RNN for a wformat
    backend, i.e. before the first call's checks run."""
    # Its PackedSequence calls go into the graph too (``packed/sequence.py``).
    # A class with a forward of its own gets nothing (``install_forward``).
    fresh = "forward" not in module.__dict__ and "check_forward_args" not in module.__dict__
    install_forward(module)
    mode = rnn_mode(module)
    if mode is not None and "check_forward_args" not in module.__dict__:
        module.__dict__["check_forward_args"] = functools.partial(_named_check_forward_args, module,
                                                                  display_name(path, mode))
    if fresh and ("forward" in module.__dict__ or "check_forward_args" in module.__dict__):
        _installed_now(module)


#: Modules given an attribute during the Dynamo compile in progress (weakly).
_INSTALLED_NOW: "weakref.WeakSet" = weakref.WeakSet()


def _installed_now(module: nn.Module) -> None:
    """Remember ``module`` until the compile in progress ends: if it fails,
    the forward wrapper ``name_errors`` installed goes again, so a compile
    that raised leaves the module's forward as it was (a compile that succeeded keeps it:
    the compiled graph's guards hold the attribute, and removing it would
    recompile at every call)."""
    _dynamo.on_compile_end(_compile_ended)  # again where torch._dynamo.reset() cleared it
    _INSTALLED_NOW.add(module)


def _compile_ended(failed: bool) -> None:
    modules = list(_INSTALLED_NOW)
    _INSTALLED_NOW.clear()
    if failed:
        # The forward wrapper goes; the named argument check stays: Dynamo
        # runs a frame that failed to compile eagerly, and the check's error
        # then names the RNN (same exception type, eager's message after it).
        for m in modules:
            uninstall_forward(m)


def unname_errors(module: nn.Module) -> bool:
    """Undo ``name_errors``; True if there was something to undo."""
    undone = uninstall_forward(module)
    f = module.__dict__.get("check_forward_args")
    if isinstance(f, functools.partial) and f.func is _named_check_forward_args:
        del module.__dict__["check_forward_args"]
        return True
    return undone


def note_seen(module: nn.RNNBase, path: str, why: str = ""):
    """File a provisional record for an RNN Dynamo is about to inline for a
    wformat backend. If the call reaches a graph, the pass's own record
    replaces it; if it never does (a ``PackedSequence`` input: Dynamo breaks
    on ``pack_padded_sequence`` and again inside ``forward``, and no backend
    is called for that code), ``wfpass.report(model)`` still says so.
    ``why``: wfpass itself left the call out of the graph, for this reason.
    Returns the record (``runtime.note_provisional``)."""
    own = flat_weight_names(module)  # public attributes: subclasses of nn.LSTM too
    names = [f"{path}.{n}" if path else n for n in own]
    label = f"'{path}' (nn.{type(module).__name__})" if path else f"nn.{type(module).__name__}"
    if why:
        reason = f"{label}: left out of the compiled graph ({why}): it runs eagerly, unchanged"
    elif overrides_forward(module):
        reason = (f"{label}: its class overrides forward, so wfpass installs nothing on it and rewrites the "
                  f"RNN calls that forward makes (a padded "
                  "batch); this call never reached a compiled graph (a PackedSequence, on which nn.RNNBase's "
                  "forward graph-breaks, or a graph break in the class's forward): it runs eagerly, unchanged")
    else:
        reason = (f"{label}: Dynamo did not put this call into a compiled graph (a PackedSequence "
                  "input, or a graph break inside the RNN): it runs eagerly, unchanged")
    return note_provisional("rnn", reason, names, [getattr(module, n) for n in own])

