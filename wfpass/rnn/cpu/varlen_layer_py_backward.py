"""The Python kernel of ``wfpass::packed_layer_backward``, with its
helpers: the backward ``packed_layer.py`` describes, bit for bit the C++
kernel's ATen loop (``native/rnn/varlen_rnn.cpp``; ``packed_layer_py.py``
says where the raw-pointer loop runs instead). Each mode's backward in named steps: the factors that do not depend
on the incoming gradient (for all N rows at once), the loop over the steps
in backward order, the weight gradients (one GEMM each over the N rows).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from .varlen_checks import as_rows, check_states
from .varlen_layer_py import LayerCall, layer_call, onednn_rows, onednn_t_rows, use_onednn

__all__ = ["carry", "check_grads"]  # packed_layer.py registers the kernel; these serve packed_lstm_runs.py too


def _prev_index(batch_sizes: torch.Tensor, B: int, N: int, reverse: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Where the state each packed row's step read lives: ``(index, first)``.
    ``index`` int64 ``[N]``: the row of ``states`` (one state per packed row)
    that row read; ``first`` int64 ``[B]``: the packed row where sequence b
    read the initial state instead (its step 0 going forward, its own last
    step reversed), whose ``index`` entry is a placeholder 0. ``_gather``
    combines them: the recurrent weight's gradient multiplies these states
    for all N rows at once. Vectorized: a Python loop over N rows cost more
    than the ops it feeds at small sizes."""
    bs = batch_sizes
    T = bs.shape[0]
    step = torch.repeat_interleave(torch.arange(T), bs, output_size=N)
    off = torch.cumsum(bs, 0) - bs
    p = torch.arange(N)
    j = p - off[step]  # the row's sequence
    if not reverse:
        # Step t > 0 read step t - 1's row of the same sequence: off[t-1] + j = p - bs[t-1].
        return torch.where(step > 0, p - bs[(step - 1).clamp(min=0)], 0), torch.arange(B)
    # Step t read step t + 1's row (off[t+1] + j = p + bs[t]) if the sequence is live there, else h0.
    live_next = j < torch.cat([bs[1:], bs.new_zeros(1)])[step]
    first = torch.empty(B, dtype=torch.int64)
    first[j[~live_next]] = p[~live_next]
    return torch.where(live_next, p + bs[step], 0), first


def _gather(states, init, index, first):
    """``[N, W]``: the state each packed row read (see ``_prev_index``)."""
    out = states.index_select(0, index)
    return out.index_copy_(0, first, init)


def _one_minus(x, out):
    """``out = 1 - x``, exactly (negation is exact), without a temporary."""
    return torch.neg(x, out=out).add_(1)


def carry(grad, data, B: int, W: int):
    """A carry of the backward loop: the gradient of each sequence's final
    state, ``[B, W]``, contiguous and its own (the loop overwrites it), zeros where there is none."""
    if grad is None:
        return data.new_zeros((B, W))
    return grad[0].clone(memory_format=torch.contiguous_format)


def _incoming(dst, grad_out, carry, r0: int, n: int):
    """``dst = grad_out[r0 : r0 + n] + carry[:n]`` (the carry alone without grad_out): a step's dL/dh."""
    if grad_out is not None:
        return torch.add(grad_out[r0:r0 + n], carry[:n], out=dst)
    return dst.copy_(carry[:n])


def _bias_grads(dg, b_ih, b_hh, data):
    """Both biases' gradients where both enter every gate as a plain sum
    (LSTM, RNN): the same values, as two tensors (outputs may not alias);
    an empty placeholder for an absent bias."""
    d_b = dg.sum(0) if b_ih is not None or b_hh is not None else None
    d_b_ih = d_b if b_ih is not None else data.new_empty(0)
    d_b_hh = (d_b.clone() if b_ih is not None else d_b) if b_hh is not None else data.new_empty(0)
    return d_b_ih, d_b_hh


def _weight_grads(dg, data, h_prev, w_ih, b_ih, b_hh):
    """``(d_data, d_w_ih, d_w_hh, d_b_ih, d_b_hh)`` where ``dg`` ``[N, G*H]``
    is dL/d(every gate's pre-activation) on both sides (LSTM, RNN): each
    one GEMM (or sum) over the N rows."""
    if use_onednn(data):  # as the C++ kernels' weight_grads; in row blocks (onednn_rows)
        d_data = onednn_rows(dg, w_ih.t())
        d_w_ih, d_w_hh = onednn_t_rows(dg, (data, h_prev))
    else:
        d_data = torch.mm(dg, w_ih)
        d_w_ih = torch.mm(dg.t(), data)
        d_w_hh = torch.mm(dg.t(), h_prev)
    d_b_ih, d_b_hh = _bias_grads(dg, b_ih, b_hh, data)
    return d_data, d_w_ih, d_w_hh, d_b_ih, d_b_hh


