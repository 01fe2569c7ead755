"""The ``wfpass::packed_lstm_runs`` op: one LSTM layer and direction over a
packed batch on the CPU, as oneDNN's LSTM layer (``aten.mkldnn_rnn_layer``,
the kernel eager runs on a padded batch) over each run of steps with the
same batch size.

Why: the per-step loop (``wfpass::packed_layer``) makes ~10 ATen calls a
step; one layer's forward without grad took 3.83 ms at hidden 128, batch
16, T = 100, lengths 20-100 (911 rows), where oneDNN's fused kernel runs the
whole padded batch (1600 rows) in 2.17 ms (docs/packed_layer.md).
Sorted longest first, a packed batch is a few runs of steps whose batch
size does not change (at most one per distinct length, 14 here): within a
run the rows of its steps are one ``[steps, n, I]`` block of ``data``, and
oneDNN's layer runs it from the state the run before left in the first
``n`` sequences. The same layer's forward: 2.59 ms. wformat runs it for inference
(``usable``); a training step keeps the per-step loop, whose backward is
faster than this op's.

What it computes is ``wfpass::packed_layer``'s (see there) for
``mode="LSTM"`` without a projection, so the same schema less ``w_hr``
and ``mode``::

    wfpass::packed_lstm_runs(Tensor data, Tensor batch_sizes, Tensor w_ih, Tensor w_hh,
        Tensor? b_ih, Tensor? b_hh, Tensor? h0, Tensor? c0, bool reverse, bool train)
        -> (out [N, H], h_n [1, B, H], c_n [1, B, H], workspace [N, 2H] or [0])

Processing order: the runs in time order (reverse: backwards, where the
batch grows: a sequence joining starts from its row of ``h0``/``c0``).

The backward recomputes: oneDNN's backward needs the workspace of a
training forward, whose size only oneDNN knows (its fake cannot say it),
so ``train=True`` keeps instead each run's initial ``h`` and ``c``
(``workspace[rows of the run's first n rows] = h | c``), and the backward
reruns each run's forward with ``train=True`` before
``aten.mkldnn_rnn_layer_backward``, runs in the opposite order, carrying
dL/dh and dL/dc of the first ``n`` sequences from one run to the next.
Forward and backward together: 12.85 ms against the loop's 10.49 ms for
that layer (docs/packed_layer.md): the recompute and oneDNN's backward cost
more than the faster forward saves.

The kernels are Python: a few ATen calls per run, not per step. Without
grad the runs read the layer direction's copy of its weights in oneDNN's
layout where the rewrite allowed one (``lstm_pack.py``, as the padded
path's inference does): oneDNN then reorders nothing per run.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..ops import define_rnn_op
from . import lstm_prepack as _lstm_prepack
from .varlen_checks import check_shapes, check_states, steps as _steps
from .varlen_layer_py import LayerCall
from .varlen_layer_py_backward import carry, check_grads
from ..varlen.meta import batch_of

__all__ = ["runs", "usable"]

_LAYER = torch.ops.aten.mkldnn_rnn_layer.default
_LAYER_BACKWARD = torch.ops.aten.mkldnn_rnn_layer_backward.default
_LSTM = 2  # oneDNN's mode number for an LSTM (aten/src/ATen/native/mkldnn/RNN.cpp)


def usable(mode: str, proj_size: int, x: torch.Tensor, need_grad: bool) -> bool:
    """Whether a packed RNN's layers run here: CPU LSTMs without a
    projection, in a dtype oneDNN's LSTM runs on this machine, without
    grad, where the per-step loop has no raw-pointer path for the dtype
    (``native.serves``: fp32 on an AVX-512 or AVX2 CPU, oneDNN on). Measured on one layer
    (docs/packed_layer.md): the loop's ATen path 3.97 ms, this op 2.65 ms,
    the raw-pointer loop 1.59 ms. With grad the loop always stays: its own
    backward beat this op's recompute (10.49 ms against 12.85 ms for a
    layer's training step on the ATen path)."""
    from ..._torch import kernels as _kernels
    from ... import native

    if need_grad or mode != "LSTM" or proj_size != 0 or x.device.type != "cpu":
        return False
    if native.serves(x):
        return False
    return _kernels.mkldnn_rnn_dtype(x.dtype)


