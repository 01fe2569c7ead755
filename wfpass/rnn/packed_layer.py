"""The ``wfpass::packed_layer`` op: one layer and one direction of an LSTM,
GRU or plain RNN over a packed batch (``PackedSequence`` layout), forward
and backward, steps of each sequence past its length never computed.

Why: eager PyTorch runs a packed RNN on the CPU through ATen's generic
per-step path (a cell call per step, each a dozen small ops, and autograd
recording all of them): a training step of one LSTM layer took 3.4x the
padded oneDNN kernel's time in ``benchmarks/bench_packed_layer.py``, on
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

``train=False`` returns an empty workspace (``[0]``) and the op cannot be
differentiated; the kernels still use a workspace-shaped scratch inside.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .ops import define_rnn_op
from .packed_meta import batch_of

__all__ = ["MODES", "gate_count", "workspace_width"]

#: The cells this op runs.
MODES = ("LSTM", "GRU", "RNN_TANH", "RNN_RELU")

_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}
_WIDTH = {"LSTM": 6, "GRU": 4, "RNN_TANH": 0, "RNN_RELU": 0}

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
    LSTM 6H (i, f, g, o, c, tanh(c)), GRU 4H (r, z, hn, n), RNN 0."""
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


def _final(states, bs, off, reverse: bool):
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
            ws = data.new_empty((N, 6 * H))
            gates, c_all, tc_all = ws[:, :4 * H], ws[:, 4 * H:5 * H], ws[:, 5 * H:]
            i_all, f_all, if_all = ws[:, :H], ws[:, H:2 * H], ws[:, :2 * H]
            g_all, o_all = ws[:, 2 * H:3 * H], ws[:, 3 * H:4 * H]
            _project(gates, _bias_sum(b_ih, b_hh, 0, 4 * H), data, w_ih)
            out = data.new_empty((N, Hout))
            cbuf = data.new_empty((B, H)) if reverse else None
            w_hr_t = w_hr.t() if w_hr is not None else None
            hpre = data.new_empty((B, H)) if w_hr is not None else None
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
                t_c = torch.tanh(c, out=tc_all[R])
                if w_hr_t is not None:
                    torch.mm(torch.mul(o_all[R], t_c, out=hpre[:n]), w_hr_t, out=out[R])
                else:
                    torch.mul(o_all[R], t_c, out=out[R])
            c_n = _final(c_all, bs, off, reverse)
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
        h_n = _final(out, bs, off, reverse)
    return out, h_n, c_n, (ws if train else data.new_empty(0))


def _packed_layer_fake(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0, mode, reverse, train):
    _check_args(mode, w_hr, c0)
    H, Hout = _sizes(mode, w_ih, w_hr)
    N = data.shape[0]
    B = h0.shape[1] if h0 is not None else (c0.shape[1] if c0 is not None else batch_of(batch_sizes))
    c_n = data.new_empty((1, B, H)) if mode == "LSTM" else data.new_empty(0)
    ws = data.new_empty((N, workspace_width(mode, H))) if train else data.new_empty(0)
    return data.new_empty((N, Hout)), data.new_empty((1, B, Hout)), c_n, ws


def _one_minus(x, out):
    """``out = 1 - x``, exactly (negation is exact), without a temporary."""
    return torch.neg(x, out=out).add_(1)