class _Back(NamedTuple):
    """What every mode's backward loop reads: ``_prev_index``'s rows, the
    state each row read, the carry of dL/dh, the steps in backward order."""
    index: torch.Tensor
    first: torch.Tensor
    h_prev: torch.Tensor  # [N, H_out]
    hcar: torch.Tensor  # [B, H_out]
    order: list  # (first row, rows) of each step
    grad_out: Optional[torch.Tensor]


def _packed_layer_backward(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0, out, h_n, c_n, workspace,
                           grad_out, grad_hn, grad_cn, mode, reverse):
    shape = data.shape  # d_data has it: [T, B, I] for a full batch (as_rows)
    data, batch_sizes, _ = as_rows(data, batch_sizes, "wfpass::packed_layer_backward")
    L = layer_call(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0, mode, reverse, workspace)
    check_grads(L, data, out, grad_out, grad_hn, grad_cn if mode == "LSTM" else None)
    # Few fresh N-row buffers, no throwaway ones: each costs page faults (the
    # CPU allocator hands large blocks back to the system; a third of this
    # backward's time at N = 1600, H = 128 before), so the factors are
    # computed in place into the buffers the loop then scales, and the
    # loop's dL/dh lives in a [B, H] buffer unless later GEMMs need every row's.
    with torch.no_grad():
        bw = _backward_start(L, data, batch_sizes, out, grad_out, grad_hn)
        if mode == "LSTM":
            *grads, d_w_hr, d_c0 = _lstm_backward(L, data, workspace, bw, grad_cn, w_ih, w_hh, b_ih, b_hh, w_hr, c0)
        else:
            d_w_hr, d_c0 = data.new_empty(0), data.new_empty(0)  # no projection, no cell state
            if mode == "GRU":
                grads = _gru_backward(L, data, workspace, bw, w_ih, w_hh, b_ih, b_hh)
            else:
                grads = _rnn_backward(L, data, out, bw, mode == "RNN_RELU", w_ih, w_hh, b_ih, b_hh)
        d_h0 = bw.hcar.unsqueeze(0) if h0 is not None else data.new_empty(0)
    return (grads[0].view(shape), *grads[1:], d_w_hr, d_h0, d_c0)


def check_grads(L: LayerCall, data, out, grad_out, grad_hn, grad_cn,
                op: str = "wfpass::packed_layer_backward") -> None:
    """The backward's own inputs against the call's sizes, before a row is
    read: ``out`` ``[N, H_out]`` and the gradients where given (the C++
    kernel's ``check_grads``)."""
    for t, name in ((out, "out"), (grad_out, "grad_out")):
        if t is not None and (tuple(t.shape) != (L.N, L.Hout) or t.dtype != data.dtype):
            raise RuntimeError(f"{op}: {name} must have shape {(L.N, L.Hout)} and data's dtype {data.dtype}, got "
                               f"{tuple(t.shape)} {t.dtype}")
    check_states(((grad_hn, L.Hout, "grad_hn"), (grad_cn, L.H, "grad_cn")), data, 1, L.B, op)


def _backward_start(L: LayerCall, data, batch_sizes, out, grad_out, grad_hn) -> _Back:
    """What the backward of every mode starts from (``_Back``)."""
    index, first = _prev_index(batch_sizes, L.B, L.N, L.reverse)
    h_prev = _gather(out, L.h_init, index, first)  # [N, H_out]: the state each row read
    # The carries: dL/dh (dL/dc) of each sequence's state, starting from
    # the gradient of its final state; after the loop, dL/dh0 (dL/dc0).
    hcar = carry(grad_hn, data, L.B, L.Hout)
    # The backward runs the steps in the opposite order of the forward.
    order = [(L.off[t], L.bs[t]) for t in range(len(L.bs))]
    if not L.reverse:
        order.reverse()
    return _Back(index, first, h_prev, hcar, order, grad_out)


