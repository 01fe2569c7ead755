"""The packed copies behind ``wfpass::packed_linear`` (``kernel.py``) and the
budget that bounds them: made once per weight set, kernel and row count
(per row count for MKL), checked against the parameters on every call,
made again where they changed, charged to ``prepack.max_bytes`` (with the
kernels the library compiles for new row counts, ``state.py``) and dropped
with their parameter.

Separate from ``kernel.py``, which holds the op, its sites and its kernel
and asks this module for a call's copy (``fresh``): what a copy is made
from, how it is checked and what it costs are read here in one place. The
LSTMs' packed copies (``rnn/cpu/lstm_prepack.py``) share the budget and the
freshness sample (``over_budget``, ``charge``, ``sample_of``), through
``kernel``'s names. A copy's site is a ``kernel.PackSite``; this module only
reads its record, options and refusals, and does not import ``kernel``.
"""
from __future__ import annotations

import weakref
from typing import Dict, Optional, Sequence, Tuple

import torch

from .._torch import kernels as _k, tensors as _tensors
from ..native import ops as _nops
from ..core import memory as _memory
from ..core.records import Record
from ..core.runtime import note
from ..core.storage import layout_of
from . import state as _state

__all__ = ["SAMPLE", "packed_bytes_alive", "count_weights", "weight_bytes", "budget_of", "memory_bound", "bound_words", "over_budget", "charge",
           "copies_of", "drop_copies", "laid_out", "whole", "sample_of", "fresh"]

#: Elements of a weight compared bit for bit on every call.
SAMPLE = 32

_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Copy:
    """One packed copy and what it was made from."""

    __slots__ = ("packed", "ptrs", "versions", "sample", "ref", "nbytes", "site")

    def __init__(self, packed, ptrs, versions, sample, ref, nbytes, site):
        self.packed, self.ptrs, self.versions, self.sample, self.ref = packed, ptrs, versions, sample, ref
        self.nbytes, self.site = nbytes, site


# id(first member) -> (weak ref to it, {(kernel, rows, m): _Copy}). The
# copies belong to the parameter: its weak reference's callback drops them.
_COPIES: Dict[int, Tuple["weakref.ref", Dict[tuple, _Copy]]] = {}
_ALIVE = [0]  # bytes of every packed copy alive in the process


def packed_bytes_alive() -> int:
    """Bytes held by every packed copy alive in this process."""
    return _ALIVE[0]


# Every weight of the graphs the format rewrote -> its bytes (weak keys: a
# deleted model's weights leave the budget with it).
_WEIGHTS = _tensors.weak_id_key_dict()


def count_weights(tensors: Sequence[torch.Tensor]) -> bool:
    """Count ``tensors`` (a rewritten graph's parameters) into the
    ``max_bytes="weights"`` budget, each tensor once; whether it grew
    (``kernel.note_weights`` then has the sites ask the budget again)."""
    grew = False
    for t in tensors:
        if isinstance(t, torch.Tensor) and t not in _WEIGHTS:
            try:
                _WEIGHTS[t] = t.numel() * t.element_size()
                grew = True
            except TypeError:  # not weak-referenceable
                pass
    return grew


def weight_bytes() -> int:
    """Bytes of the live weights ``note_weights`` counted."""
    return sum(_WEIGHTS.values())


def budget_of(max_bytes) -> Optional[int]:
    """``prepack.max_bytes`` in bytes now: ``"weights"`` is ``weight_bytes()``,
    and no more than the copies alive plus what memory leaves for new ones
    (``core/memory.py``: a share of what the process may use, read now)."""
    if max_bytes != "weights":
        return max_bytes
    room = _memory.copy_room()
    return weight_bytes() if room is None else min(weight_bytes(), _ALIVE[0] + room)


def memory_bound(max_bytes, budget: int) -> bool:
    """Was ``budget`` (``budget_of``) set by memory rather than the weights?"""
    return max_bytes == "weights" and budget < weight_bytes()


def bound_words(max_bytes, budget: int) -> str:
    """Which bound ``budget`` came from, for a refused copy's row (the
    linears' and the LSTMs')."""
    if memory_bound(max_bytes, budget):
        return "what memory leaves: " + _memory.describe()
    return "the weights' bytes" if max_bytes == "weights" else "prepack.max_bytes"


def over_budget(max_bytes, need: int, old: int = 0) -> Optional[int]:
    """The budget (``prepack.max_bytes`` in bytes now) a new copy of ``need``
    bytes, replacing one of ``old``, would take the copies alive over;
    None where it fits. The linears' copies and the LSTMs'
    (``rnn/cpu/lstm_pack.py``) share it."""
    budget = budget_of(max_bytes)
    return budget if budget is not None and _ALIVE[0] - old + need > budget else None


