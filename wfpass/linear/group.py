"""``wfpass::linear_group``: sibling linears (Q/K/V, gate/up) as one op over
their weights where each one is, for exported programs.

A compiled graph fuses siblings over one block of memory the Parameters
become views of (``kernel.py``). An exported program cannot rest on that:
AOTInductor packages each weight as a constant of its own (and
``deploy/program.py`` gives each its own storage so that it is packaged
once), so the members are apart at run time. This op reads them where they
are, and gives each member its own contiguous output, as its linear did.
Graph of an exported program before and after (q: 512 rows, k and v: 128,
input 512)::

    q = aten.linear(x, q_w, q_b);  k = aten.linear(x, k_w, k_b);  v = aten.linear(x, v_w, v_b)

    qkv = wfpass.linear_group(x, [q_w, k_w, v_w, q_b, k_b, v_b], [True, True, True], 4)
    q, k, v = qkv[0], qkv[1], qkv[2]                 # (.., 512), (.., 128), (.., 128)

Per call, up to ``direct_rows`` rows (decided at export from timings on the
exporting machine, ``deploy/linear.py``), the CPU kernel is one pass of the
copy-free direct kernel over all members' rows (``native/linear/direct.cpp``,
one GEMM over the group as a block would be, without the block); above it,
or where the direct kernel does not run, one GEMM per member: no copy of a
weight and no concatenation, ever.

``params`` holds every member's weight, then the biases present, in member
order (``has_bias``: one entry per member): one list of tensors, not of
optional ones, so that autograd routes each its gradient, and never an
empty one, as AOTInductor's extern call passes an empty list as None
(torch 2.13). The Python kernel below serves every other device and a
machine without the C++ build, with the same outputs; the gradient formula
(``_backward``) makes a training-mode program differentiate as eager does.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from ..native import schemas as _schemas

__all__ = ["linear_group"]


def _members(params: Sequence[torch.Tensor], has_bias: Sequence[bool]):
    """Each member's weight and its bias or None (see the module docstring)."""
    m = len(has_bias)
    if m == 0 or len(params) != m + sum(map(bool, has_bias)):
        raise RuntimeError(f"wfpass::linear_group: expected every member's weight, then its bias where has_bias says "
                           f"so; got {len(params)} tensors for {m} members")
    it = iter(params[m:])
    return list(params[:m]), [next(it) if h else None for h in has_bias]


def _group(x: torch.Tensor, params: Sequence[torch.Tensor], has_bias: Sequence[bool],
           direct_rows: int) -> List[torch.Tensor]:
    """The Python kernel: one linear per member (the C++ kernel's checks and
    words)."""
    weights, each = _members(params, has_bias)
    k = x.shape[-1]
    for i, (w, b) in enumerate(zip(weights, each)):
        if w.dim() != 2 or w.shape[1] != k or w.dtype != x.dtype or w.device != x.device:
            raise RuntimeError(f"wfpass::linear_group: weight {i} of shape {list(w.shape)}, {w.dtype} on {w.device} "
                               f"for an input of shape {list(x.shape)}, {x.dtype} on {x.device}")
        if b is not None and (b.dim() != 1 or b.shape[0] != w.shape[0] or b.dtype != x.dtype or b.device != x.device):
            raise RuntimeError(f"wfpass::linear_group: bias {i} of shape {list(b.shape)} for a weight of shape "
                               f"{list(w.shape)}")
    x2 = x.reshape(-1, k)
    return [F.linear(x2, w, b).view(*x.shape[:-1], w.shape[0]) for w, b in zip(weights, each)]


def _fake(x, params, has_bias, direct_rows):
    weights, _ = _members(params, has_bias)
    return [x.new_empty((*x.shape[:-1], w.shape[0])) for w in weights]


def _setup(ctx, inputs, output):
    x, params, has_bias, _ = inputs
    weights = params[:len(has_bias)]
    ctx.save_for_backward(x, *weights)
    ctx.has_bias = list(has_bias)


def _backward(ctx, grads):
    x, *weights = ctx.saved_tensors
    x2 = x.reshape(-1, x.shape[-1])
    # An output no loss reads has no gradient: it adds nothing.
    gs = [g.reshape(-1, g.shape[-1]) if g is not None else None for g in grads]
    # Every gradient, as eager's linear gives them (autograd drops those of
    # inputs that need none).
    grad_x = torch.zeros_like(x2)
    for g, w in zip(gs, weights):
        if g is not None:
            grad_x = grad_x + g @ w
    grad_w = [g.t() @ x2 if g is not None else torch.zeros_like(w) for g, w in zip(gs, weights)]
    grad_b = [g.sum(0) if g is not None else x2.new_zeros(w.shape[0])
              for g, w, has in zip(gs, weights, ctx.has_bias) if has]
    return grad_x.view(x.shape), grad_w + grad_b, None, None


_LIB = torch.library.Library("wfpass", "FRAGMENT")
_schemas.define(_LIB, "linear_group")
torch.library.register_fake("wfpass::linear_group", _fake, lib=_LIB)
# The Python kernel serves every backend key; the C++ one, once loaded, takes
# the CPU key before it (``native/linear/linear.cpp``).
_LIB.impl("linear_group", _group, "CompositeExplicitAutograd")
torch.library.register_autograd("wfpass::linear_group", _backward, setup_context=_setup, lib=_LIB)


def linear_group(x: torch.Tensor, weights: List[torch.Tensor], biases: List[Optional[torch.Tensor]],
                 direct_rows: int) -> List[torch.Tensor]:
    """``[F.linear(x, w, b) for w, b in zip(weights, biases)]`` as one op that
    reads each weight where it is (see the module docstring); ``biases``: one
    entry per weight, a tensor or None."""
    return torch.ops.wfpass.linear_group(x, list(weights) + [b for b in biases if b is not None],
                                         [b is not None for b in biases], int(direct_rows))
