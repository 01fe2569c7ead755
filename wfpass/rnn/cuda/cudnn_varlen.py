"""The ``wfpass::cudnn_packed_rnn`` op: cuDNN's multi-layer RNN over a packed
batch (a PackedSequence's ``data`` and ``batch_sizes``), read from the
model's flat weight buffer, as an op AOTAutograd traces and trains through.

It is what eager PyTorch runs for ``nn.LSTM/GRU/RNN(packed)`` on CUDA:
``aten._cudnn_rnn`` with its ``batch_sizes`` argument (``SymInt[]``,
torch 2.11.0 and 2.15.0) given, read on the host from the CPU tensor, as
``_cudnn_impl`` in ``aten/src/ATen/native/cudnn/RNN.cpp`` does (no copy
from the GPU); the backward is ``aten._cudnn_rnn_backward`` with the same
sizes. After AOTAutograd, in the forward and backward graphs::

    out, hy, cy, reserve = wfpass.cudnn_packed_rnn_fw(data, batch_sizes, [w_ih_l0, ...], h0, c0, 2, 256, 0, 2,
                                                      True, True, [offsets], 0.0)
    d_data, dhx, dcx, dw = wfpass.cudnn_packed_rnn_backward(data, batch_sizes, [w_ih_l0, ...], h0, c0, out,
                                                           g_out, g_hy, g_cy, reserve, ...)

``data`` is ``[N, I]`` (N = the sum of the lengths, sequences longest
first), ``out`` ``[N, D * H_out]``, ``hy`` / ``cy`` ``[L * D, B, ...]``
(B = ``batch_sizes[0]``: from ``hx`` where given, else ``packed.meta``).
cuDNN's training reserve depends on every batch size's value, which a
fake never sees: in training its size is one known when the op runs
(``run_time_size``), so such a graph stays out of CUDA graphs, as a
training graph of ``wfpass::cudnn_rnn`` with a symbolic length does.
The flat buffer, dropout and autocast are as in ``cudnn.py``.
"""
from __future__ import annotations

from typing import List

import torch

from ..._torch import kernels as _kernels, tensors as _tensors
from .cudnn import (RANDOM, autocast_half, backward_outputs, buffer_for, buffer_numel, dropout_args,
                    weight_grads, weights_per_layer)
from ..ops import define_rnn_op
from ..varlen.meta import batch_of

__all__ = ["cudnn_packed_call"]

_LSTM = _kernels.CUDNN_MODES["LSTM"]


def _check_sizes(batch_sizes: torch.Tensor) -> None:
    if batch_sizes.dim() != 1 or batch_sizes.dtype != torch.int64 or batch_sizes.device.type != "cpu":
        raise RuntimeError("wfpass::cudnn_packed_rnn: batch_sizes must be a 1-D CPU int64 tensor (a PackedSequence's), "
                           f"got a {batch_sizes.dim()}-D {batch_sizes.device.type} {batch_sizes.dtype} tensor")


def _sizes(batch_sizes: torch.Tensor) -> List[int]:
    """The batch sizes as cuDNN takes them: ints read on the host."""
    _check_sizes(batch_sizes)
    return batch_sizes.tolist()


def _states(data, B, hx, cx, mode, hidden_size, proj_size, num_layers, bidirectional):
    """``hx``/``cx`` with a zero state of B sequences for each None."""
    lb = num_layers * (2 if bidirectional else 1)
    if hx is None:
        hx = data.new_zeros((lb, B, proj_size or hidden_size))
    if cx is None and mode == _LSTM:
        cx = data.new_zeros((lb, B, hidden_size))
    return hx, cx


def _forward(data, batch_sizes, weights, hx, cx, mode, hidden_size, proj_size, num_layers, train, bidirectional,
             offsets, dropout=0.0):
    sizes = _sizes(batch_sizes)
    hx, cx = _states(data, sizes[0] if sizes else 0, hx, cx, mode, hidden_size, proj_size, num_layers, bidirectional)
    per = weights_per_layer(len(weights), num_layers, bidirectional)
    buf, ws = buffer_for(weights, offsets, mode, hidden_size, proj_size, num_layers, bidirectional, data.shape[1])
    p, state = dropout_args(data, train, dropout)
    out, hy, cy, reserve, _ = _kernels.cudnn_rnn(data, ws, per, buf, hx, cx, mode, hidden_size, proj_size,
                                                 num_layers, False, p, train, bidirectional, sizes, state)
    if cy is None or mode != _LSTM:
        cy = data.new_empty(0)
    if not train:
        reserve = data.new_empty(0, dtype=torch.uint8)
    return out, hy, cy, reserve


def _forward_fake(data, batch_sizes, weights, hx, cx, mode, hidden_size, proj_size, num_layers, train,
                  bidirectional, offsets, dropout=0.0):
    _check_sizes(batch_sizes)
    for t in (*weights, hx, cx):
        if t is not None and t.dtype != data.dtype:
            raise RuntimeError(f"wfpass::cudnn_packed_rnn: the data is {data.dtype} but a weight or state is "
                               f"{t.dtype}; cuDNN runs an RNN in one dtype")
    if data.dim() != 2:
        raise RuntimeError(f"wfpass::cudnn_packed_rnn: packed data must be 2-D [rows, features], got {data.dim()}-D")
    B = hx.shape[1] if hx is not None else (cx.shape[1] if cx is not None else batch_of(batch_sizes))
    D = 2 if bidirectional else 1
    out_h = proj_size or hidden_size
    out = data.new_empty((data.shape[0], D * out_h))
    hy = data.new_empty((num_layers * D, B, out_h))
    cy = data.new_empty((num_layers * D, B, hidden_size)) if mode == _LSTM else data.new_empty(0)
    # cuDNN's reserve depends on every batch size's value: known at run time.
    n = _tensors.run_time_size() if train else 0
    return out, hy, cy, data.new_empty((n,), dtype=torch.uint8)


