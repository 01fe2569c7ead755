"""The ``wfpass::cudnn_rnn`` op: cuDNN's multi-layer RNN, read from the
model's flat weight buffer, as an op AOTAutograd traces on fake tensors and
trains through, and Inductor calls as one extern kernel.

Graph after ``fuse_rnn`` for a 2-layer ``nn.LSTM`` on CUDA (Dynamo flavour)::

    out, h_n, c_n = rnn_cudnn(x, [h0, c0], w_ih_l0, w_hh_l0, b_ih_l0, b_hh_l0, w_ih_l1, ...)

and after AOTAutograd, in the forward and backward graphs::

    out, hy, cy, reserve = wfpass.cudnn_rnn_fw(x, [w_ih_l0, ...], h0, c0, 2, 256, 0, 2, False, True, [offsets], 0.0)
    dx, dhx, dcx, dw = wfpass.cudnn_rnn_backward(x, [w_ih_l0, ...], h0, c0, out, g_out, g_hy, g_cy, reserve, ...)

Why an op of wfpass's and not ``aten._cudnn_rnn`` itself (whose autograd
formula is ``_cudnn_rnn_backward``):

* ``aten._cudnn_rnn_backward`` has no fake kernel (torch 2.11.0-2.15.0), so
  AOTAutograd cannot trace a training graph through ATen's formula; this
  op's backward is an op with a fake kernel.
* ``aten._cudnn_rnn``'s meta kernel gives a reserve of 0 bytes and, for
  ``batch_first``, a contiguous output where the real kernel returns a
  transposed one: Inductor would assert on both. This op always runs
  time-major (``batch_first`` is a transpose in the graph, outside the op)
  and its fake measures the reserve once per shape on the GPU
  (``reserve_numel``), or says 0 where there is no GPU (graphs traced on
  fake CUDA tensors, which never run).
* The flat buffer cuDNN reads (``weight_buf``) is found by the op itself:
  the weights are views of one block in cuDNN's layout (``offsets``: each
  weight's offset, then the block's size; from ``_cudnn_rnn_flatten_weight``
  on the GPU), put there once by the format.
  Where they are not (the layout was lost), the op flattens copies, as
  eager PyTorch does, and the result is the same.

Dropout between layers in training is cuDNN's, as in eager: the op passes
``dropout`` with cuDNN's dropout state for the device (``dropout_state``),
and the masks drawn go into the reserve the backward reads.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from ..._torch import aot as _aot, kernels as _kernels
from ...core.graph import static_int
from .cudnn_grads import buffer_numel, grad_buffer, weight_grads
from ..ops import define_rnn_op

__all__ = ["reserve_numel", "flat_buffer", "dropout_state", "autocast_half", "backward_outputs", "buffer_numel", "grad_buffer", "weight_grads",
           "buffer_for", "dropout_args", "weights_per_layer", "RANDOM", "cudnn_call"]

# With dropout between layers the op draws random numbers (cuDNN's own
# dropout state): tagged so, the compiler neither merges two calls nor
# recomputes one for the backward (which must see the masks the forward
# drew: they are in the reserve).
RANDOM = (torch.Tag.nondeterministic_seeded,)


def weights_per_layer(n_weights: int, num_layers: int, bidirectional: bool) -> int:
    return n_weights // (num_layers * (2 if bidirectional else 1))


def _states(input, hx, cx, mode, hidden_size, proj_size, num_layers, bidirectional):
    """``hx``/``cx`` with a zero state for each None (cuDNN needs both
    tensors for an LSTM, ``hx`` for the others)."""
    lb = num_layers * (2 if bidirectional else 1)
    B = input.shape[1]
    if hx is None:
        hx = input.new_zeros((lb, B, proj_size or hidden_size))
    if cx is None and mode == _kernels.CUDNN_MODES["LSTM"]:
        cx = input.new_zeros((lb, B, hidden_size))
    return hx, cx


def flat_buffer(weights: Sequence[torch.Tensor], offsets: Sequence[int]) -> Optional[torch.Tensor]:
    """The 1-D buffer the weights are views of, when each sits at its offset
    in cuDNN's layout, contiguous and in one storage; else None.

    ``offsets``: each weight's element offset from the buffer's start, then
    the buffer's size. The size is not the end of the last weight: cuDNN 9
    puts every layer's matrices first and the biases after them, and keeps
    the bias space (zeros) for an RNN without biases, so the buffer can end
    past every weight (seen on an H200, cuDNN 9.19)."""
    if not weights or len(offsets) not in (len(weights), len(weights) + 1):
        return None
    w0 = weights[0]
    ptr = w0.untyped_storage().data_ptr()
    base = w0.storage_offset() - offsets[0]
    end = 0
    for w, off in zip(weights, offsets):
        if (w.untyped_storage().data_ptr() != ptr or not w.is_contiguous() or w.dtype != w0.dtype
                or w.storage_offset() - base != off):
            return None
        end = max(end, off + w.numel())
    if len(offsets) > len(weights):
        end = max(end, offsets[-1])
    if base < 0 or (base + end) * w0.element_size() > w0.untyped_storage().nbytes():
        return None
    return w0.new_empty(0).set_(w0.untyped_storage(), base, (end,))


def buffer_for(weights, offsets, mode, hidden_size, proj_size, num_layers, bidirectional, input_size):
    """``flat_buffer``, or a flattened copy of the weights where they are not
    in the layout (what eager PyTorch does then, with its warning)."""
    buf = flat_buffer(weights, offsets)
    if buf is not None:
        return buf, list(weights)
    per = weights_per_layer(len(weights), num_layers, bidirectional)
    clones = [w.detach().clone() for w in weights]
    buf = _kernels.cudnn_flatten(clones, per, input_size, mode, hidden_size, proj_size, num_layers, bidirectional)
    return buf, clones


#: device -> [the CUDA seed it was made under, the generator's offset last
#: seen, cuDNN's dropout state].
_DROPOUT_STATES: Dict[str, list] = {}


def dropout_state(device: torch.device, p: float) -> torch.Tensor:
    """cuDNN's dropout state for ``device``, as eager PyTorch keeps one:
    made on first use from a seed drawn from torch's CUDA generator, then
    advanced by cuDNN on every call that drops. Made again when that
    generator was seeded since the last call (its seed changed, or its
    offset went back: ``torch.manual_seed``), so seeding reproduces the
    masks from there on, as in eager. Eager's own state is not reachable
    from Python: the masks are cuDNN's, like eager's, but other draws."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = f"cuda:{index}"
    gen = torch.cuda.default_generators[index]
    seed, offset = gen.initial_seed(), gen.get_offset()
    entry = _DROPOUT_STATES.get(key)
    if entry is None or entry[0] != seed or offset < entry[1]:
        draw = int(torch.randint(0, 2**62, (1,), generator=gen, device=key).item())  # once, not per call
        entry = [seed, 0, _kernels.cudnn_dropout_state(torch.device(key), draw, p)]
        _DROPOUT_STATES[key] = entry
    entry[1] = gen.get_offset()
    return entry[2]


