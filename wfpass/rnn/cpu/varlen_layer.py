"""The ``wfpass::packed_layer`` op: one layer and one direction of an LSTM,
GRU or plain RNN over a packed batch (``PackedSequence`` layout), forward
and backward, steps of each sequence past its length never computed.

Why: eager PyTorch runs a packed RNN on the CPU through ATen's generic
per-step path (a cell call per step, each a dozen small ops, and autograd
recording all of them): a training step of one LSTM layer took 3.4x the
padded oneDNN kernel's time in ``benchmarks/rnn/bench_packed_layer.py``, on
fewer valid steps. This op keeps the packed layout (nothing padded, no
work on steps past a sequence's end) and runs the recurrence in a few
vectorized calls a step, with a hand-written backward.

What it computes. ``data`` is ``[N, I]``, time-major: the rows of step t
are ``data[off[t] : off[t] + bs[t]]`` (``bs = batch_sizes``, non-increasing,
``bs[0] = B``; ``off`` its exclusive running sum; sequences sorted longest
first, so the live rows of step t are the first ``bs[t]`` sequences)::

    for t in steps (0 .. T-1; T-1 .. 0 when reverse):
        rows = off[t] : off[t] + bs[t]
        h_prev = the state of those bs[t] sequences (h0 where a sequence
                 starts: step 0, or, reversed, its own last step)
        out[rows] = cell(data[rows], h_prev)       # PyTorch's cell formulas

with the cells of ``nn.LSTMCell`` (gate order i, f, g, o; with a
projection ``h = (o * tanh(c)) @ w_hr.T``), ``nn.GRUCell`` (gate order
r, z, n; ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``) and
``nn.RNNCell`` (tanh or relu). ``h_n`` is each sequence's state after its
last step: its own last valid step going forward, step 0 reversed; this is
exactly what ATen's packed path returns for each direction of a
bidirectional RNN.

Schema::

    wfpass::packed_layer(Tensor data, Tensor batch_sizes, Tensor w_ih, Tensor w_hh,
        Tensor? b_ih, Tensor? b_hh, Tensor? w_hr, Tensor? h0, Tensor? c0,
        str mode, bool reverse, bool train) -> (out [N, H_out], h_n [1, B, H_out],
        c_n [1, B, H] (LSTM) or [0], workspace [N, workspace_width(mode, H)] or [0])

How (the Python kernels, ``packed_layer_py.py`` and
``packed_layer_py_backward.py``; ``native/rnn/varlen_rnn.cpp`` has the
same steps in C++, registered for the CPU key, which comes first):

* the GEMMs over all N rows (the input projection, the weight gradients)
  on oneDNN's linear in fp32 (``mkldnn::_linear_pointwise``: ATen's ``mm``,
  MKL on this AMD CPU, ran them 2-4x slower), ATen's ``mm`` otherwise;
* the input projection of every step as ONE GEMM over the N packed rows,
  written straight into the workspace, with both biases folded into it
  (the recurrent bias of the gates that only ever add it, GRU's r and z,
  LSTM's four, RNN's one), so the per-step GEMM needs no bias;
* per step one in-place ``addmm_`` of the recurrent GEMM into the live rows
  of that workspace, and the gate math in place (LSTM 8 calls a step, GRU
  5, RNN 2). The state step t reads is the previous step's output rows,
  which ``out`` already holds (going forward, the first ``bs[t]`` rows of
  step t-1 are the same sequences), so no state is copied; only a reversed
  step where sequences join copies its two pieces into a buffer;
* the backward: every factor that does not depend on the incoming gradient
  computed for all N rows at once from the workspace, in place into the
  buffer of the gate gradients, which a loop of 3 (RNN), 4 (GRU) or 6
  (LSTM) calls a step then scales and pushes through the recurrent GEMM;
  then every weight gradient as ONE GEMM over the N rows (the state each
  row read gathered once, ``_prev_index``). Few fresh N-row buffers: the
  CPU allocator hands large blocks back to the system, so each new one
  costs page faults (with ten throwaway ones, a third of the LSTM
  backward's time at N = 1600, H = 128).

Workspace layout (``train=True``; what the backward reads, post-activation):

* LSTM ``[N, 6H]``: ``i | f | g | o | c | tanh(c)`` (c: the cell state
  after the step). tanh(c) is kept because the forward computes it anyway
  and ATen's float32 tanh is slow (~2 ns an element here, 8x sigmoid): a
  recompute over all N rows cost the backward ~7%.
* GRU  ``[N, 4H]``: ``r | z | hn | n`` (hn = ``W_hn h + b_hn``, the
  recurrent part of n: placed next to r and z so the step's one recurrent
  GEMM writes r, z and hn in one contiguous block)
* RNN  ``[N, 0]``: the backward needs only ``out``.

A full batch: ``data`` ``[T, B, I]`` (a plain RNN input, every step B
rows) with an empty ``batch_sizes`` is the packed batch of T steps of B
rows each, ``data.reshape(T * B, I)``; out and the workspace then have
``T * B`` rows, and the gradient of ``data`` has data's shape. This is how a
compiled graph runs a GRU, a plain RNN or a small LSTM through this loop
(``rnn/paths.py``, ``cxx_path``) without building a batch_sizes tensor of
its own.

``train=False`` returns an empty workspace (``[0]``) and the op cannot be
differentiated; the kernels still use a workspace-shaped scratch inside.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ops import define_rnn_op
from .varlen_checks import (MODES, as_rows, check_args, check_shapes, gate_count, known_different,
                            workspace_width)
from .varlen_layer_py import _packed_layer
from .varlen_layer_py_backward import _packed_layer_backward
from ..varlen.meta import batch_of

__all__ = ["MODES", "gate_count", "layer_weights", "workspace_width"]


def _fake_states(states, L: int, op: str = "wfpass::packed_layer") -> None:
    """What a fake can check of the states: their rank, L and width. Their
    batch is batch_sizes[0], a value: the kernels check it."""
    for s, w, name in states:
        if s is not None and (s.dim() != 3 or known_different(s.shape[0], L) or known_different(s.shape[2], w)):
            raise RuntimeError(f"{op}: {name} must have shape ({L}, batch_sizes[0], {w}), got {tuple(s.shape)}")


def _batch(full, h0, c0, batch_sizes):
    """B of a fake call: the full batch's, else the states', else batch_sizes'."""
    if full is not None:
        return full
    return h0.shape[1] if h0 is not None else (c0.shape[1] if c0 is not None else batch_of(batch_sizes))


