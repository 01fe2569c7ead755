"""``wfpass::packed_linear``: a linear computed from the kernel library's own
packed copy of its weight, made once and checked against the parameter on
every call.

Graph after ``prepack_linears`` (Dynamo flavour; a single linear, and the Q/K/V
block ``fuse_linears`` built, whose members are views of one block with
``q_w`` at offset 0)::

    y = wfpass.packed_linear(x, [w], [b], 512, site)
    qkv = wfpass.packed_linear(x, [q_w, k_w, v_w], [q_b, k_b, v_b], 768, site)

The op takes the **parameters themselves**, so the compiler sees which
tensors the result depends on (AOTAutograd orders it after any write to
them in the graph, and a write to a parameter before the call hands the op
the written tensor). The packed copy is not a graph input: Inductor lowers
oneDNN's packed linear only for frozen constants (``mkldnn_lowerings.py``,
torch 2.13.0), so the op keeps it beside the parameter (``_COPIES``, keyed
by the first member, dropped when that Parameter dies) and, per call,
compares it with what it was made from:

* each member's ``data_ptr`` (``param.data = ...``, ``.to()``,
  ``load_state_dict(assign=True)``, a re-fused block move it) and
  ``_version`` (every in-place write autograd counts: optimizer steps,
  ``load_state_dict``, ``copy_`` under ``no_grad``);
* a sample of 32 elements of the weight, compared bit for bit: writes
  through ``param.data`` (PEFT's ``merge``) bypass the version counter.

Any difference makes the copy again (counted ``repacked``). Per call the op
also picks the kernel for this call's row count M (``choose.py``): the
``"direct"`` kernel, which reads the parameter itself and needs no copy
(``direct_calls``), or a packed kernel, where one was measured faster for
this shape, else the plain GEMM on the parameter (``plain_calls``).

The gradient formula is ATen ops on the parameters (``x @ W``,
``gy.T @ x``), so AOTAutograd traces the backward and the packed copy never
enters it.

This module holds the op, its sites and its kernel; the packed copies, how
each call checks them and the budget they are charged to are ``copies.py``.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from .._torch import aot as _aot, kernels as _k, tensors as _tensors
from ..native import ops as _nops, schemas as _schemas
from .. import native as _native
from ..core.records import Record, Stats
from . import state as _state
# The packed copies and their budget (copies.py), re-exported: callers (the
# LSTMs' copies, the tests) read them here. ``_fresh`` is called through
# this module's name.
from .copies import (SAMPLE, _COPIES, bound_words, budget_of, charge, memory_bound, copies_of, count_weights, drop_copies,
                     fresh as _fresh, laid_out as _laid_out, over_budget, packed_bytes_alive, sample_of,
                     weight_bytes, whole as _whole)

__all__ = ["PackSite", "register_site", "packed_bytes_alive", "drop_copies", "copies_of", "SAMPLE", "note_weights",
           "over_budget", "charge", "sample_of",
           "weight_bytes", "budget_of", "memory_bound", "bound_words"]

_LIB = torch.library.Library("wfpass", "FRAGMENT")
# Two ops over one kernel: ``packed_linear`` for graphs that compute no
# gradient through the call (most calls: no autograd wrapper to pass
# through, a few microseconds a call), ``packed_linear_train`` with the
# gradient formula below for those that do (``prepack.training``) and for
# ``wfpass.apply`` graphs, which run eagerly either way.
_schemas.define(_LIB, "packed_linear")
_schemas.define(_LIB, "packed_linear_train")


class PackSite:
    """One packed call of one compiled graph: its report record, its
    options, and the kernel chosen for each row count seen.

    ``choose(m)`` returns ``"direct"``, ``"brgemm"``, ``"onednn"``, ``"mkl"`` or
    ``"plain"``; a site asks it once per row count and remembers the answer."""

    def __init__(self, record: Record, choose, max_bytes: Optional[int], fallback=None):
        self.record, self._choose, self.max_bytes = record, choose, max_bytes
        #: m -> the kernel that needs no copy ("direct" or "plain"): what runs
        #: where the budget refuses a copy (read off the decision, kept by ``choose``).
        self._fallback = fallback
        self.by_rows: Dict[int, str] = {}
        # Row counts met once and not decided yet (``kernel_for``).
        self.seen_once: set = set()
        self.id = 0
        self.names: List[str] = []  # the weights' names, for the record
        # ``wfpass.apply`` graphs run eagerly, so the op sees whether this
        # call computes a gradient: ``prepack.training`` there; None in
        # compiled graphs, where the guard decided from the graph.
        self.eager_training: Optional[bool] = None
        #: Called when a copy is refused for the budget (the record's words change).
        self.on_budget = None
        #: first weight -> the row counts whose copy the budget refused for
        #: that weight set. Per set, not per site: under regional compilation
        #: one site serves every layer, and a layer refused for the budget
        #: must not take away the copies the earlier layers have.
        self.refused = _tensors.weak_id_key_dict()
        for c in ("packed_calls", "direct_calls", "plain_calls", "repacked", "packed_bytes"):
            record.stats.setdefault(c, 0)

    def kernel_for(self, m: int) -> Optional[str]:
        """The kernel for ``m`` rows; None on the first call at a row count
        the graph was not compiled for (that call runs the plain GEMM).

        Why the second call: deciding a new row count times the candidates
        (about a second for the bench decoder's four shapes with no
        decision file) and has the library compile a kernel per shape for
        it (0.55-0.6 MiB each on torch 2.13, kept for the process). A
        prefill of varied prompt lengths meets most lengths once; neither
        cost pays for a single call. A row count that comes again is
        decided then and kept."""
        k = self.by_rows.get(m)
        if k is None:
            if m not in self.seen_once:
                self.seen_once.add(m)
                self.record.bump("first_calls")
                return None
            self.seen_once.discard(m)
            # Timing the candidates (a shape not in the decision file) makes
            # the library's kernels for them, which stay: this row holds them.
            before = _state.total()
            k = self.by_rows[m] = self._choose(m)
            grown = _state.total() - before
            if grown:
                self.record.bump("kernel_bytes", grown)
        return k

    def fallback_for(self, m: int) -> str:
        """What runs at ``m`` rows where the budget refuses a copy: the
        direct kernel where it was measured faster than the plain GEMM
        (it needs no copy), else the plain GEMM."""
        return self._fallback(m) if self._fallback is not None else "plain"

    def is_refused(self, w0: torch.Tensor, m: int) -> bool:
        """Did the budget refuse this weight set's copy at ``m`` rows?"""
        got = self.refused.get(w0)
        return got is not None and m in got