#: Set while ``reserve_numel`` measures: a dropout state of its own, so the
#: measurement does not advance the model's (the first call after a
#: ``manual_seed`` then draws the masks every later such call draws).
_MEASURING: list = [None]


def dropout_args(input, train, dropout):
    if train and dropout > 0:
        state = _MEASURING[0] if _MEASURING[0] is not None else dropout_state(input.device, float(dropout))
        return float(dropout), state
    return 0.0, None


def _cudnn_rnn(input, weights, hx, cx, mode, hidden_size, proj_size, num_layers, train, bidirectional, offsets,
               dropout=0.0):
    hx, cx = _states(input, hx, cx, mode, hidden_size, proj_size, num_layers, bidirectional)
    per = weights_per_layer(len(weights), num_layers, bidirectional)
    buf, ws = buffer_for(weights, offsets, mode, hidden_size, proj_size, num_layers, bidirectional, input.shape[2])
    p, state = dropout_args(input, train, dropout)
    out, hy, cy, reserve, _ = _kernels.cudnn_rnn(input, ws, per, buf, hx, cx, mode, hidden_size, proj_size,
                                                 num_layers, False, p, train, bidirectional, [], state)
    if cy is None or mode != _kernels.CUDNN_MODES["LSTM"]:
        cy = input.new_empty(0)
    if not train:
        reserve = input.new_empty(0, dtype=torch.uint8)
    return out, hy, cy, reserve


