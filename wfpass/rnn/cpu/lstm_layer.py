"""The ``wfpass::lstm_layer`` op: oneDNN's LSTM layer as an op AOTAutograd
can train through.

``aten.mkldnn_rnn_layer`` returns the workspace its backward formula needs
only while grad mode is on (checked on torch 2.13.0); AOTAutograd runs the
compiled forward with grad mode off, so the traced op would hand its
backward an undefined workspace. ``wfpass::lstm_layer`` is the same kernel
with the workspace always produced when ``train`` asks for it: a functional
op (fresh outputs, nothing hidden), whose autograd formula is ATen's own
``mkldnn_rnn_layer_backward`` over the op's saved inputs and outputs.
The workspace's size is oneDNN's business, so the fake implementation
measures it once per shape (``workspace_numel``).

``wfpass::lstm_layer_fw`` is ``lstm_layer`` without an autograd kernel,
for graphs that compute no gradient through the call (``train=False``: no
workspace either) and for the forward graphs AOTAutograd has already
differentiated (``aot.register_twin``): torch.library's Python autograd
kernel runs on every call, grad mode on or off, and cost ~30 us per layer
call here (T = 16, batch 1: a 157 us kernel called in 189 us; torch 2.13.0).
"""
from __future__ import annotations

from typing import Dict

import torch

from ...core.graph import static_int
from ..._torch import aot as _aot, kernels as _kernels
from ..ops import define_rnn_op
from . import lstm_prepack as _lstm_prepack

__all__ = ["workspace_numel", "zero_states"]


_MKLDNN_RNN_LAYER = torch.ops.aten.mkldnn_rnn_layer.default
_MKLDNN_RNN_LAYER_BACKWARD = torch.ops.aten.mkldnn_rnn_layer_backward.default


def zero_states(input, hidden_size, *states):
    """``states`` with each ``None`` replaced by the zero state ``[1, B, H]``.
    Made here, inside the op, rather than in the graph: a zeros tensor in
    the graph is a kernel Inductor must generate and compile (seconds of C++
    compile on a cold cache, measured), for a value the op can fill itself.
    One zero tensor serves every ``None``: the kernels only read their states."""
    if all(s is not None for s in states):
        return states
    zero = input.new_zeros((1, input.shape[1], hidden_size))
    return tuple(zero if s is None else s for s in states)


def _lstm_layer(input, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, hidden_size, has_biases, train):
    hx, cx = zero_states(input, hidden_size, hx, cx)
    if not train:  # inference: from the pair's copy in oneDNN's layout where it has one (lstm_pack.py)
        packed = _lstm_prepack.packed_pair(input, w_ih, w_hh, reverse, hidden_size, has_biases)
        if packed is not None:
            _lstm_prepack.count_python_call(w_ih)
            w_ih, w_hh = packed
    prev = torch.is_grad_enabled()
    torch.set_grad_enabled(train)  # the kernel returns its workspace only with grad mode on
    try:
        # Below autograd: ATen's autograd kernel would record a graph no one
        # differentiates (the op's gradient is lstm_layer_backward).
        with _kernels.below_autograd():
            y, hy, cy, ws = _MKLDNN_RNN_LAYER(input, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, [], 2, hidden_size, 1,
                                              has_biases, False, False, train)
    finally:
        torch.set_grad_enabled(prev)
    if ws is None or not train:
        ws = input.new_empty(0, dtype=torch.uint8)
    return y, hy, cy, ws


_WORKSPACE: Dict[tuple, int] = {}


def workspace_numel(T: int, B: int, I: int, H: int, dtype: torch.dtype, has_biases: bool) -> int:
    """Bytes of oneDNN's training workspace for one LSTM layer of this shape.
    oneDNN rounds its parts to pages, so the size is no formula of T the
    compiler could carry: it is measured once per shape, on zeros, and cached
    (a few shapes per model)."""
    key = (T, B, I, H, dtype, has_biases)
    n = _WORKSPACE.get(key)
    if n is None:
        with _aot.outside_fake_mode(), torch.enable_grad():
            x = torch.zeros(T, B, I, dtype=dtype)
            w_ih, w_hh = torch.zeros(4 * H, I, dtype=dtype), torch.zeros(4 * H, H, dtype=dtype)
            b, h = torch.zeros(4 * H, dtype=dtype), torch.zeros(1, B, H, dtype=dtype)
            ws = torch.ops.aten.mkldnn_rnn_layer.default(x, w_ih, w_hh, b, b, h, h, False, [], 2, H, 1, has_biases,
                                                         False, False, True)[3]
        n = _WORKSPACE[key] = int(ws.numel()) if ws is not None else 0
    return n


