"""The Python kernel of ``wfpass::packed_layer``'s forward, with its
helpers; ``varlen_layer_py_backward.py`` has the backward's.
``varlen_layer.py`` defines the op and says what it computes, how these
kernels compute it, and what the workspace holds.

The Python kernels run where the C++ kernels
(``native/rnn/varlen_rnn.cpp``, registered for the CPU key, which comes
first) are not loaded (``WFPASS_NATIVE=0``). They give the C++ kernels'
bits where those take their ATen loop (bf16, fp16; fp32 on a CPU with
neither AVX-512 nor AVX2 with FMA, or with ``WFPASS_FAST_LOOP=0``): both
make the same ATen calls in the same order (``tests/rnn/test_varlen_layer.py``
checks it), so a change here is a change there. fp32 on a CPU with either runs
the C++ kernels' raw-pointer loop (``native/rnn/fast_rnn.cpp``: the same steps on
oneDNN's small-GEMM kernel and hand-vectorized gate math), which agrees
with these kernels to rounding.

Here too: what both kernels start from (``layer_call``) and oneDNN's
row-blocked GEMMs both use (``onednn_rows``, ``onednn_t_rows``). The mode
tables and argument checks the op's fakes and both kernels share are
``varlen_checks.py``, the bottom of these modules (``varlen_layer.py``
imports this one and that one, never the other way round).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from ..._torch import kernels as _kernels
from .varlen_checks import as_rows, check_args, check_shapes, check_states, steps, workspace_width

__all__ = ["LayerCall", "layer_call", "use_onednn", "onednn_linear", "onednn_rows", "onednn_t_rows"]


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


def use_onednn(x) -> bool:
    """Whether the big GEMMs over all N rows (the input projection, the
    weight gradients) run on oneDNN's linear instead of ATen's mm: fp32 with
    oneDNN on. On this AMD CPU ATen's mm (MKL) ran them 2-4x slower; the C++
    kernels (``use_onednn``) take the same rule, so both give the same bits."""
    return x.dtype == torch.float32 and _kernels.onednn_linear_available()


def onednn_linear(x, w, b=None):
    """``x @ w.T (+ b)`` on oneDNN (``mkldnn::_linear_pointwise``), from contiguous copies where needed."""
    return _kernels.onednn_linear(x.contiguous(), w.contiguous(), b.contiguous() if b is not None else None)


#: oneDNN's GEMMs over the N packed rows run in blocks of ``ROW_BLOCK``
#: rows, the last one padded with zero rows to a multiple of ``ROW_PAD``.
#: Why: oneDNN keeps a primitive per shape, in ideep's cache and in its own
#: (1,024 entries each, ~0.5 MB a shape at these sizes), and N changes with
#: every batch: a training run with varying batch sizes and lengths grew by
#: hundreds of MB (docs/rnn.md, "Memory"). Blocked, a GEMM has at most
#: ``1 + ROW_BLOCK // ROW_PAD`` shapes whatever N is. The C++ kernels
#: (``packed_rnn.cpp``, ``onednn_rows``) block the same way: the same bits.
ROW_BLOCK, ROW_PAD = 256, 64


def _row_blocks(N: int):
    """``(first row, rows, padded rows)`` of each block of N rows."""
    for r0 in range(0, N, ROW_BLOCK):
        r = min(ROW_BLOCK, N - r0)
        yield r0, r, r if r == ROW_BLOCK else -(-r // ROW_PAD) * ROW_PAD


def onednn_rows(x, w, b=None, out=None):
    """``x @ w.T (+ b)`` over the rows of ``x`` ``[N, K]`` on oneDNN, in row
    blocks (``ROW_BLOCK``); into ``out`` ``[N, M]`` where given."""
    # The bias too: oneDNN's op reads it as contiguous whatever its stride (a
    # GRU's b_ih[2H:] of a strided b_ih gave wrong values; torch 2.13).
    x, w = x.contiguous(), w.contiguous()
    b = b.contiguous() if b is not None else None
    out = x.new_empty((x.shape[0], w.shape[0])) if out is None else out
    for r0, r, rp in _row_blocks(x.shape[0]):
        xs = x[r0:r0 + r]
        if rp != r:
            xs = torch.cat([xs, xs.new_zeros((rp - r, xs.shape[1]))])
        out[r0:r0 + r].copy_(_kernels.onednn_linear(xs, w, b)[:r])
    return out


def _t_block(t, r0: int, r: int, rp: int):
    """``t[r0 : r0 + r].T``, contiguous, with zero columns up to ``rp``."""
    if rp == r:
        return t[r0:r0 + r].t().contiguous()
    o = t.new_zeros((t.shape[1], rp))
    o[:, :r] = t[r0:r0 + r].t()
    return o


def onednn_t_rows(a, bs):
    """``[a.T @ b for b in bs]`` over the N rows of ``a`` ``[N, G]`` and
    each ``b`` ``[N, K]``, on oneDNN, in row blocks (``ROW_BLOCK``) summed
    in order."""
    N = a.shape[0]
    if N == 0:
        return [a.new_zeros((a.shape[1], b.shape[1])) for b in bs]
    outs = [None] * len(bs)
    for r0, r, rp in _row_blocks(N):
        at = _t_block(a, r0, r, rp)
        for i, b in enumerate(bs):
            p = _kernels.onednn_linear(at, _t_block(b, r0, r, rp), None)
            outs[i] = p if outs[i] is None else outs[i].add_(p)
    return outs


def _project(out, bias, data, w) -> None:
    """``out = data @ w.T (+ bias)``, over all N rows, written into ``out`` (a column block of the workspace)."""
    if use_onednn(data):
        onednn_rows(data, w, bias, out=out)
    elif bias is not None:
        torch.addmm(bias, data, w.t(), out=out)
    else:
        torch.mm(data, w.t(), out=out)


def _states(data, B: int, H: int, Hout: int, h0, c0, lstm: bool):
    """h0 ``[B, H_out]`` and c0 ``[B, H]`` (zeros where None; made here, not in the graph)."""
    check_states(((h0, Hout, "h0"), (c0, H, "c0")), data, 1, B)
    h = h0[0] if h0 is not None else data.new_zeros((B, Hout))
    c = (c0[0] if c0 is not None else data.new_zeros((B, H))) if lstm else None
    return h, c


class LayerCall(NamedTuple):
    """What both kernels start from: the checked sizes, ``batch_sizes`` read
    once (``bs``, and ``off``: each step's first row) and the initial states."""
    N: int
    bs: list
    off: list
    B: int
    H: int
    Hout: int
    reverse: bool
    h_init: torch.Tensor  # [B, H_out]
    c_init: Optional[torch.Tensor]  # [B, H] (LSTM), else None


def layer_call(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0, mode, reverse,
               workspace=None) -> LayerCall:
    """The call's arguments checked before any is read (``workspace``: the
    backward's, against the forward's layout), its sizes and its initial
    states."""
    check_args(mode, w_hr, c0)
    H, Hout = check_shapes(mode, data, w_ih, w_hh, b_ih, b_hh, w_hr)
    N = data.shape[0]
    bs, off = steps(batch_sizes, N)
    B = bs[0]
    if workspace is not None and tuple(workspace.shape) != (N, workspace_width(mode, H)):
        raise RuntimeError(f"wfpass::packed_layer_backward: the workspace has shape {tuple(workspace.shape)}, "
                           f"not {(N, workspace_width(mode, H))}: was the forward run with train=False?")
    h_init, c_init = _states(data, B, H, Hout, h0, c0, mode == "LSTM")
    return LayerCall(N, bs, off, B, H, Hout, reverse, h_init, c_init)


def _packed_layer(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0, mode, reverse, train):
    data, batch_sizes, _ = as_rows(data, batch_sizes)
    L = layer_call(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0, mode, reverse)
    # out= ops below would refuse inputs that require grad; the autograd
    # formula is the op's, not these calls'.
    with torch.no_grad():
        hbuf = data.new_empty((L.B, L.Hout)) if reverse else None
        w_hh_t = w_hh.t()
        if mode == "LSTM":
            out, c_n, ws = _lstm_forward(L, data, hbuf, w_ih, w_hh_t, b_ih, b_hh, w_hr)
        elif mode == "GRU":
            out, ws = _gru_forward(L, data, hbuf, w_ih, w_hh_t, b_ih, b_hh)
            c_n = data.new_empty(0)
        else:
            out, ws = _rnn_forward(L, data, hbuf, w_ih, w_hh_t, b_ih, b_hh, mode == "RNN_RELU")
            c_n = data.new_empty(0)
        h_n = _final(out, L.bs, L.off, reverse)
    return out, h_n, c_n, (ws if train else data.new_empty(0))


def _lstm_forward(L: LayerCall, data, hbuf, w_ih, w_hh_t, b_ih, b_hh, w_hr):
    """The LSTM's steps: ``(out, c_n, workspace)``, the workspace
    ``i | f | g | o | c | tanh(c)``."""
    N, H = L.N, L.H
    ws = data.new_empty((N, 6 * H))
    gates, c_all, tc_all = ws[:, :4 * H], ws[:, 4 * H:5 * H], ws[:, 5 * H:]
    i_all, f_all, if_all = ws[:, :H], ws[:, H:2 * H], ws[:, :2 * H]
    g_all, o_all = ws[:, 2 * H:3 * H], ws[:, 3 * H:4 * H]
    _project(gates, _bias_sum(b_ih, b_hh, 0, 4 * H), data, w_ih)
    out = data.new_empty((N, L.Hout))
    cbuf = data.new_empty((L.B, H)) if L.reverse else None
    w_hr_t = w_hr.t() if w_hr is not None else None
    hpre = data.new_empty((L.B, H)) if w_hr is not None else None
    for r0, n, p0, m in _schedule(L.bs, L.off, L.reverse):
        R = slice(r0, r0 + n)
        hp = _prev(out, L.h_init, hbuf, p0, m, n)
        cp = _prev(c_all, L.c_init, cbuf, p0, m, n)
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
    return out, _final(c_all, L.bs, L.off, L.reverse), ws


def _gru_forward(L: LayerCall, data, hbuf, w_ih, w_hh_t, b_ih, b_hh):
    """The GRU's steps: ``(out, workspace)``, the workspace ``r | z | hn | n``."""
    N, H = L.N, L.H
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
    for r0, n, p0, m in _schedule(L.bs, L.off, L.reverse):
        R = slice(r0, r0 + n)
        hp = _prev(out, L.h_init, hbuf, p0, m, n)
        rzh_all[R].addmm_(hp, w_hh_t)
        rz_all[R].sigmoid_()
        nt = n_all[R]
        nt.addcmul_(r_all[R], hn_all[R]).tanh_()
        torch.lerp(nt, hp, z_all[R], out=out[R])  # (1 - z) * n + z * h
    return out, ws


def _rnn_forward(L: LayerCall, data, hbuf, w_ih, w_hh_t, b_ih, b_hh, relu: bool):
    """The plain RNN's steps: ``(out, workspace)``, the workspace ``[N, 0]``."""
    ws = data.new_empty((L.N, 0))
    out = data.new_empty((L.N, L.H))
    _project(out, _bias_sum(b_ih, b_hh, 0, L.H), data, w_ih)
    for r0, n, p0, m in _schedule(L.bs, L.off, L.reverse):
        hp = _prev(out, L.h_init, hbuf, p0, m, n)
        h = out[r0:r0 + n].addmm_(hp, w_hh_t)
        h.relu_() if relu else h.tanh_()
    return out, ws