def charge(record: Optional[Record], nbytes: int) -> None:
    """A copy of ``nbytes`` made (negative: freed): the process's total and
    the row's ``packed_bytes``."""
    _ALIVE[0] += nbytes
    if record is None:
        return
    if nbytes >= 0:
        record.bump("packed_bytes", nbytes)
    else:
        st = record.stats
        st["packed_bytes"] = max(0, st.get("packed_bytes", 0) + nbytes)


def _release(c: _Copy) -> None:
    charge(c.site.record if c.site is not None else None, -c.nbytes)


def copies_of(w: torch.Tensor) -> Dict[tuple, _Copy]:
    entry = _COPIES.get(id(w))
    return entry[1] if entry is not None and entry[0]() is w else {}


def _release_all(table: Dict[tuple, _Copy]) -> int:
    freed = 0
    for c in table.values():
        _release(c)
        freed += c.nbytes
    table.clear()
    return freed


def drop_copies(w: torch.Tensor) -> int:
    """Free the packed copies made from ``w`` (``wfpass.restore``); the next
    call makes them again. Returns the bytes freed."""
    entry = _COPIES.get(id(w))
    if entry is None or entry[0]() is not w:
        return 0
    return _release_all(entry[1])


def _table_for(w0: torch.Tensor, site, weights: Sequence[torch.Tensor]) -> Dict[tuple, _Copy]:
    key = id(w0)
    entry = _COPIES.get(key)
    if entry is not None and entry[0]() is w0:
        return entry[1]
    # Weights this site has not packed before (another layer through the
    # same graph, new Parameters from ``load_state_dict(assign=True)``):
    # the record is filed under them too, so ``wfpass.report`` finds it.
    note(site.record, site.names, list(weights))

    def gone(ref, key=key):
        e = _COPIES.get(key)
        if e is not None and e[0] is ref:
            _release_all(e[1])
            del _COPIES[key]

    table: Dict[tuple, _Copy] = {}
    _COPIES[key] = (weakref.ref(w0, gone), table)
    return table


def laid_out(ts: Sequence[torch.Tensor], rows: int) -> Optional[torch.Tensor]:
    """The block ``ts`` are views of, in order, as a ``[rows, ...]`` tensor
    (``ts`` itself for one tensor); None where they are not laid out in one
    block (a split-path group whose layout was lost: the graph goes on with
    the separate parameters). The layout holds its block, so member
    addresses equal to the layout's prove the members are views of it."""
    t0 = ts[0]
    if len(ts) == 1:
        return t0
    fs = layout_of(t0)
    if fs is None or fs.block is None or not fs.holds(ts):
        return None
    if t0.dim() == 1:
        return torch.as_strided(t0, (rows,), (1,), t0.storage_offset())
    k = t0.shape[1]
    return torch.as_strided(t0, (rows, k), (k, 1), t0.storage_offset())


def whole(ts: Sequence[torch.Tensor], rows: int, site) -> Optional[torch.Tensor]:
    """The block, or the members' concatenation for this call (counted)."""
    if not ts:
        return None
    b = laid_out(ts, rows)
    if b is None:
        if site is not None:
            site.record.bump("unfused_layout_calls")
        b = torch.cat(list(ts), 0)
    return b


