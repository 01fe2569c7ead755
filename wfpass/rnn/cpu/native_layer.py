"""The ``wfpass::rnn_layer`` op: one layer and direction of a GRU or plain
RNN on ATen's native CPU kernel, as one op in the graph whatever T is.

PyTorch has no fused CPU kernel for GRUs and plain RNNs; ``torch.gru``
runs a C++ loop (the input projection of all steps as one GEMM, then per
step one recurrent GEMM and the gate math). Traced, that loop is unrolled:
T steps of graph, which Inductor compiles one by one (a 128-step GRUCell
loop took 65 s to compile). Here the loop stays inside one op:

Graph before (AOTAutograd's forward, T = 3, one layer)::

    mm = addmm(b_ih, x.view(3B, I), w_ih.t())            # input projection
    h1 = gru_step(mm[0], h0, w_hh, b_hh)                 # ~12 ops per step
    h2 = gru_step(mm[1], h1, w_hh, b_hh)
    h3 = gru_step(mm[2], h2, w_hh, b_hh)
    out = stack([h1, h2, h3])

After::

    out, h_n = wfpass.rnn_layer(x, w_ih, w_hh, b_ih, b_hh, h0, "GRU", False)

and in the backward graph one ``wfpass.rnn_layer_backward`` per layer.

The forward is ``torch.gru`` / ``rnn_tanh`` / ``rnn_relu`` without grad
(eager's kernel). The backward keeps nothing from the forward but its
inputs and ``out`` (every step's h): it recomputes the gate activations for
all steps at once from ``out`` shifted by one step (two GEMMs over T*B rows
instead of T small ones), runs the one truly sequential part, the gradient
through the recurrent GEMM, as a loop of four ops per step, and then forms
every weight gradient as one GEMM over all steps. The formulas are
PyTorch's cell definitions (``torch.nn.GRUCell``'s docs):

    r = sigmoid(x W_ir + b_ir + h W_hr + b_hr)
    z = sigmoid(x W_iz + b_iz + h W_hz + b_hz)
    n = tanh(x W_in + b_in + r * (h W_hn + b_hn))
    h' = (1 - z) * n + z * h

Both ops are functional (fresh outputs, nothing hidden from the compiler)
and have fake implementations, so Dynamo, AOTAutograd and Inductor see
their shapes, static or symbolic.
"""
from __future__ import annotations

import torch

from ..ops import define_rnn_op
from ... import native as _native
from .lstm_layer import zero_states

__all__ = ["MODES"]

#: The modes this op runs, with their ATen kernels (``torch.gru`` etc.).
MODES = ("GRU", "RNN_TANH", "RNN_RELU")


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"wfpass::rnn_layer: mode must be one of {MODES}, got {mode!r}")


def _rnn_layer(input, w_ih, w_hh, b_ih, b_hh, hx, mode, reverse):
    _check_mode(mode)
    H = w_hh.shape[1]
    (h0,) = zero_states(input, H, hx)
    params = [w_ih, w_hh] + ([b_ih, b_hh] if b_ih is not None else [])
    x = input.flip(0) if reverse else input
    fn = {"GRU": torch.gru, "RNN_TANH": torch.rnn_tanh, "RNN_RELU": torch.rnn_relu}[mode]
    with torch.no_grad():
        out, hy = fn(x, h0, params, b_ih is not None, 1, 0.0, False, False, False)
    if reverse:
        out = out.flip(0)  # a copy: flip never aliases
    # Outputs may not alias each other or an input (torch.library's rule).
    if hy.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
        hy = hy.clone()
    return out.contiguous(), hy


def _rnn_layer_fake(input, w_ih, w_hh, b_ih, b_hh, hx, mode, reverse):
    _check_mode(mode)
    T, B, H = input.shape[0], input.shape[1], w_hh.shape[1]
    return input.new_empty((T, B, H)), input.new_empty((1, B, H))


def _gates_backward(x, w_ih, w_hh, b_ih, b_hh, h0, out, gout, ghy):
    """dL/d(input gates) and dL/d(recurrent gates) of a forward-ordered GRU
    layer, each ``[T, B, 3, H]``, and dL/dh0."""
    T, B, H = out.shape
    h_prev = torch.cat([h0, out[:-1]], 0)  # the state each step read
    gi = torch.nn.functional.linear(x, w_ih, b_ih).view(T, B, 3, H)
    gh = torch.nn.functional.linear(h_prev, w_hh, b_hh).view(T, B, 3, H)
    r = torch.sigmoid(gi[:, :, 0] + gh[:, :, 0])
    z = torch.sigmoid(gi[:, :, 1] + gh[:, :, 1])
    n = torch.tanh(gi[:, :, 2] + r * gh[:, :, 2])
    # Every factor that does not depend on the incoming gradient, for all
    # steps at once: dL/d(gate pre-activation) = dh * k.
    a_n = (1 - z) * (1 - n * n)  # through n
    k_r = a_n * gh[:, :, 2] * r * (1 - r)
    k_z = (h_prev - n) * z * (1 - z)
    k_h = torch.stack([k_r, k_z, a_n * r], 2)  # recurrent side: n's part is scaled by r
    if _native.is_loaded():  # the same loop in C++ (native/rnn/rnn.cpp)
        dgh, dh_all, carry = torch.ops.wfpass._gru_grad_loop(k_h, z, w_hh, gout, ghy)
    else:
        dgh = torch.empty_like(k_h)
        dh_all = torch.empty_like(out)
        carry = ghy[0] if ghy is not None else out.new_zeros((B, H))
        for t in range(T - 1, -1, -1):  # the only sequential part: through w_hh
            dh = torch.add(gout[t], carry, out=dh_all[t]) if gout is not None else dh_all[t].copy_(carry)
            torch.mul(dh.unsqueeze(1), k_h[t], out=dgh[t])
            carry = torch.addmm(dh * z[t], dgh[t].view(B, 3 * H), w_hh)
    dgi = dgh.clone()
    torch.mul(dh_all, a_n, out=dgi[:, :, 2])
    return dgi, dgh, carry, h_prev