_RESERVE: Dict[tuple, int] = {}


def reserve_numel(T: int, B: int, I: int, mode: int, hidden_size: int, proj_size: int, num_layers: int,
                  bidirectional: bool, dtype: torch.dtype, device: torch.device, dropout: float = 0.0) -> int:
    """Bytes of cuDNN's training reserve for this shape: cuDNN's business, so
    measured once per shape on the GPU, on zeros, and cached; 0 where no GPU
    can run it (a graph traced on fake CUDA tensors, never run)."""
    key = (T, B, I, mode, hidden_size, proj_size, num_layers, bidirectional, dtype, str(device), dropout > 0)
    n = _RESERVE.get(key)
    if n is None:
        n = 0
        if torch.cuda.is_available():
            with _aot.outside_fake_mode(), torch.no_grad():
                D = 2 if bidirectional else 1
                gates = {0: 1, 1: 1, 2: 4, 3: 3}[mode]
                out_h = proj_size or hidden_size
                ws = []
                for layer in range(num_layers):
                    for _ in range(D):
                        in_size = I if layer == 0 else out_h * D
                        ws += [torch.zeros(gates * hidden_size, in_size, dtype=dtype, device=device),
                               torch.zeros(gates * hidden_size, out_h, dtype=dtype, device=device),
                               torch.zeros(gates * hidden_size, dtype=dtype, device=device),
                               torch.zeros(gates * hidden_size, dtype=dtype, device=device)]
                        if proj_size:
                            ws.append(torch.zeros(proj_size, hidden_size, dtype=dtype, device=device))
                x = torch.zeros(T, B, I, dtype=dtype, device=device)
                if dropout > 0:
                    _MEASURING[0] = _kernels.cudnn_dropout_state(torch.device(device), 0, float(dropout))
                try:
                    n = int(_cudnn_rnn(x, ws, None, None, mode, hidden_size, proj_size, num_layers, True,
                                       bidirectional, [], dropout)[3].numel())
                finally:
                    _MEASURING[0] = None
        _RESERVE[key] = n
    return n


def _cudnn_rnn_fake(input, weights, hx, cx, mode, hidden_size, proj_size, num_layers, train, bidirectional, offsets,
                    dropout=0.0):
    # cuDNN takes one dtype for all: a graph that mixes them (autocast not
    # applied, a half model fed fp32) fails here, when traced, not on the GPU.
    for t in (*weights, hx, cx):
        if t is not None and t.dtype != input.dtype:
            raise RuntimeError(f"wfpass::cudnn_rnn: the input is {input.dtype} but a weight or state is {t.dtype}; "
                               f"cuDNN runs an RNN in one dtype")
    T, B = input.shape[0], input.shape[1]
    D = 2 if bidirectional else 1
    out_h = proj_size or hidden_size
    out = input.new_empty((T, B, D * out_h))
    hy = input.new_empty((num_layers * D, B, out_h))
    cy = input.new_empty((num_layers * D, B, hidden_size)) if mode == _kernels.CUDNN_MODES["LSTM"] else input.new_empty(0)
    n = 0
    if train:
        dims = [static_int(d) for d in input.shape]  # specialized sizes count as static
        if all(d is not None for d in dims):
            n = reserve_numel(dims[0], dims[1], dims[2], mode, hidden_size, proj_size, num_layers, bidirectional,
                              input.dtype, input.device, dropout)
        else:  # a symbolic T or batch: a size known once the op has run
            n = torch.library.get_ctx().new_dynamic_size()
    return out, hy, cy, input.new_empty((n,), dtype=torch.uint8)