def _packed_layer_fake(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0, mode, reverse, train):
    check_args(mode, w_hr, c0)
    data, batch_sizes, full = as_rows(data, batch_sizes)
    H, Hout = check_shapes(mode, data, w_ih, w_hh, b_ih, b_hh, w_hr)
    _fake_states(((h0, Hout, "h0"), (c0, H, "c0")), 1)
    N = data.shape[0]
    B = _batch(full, h0, c0, batch_sizes)
    c_n = data.new_empty((1, B, H)) if mode == "LSTM" else data.new_empty(0)
    ws = data.new_empty((N, workspace_width(mode, H))) if train else data.new_empty(0)
    return data.new_empty((N, Hout)), data.new_empty((1, B, Hout)), c_n, ws


def _like(t: Optional[torch.Tensor], ref: torch.Tensor):
    """The fake of a gradient: contiguous, ``t``'s shape and dtype, or empty for an absent input."""
    return t.new_empty(t.shape) if t is not None else ref.new_empty(0)


def _packed_layer_backward_fake(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0, out, h_n, c_n, workspace,
                                grad_out, grad_hn, grad_cn, mode, reverse):
    check_args(mode, w_hr, c0)
    rows, _, _ = as_rows(data, batch_sizes, "wfpass::packed_layer_backward")
    H, Hout = check_shapes(mode, rows, w_ih, w_hh, b_ih, b_hh, w_hr)
    _fake_states(((h0, Hout, "h0"), (c0, H, "c0"), (grad_hn, Hout, "grad_hn")), 1, "wfpass::packed_layer_backward")
    return tuple(_like(t, data) for t in (data, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0))