# site id -> PackSite. Weak values: a site lives as long as the compiled
# graph (or GraphModule) that calls it holds it; nothing here grows.
_SITES: "weakref.WeakValueDictionary[int, PackSite]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def register_site(site: PackSite) -> int:
    site.id = next(_IDS)
    _SITES[site.id] = site
    if _native.is_loaded():
        # The C++ kernel counts the calls it answers itself; the record
        # reads them when it is read, and once more when the site dies.
        stats = site.record.stats
        pull = _NativeCounts(site.id)
        stats.pull(pull)
        weakref.finalize(site, _retire, site.id, pull, stats)
    return site.id


_KERNEL_CODE = {"plain": 0, "onednn": 1, "mkl": 2, "brgemm": 3, "direct": 4}


class _NativeCounts:
    """The C++ kernel's counts for one site since the last read."""

    __slots__ = ("sid", "dead")

    def __init__(self, sid: int):
        self.sid, self.dead = sid, False

    def __call__(self):
        if self.dead:
            return None
        packed, plain, direct = torch.ops.wfpass._pack_take_counts(self.sid)
        return {"packed_calls": packed, "plain_calls": plain, "direct_calls": direct}


def _retire(sid: int, pull: "_NativeCounts", stats: Stats) -> None:
    stats.add(pull())
    pull.dead = True
    torch.ops.wfpass._pack_forget(sid)