def runs(batch_sizes: torch.Tensor, reverse: bool) -> List[Tuple[int, int, int]]:
    """``(first row, steps, n)`` of each run of equal batch size, in processing order."""
    bs = batch_sizes.tolist()
    out, row, t = [], 0, 0
    while t < len(bs):
        t1 = t
        while t1 < len(bs) and bs[t1] == bs[t]:
            t1 += 1
        out.append((row, t1 - t, bs[t]))
        row += (t1 - t) * bs[t]
        t = t1
    return out[::-1] if reverse else out


def _bias(b: Optional[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    return b if b is not None else w.new_zeros(w.shape[0])


_OP = "wfpass::packed_lstm_runs"


def _checked(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, h0, c0, op=_OP):
    """``(H, B, batch_sizes as a list)``, every size checked before oneDNN
    reads a row (``packed_layer``'s checks: oneDNN's layer trusts the
    shapes it is given)."""
    H, _ = check_shapes("LSTM", data, w_ih, w_hh, b_ih, b_hh, None, op)
    bs, _ = _steps(batch_sizes, data.shape[0], op)
    check_states(((h0, H, "h0"), (c0, H, "c0")), data, 1, bs[0], op)
    return H, bs[0], bs


def _forward(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, h0, c0, reverse, train):
    H, B, bs = _checked(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, h0, c0)
    has_biases = b_ih is not None
    b_ih, b_hh = _bias(b_ih, w_ih), _bias(b_hh, w_ih)
    out = data.new_empty((data.shape[0], H))
    ws = data.new_empty((data.shape[0], 2 * H)) if train else data.new_empty(0)
    h, c = carry(h0, data, B, H), carry(c0, data, B, H)  # running states, overwritten run by run
    layer_ih, layer_hh = w_ih, w_hh
    if not train:
        # The layer direction's copy in oneDNN's layout, as the padded
        # path's inference reads it (lstm_pack.py): one copy serves every
        # run (its layout does not depend on the run's length or batch, nor
        # on has_biases: checked bit for bit); without it oneDNN would
        # reorder both weights once per run.
        packed = _lstm_prepack.packed_pair(data.narrow(0, 0, bs[0]).unsqueeze(0), w_ih, w_hh, reverse, H,
                                        has_biases)
        if packed is not None:
            _lstm_prepack.count_python_call(w_ih)
            layer_ih, layer_hh = packed
    with torch.no_grad():
        for row, steps, n in runs(batch_sizes, reverse):
            x = data.narrow(0, row, steps * n).view(steps, n, -1)
            if train:
                ws[row:row + n, :H] = h[:n]
                ws[row:row + n, H:] = c[:n]
            y, hy, cy, _ = _LAYER(x, layer_ih, layer_hh, b_ih, b_hh, h[:n].unsqueeze(0), c[:n].unsqueeze(0), reverse,
                                  [], _LSTM, H, 1, True, False, False, False)
            out.narrow(0, row, steps * n).copy_(y.view(steps * n, H))
            h[:n] = hy[0]
            c[:n] = cy[0]
    return out, h.unsqueeze(0), c.unsqueeze(0), ws


def _backward(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, h0, c0, workspace, grad_out, grad_hn, grad_cn, reverse):
    op = _OP + "_backward"
    H, B, bs = _checked(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, h0, c0, op)
    N = data.shape[0]
    if tuple(workspace.shape) != (N, 2 * H):
        raise RuntimeError(f"{op}: the workspace has shape {tuple(workspace.shape)}, not {(N, 2 * H)}: was the "
                           "forward run with train=False?")
    check_grads(LayerCall(N, bs, [], B, H, H, reverse, None, None), data, None, grad_out, grad_hn, grad_cn, op)
    bi, bh = _bias(b_ih, w_ih), _bias(b_hh, w_ih)
    dh, dc = carry(grad_hn, data, B, H), carry(grad_cn, data, B, H)
    d_data = data.new_empty(data.shape)
    dw = [torch.zeros_like(w) for w in (w_ih, w_hh, bi, bh)]
    # oneDNN's layer keeps its workspace only with grad mode on (this kernel
    # runs below autograd: nothing is recorded).
    with torch.enable_grad():
        for row, steps, n in reversed(runs(batch_sizes, reverse)):
            rows = steps * n
            x = data.narrow(0, row, rows).view(steps, n, -1)
            hx = workspace[row:row + n, :H].contiguous().unsqueeze(0)
            cx = workspace[row:row + n, H:].contiguous().unsqueeze(0)
            y, hy, cy, ws = _LAYER(x, w_ih, w_hh, bi, bh, hx, cx, reverse, [], _LSTM, H, 1, True, False, False, True)
            g = grad_out.narrow(0, row, rows).view(steps, n, H) if grad_out is not None else torch.zeros_like(y)
            dx, *dws, dhx, dcx = _LAYER_BACKWARD(x, w_ih, w_hh, bi, bh, hx, cx, y, hy, cy, g, dh[:n].unsqueeze(0),
                                                dc[:n].unsqueeze(0), reverse, _LSTM, H, 1, True, True, False, [],
                                                False, ws)
            d_data.narrow(0, row, rows).copy_(dx.reshape(rows, -1))
            for acc, d in zip(dw, dws):
                acc.add_(d)
            dh[:n] = dhx[0]
            dc[:n] = dcx[0]
    empty = data.new_empty(0)
    return (d_data, dw[0], dw[1], dw[2] if b_ih is not None else empty, dw[3] if b_hh is not None else empty,
            dh.unsqueeze(0) if h0 is not None else empty, dc.unsqueeze(0) if c0 is not None else empty)


def _forward_fake(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, h0, c0, reverse, train):
    check_shapes("LSTM", data, w_ih, w_hh, b_ih, b_hh, None, _OP)
    H, N = w_hh.shape[1], data.shape[0]
    B = h0.shape[1] if h0 is not None else (c0.shape[1] if c0 is not None else batch_of(batch_sizes))
    ws = data.new_empty((N, 2 * H)) if train else data.new_empty(0)
    return data.new_empty((N, H)), data.new_empty((1, B, H)), data.new_empty((1, B, H)), ws


def _backward_fake(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, h0, c0, workspace, grad_out, grad_hn, grad_cn,
                   reverse):
    check_shapes("LSTM", data, w_ih, w_hh, b_ih, b_hh, None, _OP + "_backward")
    return tuple(t.new_empty(t.shape) if t is not None else data.new_empty(0)
                 for t in (data, w_ih, w_hh, b_ih, b_hh, h0, c0))


def _setup(ctx, inputs, output):
    data, batch_sizes, w_ih, w_hh, b_ih, b_hh, h0, c0, reverse, train = inputs
    ctx.save_for_backward(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, h0, c0, output[3])
    ctx.static = (reverse, train)
    ctx.set_materialize_grads(False)


def _grad(ctx, g_out, g_hn, g_cn, _g_ws):
    reverse, train = ctx.static
    if not train:
        raise RuntimeError("wfpass::packed_lstm_runs: backward through a call made with train=False (it keeps no "
                           "states); call it with train=True to differentiate it")
    data, batch_sizes, w_ih, w_hh, b_ih, b_hh, h0, c0, ws = ctx.saved_tensors
    grads = torch.ops.wfpass.packed_lstm_runs_backward.default(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, h0, c0,
                                                               ws, g_out, g_hn, g_cn, reverse)
    d_data, d_w_ih, d_w_hh, *rest = grads
    rest = [g if t is not None else None for g, t in zip(rest, (b_ih, b_hh, h0, c0))]
    return (d_data, None, d_w_ih, d_w_hh, *rest, None, None)


_LIB = define_rnn_op("packed_lstm_runs", forward=_forward,
                     forward_fake=_forward_fake, backward=_backward, backward_fake=_backward_fake, setup=_setup,
                     grad=_grad)