def _lstm_backward(L: LayerCall, data, workspace, bw: _Back, grad_cn, w_ih, w_hh, b_ih, b_hh, w_hr, c0):
    """The LSTM's gradients: ``(d_data, d_w_ih, d_w_hh, d_b_ih, d_b_hh,
    d_w_hr, d_c0)``, the last two empty without a projection, without c0."""
    d_w_hr, d_c0 = data.new_empty(0), data.new_empty(0)
    H = L.H
    dg, k_c = _lstm_factors(L, data, workspace, bw)
    ccar = carry(grad_cn, data, L.B, H)
    dh_all = _lstm_loop(L, data, workspace, dg, k_c, ccar, bw, w_hh, w_hr)
    if w_hr is not None:
        o, tc = workspace[:, 3 * H:4 * H], workspace[:, 5 * H:]
        d_w_hr = torch.mm(dh_all.t(), torch.mul(o, tc, out=k_c))  # k_c's buffer is free now
    if c0 is not None:
        d_c0 = ccar.unsqueeze(0)
    return (*_weight_grads(dg.view(L.N, 4 * H), data, bw.h_prev, w_ih, b_ih, b_hh), d_w_hr, d_c0)


def _lstm_factors(L: LayerCall, data, workspace, bw: _Back):
    """``(dg [N, 4, H], k_c [N, H])``: dL/d(pre-activation) = dc * k_i,
    k_f, k_g and dh * k_o, where the step's dc = carried dc + dh * k_c: the
    factors for all rows at once, written into dg, which the loop then
    scales in place."""
    N, H = L.N, L.H
    i, f, g, o, c, tc = (workspace[:, k * H:(k + 1) * H] for k in range(6))
    dg = data.new_empty((N, 4, H))
    dg_if, dg_i, dg_f, dg_g, dg_o = dg[:, :2], dg[:, 0], dg[:, 1], dg[:, 2], dg[:, 3]
    ws_if = workspace[:, :2 * H].view(N, 2, H)
    _one_minus(ws_if, dg_if).mul_(ws_if)  # i (1 - i), f (1 - f)
    dg_i.mul_(g)
    k_c = _gather(c, L.c_init, bw.index, bw.first)  # c_prev, until k_f has it
    dg_f.mul_(k_c)
    torch.mul(g, g, out=dg_g).neg_().add_(1).mul_(i)  # (1 - g^2) i
    _one_minus(o, dg_o).mul_(o).mul_(tc)  # (1 - o) o tanh(c)
    torch.mul(tc, tc, out=k_c).neg_().add_(1).mul_(o)  # (1 - tanh(c)^2) o
    return dg, k_c


def _lstm_loop(L: LayerCall, data, workspace, dg, k_c, ccar, bw: _Back, w_hh, w_hr):
    """The LSTM's steps backward: scales ``dg`` in place, leaves dL/dh0 in
    ``bw.hcar`` and dL/dc0 in ``ccar``; returns the buffer of dL/dh (every
    row's with a projection)."""
    N, H = L.N, L.H
    f = workspace[:, H:2 * H]
    dg_ifg, dg_o, dg2 = dg[:, :3], dg[:, 3], dg.view(N, 4 * H)
    proj = w_hr is not None
    # With a projection, d_w_hr needs every row's dL/dh.
    dh_all = data.new_empty((N, L.Hout)) if proj else data.new_empty((L.B, L.Hout))
    dhp = data.new_empty((L.B, H)) if proj else None
    for r0, n in bw.order:
        R = slice(r0, r0 + n)
        dh = _incoming(dh_all[R] if proj else dh_all[:n], bw.grad_out, bw.hcar, r0, n)
        if proj:  # through the projection: dL/d(o * tanh(c))
            dh = torch.mm(dh, w_hr, out=dhp[:n])
        dc = ccar[:n]
        dc.addcmul_(dh, k_c[R])
        dg_ifg[R].mul_(dc.unsqueeze(1))
        dg_o[R].mul_(dh)
        dc.mul_(f[R])  # dL/dc_prev
        torch.mm(dg2[R], w_hh, out=bw.hcar[:n])  # dL/dh_prev
    return dh_all