def backward_outputs(input, weights, offsets, hx0, cx0, dx, dhx, dcx, dw):
    """The backward op's outputs from ``_cudnn_rnn_backward``'s: zeros for
    a gradient cuDNN left undefined, and the weights' gradients as their
    buffer (``grad_buffer``; ``cudnn_packed.py`` shares this)."""
    flat = grad_buffer(dw, weights, offsets, input)
    dx = dx if dx is not None and dx.numel() else torch.zeros_like(input)
    dhx = dhx if dhx is not None and dhx.numel() else torch.zeros_like(hx0)
    dcx = dcx if dcx is not None and dcx.numel() else (torch.zeros_like(cx0) if cx0 is not None else input.new_empty(0))
    return dx, dhx, dcx, flat


def _cudnn_rnn_backward(input, weights, hx, cx, output, grad_output, grad_hy, grad_cy, reserve, mode, hidden_size,
                        proj_size, num_layers, bidirectional, offsets, output_mask, dropout=0.0):
    hx0, cx0 = _states(input, hx, cx, mode, hidden_size, proj_size, num_layers, bidirectional)
    per = weights_per_layer(len(weights), num_layers, bidirectional)
    buf, ws = buffer_for(weights, offsets, mode, hidden_size, proj_size, num_layers, bidirectional, input.shape[2])
    if grad_output is None:
        grad_output = torch.zeros_like(output)
    # The masks the forward drew are in ``reserve``; cuDNN reads the
    # dropout descriptor (p and a state) to find them.
    p, state = dropout_args(input, True, dropout)
    dx, dhx, dcx, dw = _kernels.cudnn_rnn_backward(
        input, ws, per, buf, hx0, cx0, output, grad_output, grad_hy, grad_cy, mode, hidden_size, proj_size,
        num_layers, False, p, True, bidirectional, [], state, reserve, list(output_mask))
    return backward_outputs(input, weights, offsets, hx0, cx0, dx, dhx, dcx, dw)


def _cudnn_rnn_backward_fake(input, weights, hx, cx, output, grad_output, grad_hy, grad_cy, reserve, mode,
                             hidden_size, proj_size, num_layers, bidirectional, offsets, output_mask, dropout=0.0):
    hx0, cx0 = _states(input, hx, cx, mode, hidden_size, proj_size, num_layers, bidirectional)
    dcx = torch.empty_like(cx0) if cx0 is not None else input.new_empty(0)
    return torch.empty_like(input), torch.empty_like(hx0), dcx, input.new_empty((buffer_numel(weights, offsets),))


def _setup(ctx, inputs, output):
    # ``dropout`` has no default in the schema: torch 2.11's dispatcher
    # drops a trailing argument equal to its default, and the autograd
    # wrapper then wants fewer grads than setup_context saw inputs.
    input, weights, hx, cx, mode, hidden_size, proj_size, num_layers, train, bidirectional, offsets, dropout = inputs
    out, hy, cy, reserve = output
    ctx.save_for_backward(input, hx, cx, out, reserve, *weights)
    ctx.static = (mode, hidden_size, proj_size, num_layers, train, bidirectional, list(offsets), dropout)
    ctx.set_materialize_grads(False)


def _grad(ctx, g_out, g_hy, g_cy, _g_reserve):
    input, hx, cx, out, reserve, *weights = ctx.saved_tensors
    mode, hidden_size, proj_size, num_layers, train, bidirectional, offsets, dropout = ctx.static
    if not train:
        raise RuntimeError("wfpass: a cuDNN RNN call run without grad was differentiated")
    if mode != _kernels.CUDNN_MODES["LSTM"]:
        g_cy = None
    dx, dhx, dcx, flat = torch.ops.wfpass.cudnn_rnn_backward.default(
        input, weights, hx, cx, out, g_out, g_hy, g_cy, reserve, mode, hidden_size, proj_size, num_layers,
        bidirectional, offsets, [True, True, mode == _kernels.CUDNN_MODES["LSTM"], True], dropout)
    dws = weight_grads(flat, weights, offsets)  # views of cuDNN's gradient buffer, no copy
    return (dx, dws, dhx if hx is not None else None, dcx if cx is not None else None) + (None,) * 8


