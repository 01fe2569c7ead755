"""The ``wfpass::packed_layer`` op: one layer and one direction of an LSTM,
GRU or plain RNN over a packed batch (``PackedSequence`` layout), forward
and backward, steps of each sequence past its length never computed.

Why: eager PyTorch runs a packed RNN on the CPU through ATen's generic
per-step path (a cell call per step, each a dozen small ops, and autograd
recording all of them), about 5x slower than the padded oneDNN kernel.
This op keeps the packed layout (nothing padded, nothing wasted on steps
past a sequence's end) and runs the recurrence in a few vectorized calls a
step, with a hand-written backward.

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

How (the Python kernels below; ``_torch/native/packed_rnn.cpp`` has the
same steps in C++, registered for the CPU key, which comes first):

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
  computed for all N rows at once from the workspace, a loop of 3 (RNN), 4
  (GRU) or 6 (LSTM) calls a step through the recurrent GEMM, then every
  weight gradient as ONE GEMM over the N rows (the state each row read,
  gathered once with ``prev_index``).

Workspace layout (``train=True``; what the backward reads, post-activation):

* LSTM ``[N, 5H]``: ``i | f | g | o | c`` (c: the cell state after the step)
* GRU  ``[N, 4H]``: ``r | z | hn | n`` (hn = ``W_hn h + b_hn``, the
  recurrent part of n: placed next to r and z so the step's one recurrent
  GEMM writes r, z and hn in one contiguous block)
* RNN  ``[N, 0]``: the backward needs only ``out``.

``train=False`` returns an empty workspace (``[0]``) and the op cannot be
differentiated; the kernels still use a workspace-shaped scratch inside.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .ops import define_rnn_op
from .packed_meta import batch_of

__all__ = ["MODES", "gate_count", "workspace_width", "prev_index"]

#: The cells this op runs.
MODES = ("LSTM", "GRU", "RNN_TANH", "RNN_RELU")

_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}
_WIDTH = {"LSTM": 5, "GRU": 4, "RNN_TANH": 0, "RNN_RELU": 0}

_ARGS = ("Tensor data, Tensor batch_sizes, Tensor w_ih, Tensor w_hh, Tensor? b_ih, Tensor? b_hh, Tensor? w_hr, "
         "Tensor? h0, Tensor? c0, str mode, bool reverse, bool train")
_RETURNS = "(Tensor, Tensor, Tensor, Tensor)"
_BACKWARD = ("(Tensor data, Tensor batch_sizes, Tensor w_ih, Tensor w_hh, Tensor? b_ih, Tensor? b_hh, Tensor? w_hr, "
             "Tensor? h0, Tensor? c0, Tensor out, Tensor h_n, Tensor c_n, Tensor workspace, Tensor? grad_out, "
             "Tensor? grad_hn, Tensor? grad_cn, str mode, bool reverse) -> (Tensor d_data, Tensor d_w_ih, "
             "Tensor d_w_hh, Tensor d_b_ih, Tensor d_b_hh, Tensor d_w_hr, Tensor d_h0, Tensor d_c0)")


def gate_count(mode: str) -> int:
    """Gates per hidden unit: the rows of ``w_ih`` are ``gate_count * H``."""
    _check_mode(mode)
    return _GATES[mode]


def workspace_width(mode: str, H: int) -> int:
    """Columns of the training workspace for ``mode`` and hidden size H:
    LSTM 5H (i, f, g, o, c), GRU 4H (r, z, hn, n), RNN 0."""
    _check_mode(mode)
    return _WIDTH[mode] * H


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"wfpass::packed_layer: mode must be one of {MODES}, got {mode!r}")


def _check_args(mode: str, w_hr, c0) -> None:
    _check_mode(mode)
    if mode != "LSTM" and (w_hr is not None or c0 is not None):
        raise ValueError(f"wfpass::packed_layer: w_hr and c0 are LSTM arguments, got one for mode {mode!r}")


def _sizes(mode: str, w_ih, w_hr) -> Tuple[int, int]:
    """(H, H_out): the hidden size and the size of h (H_out < H with a projection)."""
    H = w_ih.shape[0] // _GATES[mode]
    return H, (w_hr.shape[0] if w_hr is not None else H)


def _steps(batch_sizes: torch.Tensor, N: int) -> Tuple[list, list]:
    """``batch_sizes`` read once (one ``.tolist()``), checked, and its row offsets."""
    if batch_sizes.dim() != 1 or batch_sizes.dtype != torch.int64 or batch_sizes.device.type != "cpu":
        raise ValueError("wfpass::packed_layer: batch_sizes must be a 1-D int64 CPU tensor (a PackedSequence's)")
    bs = batch_sizes.tolist()
    if not bs or bs[-1] < 1 or any(a < b for a, b in zip(bs, bs[1:])) or sum(bs) != N:
        raise ValueError(f"wfpass::packed_layer: batch_sizes must be positive, non-increasing and sum to "
                         f"data.shape[0] = {N}; got {bs[:8]}{'...' if len(bs) > 8 else ''}")
    off, acc = [], 0
    for n in bs:
        off.append(acc)
        acc += n
    return bs, off


def _schedule(bs: Sequence[int], off: Sequence[int], reverse: bool):
    """The forward's steps in order: ``(r0, n, p0, m)``: the step's rows
    ``r0 : r0 + n``; its state's first ``m`` rows are rows ``p0 : p0 + m``
    of the step before it (in processing order), the rest rows ``m : n`` of
    the initial state. Going forward m = n except at step 0 (m = 0);
    reversed, m = bs[t + 1] (0 at the last step): the sequences that join
    at step t start from h0."""
    T = len(bs)
    for k in range(T):
        t = T - 1 - k if reverse else k
        if not reverse:
            yield off[t], bs[t], (off[t - 1] if t else 0), (bs[t] if t else 0)
        else:
            last = t == T - 1
            yield off[t], bs[t], (0 if last else off[t + 1]), (0 if last else bs[t + 1])


def prev_index(batch_sizes: torch.Tensor, reverse: bool) -> torch.Tensor:
    """For each of the N packed rows, the row of ``cat([states, init])``
    (``states`` ``[N, W]`` one per packed row, ``init`` ``[B, W]``) holding
    the state that row's step read: what the weight gradient of the
    recurrent GEMM multiplies, gathered for all rows at once. int64 ``[N]``."""
    bs = batch_sizes
    T = bs.shape[0]
    N = int(bs.sum())
    step = torch.repeat_interleave(torch.arange(T), bs)
    off = torch.cumsum(bs, 0) - bs
    p = torch.arange(N)
    j = p - off[step]  # the row's sequence
    if not reverse:
        # Step t > 0 read step t - 1's row of the same sequence: off[t-1] + j = p - bs[t-1].
        return torch.where(step > 0, p - bs[(step - 1).clamp(min=0)], N + j)
    nxt = torch.cat([bs[1:], bs.new_zeros(1)])
    # Step t read step t + 1's row (off[t+1] + j = p + bs[t]) if the sequence is live there, else h0.
    return torch.where(j < nxt[step], p + bs[step], N + j)


def _prev(states, init, buf, p0: int, m: int, n: int):
    """The ``[n, W]`` state a step reads (see ``_schedule``): a view where
    it is one block, else its two pieces copied into ``buf``."""
    if m == n:
        return states[p0:p0 + n]
    if m == 0:
        return init[:n]
    buf[:m].copy_(states[p0:p0 + m])
    buf[m:n].copy_(init[m:n])
    return buf[:n]


def _final(states, init, bs, off, reverse: bool):
    """``[1, B, W]``: each sequence's state after its last step. Reversed,
    that is step 0 (all B rows, the first B packed rows); forward, the
    sequences that end at step t are rows ``bs[t+1] : bs[t]`` of that step
    (one copy per distinct length)."""
    B = bs[0]
    fin = states.new_empty((1, B, states.shape[1]))
    if reverse:
        fin[0].copy_(states[:B])
        return fin
    for t in range(len(bs)):
        m = bs[t + 1] if t + 1 < len(bs) else 0
        if m < bs[t]:
            fin[0, m:bs[t]].copy_(states[off[t] + m:off[t] + bs[t]])
    return fin


def _bias_sum(a, b, lo: int, hi: int):
    """``a[lo:hi] + b[lo:hi]`` for the biases given, or None."""
    a = a[lo:hi] if a is not None else None
    b = b[lo:hi] if b is not None else None
    if a is not None and b is not None:
        return a + b
    return a if a is not None else b


def _project(out, bias, data, w) -> None:
    """``out = data @ w.T (+ bias)``, over all N rows, written into ``out`` (a column block of the workspace)."""
    if bias is not None:
        torch.addmm(bias, data, w.t(), out=out)
    else:
        torch.mm(data, w.t(), out=out)


def _states(data, B: int, H: int, Hout: int, h0, c0, lstm: bool):
    """h0 ``[B, H_out]`` and c0 ``[B, H]`` (zeros where None; made here, not in the graph)."""
    for s, w, name in ((h0, Hout, "h0"), (c0, H, "c0")):
        if s is not None and tuple(s.shape) != (1, B, w):
            raise ValueError(f"wfpass::packed_layer: {name} must have shape {(1, B, w)}, got {tuple(s.shape)}")
    h = h0[0] if h0 is not None else data.new_zeros((B, Hout))
    c = (c0[0] if c0 is not None else data.new_zeros((B, H))) if lstm else None
    return h, c


def _packed_layer(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0, mode, reverse, train):
    _check_args(mode, w_hr, c0)
    N = data.shape[0]
    bs, off = _steps(batch_sizes, N)
    B = bs[0]
    H, Hout = _sizes(mode, w_ih, w_hr)
    h_init, c_init = _states(data, B, H, Hout, h0, c0, mode == "LSTM")
    # out= ops below would refuse inputs that require grad; the autograd
    # formula is the op's, not these calls'.
    with torch.no_grad():
        hbuf = data.new_empty((B, Hout)) if reverse else None
        w_hh_t = w_hh.t()
        if mode == "LSTM":
            ws = data.new_empty((N, 5 * H))
            gates, c_all = ws[:, :4 * H], ws[:, 4 * H:]
            i_all, f_all, if_all = ws[:, :H], ws[:, H:2 * H], ws[:, :2 * H]
            g_all, o_all = ws[:, 2 * H:3 * H], ws[:, 3 * H:4 * H]
            _project(gates, _bias_sum(b_ih, b_hh, 0, 4 * H), data, w_ih)
            out = data.new_empty((N, Hout))
            tc = data.new_empty((B, H))
            cbuf = data.new_empty((B, H)) if reverse else None
            w_hr_t = w_hr.t() if w_hr is not None else None
            for r0, n, p0, m in _schedule(bs, off, reverse):
                R = slice(r0, r0 + n)
                hp = _prev(out, h_init, hbuf, p0, m, n)
                cp = _prev(c_all, c_init, cbuf, p0, m, n)
                gates[R].addmm_(hp, w_hh_t)
                if_all[R].sigmoid_()
                g_all[R].tanh_()
                o_all[R].sigmoid_()
                c = c_all[R]
                torch.mul(f_all[R], cp, out=c)
                c.addcmul_(i_all[R], g_all[R])  # c = f * c_prev + i * g
                t_c = torch.tanh(c, out=tc[:n])
                if w_hr_t is not None:
                    torch.mm(t_c.mul_(o_all[R]), w_hr_t, out=out[R])
                else:
                    torch.mul(o_all[R], t_c, out=out[R])
            c_n = _final(c_all, c_init, bs, off, reverse)
        elif mode == "GRU":
            ws = data.new_empty((N, 4 * H))
            rz_all, rzh_all = ws[:, :2 * H], ws[:, :3 * H]
            r_all, z_all, hn_all, n_all = (ws[:, k * H:(k + 1) * H] for k in range(4))
            _project(rz_all, _bias_sum(b_ih, b_hh, 0, 2 * H), data, w_ih[:2 * H])
            _project(n_all, b_ih[2 * H:] if b_ih is not None else None, data, w_ih[2 * H:])
            # hn starts as b_hn so the step's GEMM, accumulating into r | z | hn, yields W_hn h + b_hn.
            if b_hh is not None:
                hn_all.copy_(b_hh[2 * H:])
            else:
                hn_all.zero_()
            out = data.new_empty((N, H))
            for r0, n, p0, m in _schedule(bs, off, reverse):
                R = slice(r0, r0 + n)
                hp = _prev(out, h_init, hbuf, p0, m, n)
                rzh_all[R].addmm_(hp, w_hh_t)
                rz_all[R].sigmoid_()
                nt = n_all[R]
                nt.addcmul_(r_all[R], hn_all[R]).tanh_()
                torch.lerp(nt, hp, z_all[R], out=out[R])  # (1 - z) * n + z * h
            c_n = data.new_empty(0)
        else:
            ws = data.new_empty((N, 0))
            out = data.new_empty((N, H))
            _project(out, _bias_sum(b_ih, b_hh, 0, H), data, w_ih)
            relu = mode == "RNN_RELU"
            for r0, n, p0, m in _schedule(bs, off, reverse):
                hp = _prev(out, h_init, hbuf, p0, m, n)
                h = out[r0:r0 + n].addmm_(hp, w_hh_t)
                h.relu_() if relu else h.tanh_()
            c_n = data.new_empty(0)
        h_n = _final(out, h_init, bs, off, reverse)
    return out, h_n, c_n, (ws if train else data.new_empty(0))


def _packed_layer_fake(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0, mode, reverse, train):
    _check_args(mode, w_hr, c0)
    H, Hout = _sizes(mode, w_ih, w_hr)
    N = data.shape[0]
    B = h0.shape[1] if h0 is not None else (c0.shape[1] if c0 is not None else batch_of(batch_sizes))
    c_n = data.new_empty((1, B, H)) if mode == "LSTM" else data.new_empty(0)
    ws = data.new_empty((N, workspace_width(mode, H))) if train else data.new_empty(0)
    return data.new_empty((N, Hout)), data.new_empty((1, B, Hout)), c_n, ws


def _packed_layer_backward(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0, out, h_n, c_n, workspace,
                           grad_out, grad_hn, grad_cn, mode, reverse):
    _check_args(mode, w_hr, c0)
    N = data.shape[0]
    bs, off = _steps(batch_sizes, N)
    B = bs[0]
    H, Hout = _sizes(mode, w_ih, w_hr)
    if tuple(workspace.shape) != (N, workspace_width(mode, H)):
        raise RuntimeError(f"wfpass::packed_layer_backward: the workspace has shape {tuple(workspace.shape)}, "
                           f"not {(N, workspace_width(mode, H))}: was the forward run with train=False?")
    h_init, c_init = _states(data, B, H, Hout, h0, c0, mode == "LSTM")
    gout = grad_out
    with torch.no_grad():
        idx = prev_index(batch_sizes, reverse)
        h_prev = torch.cat([out, h_init]).index_select(0, idx)  # [N, H_out]: the state each row read
        # The carries: dL/dh (dL/dc) of each sequence's state, starting from
        # the gradient of its final state; after the loop, dL/dh0 (dL/dc0).
        hcar = (grad_hn[0].clone(memory_format=torch.contiguous_format) if grad_hn is not None
                else data.new_zeros((B, Hout)))
        # The backward runs the steps in the opposite order of the forward.
        order = [(off[t], bs[t]) for t in range(len(bs))]
        if not reverse:
            order.reverse()
        d_w_hr = data.new_empty(0)  # replaced below where there is a projection
        d_c0 = None
        if mode == "LSTM":
            i, f, g, o, c = (workspace[:, k * H:(k + 1) * H] for k in range(5))
            c_prev = torch.cat([c, c_init]).index_select(0, idx)
            tc = torch.tanh(c)
            # dL/d(pre-activation) = dh * k (o) or dc * k (i, f, g), where
            # dc = carried dc + dh * k_c; the factors, for all rows at once.
            k_c = o * (1 - tc * tc)
            k_o = tc * o * (1 - o)
            k_ifg = torch.stack([g * i * (1 - i), c_prev * f * (1 - f), i * (1 - g * g)], 1)  # [N, 3, H]
            ccar = (grad_cn[0].clone(memory_format=torch.contiguous_format) if grad_cn is not None
                    else data.new_zeros((B, H)))
            dg = data.new_empty((N, 4, H))
            dg_ifg, dg_o, dgi = dg[:, :3], dg[:, 3], dg.view(N, 4 * H)
            dh_all = data.new_empty((N, Hout))
            dhp = data.new_empty((B, H)) if w_hr is not None else None
            for r0, n in order:
                R = slice(r0, r0 + n)
                dh = dh_all[R]
                torch.add(gout[R], hcar[:n], out=dh) if gout is not None else dh.copy_(hcar[:n])
                if w_hr is not None:  # through the projection: dL/d(o * tanh(c))
                    dh = torch.mm(dh, w_hr, out=dhp[:n])
                dc = ccar[:n]
                dc.addcmul_(dh, k_c[R])
                torch.mul(dc.unsqueeze(1), k_ifg[R], out=dg_ifg[R])
                torch.mul(dh, k_o[R], out=dg_o[R])
                dc.mul_(f[R])  # dL/dc_prev
                torch.mm(dgi[R], w_hh, out=hcar[:n])  # dL/dh_prev
            dgh = dgi
            if w_hr is not None:
                d_w_hr = torch.mm(dh_all.t(), o * tc)
            d_c0 = ccar.unsqueeze(0)
        elif mode == "GRU":
            r, z, hn, n_ = (workspace[:, k * H:(k + 1) * H] for k in range(4))
            # As native_layer._gates_backward: dL/d(recurrent gates) = dh * k_h.
            a_n = (1 - z) * (1 - n_ * n_)
            k_h = torch.stack([a_n * hn * r * (1 - r), (h_prev - n_) * z * (1 - z), a_n * r], 1)  # [N, 3, H]
            dg = data.new_empty((N, 3, H))
            dh_all = data.new_empty((N, H))
            for r0, n in order:
                R = slice(r0, r0 + n)
                dh = dh_all[R]
                torch.add(gout[R], hcar[:n], out=dh) if gout is not None else dh.copy_(hcar[:n])
                torch.mul(dh.unsqueeze(1), k_h[R], out=dg[R])
                torch.mul(dh, z[R], out=hcar[:n])
                hcar[:n].addmm_(dg[R].view(n, 3 * H), w_hh)  # dL/dh_prev = dh * z + dgh @ W_hh
            dgh = dg.view(N, 3 * H)
            dgi = dg.clone()
            torch.mul(dh_all, a_n, out=dgi[:, 2])  # the input side of n is not scaled by r
            dgi = dgi.view(N, 3 * H)
        else:
            d_act = (out > 0).to(out.dtype) if mode == "RNN_RELU" else 1 - out * out
            dgi = dgh = data.new_empty((N, H))
            for r0, n in order:
                d = dgi[r0:r0 + n]
                torch.add(gout[r0:r0 + n], hcar[:n], out=d) if gout is not None else d.copy_(hcar[:n])
                d.mul_(d_act[r0:r0 + n])
                torch.mm(d, w_hh, out=hcar[:n])
        d_data = torch.mm(dgi, w_ih)
        d_w_ih = torch.mm(dgi.t(), data)
        d_w_hh = torch.mm(dgh.t(), h_prev)
        d_b_ih = dgi.sum(0) if b_ih is not None else data.new_empty(0)
        d_b_hh = dgh.sum(0) if b_hh is not None else data.new_empty(0)
        d_h0 = hcar.unsqueeze(0) if h0 is not None else data.new_empty(0)
        if d_c0 is None or c0 is None:
            d_c0 = data.new_empty(0)
    return d_data, d_w_ih, d_w_hh, d_b_ih, d_b_hh, d_w_hr, d_h0, d_c0


def _like(t: Optional[torch.Tensor], ref: torch.Tensor):
    """The fake of a gradient: contiguous, ``t``'s shape and dtype, or empty for an absent input."""
    return t.new_empty(t.shape) if t is not None else ref.new_empty(0)


def _packed_layer_backward_fake(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0, out, h_n, c_n, workspace,
                                grad_out, grad_hn, grad_cn, mode, reverse):
    _check_args(mode, w_hr, c0)
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


# The C++ kernels (``_torch/native/packed_rnn.cpp``) take the CPU key, which
# comes before these registrations once they are loaded.
_LIB = define_rnn_op("packed_layer", _ARGS, _RETURNS, _BACKWARD, forward=_packed_layer,
                     forward_fake=_packed_layer_fake, backward=_packed_layer_backward,
                     backward_fake=_packed_layer_backward_fake, setup=_setup, grad=_grad)