def _backward(data, batch_sizes, weights, hx, cx, output, grad_output, grad_hy, grad_cy, reserve, mode, hidden_size,
              proj_size, num_layers, bidirectional, offsets, output_mask, dropout=0.0):
    sizes = _sizes(batch_sizes)
    hx0, cx0 = _states(data, sizes[0] if sizes else 0, hx, cx, mode, hidden_size, proj_size, num_layers,
                       bidirectional)
    per = weights_per_layer(len(weights), num_layers, bidirectional)
    buf, ws = buffer_for(weights, offsets, mode, hidden_size, proj_size, num_layers, bidirectional, data.shape[1])
    if grad_output is None:
        grad_output = torch.zeros_like(output)
    p, state = dropout_args(data, True, dropout)  # the masks are in ``reserve``
    dx, dhx, dcx, dw = _kernels.cudnn_rnn_backward(
        data, ws, per, buf, hx0, cx0, output, grad_output, grad_hy, grad_cy, mode, hidden_size, proj_size,
        num_layers, False, p, True, bidirectional, sizes, state, reserve, list(output_mask))
    return backward_outputs(data, weights, offsets, hx0, cx0, dx, dhx, dcx, dw)


def _backward_fake(data, batch_sizes, weights, hx, cx, output, grad_output, grad_hy, grad_cy, reserve, mode,
                   hidden_size, proj_size, num_layers, bidirectional, offsets, output_mask, dropout=0.0):
    _check_sizes(batch_sizes)
    lb = num_layers * (2 if bidirectional else 1)
    B = hx.shape[1] if hx is not None else (cx.shape[1] if cx is not None else batch_of(batch_sizes))
    dhx = torch.empty_like(hx) if hx is not None else data.new_empty((lb, B, proj_size or hidden_size))
    if mode == _LSTM:
        dcx = torch.empty_like(cx) if cx is not None else data.new_empty((lb, B, hidden_size))
    else:
        dcx = data.new_empty(0)
    return torch.empty_like(data), dhx, dcx, data.new_empty((buffer_numel(weights, offsets),))


def _setup(ctx, inputs, output):
    (data, batch_sizes, weights, hx, cx, mode, hidden_size, proj_size, num_layers, train, bidirectional, offsets,
     dropout) = inputs
    out, _hy, _cy, reserve = output
    ctx.save_for_backward(data, batch_sizes, hx, cx, out, reserve, *weights)
    ctx.static = (mode, hidden_size, proj_size, num_layers, train, bidirectional, list(offsets), dropout)
    ctx.set_materialize_grads(False)


def _grad(ctx, g_out, g_hy, g_cy, _g_reserve):
    data, batch_sizes, hx, cx, out, reserve, *weights = ctx.saved_tensors
    mode, hidden_size, proj_size, num_layers, train, bidirectional, offsets, dropout = ctx.static
    if not train:
        raise RuntimeError("wfpass: a cuDNN packed RNN call run without grad was differentiated")
    if mode != _LSTM:
        g_cy = None
    d_data, dhx, dcx, flat = torch.ops.wfpass.cudnn_packed_rnn_backward.default(
        data, batch_sizes, weights, hx, cx, out, g_out, g_hy, g_cy, reserve, mode, hidden_size, proj_size,
        num_layers, bidirectional, offsets, [True, True, mode == _LSTM, True], dropout)
    dws = weight_grads(flat, weights, offsets)  # views of cuDNN's gradient buffer, no copy
    return (d_data, None, dws, dhx if hx is not None else None, dcx if cx is not None else None) + (None,) * 8


_LIB = define_rnn_op("cudnn_packed_rnn", forward=_forward,
                     forward_fake=_forward_fake, backward=_backward, backward_fake=_backward_fake, setup=_setup,
                     grad=_grad, tags=RANDOM, python_bodies=True)


def cudnn_packed_call(spec, data, batch_sizes, hx, ws, need_grad: bool, train: bool = False):
    """One RNN call over a packed batch on cuDNN: ``(out, h_n, c_n)``,
    ``c_n`` an empty tensor but for an LSTM (as ``wfpass::packed_rnn``
    returns). ``data``: ``[N, I]`` on CUDA, ``batch_sizes`` the CPU int64
    sizes; ``hx``: ``[]``, ``[h0]`` or ``[h0, c0]`` (an entry may be None:
    a zero state). Inside CUDA autocast, in fp16 as eager does. ``train``:
    the module's mode; with ``spec.dropout`` it drops between layers, as
    eager's cuDNN call does, with or without grad."""
    hx = list(hx)
    data, hx, ws = autocast_half(spec, data, hx, ws)
    mode = _kernels.CUDNN_MODES[spec.mode]
    h = hx[0] if hx else None
    c = hx[1] if spec.mode == "LSTM" and len(hx) > 1 else None
    dropout = float(spec.dropout) if train and spec.num_layers > 1 else 0.0
    op = torch.ops.wfpass.cudnn_packed_rnn.default if need_grad else torch.ops.wfpass.cudnn_packed_rnn_fw.default
    out, hy, cy, _ = op(data.contiguous(), batch_sizes, list(ws), h, c, mode, spec.hidden_size, spec.proj_size,
                        spec.num_layers, bool(need_grad or dropout > 0), spec.bidirectional,
                        [*spec.offsets, spec.numel], dropout)
    return out, hy, (cy if spec.mode == "LSTM" else out.new_empty(0))