def _carry(grad, data, B: int, W: int):
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
    # Few fresh N-row buffers, no throwaway ones: each costs page faults (the
    # CPU allocator hands large blocks back to the system; a third of this
    # backward's time at N = 1600, H = 128 before), so the factors are
    # computed in place into the buffers the loop then scales, and the
    # loop's dL/dh lives in a [B, H] buffer unless later GEMMs need every row's.
    with torch.no_grad():
        index, first = _prev_index(batch_sizes, B, N, reverse)
        h_prev = _gather(out, h_init, index, first)  # [N, H_out]: the state each row read
        # The carries: dL/dh (dL/dc) of each sequence's state, starting from
        # the gradient of its final state; after the loop, dL/dh0 (dL/dc0).
        hcar = _carry(grad_hn, data, B, Hout)
        # The backward runs the steps in the opposite order of the forward.
        order = [(off[t], bs[t]) for t in range(len(bs))]
        if not reverse:
            order.reverse()
        d_w_hr, d_c0 = data.new_empty(0), data.new_empty(0)
        if mode == "LSTM":
            i, f, g, o, c, tc = (workspace[:, k * H:(k + 1) * H] for k in range(6))
            # dL/d(pre-activation) = dc * k_i, k_f, k_g and dh * k_o, where the
            # step's dc = carried dc + dh * k_c: the factors for all rows at
            # once, written into dg, which the loop then scales in place.
            dg = data.new_empty((N, 4, H))
            dg_if, dg_i, dg_f, dg_g, dg_o = dg[:, :2], dg[:, 0], dg[:, 1], dg[:, 2], dg[:, 3]
            ws_if = workspace[:, :2 * H].view(N, 2, H)
            _one_minus(ws_if, dg_if).mul_(ws_if)  # i (1 - i), f (1 - f)
            dg_i.mul_(g)
            k_c = _gather(c, c_init, index, first)  # c_prev, until k_f has it
            dg_f.mul_(k_c)
            torch.mul(g, g, out=dg_g).neg_().add_(1).mul_(i)  # (1 - g^2) i
            _one_minus(o, dg_o).mul_(o).mul_(tc)  # (1 - o) o tanh(c)
            torch.mul(tc, tc, out=k_c).neg_().add_(1).mul_(o)  # (1 - tanh(c)^2) o
            ccar = _carry(grad_cn, data, B, H)
            dg_ifg, dg2 = dg[:, :3], dg.view(N, 4 * H)
            proj = w_hr is not None
            # With a projection, d_w_hr needs every row's dL/dh.
            dh_all = data.new_empty((N, Hout)) if proj else data.new_empty((B, Hout))
            dhp = data.new_empty((B, H)) if proj else None
            for r0, n in order:
                R = slice(r0, r0 + n)
                dh = _incoming(dh_all[R] if proj else dh_all[:n], grad_out, hcar, r0, n)
                if proj:  # through the projection: dL/d(o * tanh(c))
                    dh = torch.mm(dh, w_hr, out=dhp[:n])
                dc = ccar[:n]
                dc.addcmul_(dh, k_c[R])
                dg_ifg[R].mul_(dc.unsqueeze(1))
                dg_o[R].mul_(dh)
                dc.mul_(f[R])  # dL/dc_prev
                torch.mm(dg2[R], w_hh, out=hcar[:n])  # dL/dh_prev
            if proj:
                d_w_hr = torch.mm(dh_all.t(), torch.mul(o, tc, out=k_c))  # k_c's buffer is free now
            if c0 is not None:
                d_c0 = ccar.unsqueeze(0)
            d_data = torch.mm(dg2, w_ih)
            d_w_ih = torch.mm(dg2.t(), data)
            d_w_hh = torch.mm(dg2.t(), h_prev)
            d_b_ih, d_b_hh = _bias_grads(dg2, b_ih, b_hh, data)
        elif mode == "GRU":
            r, z, hn, n_ = (workspace[:, k * H:(k + 1) * H] for k in range(4))
            # As native_layer._gates_backward: dL/d(recurrent gates) =
            # dh * (k_r, k_z, a_n r), written into dg, scaled in the loop.
            dg = data.new_empty((N, 3, H))
            dg_r, dg_z, dg_n = dg[:, 0], dg[:, 1], dg[:, 2]
            a_n = torch.mul(n_, n_).neg_().add_(1)
            a_n.mul_(_one_minus(z, dg_z))  # (1 - n^2)(1 - z): through n
            dg_z.mul_(z).mul_(torch.sub(h_prev, n_, out=dg_r))  # (1 - z) z (h_prev - n)
            _one_minus(r, dg_r).mul_(r).mul_(hn).mul_(a_n)  # (1 - r) r hn a_n
            torch.mul(a_n, r, out=dg_n)  # the recurrent side of n is scaled by r
            dg2 = dg.view(N, 3 * H)
            dh_all = data.new_empty((N, H))
            for r0, n in order:
                R = slice(r0, r0 + n)
                dh = _incoming(dh_all[R], grad_out, hcar, r0, n)
                dg[R].mul_(dh.unsqueeze(1))
                hc = torch.mul(dh, z[R], out=hcar[:n])
                hc.addmm_(dg2[R], w_hh)  # dL/dh_prev = dh * z + dgh @ W_hh
            # The input side differs from dg only in n's third (not scaled by
            # r): its gradients as GEMMs over dg's r | z columns and this one.
            dgi_n, dg_rz = a_n.mul_(dh_all), dg2[:, :2 * H]
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
        else:
            # d act(pre) / d pre, scaled in place by dL/dh in the loop.
            dpre = (out > 0).to(out.dtype) if mode == "RNN_RELU" else torch.mul(out, out).neg_().add_(1)
            dh_buf = data.new_empty((B, H))
            for r0, n in order:
                dh = _incoming(dh_buf[:n], grad_out, hcar, r0, n)
                torch.mm(dpre[r0:r0 + n].mul_(dh), w_hh, out=hcar[:n])
            d_data = torch.mm(dpre, w_ih)
            d_w_ih = torch.mm(dpre.t(), data)
            d_w_hh = torch.mm(dpre.t(), h_prev)
            d_b_ih, d_b_hh = _bias_grads(dpre, b_ih, b_hh, data)
        d_h0 = hcar.unsqueeze(0) if h0 is not None else data.new_empty(0)
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