def _setup(ctx, inputs, output):
    data, batch_sizes, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0, mode, reverse, train = inputs
    out, h_n, c_n, ws = output
    ctx.save_for_backward(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0, out, h_n, c_n, ws)
    ctx.static = (mode, reverse, train)
    ctx.set_materialize_grads(False)


def _grad(ctx, g_out, g_hn, g_cn, _g_ws):
    mode, reverse, train = ctx.static
    if not train:
        raise RuntimeError("wfpass::packed_layer: backward through a call made with train=False (it keeps no "
                           "workspace); call it with train=True to differentiate it")
    data, batch_sizes, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0, out, h_n, c_n, ws = ctx.saved_tensors
    if mode != "LSTM":
        g_cn = None  # c_n is an empty placeholder
    grads = torch.ops.wfpass.packed_layer_backward.default(
        data, batch_sizes, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0, out, h_n, c_n, ws, g_out, g_hn, g_cn, mode,
        reverse)
    d_data, d_w_ih, d_w_hh, *rest = grads
    # No gradient for an input that was None (its slot holds an empty placeholder).
    rest = [g if t is not None else None for g, t in zip(rest, (b_ih, b_hh, w_hr, h0, c0))]
    return (d_data, None, d_w_ih, d_w_hh, *rest, None, None, None)


# The C++ kernels (``native/rnn/varlen_rnn.cpp``) take the CPU key, which
# comes before these registrations once they are loaded.
_LIB = define_rnn_op("packed_layer", forward=_packed_layer,
                     forward_fake=_packed_layer_fake, backward=_packed_layer_backward,
                     backward_fake=_packed_layer_backward_fake, setup=_setup, grad=_grad)


# -- both directions of a bidirectional layer in one call ---------------------------------------


def layer_weights(w, has_biases: bool, has_proj: bool):
    """One layer and direction's ``(w_ih, w_hh, b_ih, b_hh, w_hr)`` (None
    where absent) from its weights in the module's order."""
    return (w[0], w[1], w[2] if has_biases else None, w[3] if has_biases else None, w[-1] if has_proj else None)


def _directions(weights, has_biases: bool, has_proj: bool):
    """Each direction's ``layer_weights`` from the forward direction's
    weights followed by the reverse direction's."""
    per = 2 + (2 if has_biases else 0) + (1 if has_proj else 0)
    if len(weights) != 2 * per:
        raise RuntimeError(f"wfpass::packed_bilayer: expected {2 * per} weights (both directions), "
                           f"got {len(weights)}")
    return [layer_weights(weights[d * per:(d + 1) * per], has_biases, has_proj) for d in (0, 1)]


def _half(t, d):
    return None if t is None else t[d:d + 1]


def _bilayer(data, batch_sizes, weights, h0, c0, mode, has_biases, has_proj, train):
    """Where the C++ kernel is not registered: the two directions one after
    the other, concatenated (what the C++ kernel gives, bit for bit)."""
    op = torch.ops.wfpass.packed_layer.default if train else torch.ops.wfpass.packed_layer_fw.default
    r = [op(data, batch_sizes, *w, _half(h0, d), _half(c0, d), mode, d == 1, train)
         for d, w in enumerate(_directions(weights, has_biases, has_proj))]
    c_n = torch.cat([r[0][2], r[1][2]], 0) if mode == "LSTM" else data.new_empty(0)
    return torch.cat([r[0][0], r[1][0]], 1), torch.cat([r[0][1], r[1][1]], 0), c_n, r[0][3], r[1][3]


def _bilayer_fake(data, batch_sizes, weights, h0, c0, mode, has_biases, has_proj, train):
    (w_ih, w_hh, b_ih, b_hh, w_hr), back = _directions(weights, has_biases, has_proj)
    check_args(mode, w_hr, c0)
    data, batch_sizes, full = as_rows(data, batch_sizes, "wfpass::packed_bilayer")
    H, Hout = check_shapes(mode, data, w_ih, w_hh, b_ih, b_hh, w_hr)
    check_shapes(mode, data, *back)
    _fake_states(((h0, Hout, "h0"), (c0, H, "c0")), 2, "wfpass::packed_bilayer")
    N = data.shape[0]
    B = _batch(full, h0, c0, batch_sizes)
    c_n = data.new_empty((2, B, H)) if mode == "LSTM" else data.new_empty(0)
    ws = [data.new_empty((N, workspace_width(mode, H))) if train else data.new_empty(0) for _ in (0, 1)]
    return data.new_empty((N, 2 * Hout)), data.new_empty((2, B, Hout)), c_n, *ws


