"""The RNN format's kernels: the paths an RNN call can take, and which one it takes.

Graph after ``fuse_rnn`` (Dynamo flavour, a 2-layer ``nn.LSTM`` on the CPU,
T > ``seq_threshold``)::

    out, h_n, c_n = rnn_mkldnn(x, [h0, c0], w_ih_l0, w_hh_l0, b_ih_l0, b_hh_l0, w_ih_l1, ...)

``rnn_mkldnn`` is an ``RnnForward``: a callable object holding the RNN's
spec and the path the pass chose (its name in the graph says which); AOTAutograd traces it like any Python function, into ATen ops
that carry their own derivative formulas:

* ``mkldnn``: ``aten.mkldnn_rnn_layer`` per layer and direction, the kernel
  eager PyTorch runs for a CPU LSTM (oneDNN), whose backward is
  ``mkldnn_rnn_layer_backward``. The graph holds one op per layer whatever
  the length T, so compile time does not grow with T.
* ``cxx``: a float32 GRU or plain RNN, or a small LSTM (``cxx_serves``), as
  wfpass's C++ loop, ``wfpass::packed_layer`` (``packed_bilayer`` for both
  directions of a bidirectional layer) over the full batch: per step
  oneDNN's small-GEMM kernel and AVX-512 gate math, and a backward of its
  own. oneDNN's LSTM layer call has a fixed cost of tens of microseconds
  (its primitive, a reorder of the weights on every call) that a small
  LSTM's kernel time does not hide; ATen's GRU and RNN kernels run a
  dozen ops a step.
* ``loop``: the unfused path, for T <= ``seq_threshold``: the input
  projection of all steps as one GEMM, then one recurrent GEMM and the gate
  math per step (T is small here, so the unrolled graph is too).
  GRUs, plain RNNs (no fused CPU kernel in PyTorch) and LSTMs oneDNN does
  not take (``proj_size``, some dtypes) take this path at every static T.
* ``aten``: the same ``torch.lstm`` / ``gru`` / ``rnn_tanh`` call as eager,
  which AOTAutograd decomposes into ATen ops as it would without wfpass;
  only for a symbolic T where the two paths above cannot run (the loop
  needs a static T). oneDNN runs symbolic shapes too, with and without
  grad: the size of its training workspace is then a size known when the
  op has run (an unbacked symbol, ``cpu/lstm_layer.py``).

No state is kept between the forward and the backward that AOTAutograd
does not see: what the backward needs, ``mkldnn_rnn_layer``'s workspace
included, are outputs of traced ops, saved and freed by AOTAutograd.

The path is chosen once, when the graph is compiled (``plan.py``: the
call's ``RnnPlan``), from the static length T (``T <= seq_threshold``: ``loop``). RNNs off the CPU are not captured at all
(``wfpass.capture``): they graph-break and run eagerly, as without wfpass. ``seq_threshold="auto"`` measures the two paths
once per shape at compile time (with the model's weights; ``auto.py``).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from .._torch import kernels as _kernels
from .cpu import lstm_layer  # noqa: F401  (registers wfpass::lstm_layer, which mkldnn_path calls)
from .cpu import native_layer  # noqa: F401  (registers wfpass::rnn_layer, which native_path calls)
from .cpu import varlen_layer  # noqa: F401  (registers wfpass::packed_layer, which cxx_path calls)
from .cuda.cudnn import cudnn_call
from .spec import RnnSpec, zero_state

__all__ = ["fused_path", "unfused_path", "mkldnn_path", "native_path", "cxx_path", "RnnForward"]


def _hx_arg(spec: RnnSpec, hx: Sequence[torch.Tensor]):
    """The state as ``torch._VF`` takes it: ``[h, c]`` for an LSTM, ``h`` otherwise."""
    return list(hx) if spec.mode == "LSTM" else hx[0]


def fused_path(spec: RnnSpec, x, hx, ws, has_b: bool, train: bool, p: float):
    """``torch._VF.<mode>`` as PyTorch dispatches it: oneDNN (CPU LSTM), cuDNN (CUDA)."""
    return _kernels.rnn_kernel(spec.mode)(
        x, _hx_arg(spec, hx), ws, has_b, spec.num_layers, p, train, spec.bidirectional, spec.batch_first
    )


def unfused_path(spec: RnnSpec, x, hx, ws, has_b: bool, train: bool, p: float):
    """Input projection for all steps as one GEMM, then per-step recurrent GEMMs."""
    if x.device.type == "cpu" and spec.options.unfused_impl != "loop":
        # ATen's native CPU kernel is this algorithm (it precomputes
        # ``linear_ih`` over the whole sequence) without Python per step;
        # only the LSTM has a oneDNN kernel to switch off.
        if spec.mode != "LSTM" or not _kernels.get_mkldnn_enabled():
            return fused_path(spec, x, hx, ws, has_b, train, p)
        _kernels.set_mkldnn_enabled(False)
        try:
            return fused_path(spec, x, hx, ws, has_b, train, p)
        finally:
            _kernels.set_mkldnn_enabled(True)
    return _loop(spec, x, hx, ws, has_b, train, p)


def _layers(spec: RnnSpec, x, train: bool, p: float, direction):
    """The layer and direction structure every path shares, as ``nn.LSTM``
    has it: ``direction(layer_in, k, reverse) -> (y, final_state)`` for
    each layer and direction ``k``, directions concatenated, dropout between
    layers in training, batch-first in and out. Returns the output and the
    final states in ``k`` order."""
    if spec.batch_first:
        x = x.transpose(0, 1)
    finals = []
    layer_in = x
    for layer in range(spec.num_layers):
        outs = []
        for d in range(spec.directions):
            y, final = direction(layer_in, layer * spec.directions + d, d == 1)
            outs.append(y)
            finals.append(final)
        layer_out = outs[0] if spec.directions == 1 else torch.cat(outs, 2)
        if p > 0 and train and layer < spec.num_layers - 1:
            layer_out = F.dropout(layer_out, p, True)
        layer_in = layer_out
    return (layer_in.transpose(0, 1) if spec.batch_first else layer_in), finals


def _loop(spec: RnnSpec, x, hx, ws, has_b: bool, train: bool, p: float):
    """The unfused path in PyTorch ops, with ATen's native cell formulas and
    dropout placement: the input projection of all steps as one GEMM, then
    one recurrent GEMM and the gate math per step."""
    per = (4 if has_b else 2) + (1 if spec.proj_size > 0 else 0)
    lstm = spec.mode == "LSTM"
    h0 = hx[0]
    c0 = hx[1] if lstm else None

    def direction(layer_in, k, reverse):
        T = layer_in.shape[0]
        w = ws[k * per : (k + 1) * per]
        w_ih, w_hh = w[0], w[1]
        b_ih, b_hh = (w[2], w[3]) if has_b else (None, None)
        w_hr = w[-1] if spec.proj_size > 0 else None
        xw = F.linear(layer_in, w_ih, b_ih)  # all steps: one GEMM
        h = h0[k]
        c = c0[k] if lstm else None
        ys: List[Optional[torch.Tensor]] = [None] * T
        for t in (range(T - 1, -1, -1) if reverse else range(T)):
            if lstm:
                gates = F.linear(h, w_hh, b_hh).add(xw[t])
                i, f, g, o = gates.chunk(4, 1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                if w_hr is not None:
                    h = F.linear(h, w_hr)
            elif spec.mode == "GRU":
                gh = F.linear(h, w_hh, b_hh)
                ir, iz, in_ = xw[t].chunk(3, 1)
                hr, hz, hn = gh.chunk(3, 1)
                r = torch.sigmoid(ir + hr)
                z = torch.sigmoid(iz + hz)
                n = torch.tanh(in_ + r * hn)
                h = (h - n) * z + n
            elif spec.mode == "RNN_TANH":
                h = torch.tanh(F.linear(h, w_hh, b_hh).add(xw[t]))
            else:
                h = torch.relu(F.linear(h, w_hh, b_hh).add(xw[t]))
            ys[t] = h
        return torch.stack(ys, 0), (h, c)

    out, finals = _layers(spec, x, train, p, direction)
    hy = torch.stack([h for h, _ in finals], 0)
    if lstm:
        return out, hy, torch.stack([c for _, c in finals], 0)
    return out, hy


def mkldnn_path(spec: RnnSpec, x, hx, ws, has_b: bool, train: bool, p: float, need_grad: bool):
    """A CPU LSTM as oneDNN LSTM layer calls (``wfpass::lstm_layer``, i.e.
    ``aten.mkldnn_rnn_layer``), one per layer and direction, as ATen's own
    oneDNN LSTM runs it, with dropout between layers like ``nn.LSTM``.
    ``need_grad``: ask the kernel for the workspace its backward formula reads."""
    per = spec.weights_per_layer
    h0, c0 = hx[0], hx[1]

    def direction(layer_in, k, reverse):
        w = ws[k * per : (k + 1) * per]
        w0, w1 = w[0], w[1]
        w2, w3 = (w[2], w[3]) if has_b else (w0.new_zeros(w0.shape[0]),) * 2
        h = None if h0 is None else h0[k : k + 1].contiguous()
        c = None if c0 is None else c0[k : k + 1].contiguous()
        # With grad: the op with an autograd formula (compiled forward graphs
        # then call its twin, ``lstm_layer_fw``). Without: that twin itself,
        # no workspace and no autograd kernel; not ``aten.mkldnn_rnn_layer``
        # directly, which would need the zero state as a tensor built in the
        # graph: a kernel Inductor compiles, 7 s more per cold compile of a
        # folded cell loop (measured), for 5 us per call.
        op = torch.ops.wfpass.lstm_layer.default if need_grad else torch.ops.wfpass.lstm_layer_fw.default
        y, hy, cy, _ws = op(layer_in.contiguous(), w0, w1, w2, w3, h, c, reverse, spec.hidden_size, has_b, need_grad)
        return y, (hy, cy)

    out, finals = _layers(spec, x, train, p, direction)
    return out, torch.cat([h for h, _ in finals], 0), torch.cat([c for _, c in finals], 0)


def native_path(spec: RnnSpec, x, hx, ws, has_b: bool, train: bool, p: float, need_grad: bool):
    """A CPU GRU or plain RNN as ``wfpass::rnn_layer`` calls, one per layer
    and direction: ATen's native kernel as one op whatever T is, with a
    backward op of its own (``cpu/native_layer.py``); dropout between layers
    like ``nn.GRU``."""
    per = spec.weights_per_layer
    h0 = hx[0]

    def direction(layer_in, k, reverse):
        w = ws[k * per : (k + 1) * per]
        b_ih, b_hh = (w[2], w[3]) if has_b else (None, None)
        op = torch.ops.wfpass.rnn_layer.default if need_grad else torch.ops.wfpass.rnn_layer_fw.default
        y, hy = op(layer_in.contiguous(), w[0], w[1], b_ih, b_hh, None if h0 is None else h0[k : k + 1].contiguous(),
                   spec.mode, reverse)
        return y, (hy, None)

    out, finals = _layers(spec, x, train, p, direction)
    return out, torch.cat([h for h, _ in finals], 0)


def cxx_path(spec: RnnSpec, x, hx, ws, has_b: bool, train: bool, p: float, need_grad: bool):
    """A CPU RNN as wfpass's C++ loop, one op per layer: the variable-length
    kernel over the full batch (``data`` ``[T, B, I]``, no batch sizes),
    ``wfpass::packed_layer`` for one direction, ``packed_bilayer`` for both
    (at once where torch has two threads); dropout between layers like
    ``nn.LSTM``. ``need_grad``: the op with an autograd formula, which keeps
    the workspace its backward reads; else its twin ``_fw``. Returns
    ``(out, h_n, c_n)``, ``c_n`` None but for an LSTM.

    Graph (2-layer LSTM, T 4, batch 4, training)::

        before: rnn_mkldnn(x, [None, None], w_ih_l0, ...)   # oneDNN, a layer a call
        after:  rnn_cxx(x, [None, None], w_ih_l0, ...)      # inside, traced:
                out0, h0, c0, ws0 = wfpass.packed_layer(x, empty, w_ih_l0, w_hh_l0, b_ih_l0, b_hh_l0,
                                                        None, None, None, "LSTM", False, True)
                out1, h1, c1, ws1 = wfpass.packed_layer(out0.view(4, 4, 64), empty, w_ih_l1, ...)
    """
    if spec.batch_first:
        x = x.transpose(0, 1)
    T, B = x.shape[0], x.shape[1]
    per, D = spec.weights_per_layer, spec.directions
    lstm = spec.mode == "LSTM"
    h0, c0 = hx[0], (hx[1] if lstm else None)
    # The op's own "no batch sizes": an empty int64 tensor, an allocation in
    # the compiled graph and no kernel.
    no_sizes = x.new_empty(0, dtype=torch.int64)
    suffix = "" if need_grad else "_fw"
    one = getattr(torch.ops.wfpass, "packed_layer" + suffix).default
    two = getattr(torch.ops.wfpass, "packed_bilayer" + suffix).default
    hs, cs = [], []
    layer_in = x
    for layer in range(spec.num_layers):
        k = layer * D
        h = None if h0 is None else h0[k : k + D]
        c = None if c0 is None else c0[k : k + D]
        w = ws[k * per : (k + D) * per]
        if D == 1:
            b_ih, b_hh = (w[2], w[3]) if has_b else (None, None)
            w_hr = w[per - 1] if spec.proj_size else None
            out, hy, cy, _ws = one(layer_in, no_sizes, w[0], w[1], b_ih, b_hh, w_hr, h, c, spec.mode, False,
                                   need_grad)
        else:
            out, hy, cy, *_ws = two(layer_in, no_sizes, list(w), h, c, spec.mode, has_b, spec.proj_size > 0,
                                    need_grad)
        out = out.view(T, B, out.shape[1])
        hs.append(hy)
        cs.append(cy)
        if p > 0 and train and layer < spec.num_layers - 1:
            out = F.dropout(out, p, True)
        layer_in = out
    out = layer_in.transpose(0, 1) if spec.batch_first else layer_in
    return out, torch.cat(hs, 0), (torch.cat(cs, 0) if lstm else None)


class RnnForward:
    """The graph's call of one RNN (Dynamo flavour): ``(x, hx, *weights) ->
    (out, h_n, c_n)`` on the path chosen at compile time. A callable object,
    so the graph carries its spec without any global table."""

    def __init__(self, spec: RnnSpec, path: str, train: bool, cast=None, need_grad: Optional[bool] = None):
        self.spec, self.path, self.train = spec, path, train
        # None: differentiable where an input needs grad (a compiled graph);
        # False: never (an exported inference program, ``wfpass.export``).
        self.need_grad = need_grad
        # Under autocast: (autocast dtype, output dtype[, compute dtype]) (``guards.autocast_cast``,
        # ``guards.emulates_half``: rounded to the autocast dtype, computed in float32).
        self.cast = cast
        self.__name__ = self.__qualname__ = f"rnn_{path}"

    __module__ = __name__

    def __call__(self, x, hx, *weights):
        if self.cast is None:
            return self._run(x, hx, *weights)
        dt, out_dt, compute = self.cast[0], self.cast[1], self.cast[-1]

        def to(t):
            if t is None:
                return t
            t = t if t.dtype == dt else t.to(dt)
            return t if compute == dt else t.to(compute)  # rounded to dt, computed in float32 (guards.emulates_half)
        # Casts the compiler sees (their gradient formulas take the grads
        # back to float32); inside, autocast off: every op runs in ``compute``.
        with torch.autocast(x.device.type, enabled=False):
            outs = self._run(to(x), [to(h) for h in hx], *[to(w) for w in weights])
        return tuple(o if o is None or o.dtype == out_dt else o.to(out_dt) for o in outs)

    def _run(self, x, hx, *weights):
        spec = self.spec
        p = spec.dropout
        ws, has_b = weights, spec.has_biases
        if self.path not in ("mkldnn", "native", "cudnn", "cxx") and any(h is None for h in hx):
            # A zero state (None): the layer ops fill their own; the others get it here.
            hx = [z if h is None else h for h, z in zip(hx, zero_state(spec, x))]
        need_grad = self.need_grad
        if need_grad is None:
            need_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *hx, *weights))
        path = self.path
        if path == "cxx" and any(h is not None and h.dtype != x.dtype for h in hx):
            # A state of another dtype: eager's kernels, which raise eager's error.
            path = "mkldnn" if spec.mode == "LSTM" else "native"
        if path == "cudnn":
            out, hy, cy = cudnn_call(spec, x, hx, ws, need_grad, self.train)
        elif path == "mkldnn":
            out, hy, cy = mkldnn_path(spec, x, hx, ws, has_b, self.train, p, need_grad)
        elif path == "cxx":
            out, hy, cy = cxx_path(spec, x, hx, ws, has_b, self.train, p, need_grad)
        elif path == "native":
            out, hy = native_path(spec, x, hx, ws, has_b, self.train, p, need_grad)
            cy = None
        elif path == "loop":
            outs = _loop(spec, x, hx, ws, has_b, self.train, p)
            out, hy, cy = outs[0], outs[1], (outs[2] if spec.mode == "LSTM" else None)
        elif spec.mode == "LSTM":
            # ATen's decomposition of torch.lstm (torch/_decomp/decompositions.py,
            # torch 2.13.0) picks aten.mkldnn_rnn_layer in inference mode
            # whenever oneDNN is on and the input needs no grad: without the
            # workspace its backward needs (weights that need grad), and in a
            # form Inductor's lowering fails on. Traced with oneDNN off it
            # unrolls the plain cell math, which AOTAutograd differentiates.
            with _kernels.mkldnn_disabled():
                outs = fused_path(spec, x, hx, ws, has_b, self.train, p)
            out, hy, cy = outs[0], outs[1], outs[2]
        else:
            outs = fused_path(spec, x, hx, ws, has_b, self.train, p)
            out, hy, cy = outs[0], outs[1], None
        return (out, hy, cy) if spec.mode == "LSTM" else (out, hy)

    def __repr__(self) -> str:
        return f"RnnForward({self.spec.name}, path={self.path!r})"
