"""Calls of a captured RNN that ran eagerly inside a compiled function,
counted on the RNN's report row with the reason (``packed.sequence.rnn_forward``
calls ``note_eager_call`` in eager code)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from .._torch import dynamo as _dynamo
from ..core.notes import records_of
from ..core.runtime import note_provisional
from .spec import flat_weight_names

__all__ = ["note_eager_call"]


#: Why a captured RNN's call ran eagerly inside a compiled function.
_EAGER_WHY = {
    "limit": ("Dynamo runs the function that calls it eagerly: its recompile limit "
              f"({_dynamo.RECOMPILE_LIMIT}) was reached, as each new {{what}} compiled a graph of its own"),
    "break": "a graph break left the call out of the compiled graph",
    "subclass": ("its class overrides permute_hidden or check_forward_args, which wfpass does not put into the "
                 "graph for a PackedSequence: Dynamo calls it eagerly"),
}


def note_eager_call(module: nn.Module, packed: bool, where: Optional[str] = None) -> None:
    """Count one call of a captured RNN that ran eagerly inside a compiled
    function (``rnn_forward`` calls this in eager code) on the RNN's row of
    ``wfpass.report(model)``: ``eager_calls``, and the row says why. Outside
    any compiled function nothing is counted: the user ran the model eagerly.
    ``where``: why, where the caller knows (a key of ``_EAGER_WHY``)."""
    if torch.compiler.is_compiling():  # Dynamo tracing a frame that calls this (an error's retry): not a run
        return
    where = where or _dynamo.eager_run_inside_compile()
    if where is None:
        return
    try:
        names = flat_weight_names(module)
        first = getattr(module, names[0])
    except (AttributeError, IndexError):  # not an RNN's weights any more: nothing to file under
        return
    recs = [r for r in records_of(first) if r.pattern == "rnn"]
    if not recs:  # no compile filed a row for it yet: one saying it ran eagerly
        label = f"nn.{type(module).__name__}"
        rec = note_provisional("rnn", f"{label}: this call ran eagerly, unchanged", names,
                               [getattr(module, n) for n in names])
        if rec is None:
            return
        recs = [rec]
    rec = recs[-1]
    rec.bump("eager_calls")
    what = "Python value or shape it was called with (a lengths list of a new size)" if packed else "Python value or shape it was called with"
    rec.detail["ran_eagerly"] = _EAGER_WHY[where].format(what=what)