def _gru_backward(L: LayerCall, data, workspace, bw: _Back, w_ih, w_hh, b_ih, b_hh):
    """The GRU's gradients: ``(d_data, d_w_ih, d_w_hh, d_b_ih, d_b_hh)``."""
    N, H = L.N, L.H
    z = workspace[:, H:2 * H]
    dg, a_n = _gru_factors(L, data, workspace, bw.h_prev)
    dg2 = dg.view(N, 3 * H)
    dh_all = data.new_empty((N, H))
    for r0, n in bw.order:
        R = slice(r0, r0 + n)
        dh = _incoming(dh_all[R], bw.grad_out, bw.hcar, r0, n)
        dg[R].mul_(dh.unsqueeze(1))
        hc = torch.mul(dh, z[R], out=bw.hcar[:n])
        hc.addmm_(dg2[R], w_hh)  # dL/dh_prev = dh * z + dgh @ W_hh
    # The input side differs from dg only in n's third (not scaled by
    # r): its gradients as GEMMs over dg's r | z columns and this one.
    return _gru_weight_grads(L, data, dg2, a_n.mul_(dh_all), bw.h_prev, w_ih, b_ih, b_hh)


def _gru_factors(L: LayerCall, data, workspace, h_prev):
    """``(dg [N, 3, H], a_n [N, H])``: as native_layer._gates_backward,
    dL/d(recurrent gates) = dh * (k_r, k_z, a_n r), written into dg, which
    the loop scales; a_n = (1 - n^2)(1 - z), the factor through n."""
    N, H = L.N, L.H
    r, z, hn, n_ = (workspace[:, k * H:(k + 1) * H] for k in range(4))
    dg = data.new_empty((N, 3, H))
    dg_r, dg_z, dg_n = dg[:, 0], dg[:, 1], dg[:, 2]
    a_n = torch.mul(n_, n_).neg_().add_(1)
    a_n.mul_(_one_minus(z, dg_z))  # (1 - n^2)(1 - z): through n
    dg_z.mul_(z).mul_(torch.sub(h_prev, n_, out=dg_r))  # (1 - z) z (h_prev - n)
    _one_minus(r, dg_r).mul_(r).mul_(hn).mul_(a_n)  # (1 - r) r hn a_n
    torch.mul(a_n, r, out=dg_n)  # the recurrent side of n is scaled by r
    return dg, a_n


def _gru_weight_grads(L: LayerCall, data, dg2, dgi_n, h_prev, w_ih, b_ih, b_hh):
    """The GRU's ``(d_data, d_w_ih, d_w_hh, d_b_ih, d_b_hh)``: ``dg2``
    ``[N, 3H]`` the recurrent gates' dL/d(pre-activation), ``dgi_n`` the
    input side's n (its r and z are dg2's)."""
    H = L.H
    dg_rz = dg2[:, :2 * H]
    if use_onednn(data):  # as the C++ kernel's GRU branch
        d_data = onednn_rows(dg_rz, w_ih[:2 * H].t()).add_(onednn_rows(dgi_n, w_ih[2 * H:].t()))
        d_w_ih = torch.cat([onednn_t_rows(dg_rz, (data,))[0], onednn_t_rows(dgi_n, (data,))[0]])
        d_w_hh, = onednn_t_rows(dg2, (h_prev,))
    else:
        d_data = torch.mm(dg_rz, w_ih[:2 * H]).addmm_(dgi_n, w_ih[2 * H:])
        d_w_ih = data.new_empty(w_ih.shape)
        torch.mm(dg_rz.t(), data, out=d_w_ih[:2 * H])
        torch.mm(dgi_n.t(), data, out=d_w_ih[2 * H:])
        d_w_hh = torch.mm(dg2.t(), h_prev)
    d_b_ih = data.new_empty(0)
    if b_ih is not None:
        d_b_ih = data.new_empty(3 * H)
        torch.sum(dg_rz, 0, out=d_b_ih[:2 * H])
        torch.sum(dgi_n, 0, out=d_b_ih[2 * H:])
    d_b_hh = dg2.sum(0) if b_hh is not None else data.new_empty(0)
    return d_data, d_w_ih, d_w_hh, d_b_ih, d_b_hh


def _rnn_backward(L: LayerCall, data, out, bw: _Back, relu: bool, w_ih, w_hh, b_ih, b_hh):
    """The plain RNN's gradients: ``(d_data, d_w_ih, d_w_hh, d_b_ih, d_b_hh)``."""
    # d act(pre) / d pre, scaled in place by dL/dh in the loop.
    dpre = (out > 0).to(out.dtype) if relu else torch.mul(out, out).neg_().add_(1)
    dh_buf = data.new_empty((L.B, L.H))
    for r0, n in bw.order:
        dh = _incoming(dh_buf[:n], bw.grad_out, bw.hcar, r0, n)
        torch.mm(dpre[r0:r0 + n].mul_(dh), w_hh, out=bw.hcar[:n])
    return _weight_grads(dpre, data, bw.h_prev, w_ih, b_ih, b_hh)