def _hand_to_native(s: PackSite, m: int, kernel: str, packed, weights, rows: int) -> None:
    """Tell the C++ kernel what this call decided, so it answers the next
    calls of this site and row count itself while nothing changes."""
    et = -1 if s.eager_training is None else int(bool(s.eager_training))
    torch.ops.wfpass._pack_put(s.id, m, _KERNEL_CODE[kernel], packed, list(weights), rows, SAMPLE, et)


def note_weights(tensors: Sequence[torch.Tensor]) -> None:
    """Count ``tensors`` (a rewritten graph's parameters) into the
    ``max_bytes="weights"`` budget, each tensor once (``copies.count_weights``);
    where it grew, what it refused may fit now."""
    if count_weights(tensors):
        _reconsider_refusals()


#: Called when the ``"weights"`` budget grows (the LSTM copies' refusals,
#: ``rnn/cpu/lstm_pack.py``, which this module does not import).
ON_BUDGET_GROWTH: List = []


def _reconsider_refusals() -> None:
    """The ``"weights"`` budget grew: what it refused may fit now. Under regional
    compilation the first layer's first call meets a budget of its own
    weights alone (the other layers have not run yet), and its copy with the
    library's kernel for the row count (state.py) is larger than that; kept
    refused, the first layer would never pack. Each site with a refusal
    forgets it, in Python and in the C++ kernel (which answered those calls
    with the plain GEMM): the next call of each weight set and row count
    asks the budget again. At most once per parameter set the budget meets."""
    for s in list(_SITES.values()):
        if s.max_bytes != "weights" or not len(s.refused):
            continue  # a budget in bytes did not grow
        s.refused = _tensors.weak_id_key_dict()
        s.record.detail.pop("over_budget", None)
        if _native.is_loaded():
            s.record.stats._sync()  # the C++ kernel's counts so far, before it forgets the site
            torch.ops.wfpass._pack_forget(s.id)
        if s.on_budget is not None:
            s.on_budget()
    for fn in ON_BUDGET_GROWTH:
        fn()


def _packed_linear(x: torch.Tensor, weights: List[torch.Tensor], biases: List[torch.Tensor], rows: int, site: int) -> torch.Tensor:
    s = _SITES.get(site)
    k = weights[0].shape[1]
    m = x.numel() // k if k else 0
    if s is not None and m > 0:
        kernel = chosen = s.kernel_for(m)
        if chosen is None:
            # A row count's first call: the plain GEMM, and not handed to the
            # C++ kernel, so that its next call comes back here to be decided.
            s.record.bump("plain_calls")
            return _plain(x, weights, biases, rows, s)
        if s.eager_training is False and torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
            kernel = "plain"
        if kernel == "direct":
            y = _direct(s, m, x, weights, biases, rows)
            if y is not None:
                return y
        elif kernel != "plain":
            skey = _state.key_of(kernel, x, rows, bool(biases))
            c = _fresh(s, weights, rows, kernel, m, skey)
            if c is not None:
                s.record.bump("packed_calls")
                bias = _whole(biases, rows, s)
                if kernel == "mkl":
                    y, grown = _state.run_first(skey, lambda: _k.mkl_linear(x, c.packed, _laid_out(weights, rows), bias, m))
                elif kernel == "brgemm":
                    y, grown = _state.run_first(skey, lambda: _nops.panel_linear(x, c.packed, bias, rows))
                else:
                    y, grown = _state.run_first(skey, lambda: _k.onednn_linear(x, c.packed, bias))
                if grown:
                    s.record.bump("kernel_bytes", grown)
                if _native.is_loaded():
                    _hand_to_native(s, m, kernel, c.packed, weights, rows)
                return y if y.is_contiguous() else y.contiguous()
            if s.is_refused(weights[0], m):
                # Over the budget for this weight set: the kernel that needs no
                # copy, and the C++ kernel answers its next calls with it.
                if s.fallback_for(m) == "direct":
                    y = _direct(s, m, x, weights, biases, rows)
                    if y is not None:
                        return y
                if _native.is_loaded():
                    _hand_to_native(s, m, "plain", None, weights, rows)
        elif chosen == "plain" and _native.is_loaded():
            _hand_to_native(s, m, kernel, None, weights, rows)
        s.record.bump("plain_calls")
    return _plain(x, weights, biases, rows, s)