def _bilayer_backward(data, batch_sizes, weights, h0, c0, out, h_n, c_n, ws_f, ws_b, grad_out, grad_hn, grad_cn,
                      mode, has_biases, has_proj):
    dirs = _directions(weights, has_biases, has_proj)
    Hout = out.shape[1] // 2
    r = []
    for d, w in enumerate(dirs):
        r.append(torch.ops.wfpass.packed_layer_backward.default(
            data, batch_sizes, *w, _half(h0, d), _half(c0, d), out[:, d * Hout:(d + 1) * Hout], h_n[d:d + 1],
            c_n[d:d + 1] if mode == "LSTM" else c_n, (ws_f, ws_b)[d],
            None if grad_out is None else grad_out[:, d * Hout:(d + 1) * Hout], _half(grad_hn, d),
            _half(grad_cn, d) if mode == "LSTM" else None, mode, d == 1))
    d_w = [g for d in (0, 1) for g, t in zip(r[d][1:6], dirs[d]) if t is not None]
    empty = data.new_empty(0)
    d_h0 = torch.cat([r[0][6], r[1][6]], 0) if h0 is not None else empty
    d_c0 = torch.cat([r[0][7], r[1][7]], 0) if mode == "LSTM" and c0 is not None else empty
    return r[0][0] + r[1][0], d_w, d_h0, d_c0


def _bilayer_backward_fake(data, batch_sizes, weights, h0, c0, out, h_n, c_n, ws_f, ws_b, grad_out, grad_hn,
                           grad_cn, mode, has_biases, has_proj):
    empty = data.new_empty(0)
    return (data.new_empty(data.shape), [w.new_empty(w.shape) for w in weights],
            h0.new_empty(h0.shape) if h0 is not None else empty,
            c0.new_empty(c0.shape) if mode == "LSTM" and c0 is not None else empty)


def _bi_setup(ctx, inputs, output):
    data, batch_sizes, weights, h0, c0, mode, has_biases, has_proj, train = inputs
    out, h_n, c_n, ws_f, ws_b = output
    ctx.save_for_backward(data, batch_sizes, h0, c0, out, h_n, c_n, ws_f, ws_b, *weights)
    ctx.static = (mode, has_biases, has_proj, train)
    ctx.set_materialize_grads(False)


def _bi_grad(ctx, g_out, g_hn, g_cn, _g_wf, _g_wb):
    mode, has_biases, has_proj, train = ctx.static
    if not train:
        raise RuntimeError("wfpass::packed_bilayer: backward through a call made with train=False (it keeps no "
                           "workspace); call it with train=True to differentiate it")
    data, batch_sizes, h0, c0, out, h_n, c_n, ws_f, ws_b, *weights = ctx.saved_tensors
    d_data, d_w, d_h0, d_c0 = torch.ops.wfpass.packed_bilayer_backward.default(
        data, batch_sizes, weights, h0, c0, out, h_n, c_n, ws_f, ws_b, g_out, g_hn,
        g_cn if mode == "LSTM" else None, mode, has_biases, has_proj)
    return (d_data, None, list(d_w), d_h0 if h0 is not None else None,
            d_c0 if (mode == "LSTM" and c0 is not None) else None, None, None, None, None)


# ``wfpass::packed_bilayer``: both directions of a bidirectional layer in one
# call, into one [N, 2 H_out] output; ``_fw`` its twin without an autograd
# kernel. The C++ kernels (``native/rnn/varlen_rnn.cpp``) run the two
# directions at once where torch has two or more threads.
_BI_LIB = define_rnn_op("packed_bilayer", forward=_bilayer,
                        forward_fake=_bilayer_fake, backward=_bilayer_backward,
                        backward_fake=_bilayer_backward_fake, setup=_bi_setup, grad=_bi_grad)
