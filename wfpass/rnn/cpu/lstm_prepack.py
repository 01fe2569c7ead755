"""An inference LSTM layer's weights in oneDNN's own layout, made once.

ATen's oneDNN LSTM layer (``aten.mkldnn_rnn_layer``, what
``wfpass::lstm_layer`` calls) reorders both weights of a layer into
oneDNN's layout on every call it is given plain weights: measured here
(torch 2.13, 1 thread, AMD EPYC with AVX-512) 23-53 us of a call at
hidden 64-128, 2.5 ms of a 2.7 ms step at hidden 512
(``benchmarks/rnn/lstm_pack_kernel.py``, docs/rnn.md). Given the
weights already in that layout (torch's
``mkldnn::_reorder_mkldnn_rnn_layer_weight``, what Inductor's freezing
passes give it) it skips the reorder, and computes the same bits.

So a compiled inference graph whose LSTM runs oneDNN's layer op keeps such a
copy per layer and direction beside the parameters: the parameters stay
the truth (the state_dict, the optimizer, the backward read them); the copy
is derived state under the packed-weight format's rules (``docs/guide/prepack.md``):

* made only where the rewrite allowed it (``allow``: a float32 or bfloat16
  (where oneDNN runs it) CPU LSTM on
  oneDNN's path in a graph that computes no gradient, ``prepack.mode`` not
  ``"off"``); training graphs read the parameters;
* counted with the packed linears' copies against ``prepack.max_bytes`` (by
  default the weights' bytes); a pair over it runs on its parameters
  (``over_bound_calls``), and is asked again when the budget grows;
* never stale: every call checks the pair's addresses, version counters and
  a sample of their bits (``SAMPLE`` elements each), and a change makes the
  copy again (``repacked``);
* in the report: the row's ``packed_calls`` and ``packed_bytes``, and its
  words.

The per-call check runs in C++ (``native/rnn/rnn.cpp``), which asks
``_lstm_pack_ask`` (here) where it has no answer; without the C++ build the
Python kernel (``lstm_layer.py``) calls ``packed_pair`` itself.

The copy's layout is the one oneDNN picks for the shape of the call that made
it (length and batch); a call of another shape reads it as it is, and
oneDNN converts it if its kernel for that shape wants another (measured: no
conversion between lengths 1-16 and batches 1-8 on the machines above).
"""
from __future__ import annotations

import itertools
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..._torch import kernels as _k, tensors as _tensors
from ... import native as _native
from ...prepack import kernel as _pk
from ...native import schemas as _schemas

__all__ = ["allow", "packed_pair", "drop", "count_python_call", "reconsider"]

#: Elements of each weight compared bit for bit on every call.
SAMPLE = _pk.SAMPLE

_IDS = itertools.count(1)


class _Pair:
    """One layer direction's weights the rewrite allowed a copy for: its
    record, the budget's option, and the copy (if made) with what it was
    made from."""

    __slots__ = ("id", "record", "max_bytes", "w_hh", "copy", "nbytes", "made_from", "refused", "__weakref__")

    def __init__(self, record, max_bytes, w_hh: torch.Tensor):
        self.id = next(_IDS)
        self.record, self.max_bytes = record, max_bytes
        self.w_hh = weakref.ref(w_hh)
        self.copy: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.nbytes = 0
        self.made_from: Optional[tuple] = None  # (ptrs, versions, samples) of the pair when copied
        self.refused = False


# w_ih -> its pair (weak, identity keys: the copy dies with the parameter).
_PAIRS = _tensors.weak_id_key_dict()