def _direct(s: PackSite, m: int, x: torch.Tensor, weights, biases, rows: int) -> Optional[torch.Tensor]:
    """The direct kernel on the parameters' block; None where they are not
    one block this call (the plain GEMM over their concatenation then).
    No copy: it reads the parameters as they are now, so there is nothing
    to check, to make again or to charge to the budget."""
    block = _laid_out(weights, rows)
    if block is None:
        return None
    s.record.bump("direct_calls")
    y = _nops.direct_linear(x, block.detach(), _whole(biases, rows, s))
    if _native.is_loaded():
        _hand_to_native(s, m, "direct", None, weights, rows)
    return y if y.is_contiguous() else y.contiguous()


def _plain(x: torch.Tensor, weights, biases, rows: int, s: Optional[PackSite]) -> torch.Tensor:
    """The plain GEMM on the parameters (their block, or their concatenation, counted)."""
    y = F.linear(x, _whole(weights, rows, s), _whole(biases, rows, s))
    return y if y.is_contiguous() else y.contiguous()


def _packed_linear_fake(x, weights, biases, rows, site):
    return x.new_empty((*x.shape[:-1], rows))


# The C++ kernel (wfpass/native/prepack/prepack.cpp) answers every call whose site,
# row count and copy the Python kernel already checked, and hands the rest
# to ``packed_linear_slow``: this same Python function.
_schemas.define(_LIB, "packed_linear_slow")
_LIB.impl("packed_linear_slow", _packed_linear, "CPU")
for _name in ("packed_linear", "packed_linear_train"):
    torch.library.register_fake("wfpass::" + _name, _packed_linear_fake, lib=_LIB)
# The Python kernel serves every backend key; the C++ one, once loaded
# (``native``: at the first compile), takes the CPU key before it.
for _name in ("packed_linear", "packed_linear_train"):
    _LIB.impl(_name, _packed_linear, "CompositeExplicitAutograd")


def _setup(ctx, inputs, output):
    x, weights, biases, rows, _site = inputs
    ctx.save_for_backward(x, *weights)
    ctx.bias_rows = [b.shape[0] for b in biases]


def _any(needs) -> bool:
    return any(needs) if isinstance(needs, (list, tuple)) else bool(needs)


def _grad(ctx, gy):
    """The backward reads the parameters, never the packed copy: ``gx = gy @ W``,
    ``gW = gy.T @ x`` split by member, ``gb = sum(gy)`` split by bias."""
    x, *weights = ctx.saved_tensors
    needs = ctx.needs_input_grad
    # List inputs take lists back, one entry (or None) per tensor.
    gx, gws, gbs = None, [None] * len(weights), [None] * len(ctx.bias_rows)
    gy2 = gy.reshape(-1, gy.shape[-1])
    if _any(needs[0]):
        w = weights[0] if len(weights) == 1 else torch.cat(weights, 0)
        gx = gy @ w
    if _any(needs[1]):
        g = gy2.t() @ x.reshape(-1, x.shape[-1])
        gws = list(g.split([t.shape[0] for t in weights], 0))
    if ctx.bias_rows and _any(needs[2]):
        gbs = list(gy2.sum(0).split(ctx.bias_rows, 0))
    return gx, gws, gbs, None, None


torch.library.register_autograd("wfpass::packed_linear_train", _grad, setup_context=_setup, lib=_LIB)
# Compiled forward graphs call the same kernel without the autograd kernel.
_aot.register_twin(torch.ops.wfpass.packed_linear_train.default, torch.ops.wfpass.packed_linear.default)