def _lstm_layer_fake(input, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, hidden_size, has_biases, train):
    T, B = input.shape[0], input.shape[1]
    n = 0
    if train:
        dims = [static_int(d) for d in input.shape]  # specialized sizes count as static
        if all(d is not None for d in dims):
            n = workspace_numel(dims[0], dims[1], dims[2], hidden_size, input.dtype, has_biases)
        else:
            # A symbolic T or batch: oneDNN's size is no formula of them, so
            # it is a size known only when the op has run (an unbacked
            # symbol), which AOTAutograd saves for the backward like any size.
            n = torch.library.get_ctx().new_dynamic_size()
    state = (1, B, hidden_size)
    return (input.new_empty((T, B, hidden_size)), input.new_empty(state), input.new_empty(state),
            input.new_empty((n,), dtype=torch.uint8))


def _lstm_layer_backward(input, w_ih, w_hh, b_ih, b_hh, hx, cx, output, hy, cy, grad_output, grad_hy, grad_cy,
                         reverse, hidden_size, has_biases, workspace):
    hx, cx = zero_states(input, hidden_size, hx, cx)
    grads = _MKLDNN_RNN_LAYER_BACKWARD(
        input, w_ih, w_hh, b_ih, b_hh, hx, cx, output, hy, cy, grad_output, grad_hy, grad_cy, reverse, 2,
        hidden_size, 1, has_biases, True, False, [], False, workspace)
    # An op's outputs must have the strides and dtype its fake promises
    # (``empty_like``) and may not alias each other: copy a gradient only
    # where the kernel's answer breaks a rule. oneDNN returns some bf16
    # gradients in float32 (seen for the input's, torch 2.13.0): a bf16
    # linear before the LSTM then failed in the backward with "expected m1
    # and m2 to have the same dtype". The kernel allocates its gradients
    # (none aliases an input: opcheck's schema test in the tests); this
    # runs per call, so it checks only what can go wrong.
    out = []
    seen = set()
    for g, ref in zip(grads, (input, w_ih, w_hh, b_ih, b_hh, hx, cx)):
        if g is None:
            g = torch.zeros_like(ref)
        elif g.dtype != ref.dtype or g.stride() != ref.stride() or g.untyped_storage().data_ptr() in seen:
            g = torch.empty_like(ref).copy_(g)
        seen.add(g.untyped_storage().data_ptr())
        out.append(g)
    return tuple(out)


def _lstm_layer_backward_fake(input, w_ih, w_hh, b_ih, b_hh, hx, cx, output, hy, cy, grad_output, grad_hy, grad_cy,
                              reverse, hidden_size, has_biases, workspace):
    hx, cx = zero_states(input, hidden_size, hx, cx)
    return tuple(torch.empty_like(t) for t in (input, w_ih, w_hh, b_ih, b_hh, hx, cx))


def _lstm_layer_setup(ctx, inputs, output):
    input, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, hidden_size, has_biases, train = inputs
    y, hy, cy, ws = output
    ctx.save_for_backward(input, w_ih, w_hh, b_ih, b_hh, hx, cx, y, hy, cy, ws)
    ctx.static = (reverse, hidden_size, has_biases, train)
    ctx.set_materialize_grads(False)


def _lstm_layer_grad(ctx, gy, ghy, gcy, _gws):
    input, w_ih, w_hh, b_ih, b_hh, hx, cx, y, hy, cy, ws = ctx.saved_tensors
    reverse, hidden_size, has_biases, train = ctx.static
    if not train:
        raise RuntimeError("wfpass: an LSTM layer run without grad was differentiated")
    grads = list(torch.ops.wfpass.lstm_layer_backward.default(
        input, w_ih, w_hh, b_ih, b_hh, hx, cx, y, hy, cy, gy, ghy, gcy, reverse, hidden_size, has_biases, ws))
    grads[5:7] = [g if h is not None else None for g, h in zip(grads[5:7], (hx, cx))]  # no grad for a state made inside
    return (*grads, None, None, None, None)


# The C++ kernels (``native/rnn/rnn.cpp``) take the CPU key, which comes
# before these registrations once they are loaded.
_LIB = define_rnn_op("lstm_layer",
                     forward=_lstm_layer, forward_fake=_lstm_layer_fake, backward=_lstm_layer_backward,
                     backward_fake=_lstm_layer_backward_fake, setup=_lstm_layer_setup, grad=_lstm_layer_grad)