_LIB = define_rnn_op("cudnn_rnn", forward=_cudnn_rnn,
                     forward_fake=_cudnn_rnn_fake, backward=_cudnn_rnn_backward,
                     backward_fake=_cudnn_rnn_backward_fake, setup=_setup, grad=_grad, tags=RANDOM, python_bodies=True)


def _eligible(t: Optional[torch.Tensor]) -> bool:
    return t is not None and t.is_floating_point() and t.dtype not in (torch.float64, torch.float16)


def autocast_half(spec, x, hx, ws):
    """What eager PyTorch does to a cuDNN RNN inside a CUDA autocast region
    (``aten/src/ATen/cudnn/AutocastRNN.cpp``, torch 2.11-2.15): whatever the
    region's dtype, the RNN runs in **fp16**; input and states are cast, and
    the weights are cast into one fp16 block in cuDNN's layout, on every
    call, through autograd (their gradients reach the fp32 Parameters).
    Here that block is one ``cat`` in the graph (zeros where cuDNN's layout
    leaves a gap), and the op reads it as its flat buffer. Outside autocast,
    or for weights already fp16 (or fp64, which autocast leaves alone): the
    arguments unchanged."""
    if not torch.is_autocast_enabled("cuda") or not _eligible(ws[0]):
        return x, hx, ws
    half = torch.float16
    # In offset order (cuDNN 9 puts the biases after every matrix), zeros
    # in the gaps and up to the buffer's size (the last entry of offsets).
    order = sorted(range(len(ws)), key=lambda i: spec.offsets[i])
    pieces, pos = [], 0
    for i in order:
        off = spec.offsets[i]
        if off > pos:
            pieces.append(ws[i].new_zeros((off - pos,), dtype=half))
        pieces.append(ws[i].reshape(-1).to(half))
        pos = off + ws[i].numel()
    if spec.numel > pos:
        pieces.append(ws[0].new_zeros((spec.numel - pos,), dtype=half))
    block = torch.cat(pieces)
    ws = [block[off:off + w.numel()].view(w.shape) for w, off in zip(ws, spec.offsets)]
    x = x.to(half) if _eligible(x) else x
    hx = [h.to(half) if _eligible(h) else h for h in hx]
    return x, hx, ws


def cudnn_call(spec, x, hx, ws, need_grad: bool, training: bool = False):
    """One RNN call on cuDNN: ``(out, h_n, c_n)`` (``c_n`` None but for an
    LSTM). ``x`` as the module takes it (``batch_first`` or not); the op
    runs time-major, so a batch-first input is transposed around it. Inside
    CUDA autocast, in fp16 as eager does (``autocast_half``). ``training``:
    the module's mode; with ``spec.dropout`` it drops between layers, as
    eager's cuDNN call does, with or without grad."""
    x, hx, ws = autocast_half(spec, x, hx, ws)
    mode = _kernels.CUDNN_MODES[spec.mode]
    xt = x.transpose(0, 1) if spec.batch_first else x
    h = hx[0] if hx else None
    c = hx[1] if spec.mode == "LSTM" and len(hx) > 1 else None
    dropout = float(spec.dropout) if training and spec.num_layers > 1 else 0.0
    op = torch.ops.wfpass.cudnn_rnn.default if need_grad else torch.ops.wfpass.cudnn_rnn_fw.default
    out, hy, cy, _ = op(xt.contiguous(), list(ws), h, c, mode, spec.hidden_size, spec.proj_size, spec.num_layers,
                        bool(need_grad or dropout > 0), spec.bidirectional, [*spec.offsets, spec.numel], dropout)
    if spec.batch_first:
        out = out.transpose(0, 1)
    return out, hy, (cy if spec.mode == "LSTM" else None)