def sample_of(block: torch.Tensor) -> torch.Tensor:
    """Every (numel // SAMPLE)-th element of a weight, read as integers of
    its width: what a packed copy's freshness check compares bit for bit on
    every call (the linears' blocks here, an inference LSTM's pair in
    ``rnn/cpu/lstm_pack.py``; the C++ kernels' twin is
    ``native/common/weight_sample.h``)."""
    flat = block.detach().reshape(-1)
    step = max(1, flat.numel() // SAMPLE)
    return flat.view(_INT_VIEW[flat.element_size()])[::step]




def fresh(site, weights: Sequence[torch.Tensor], rows: int, kernel: str, m: int,
          skey: tuple) -> Optional[_Copy]:
    """The packed copy for this call: the one made before if nothing it was
    made from changed, else a new one; None where a new one would go over
    ``max_bytes``, or the library's kernel for this row count (``skey``,
    state.py) over the same number for the kernels."""
    w0 = weights[0]
    if site.is_refused(w0, m):
        return None
    table = _table_for(w0, site, weights)
    key = (kernel, rows, m if kernel == "mkl" else 0)
    c = table.get(key)
    ptrs = tuple(w.data_ptr() for w in weights)
    versions = tuple(w._version for w in weights)
    if _kernel_over_budget(site, w0, m, kernel, skey):
        return None
    if c is not None and c.ptrs == ptrs and c.versions == versions and torch.equal(c.sample, c.ref):
        return c
    block = laid_out(weights, rows)
    if block is None:
        return None  # not in one block this call: the plain GEMM over their concatenation
    old = c.nbytes if c is not None else 0
    made = _pack_within_budget(site, w0, m, kernel, block.detach(), old)
    if made is None:
        return None
    packed, nbytes, block = made
    sample = sample_of(block)
    if c is not None:
        _release(c)
        site.record.bump("repacked")
    new = _Copy(packed, ptrs, versions, sample, sample.clone(), nbytes, site)
    table[key] = new
    charge(site.record, nbytes)
    return new


def _kernel_over_budget(site, w0: torch.Tensor, m: int, kernel: str, skey: tuple) -> bool:
    """Would the library's kernel for this row count (``skey``, not run yet
    in the process) take the kernels over ``max_bytes``? Then the row says
    so and this weight set runs without a copy at ``m`` rows."""
    # The kernel the library compiles for a row count it has not run yet
    # (0.55-0.6 MiB with oneDNN on torch 2.13, whatever the weight's size) is
    # bounded by the same number, on its own: counted with the copies, the
    # bench decoder's kernels for its dynamic row counts were refused and its
    # 5-token call fell from 1.91x to 0.82x of Inductor (docs/guide/prepack.md#memory).
    # Asked only for a new kernel: the budget sums the weights' bytes, and
    # with the Python kernel alone every call comes here.
    if not _state.known(skey):
        budget = budget_of(site.max_bytes)
        need = _state.estimate(skey)
        if budget is not None and _state.total() + need > budget:
            _over_budget(site, w0, m, kernel, need, budget, what="kernel")
            return True
    return False


def _pack_within_budget(site, w0: torch.Tensor, m: int, kernel: str, block: torch.Tensor,
                        old: int) -> Optional[Tuple[torch.Tensor, int, torch.Tensor]]:
    """A new copy of ``block`` for ``kernel`` (replacing one of ``old``
    bytes): the copy, its bytes and the (contiguous) block it was made
    from; None where it would go over ``max_bytes``, asked before it is made
    (with the size a copy of this shape had before) and after."""
    # The copy's size: the one measured for this shape (MKL's is larger than
    # the weight and made per row count), else the weight's.
    need = _COPY_BYTES.get((kernel, block.dtype, tuple(block.shape), m if kernel == "mkl" else 0),
                           block.numel() * block.element_size())
    budget = over_budget(site.max_bytes, need, old)
    if budget is not None:
        _over_budget(site, w0, m, kernel, need, budget)
        return None
    if not block.is_contiguous():
        block = block.contiguous()
    if kernel == "mkl":
        packed = _k.mkl_pack(block, m)
    elif kernel == "brgemm":
        packed = _nops.panel_pack(block)
    else:
        packed = _k.onednn_pack(block)
    nbytes = _k.onednn_nbytes(packed) if packed.is_mkldnn else packed.numel() * packed.element_size()
    _COPY_BYTES[(kernel, block.dtype, tuple(block.shape), m if kernel == "mkl" else 0)] = nbytes
    budget = over_budget(site.max_bytes, nbytes, old)
    if budget is not None:
        _over_budget(site, w0, m, kernel, nbytes, budget)
        return None
    return packed, nbytes, block


# (kernel, dtype, block shape, M for MKL) -> bytes of such a copy, as made.
_COPY_BYTES: Dict[tuple, int] = {}


def _over_budget(site, w0: torch.Tensor, m: int, kernel: str, need: int, budget: int,
                 what: str = "copy") -> None:
    """This weight set's copy (or the library's kernel for this row count)
    would go over ``max_bytes``: from now on it runs the plain GEMM at this
    row count (the C++ kernel answers it too), and the row says so. Other
    weight sets through the same site (other layers under regional
    compilation) keep their copies."""
    site.record.bump("over_bound_calls")
    site.refused.setdefault(w0, set()).add(m)
    words = site.record.detail.setdefault("over_budget", {})
    if m not in words:
        whose = bound_words(site.max_bytes, budget)
        instead = "the direct kernel (no copy)" if site.fallback_for(m) == "direct" else "the plain GEMM"
        if what == "copy":
            words[m] = (f"M={m}: {instead} for a weight set whose {kernel} copy ({need / 2**20:.1f} MiB) would "
                        f"take the packed copies over their budget ({budget / 2**20:.1f} MiB, {whose}; "
                        f"{_ALIVE[0] / 2**20:.1f} MiB in use)")
        else:
            words[m] = (f"M={m}: {instead}: the {kernel} kernel the library would compile for this row count "
                        f"({need / 2**20:.1f} MiB) would take the kernels kept for packed calls over their budget "
                        f"({budget / 2**20:.1f} MiB, {whose}; {_state.total() / 2**20:.1f} MiB in use)")
        if site.on_budget is not None:
            site.on_budget()