def allow(record, weights: Sequence[Tuple[torch.Tensor, torch.Tensor]], max_bytes) -> None:
    """Let these (w_ih, w_hh) pairs of one LSTM have a copy in oneDNN's
    layout, counted on ``record``; ``max_bytes``: ``prepack.max_bytes``."""
    flat = [w for pair in weights for w in pair]
    _pk.note_weights(flat)
    for w_ih, w_hh in weights:
        p = _PAIRS.get(w_ih)
        if p is not None and p.w_hh() is w_hh:
            continue  # another graph over the same parameters: one pair, one record
        p = _Pair(record, max_bytes, w_hh)
        _PAIRS[w_ih] = p
        weakref.finalize(w_ih, _release, p)
        if _native.is_loaded():
            # A plain answer the C++ kernel holds for these addresses (the
            # pair ran before it was allowed a copy) must not stand.
            torch.ops.wfpass._lstm_pack_forget(0, w_ih, w_hh)
    for c in ("packed_calls", "packed_bytes"):
        record.stats.setdefault(c, 0)
    if _native.is_loaded():
        # The record's pairs, whose C++ counts its stats pull when read
        # (one pull per record, however many graphs allow pairs on it).
        mine = record.detail.get("_lstm_pairs")
        if mine is None:
            mine = record.detail["_lstm_pairs"] = weakref.WeakSet()
            record.stats.pull(_Counts(mine))
        for w_ih, _ in weights:
            mine.add(_PAIRS[w_ih])


class _Counts:
    """The C++ kernel's packed calls of a record's pairs since the last read."""

    __slots__ = ("pairs",)

    def __init__(self, pairs):
        self.pairs = pairs

    def __call__(self):
        ids = [p.id for p in list(self.pairs)]
        if not ids:
            return {}
        return {"packed_calls": int(torch.ops.wfpass._lstm_pack_take_calls(ids))}


def _release(p: _Pair) -> None:
    """The pair's w_ih died (or ``drop``): free its copy's bytes."""
    if p.copy is not None:
        _pk.charge(p.record, -p.nbytes)
    p.copy, p.nbytes, p.made_from = None, 0, None
    if _native.is_loaded():
        torch.ops.wfpass._lstm_pack_forget(p.id, None, None)


def _state_of(w_ih: torch.Tensor, w_hh: torch.Tensor) -> tuple:
    return ((w_ih.data_ptr(), w_hh.data_ptr()), (w_ih._version, w_hh._version))


def _holds(p: _Pair, w_ih: torch.Tensor, w_hh: torch.Tensor) -> bool:
    if p.copy is None or p.made_from is None:
        return False
    ptrs_versions, samples = p.made_from[:2], p.made_from[2]
    return (_state_of(w_ih, w_hh) == ptrs_versions
            and torch.equal(_pk.sample_of(w_ih), samples[0]) and torch.equal(_pk.sample_of(w_hh), samples[1]))


#: The dtypes a copy is made for (where oneDNN's LSTM runs them: ``allow``'s caller checks).
DTYPES = (torch.float32, torch.bfloat16)


def _servable(w: torch.Tensor) -> bool:
    return (w.device.type == "cpu" and w.layout == torch.strided and w.dtype in DTYPES
            and w.is_contiguous() and not w.is_mkldnn)


def packed_pair(input: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, reverse: bool, hidden_size: int,
                has_biases: bool) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """The copy this inference call reads, made or made again if needed;
    None: the call reads the parameters (not allowed, over the budget, or
    oneDNN keeps this shape's weights in the plain layout)."""
    p = _PAIRS.get(w_ih)
    if (p is None or p.w_hh() is not w_hh or p.refused or not (_servable(w_ih) and _servable(w_hh))
            or not (input.dtype == w_ih.dtype == w_hh.dtype)):
        return None
    if not _holds(p, w_ih, w_hh):
        if not _make(p, input, w_ih, w_hh, reverse, hidden_size, has_biases):
            return None
    return p.copy


