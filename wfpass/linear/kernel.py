"""The fused sibling-linear format: one weight block, one GEMM, a split.

Graph after ``fuse_linears`` (Dynamo flavour; q: 16 rows, k: 8, v: 8, in: 32)::

    w = torch.as_strided(q_w, (32, 32), (32, 1), 0)   # the block, a view of q_w's storage
    b = torch.as_strided(q_b, (32,), (1,), 0)         # every member has a bias: the bias block
    y = fused_linear(x, w, b, spec, q_w, k_w, v_w, q_b, k_b, v_b)
    q, k, v = y.split([16, 8, 8], -1)

The members are views of one block with ``q_w`` at offset 0, so the block is
a view of ``q_w``'s storage: an alias AOTAutograd tracks like any other (a
write to a member before the GEMM would be seen; the pass skips such groups
anyway) and Inductor reads as a reinterpretation of its input, no copy. The
backend checks before every call that this call's parameters are laid out
that way (``runtime.guarded_call``).

A group in which only some members have a bias keeps its biases apart
(zero slots in a shared buffer would be written into every checkpoint); the
bias vector is built in the graph (``bias_vector``), one small fused kernel.

``q_w ... v_b`` are passed to ``FusedLinear`` only so autograd can route each
its own gradient; the forward reads the block.

A graph whose row count M is symbolic (Dynamo's recompile after a second
length) serves every M, so it picks per call (the ``by_rows`` path): ``spec``
carries the largest M of the one GEMM, ``(sizes, has_bias, 4)``, and the
forward AOTAutograd traces calls one op that picks::

    y = fused_linear(x, w, b, ([16, 8, 8], [True, True, True], 4), q_w, ...)   # the FX graph: as above

    y = wfpass.linear_by_rows(x, w, b, [16, 8, 8], 4)   # what AOTAutograd traces from it; x: (1, s0, 32)

    M <= 4: addmm(b, x2, w.t()).view(1, s0, 32)            # x2 = x.view(-1, 32): (M, 32)
    M > 4:  one addmm per member over its rows of w and b, each writing its
            columns of one (M, 32) output (no copy for the concatenation)

Its CPU kernel is C++ (``native/linear/linear.cpp``), its Python kernel
serves CUDA and a machine without the C++ build. An op, not a ``cond``:
Inductor's and AOTAutograd's caches refuse a graph with a ``cond`` (torch
2.11-2.15), so every process would trace and compile the graph again.
The backward is ``FusedLinear``'s, the same for both (its GEMMs read the
block). ``runtime.guarded_call`` counts each call on the path its M takes.

``wfpass.apply`` graphs run eagerly, with no backend around them: there the
block comes from ``EagerBlock``, which makes the same check in place.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from ..native import schemas as _schemas


__all__ = ["FusedLinear", "LinearLayout", "fused_linear", "bias_vector", "EagerBlock", "EagerLayoutCheck"]


def _offsets(sizes: Sequence[int], scale: int) -> Tuple[int, ...]:
    offs, acc = [], 0
    for s in sizes:
        offs.append(acc)
        acc += s * scale
    return tuple(offs)


class LinearLayout:
    """Static facts of one group, computed once at rewrite time: element
    offsets of each member's weight in the weight block and of each bias slot
    in the bias block."""

    def __init__(self, sizes: Sequence[int], has_bias: Sequence[bool], in_features: int):
        self.sizes, self.has_bias = tuple(sizes), tuple(has_bias)
        self.total, self.in_features = sum(sizes), in_features
        self.w_offsets = _offsets(sizes, in_features)
        self.b_slots = _offsets(sizes, 1)

    @property
    def weight_key(self) -> tuple:
        return ("linear.weight", self.sizes, self.in_features)

    @property
    def bias_key(self) -> tuple:
        return ("linear.bias", self.sizes)


def bias_vector(sizes: Sequence[int], has_bias: Sequence[bool], *biases: torch.Tensor) -> torch.Tensor:
    """The group's bias vector when only some members have a bias: theirs,
    and zeros for the others. Built in the graph from the biases (the
    compiler fuses it into one small kernel); ``FusedLinear`` routes the
    gradients, so none flows through it."""
    it = iter(biases)
    ref = biases[0]
    parts = [next(it).detach() if hb else ref.new_zeros(n) for n, hb in zip(sizes, has_bias)]
    return torch.cat(parts, 0)


class FusedLinear(torch.autograd.Function):
    """``y = x @ W_block.T + b_block`` with each member's gradient sent to its
    own Parameter.

    Inputs: ``x, w_block, b_block, spec, *weights, *present_biases`` where
    ``spec = (sizes, has_bias)``, or ``(sizes, has_bias, max_rows)`` where
    the path is chosen per call (``by_rows``). Written in aten ops (and
    ``wfpass::linear_by_rows`` where M is symbolic) only, so AOTAutograd
    traces forward and backward and Inductor compiles the GEMMs like any
    other.
    """

    @staticmethod
    def forward(x, w_block, b_block, spec, *params):
        if len(spec) > 2:
            return by_rows(x, w_block, b_block, spec[0], spec[2])
        return F.linear(x, w_block, b_block)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w_block, _b_block, spec, *_params = inputs
        ctx.save_for_backward(x, w_block)
        ctx.spec = spec

    @staticmethod
    def backward(ctx, gy):
        x, w_block = ctx.saved_tensors
        sizes, has_bias = ctx.spec[:2]
        n = len(sizes)
        needs = ctx.needs_input_grad
        gx = gy @ w_block if needs[0] else None
        gy2 = gy.reshape(-1, gy.shape[-1])
        w_grads: list = [None] * n
        if any(needs[4 : 4 + n]):
            x2 = x.reshape(-1, x.shape[-1])
            w_grads = list((gy2.t() @ x2).split(list(sizes), 0))
        b_grads = []
        if any(has_bias):
            gb = gy2.sum(0).split(list(sizes), 0)
            b_grads = [g for g, hb in zip(gb, has_bias) if hb]
        return (gx, None, None, None, *w_grads, *b_grads)


def fused_linear(x, w_block, b_block, spec, *params):
    """Graph-level entry point (FX cannot name ``FusedLinear.apply`` in code)."""
    return FusedLinear.apply(x, w_block, b_block, spec, *params)


def _by_rows(x: torch.Tensor, w_block: torch.Tensor, b_block: Optional[torch.Tensor], sizes: Sequence[int],
             max_rows: int) -> torch.Tensor:
    """``wfpass::linear_by_rows``'s Python kernel: the C++ one's choice and
    output (see the module docstring)."""
    x2 = x.reshape(-1, x.shape[-1])
    total = w_block.shape[0]
    if x2.shape[0] <= max_rows:
        return F.linear(x2, w_block, b_block).view(*x.shape[:-1], total)
    bs = b_block.split(list(sizes), 0) if b_block is not None else [None] * len(sizes)
    y2 = torch.cat([F.linear(x2, w, b) for w, b in zip(w_block.split(list(sizes), 0), bs)], -1)
    return y2.view(*x.shape[:-1], total)


def _by_rows_fake(x, w_block, b_block, sizes, max_rows):
    return x.new_empty((*x.shape[:-1], w_block.shape[0]))


_LIB = torch.library.Library("wfpass", "FRAGMENT")
_schemas.define(_LIB, "linear_by_rows")
torch.library.register_fake("wfpass::linear_by_rows", _by_rows_fake, lib=_LIB)
# The Python kernel serves every backend key; the C++ one, once loaded
# (``native``: at the first compile), takes the CPU key before it.
_LIB.impl("linear_by_rows", _by_rows, "CompositeExplicitAutograd")


def by_rows(x: torch.Tensor, w_block: torch.Tensor, b_block: Optional[torch.Tensor], sizes: Sequence[int],
            max_rows: int) -> torch.Tensor:
    """The forward of the ``by_rows`` path: one GEMM over the block where x
    has at most ``max_rows`` rows, one GEMM per member (over its rows of the
    block) above. A symbolic row count becomes a call of
    ``wfpass::linear_by_rows`` in the traced graph, which decides per call;
    a known one (a real tensor, a static shape) picks here. Both give the
    same output."""
    rows = math.prod(x.shape[:-1])
    if isinstance(rows, torch.SymInt):
        return torch.ops.wfpass.linear_by_rows(x, w_block, b_block, [int(s) for s in sizes], max_rows)
    return _by_rows(x, w_block, b_block, sizes, max_rows)


# -- wfpass.apply graphs: the same check, in place ------------------------------


class _EagerSite:
    """Base of the callables ``wfpass.apply`` graphs call (FX takes a callable
    object as a call target; it carries its site, no global table)."""

    __module__ = __name__

    def __init__(self, site, name: str):
        self.site = site
        self.__name__ = self.__qualname__ = name


class EagerBlock(_EagerSite):
    """``wfpass.apply`` graphs: the block as a view when the members are in it
    (re-fused first if the layout was lost), otherwise their concatenation for
    this call (counted ``fallback_calls``)."""

    def __init__(self, site, rows: int, cols: Optional[int], name: str):
        super().__init__(site, name)
        self.rows, self.cols = rows, cols

    def __call__(self, *members: torch.Tensor) -> torch.Tensor:
        fs = self.site.find(members)
        if fs is None:
            self.site.record.bump("fallback_calls")
            return torch.cat([m.detach().reshape(m.shape[0], -1) if self.cols else m.detach() for m in members], 0)
        [self.site.record_of(fs).bump(c) for c in self.site.counter]
        shape, stride = ((self.rows, self.cols), (self.cols, 1)) if self.cols else ((self.rows,), (1,))
        return torch.as_strided(members[0].detach(), shape, stride, 0)


class EagerLayoutCheck(_EagerSite):
    """``wfpass.apply`` graphs on the split path: the GEMMs read each member,
    so nothing needs the block; a lost layout is re-fused here (counted
    ``re_fused``), or the call goes on as it is (``unfused_layout_calls``)."""

    _wfpass_keep = True  # run for its effect: dead-code elimination keeps it

    def __call__(self, *members: torch.Tensor) -> None:
        fs = self.site.find(members)
        if fs is None:
            self.site.record.bump("unfused_layout_calls")
        else:
            [self.site.record_of(fs).bump(c) for c in self.site.counter]
        return None