def _plain_backward(w_hh, h0, out, gout, ghy, relu):
    """dL/d(pre-activation) of a forward-ordered plain RNN layer, ``[T, B, H]``, and dL/dh0."""
    T, B, H = out.shape
    d_act = (out > 0).to(out.dtype) if relu else 1 - out * out
    dpre = torch.empty_like(out)
    carry = ghy[0] if ghy is not None else out.new_zeros((B, H))
    for t in range(T - 1, -1, -1):
        dh = gout[t] + carry if gout is not None else carry
        torch.mul(dh, d_act[t], out=dpre[t])
        carry = torch.mm(dpre[t], w_hh)
    return dpre, carry, torch.cat([h0, out[:-1]], 0)


def _rnn_layer_backward(input, w_ih, w_hh, b_ih, b_hh, hx, output, grad_output, grad_hy, mode, reverse):
    _check_mode(mode)
    T, B, I = input.shape
    H = w_hh.shape[1]
    (h0,) = zero_states(input, H, hx)
    x, out, gout = input, output, grad_output
    if reverse:  # a reversed layer is the forward recurrence over the flipped sequence
        x, out = x.flip(0), out.flip(0)
        gout = gout.flip(0) if gout is not None else None
    if mode == "GRU":
        dgi, dgh, dh0, h_prev = _gates_backward(x, w_ih, w_hh, b_ih, b_hh, h0, out, gout, grad_hy)
        dgi, dgh = dgi.view(T * B, 3 * H), dgh.view(T * B, 3 * H)
    else:
        dpre, dh0, h_prev = _plain_backward(w_hh, h0, out, gout, grad_hy, mode == "RNN_RELU")
        dgi = dgh = dpre.view(T * B, H)
    dx = torch.mm(dgi, w_ih).view(T, B, I)
    if reverse:
        dx = dx.flip(0)
    dw_ih = torch.mm(dgi.t(), x.reshape(T * B, I))
    dw_hh = torch.mm(dgh.t(), h_prev.reshape(T * B, H))
    if b_ih is not None:
        db_ih, db_hh = dgi.sum(0), dgh.sum(0)
    else:  # no biases: empty placeholders (the autograd formula returns None for them)
        db_ih, db_hh = input.new_empty(0), input.new_empty(0)
    return dx.contiguous(), dw_ih, dw_hh, db_ih, db_hh, dh0.unsqueeze(0).clone()


def _rnn_layer_backward_fake(input, w_ih, w_hh, b_ih, b_hh, hx, output, grad_output, grad_hy, mode, reverse):
    _check_mode(mode)
    B, H = input.shape[1], w_hh.shape[1]
    if b_ih is not None:
        biases = (torch.empty_like(b_ih), torch.empty_like(b_hh))
    else:
        biases = (input.new_empty(0), input.new_empty(0))
    return (torch.empty_like(input), torch.empty_like(w_ih), torch.empty_like(w_hh), *biases,
            input.new_empty((1, B, H)))


def _setup(ctx, inputs, output):
    input, w_ih, w_hh, b_ih, b_hh, hx, mode, reverse = inputs
    ctx.save_for_backward(input, w_ih, w_hh, b_ih, b_hh, hx, output[0])
    ctx.static = (mode, reverse, b_ih is not None, hx is not None)
    ctx.set_materialize_grads(False)


def _grad(ctx, g_out, g_hy):
    input, w_ih, w_hh, b_ih, b_hh, hx, out = ctx.saved_tensors
    mode, reverse, has_b, has_hx = ctx.static
    dx, dw_ih, dw_hh, db_ih, db_hh, dhx = torch.ops.wfpass.rnn_layer_backward.default(
        input, w_ih, w_hh, b_ih, b_hh, hx, out, g_out, g_hy, mode, reverse)
    return (dx, dw_ih, dw_hh, db_ih if has_b else None, db_hh if has_b else None, dhx if has_hx else None,
            None, None)


# The C++ kernels (``native/rnn/rnn.cpp``) take the CPU key, which comes
# before these registrations once they are loaded.
_LIB = define_rnn_op("rnn_layer", forward=_rnn_layer,
                     forward_fake=_rnn_layer_fake, backward=_rnn_layer_backward,
                     backward_fake=_rnn_layer_backward_fake, setup=_setup, grad=_grad)