def _make(p: _Pair, input, w_ih, w_hh, reverse, hidden_size, has_biases) -> bool:
    old = p.nbytes
    need = (w_ih.numel() + w_hh.numel()) * w_ih.element_size()  # oneDNN's blocked copy: about the weights' bytes
    budget = _pk.over_budget(p.max_bytes, need, old)
    if budget is not None:
        _refuse(p, need, budget)
        return False
    with torch.no_grad():
        got = torch.ops.mkldnn._reorder_mkldnn_rnn_layer_weight(
            w_ih.detach(), w_hh.detach(), hidden_size, reverse, has_biases, False, list(input.shape))
    if not (got[0].is_mkldnn and got[1].is_mkldnn):
        # oneDNN keeps this shape's weights in the plain layout: it reorders
        # nothing per call, so there is nothing to keep.
        p.refused = True
        _say(p.record, "in inference oneDNN reads these weights in the plain layout on this machine: no copy")
        _release(p)
        return False
    nbytes = sum(_k.onednn_nbytes(t) for t in got)
    budget = _pk.over_budget(p.max_bytes, nbytes, old)
    if budget is not None:
        _refuse(p, nbytes, budget)
        return False
    if p.copy is not None:
        _release(p)
        p.record.bump("repacked")
    p.copy, p.nbytes = (got[0], got[1]), nbytes
    p.made_from = (*_state_of(w_ih, w_hh), (_pk.sample_of(w_ih).clone(), _pk.sample_of(w_hh).clone()))
    _pk.charge(p.record, nbytes)
    _say(p.record, "in inference oneDNN reads each layer's weights from a copy in its own layout, made once and "
                   "checked against the parameters on every call, instead of reordering them on every call "
                   "(packed_calls, packed_bytes)")
    return True


def _say(record, words: str) -> None:
    """The row's words on its copies: in ``detail["packed_weights"]`` and
    at the end of its text (replacing what this module said before)."""
    old = record.detail.get("_lstm_words")
    if old == words:
        return
    if old and f"; {old}" in record.reason:
        record.reason = record.reason.replace(f"; {old}", f"; {words}")
    else:
        record.reason += f"; {words}"
    record.detail["_lstm_words"] = record.detail["packed_weights"] = words


def _refuse(p: _Pair, need: int, budget: int) -> None:
    """Over ``prepack.max_bytes``: the pair reads its parameters until the
    budget grows (``reconsider``)."""
    _release(p)
    p.refused = True
    p.record.bump("over_bound_calls")
    whose = _pk.bound_words(p.max_bytes, budget)
    _say(p.record, f"in inference oneDNN reads the parameters, not a copy in its own layout: a copy "
                   f"({need / 2**20:.1f} MiB) would take the packed copies over their budget ({budget / 2**20:.1f} "
                   f"MiB, {whose}; {_pk.packed_bytes_alive() / 2**20:.1f} MiB in use) (over_bound_calls)")


def reconsider() -> None:
    """The ``"weights"`` budget grew: refused pairs are asked again."""
    for w_ih, p in list(_PAIRS.items()):
        if p.refused and p.max_bytes == "weights" and p.copy is None:
            p.refused = False
            if _native.is_loaded():
                w_hh = p.w_hh()
                if w_hh is not None:
                    torch.ops.wfpass._lstm_pack_forget(0, w_ih, w_hh)


def drop(w: torch.Tensor) -> int:
    """Free the copy made from ``w`` (``wfpass.restore``); the next call
    makes it again. Returns the bytes freed."""
    p = _PAIRS.get(w)
    if p is None or p.copy is None:
        return 0
    n = p.nbytes
    _release(p)
    return n


def count_python_call(w_ih: torch.Tensor) -> None:
    """The Python kernel ran a call from the copy (the C++ one counts its own)."""
    p = _PAIRS.get(w_ih)
    if p is not None:
        p.record.bump("packed_calls")


def _ask(input, w_ih, w_hh, reverse, hidden_size, has_biases) -> None:
    """The C++ kernel's question for a pair it holds no answer for: answered
    through ``_lstm_pack_put`` (a copy, or none)."""
    got = packed_pair(input, w_ih, w_hh, reverse, hidden_size, has_biases)
    if got is None and _servable(w_ih) and _servable(w_hh):
        torch.ops.wfpass._lstm_pack_put(0, w_ih, w_hh, reverse, None, None, SAMPLE)
    elif got is not None:
        p = _PAIRS[w_ih]
        torch.ops.wfpass._lstm_pack_put(p.id, w_ih, w_hh, reverse, got[0], got[1], SAMPLE)


_pk.ON_BUDGET_GROWTH.append(reconsider)

_LIB = torch.library.Library("wfpass", "FRAGMENT")
# Called only from inside the C++ kernel of wfpass::lstm_layer_fw, at run
# time: never traced, so no fake implementation.
_schemas.define(_LIB, "_lstm_pack_ask")
_LIB.impl("_lstm_pack_ask", _ask, "CompositeExplicitAutograd")
