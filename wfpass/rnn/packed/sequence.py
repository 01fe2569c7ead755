"""Variable-length batches in the compiled graph: ``pack_padded_sequence``
-> ``nn.LSTM/GRU/RNN`` -> ``pad_packed_sequence``, forward and backward.

Without wfpass, Dynamo graph-breaks on both functions (they are on its
skip list) and the RNN runs eagerly on ATen's per-step packed path. For
wformat backends that run ``fuse_rnn``, three calls go into the graph
instead, each a real op with eager's semantics (the values a user can read
are eager's values: ``packed.data``, ``batch_sizes``, the indices):

User code::

    packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
    out, (h_n, c_n) = self.lstm(packed)
    y, lens = pad_packed_sequence(out, batch_first=True)

Dynamo's graph (before ``fuse_rnn``)::

    lengths, sorted_idx = sort(lengths, descending=True)
    data, batch_sizes = wfpass.pack_padded(x, lengths, False, sorted_idx)   # the sort folded in
    out, h_n, c_n = wfpass.packed_rnn(data, batch_sizes, [], [w_ih_l0, ...], "LSTM", ...)
    y, lens = wfpass.pad_packed(out, batch_sizes, True, 0.0, -1, unsorted_idx)
    h_n = h_n.index_select(1, unsorted_idx)

After ``fuse_rnn``, ``packed_rnn`` is ``rnn_packed(data, batch_sizes, hx,
*weights)`` in the group of its weights (one flat block), and AOTAutograd
traces it into one ``wfpass.packed_layer`` per layer and direction (the
C++ kernel that steps a shrinking batch, ``cpu/packed_layer.py``; one
``wfpass.packed_bilayer`` per layer of a bidirectional RNN, its two
directions at once on two threads), or into one cuDNN call in packed mode
on CUDA.

**The data-dependent sizes.** ``sum(lengths)`` (the rows of ``data``) and
``max(lengths)`` (the rows of ``batch_sizes``, and the padded output's
length when ``total_length`` is not given) are sizes the compiler learns
when ``pack_padded`` runs: unbacked symbols made by its fake, which every
later op's fake reuses (``data.shape[0]``, ``batch_sizes.shape[0]``), so
one compiled graph serves every set of lengths. The number of sequences B
is the padded input's own (backed) size; the fakes of ops that only see
``batch_sizes`` find it again through ``meta.py``. ``lengths`` stays on
the CPU, as eager requires, so no size is read from a GPU.

Where Dynamo runs these functions for any other backend, they graph-break
as before (``torch._dynamo.graph_break``, at the same call).
"""
from __future__ import annotations

import functools
from typing import List

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import PackedSequence, invert_permutation

from ..._torch import dynamo_hooks as _hooks, kernels as _kernels, tensors as _tensors
from ..cpu.packed_layer_py import known_different
from .meta import batch_of, note_batch
from ..spec import flat_weight_names, overrides_forward, rnn_mode

__all__ = ["PACKED_RNN", "PackedRnnForward", "packed_path", "install", "pack_padded_sequence", "pad_packed_sequence", "rnn_forward", "install_forward", "uninstall_forward",
           "packed_rnn_kernel"]

_LIB = torch.library.Library("wfpass", "FRAGMENT")

# -- pack_padded / pad_packed: eager's ATen kernels as ops with fakes ----------------------------

# ``order``: the batch's reordering, folded into the copy (the index_select
# eager runs around packing an unsorted batch): packing reads column
# ``order[b]`` into slot b (``sorted_indices``); padding writes slot
# ``order[j]`` into column j (``unsorted_indices``). On the CPU the C++
# kernels (``_torch/native/sequence.cpp``) copy each row once; these Python
# kernels, used elsewhere, run eager's index_select and ATen's kernel.
_LIB.define("pack_padded(Tensor input, Tensor lengths, bool batch_first, Tensor? order=None) -> (Tensor, Tensor)")
_LIB.define("pack_padded_backward(Tensor grad, Tensor batch_sizes, SymInt[] input_size, bool batch_first, "
            "Tensor? order=None) -> Tensor")
_LIB.define("pad_packed(Tensor data, Tensor batch_sizes, bool batch_first, float padding_value, SymInt total_length, "
            "Tensor? order=None) -> (Tensor, Tensor)")
_LIB.define("pad_packed_backward(Tensor grad, Tensor batch_sizes, SymInt rows, bool batch_first, "
            "Tensor? order=None) -> Tensor")


def _inverse(order: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


# The Python kernels check what the C++ ones check (sequence.cpp), before
# ATen's kernels read a row: those check less (lengths longer than the input
# packed fewer rows than batch_sizes says; a negative batch size crashed
# eager's pad). RuntimeError, eager's type; O(T) and O(B), nothing per element.

def _checked_sizes(batch_sizes: torch.Tensor, rows: int, what: str, rows_name: str = "data") -> list:
    """``batch_sizes`` as a list: 1-D, each entry in [0, the one before], summing to ``rows``."""
    if batch_sizes.dim() != 1:
        raise RuntimeError(f"{what}: batch_sizes must be 1-D, got {batch_sizes.dim()}-D")
    bs = batch_sizes.tolist()
    for t, n in enumerate(bs):
        if n < 0 or (t and n > bs[t - 1]):
            raise RuntimeError(f"{what}: batch_sizes must be non-negative and non-increasing, got {n} at step {t}"
                               + (f" after {bs[t - 1]}" if t else ""))
    if sum(bs) != rows:
        raise RuntimeError(f"{what}: {rows_name} has {rows} rows, but batch_sizes sums to {sum(bs)}")
    return bs


def _check_order(order, B: int, what: str) -> None:
    """``order`` is a permutation of [0, B) (its values only on the CPU:
    reading a GPU tensor's would wait for it; index_select bounds-checks there)."""
    if order is None:
        return
    if order.dim() != 1 or order.numel() != B:
        raise RuntimeError(f"{what}: the batch order has {order.numel()} entries for a batch of {B}")
    if order.device.type == "cpu" and not torch.equal(torch.sort(order.long()).values, torch.arange(B)):
        raise RuntimeError(f"{what}: the batch order is not a permutation of 0..{B - 1}")


def _pack_padded(input, lengths, batch_first, order=None):
    if input.dim() < 2:
        raise RuntimeError("pack_padded_sequence: the input needs a time and a batch dimension")
    T = input.shape[1 if batch_first else 0]
    if lengths.device.type == "cpu" and lengths.dim() == 1 and lengths.numel() and int(lengths.max()) > T:
        raise RuntimeError(f"pack_padded_sequence: a length ({int(lengths.max())}) is longer than the input's {T} "
                           "steps")
    _check_order(order, input.shape[0 if batch_first else 1], "pack_padded_sequence")
    if order is not None:
        input = input.index_select(0 if batch_first else 1, order.to(input.device))
    data, batch_sizes = _kernels.pack_padded(input, lengths, batch_first)
    # Fresh outputs (torch.library's rule: no output aliases an input).
    return data.clone() if data._base is not None or data.data_ptr() == input.data_ptr() else data, batch_sizes


def _pack_padded_fake(input, lengths, batch_first, order=None):
    if lengths.dim() != 1 or lengths.dtype != torch.int64 or lengths.device.type != "cpu":
        raise RuntimeError("'lengths' argument should be a 1D CPU int64 tensor, "
                           f"but got {lengths.dim()}D {lengths.device.type} {lengths.dtype} tensor")
    if input.dim() < 2:
        raise RuntimeError("pack_padded_sequence: the input needs a time and a batch dimension")
    B = input.shape[0 if batch_first else 1]
    if known_different(lengths.shape[0], B):
        raise RuntimeError(f"Expected `len(lengths)` to be equal to batch_size, but got {lengths.shape[0]} "
                           f"(batch_size={B})")
    rows = _tensors.run_time_size()  # sum(lengths)
    steps = _tensors.run_time_size()  # max(lengths)
    batch_sizes = torch.empty((steps,), dtype=torch.int64, device="cpu")
    note_batch(batch_sizes, input.shape[0 if batch_first else 1])
    return input.new_empty((rows, *input.shape[2:])), batch_sizes


def _check_pack_grad(grad, input_size, what: str) -> None:
    """``grad`` is the packed data of an input of ``input_size``."""
    if len(input_size) < 2 or grad.dim() != len(input_size) - 1:
        raise RuntimeError(f"{what}: grad must be the packed data of an input of {len(input_size)} dimensions, "
                           f"got {grad.dim()}-D")
    if any(known_different(a, b) for a, b in zip(grad.shape[1:], input_size[2:])):
        raise RuntimeError(f"{what}: grad has shape {list(grad.shape)}, the input's features are "
                           f"{list(input_size[2:])}")


def _pack_padded_backward(grad, batch_sizes, input_size, batch_first, order=None):
    what = "pack_padded_sequence's backward"
    _check_pack_grad(grad, input_size, what)
    bs = _checked_sizes(batch_sizes, grad.shape[0], what, "grad")
    B, T = input_size[0 if batch_first else 1], input_size[1 if batch_first else 0]
    if len(bs) > T or (bs and bs[0] != B):  # rows are written into a [T, B] grid
        raise RuntimeError(f"{what}: batch_sizes ({len(bs)} steps, first {bs[0] if bs else 0}) does not describe an "
                           f"input of {T} steps and {B} sequences")
    _check_order(order, B, what)
    # Contiguous, as the fake says: ATen's returns a batch-first gradient as
    # a transposed view of a time-major buffer (Inductor checks strides).
    g = torch.ops.aten._pack_padded_sequence_backward(grad, input_size, batch_sizes, batch_first)
    if order is not None:
        g = g.index_select(0 if batch_first else 1, _inverse(order.to(g.device)))
    return g.contiguous()


def _pack_padded_backward_fake(grad, batch_sizes, input_size, batch_first, order=None):
    _check_pack_grad(grad, input_size, "pack_padded_sequence's backward")
    return grad.new_empty(input_size)


def _lengths_of(batch_sizes: torch.Tensor) -> torch.Tensor:
    """Each sequence's length, longest first, from a packed batch's sizes."""
    steps = torch.arange(1, batch_sizes.numel() + 1, dtype=torch.int64)
    return torch.repeat_interleave(steps.flip(0), (batch_sizes - torch.cat([batch_sizes[1:], batch_sizes.new_zeros(1)])).flip(0))


def _pad_packed(data, batch_sizes, batch_first, padding_value, total_length, order=None):
    if data.dim() < 1:
        raise RuntimeError("pad_packed_sequence: data must have a row dimension, got a 0-D tensor")
    bs = _checked_sizes(batch_sizes, data.shape[0], "pad_packed_sequence")
    _check_order(order, bs[0] if bs else 0, "pad_packed_sequence")
    steps = batch_sizes.numel()
    if total_length >= 0 and total_length < steps:
        raise ValueError("Expected total_length to be at least the length of the longest sequence in input, but got "
                         f"total_length={total_length} and max sequence length being {steps}")
    out, lengths = _kernels.pad_packed(data, batch_sizes, batch_first, padding_value,
                                       total_length if total_length >= 0 else steps)
    if order is not None:
        out = out.index_select(0 if batch_first else 1, order.to(out.device))
    return out.contiguous(), lengths


def _pad_packed_fake(data, batch_sizes, batch_first, padding_value, total_length, order=None):
    if data.dim() < 1 or batch_sizes.dim() != 1:
        raise RuntimeError(f"pad_packed_sequence: data must have a row dimension and batch_sizes be 1-D, got "
                           f"{data.dim()}-D and {batch_sizes.dim()}-D")
    B = batch_of(batch_sizes)
    T = batch_sizes.shape[0] if (isinstance(total_length, int) and total_length < 0) else total_length
    shape = (B, T) if batch_first else (T, B)  # contiguous, as the kernel returns it
    return data.new_empty((*shape, *data.shape[1:])), torch.empty((B,), dtype=torch.int64, device="cpu")


def _pad_packed_backward(grad, batch_sizes, rows, batch_first, order=None):
    what = "pad_packed_sequence's backward"
    if grad.dim() < 2:
        raise RuntimeError(f"{what}: grad must have a time and a batch dimension, got {grad.dim()}-D")
    bs = _checked_sizes(batch_sizes, rows, what, "the packed data")
    Tg, Bg = grad.shape[1 if batch_first else 0], grad.shape[0 if batch_first else 1]
    if len(bs) > Tg or (bs[0] if bs else 0) != Bg:  # rows are read from grad's [T, B] grid
        raise RuntimeError(f"{what}: grad has {Tg} steps and {Bg} sequences, batch_sizes {len(bs)} steps and "
                           f"{bs[0] if bs else 0} sequences")
    _check_order(order, Bg, what)
    steps = batch_sizes.numel()
    g = grad.narrow(1 if batch_first else 0, 0, steps)
    if order is not None:
        g = g.index_select(0 if batch_first else 1, _inverse(order.to(g.device)))
    data, _ = _kernels.pack_padded(g, _lengths_of(batch_sizes), batch_first)
    return data.contiguous()


def _pad_packed_backward_fake(grad, batch_sizes, rows, batch_first, order=None):
    if grad.dim() < 2:
        raise RuntimeError(f"pad_packed_sequence's backward: grad must have a time and a batch dimension, got "
                           f"{grad.dim()}-D")
    return grad.new_empty((rows, *grad.shape[2:]))


for _name, _kernel, _fake in (("pack_padded", _pack_padded, _pack_padded_fake),
                              ("pack_padded_backward", _pack_padded_backward, _pack_padded_backward_fake),
                              ("pad_packed", _pad_packed, _pad_packed_fake),
                              ("pad_packed_backward", _pad_packed_backward, _pad_packed_backward_fake)):
    _LIB.impl(_name, _kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"wfpass::{_name}", _fake, lib=_LIB)


def _pack_setup(ctx, inputs, output):
    input, _lengths, batch_first, order = inputs
    ctx.input_size = tuple(input.shape)
    ctx.batch_first = batch_first
    ctx.save_for_backward(output[1], order)


def _pack_grad(ctx, g_data, _g_sizes):
    batch_sizes, order = ctx.saved_tensors
    if g_data is None:
        return None, None, None, None
    return (torch.ops.wfpass.pack_padded_backward(g_data, batch_sizes, ctx.input_size, ctx.batch_first, order),
            None, None, None)


def _pad_setup(ctx, inputs, output):
    data, batch_sizes, batch_first, _value, _total, order = inputs
    ctx.rows = data.shape[0]
    ctx.batch_first = batch_first
    ctx.save_for_backward(batch_sizes, order)


def _pad_grad(ctx, g_out, _g_lengths):
    batch_sizes, order = ctx.saved_tensors
    if g_out is None:
        return None, None, None, None, None, None
    # The padded positions' gradient goes nowhere, as in eager.
    return (torch.ops.wfpass.pad_packed_backward(g_out, batch_sizes, ctx.rows, ctx.batch_first, order),
            None, None, None, None, None)


torch.library.register_autograd("wfpass::pack_padded", _pack_grad, setup_context=_pack_setup, lib=_LIB)
torch.library.register_autograd("wfpass::pad_packed", _pad_grad, setup_context=_pad_setup, lib=_LIB)


# -- the zero initial state of an RNN over a packed batch ------------------------------------------

# Eager makes it from ``int(batch_sizes[0])``. Here it is one op whose fake
# takes B from ``meta.py`` (the padded input's size where the graph packed
# the batch). Why an op, and one per RNN call: for a PackedSequence made
# outside the graph, B is a size learnt at run time (an unbacked symbol); made
# here, it is bound to one forward node that every layer then reads through
# ``h0.shape[1]``. Left to each layer op's fake, each would make a symbol of
# its own, which no output returns (Dynamo's PendingUnbackedSymbolNotFound),
# and the partitioner would find the symbol only in a gradient's shape.
_LIB.define("packed_zero_state(Tensor batch_sizes, int rows, int hidden, ScalarType dtype, Device device) -> Tensor")


def _packed_zero_state(batch_sizes, rows, hidden, dtype, device):
    return torch.zeros((rows, int(batch_sizes[0]) if batch_sizes.numel() else 0, hidden), dtype=dtype, device=device)


def _packed_zero_state_fake(batch_sizes, rows, hidden, dtype, device):
    return torch.empty((rows, batch_of(batch_sizes), hidden), dtype=dtype, device=device)


_LIB.impl("packed_zero_state", _packed_zero_state, "CompositeExplicitAutograd")
torch.library.register_fake("wfpass::packed_zero_state", _packed_zero_state_fake, lib=_LIB)

# -- the whole RNN over a packed batch -----------------------------------------------------------

_LIB.define("packed_rnn(Tensor data, Tensor batch_sizes, Tensor[] hx, Tensor[] weights, str mode, bool has_biases, "
            "int num_layers, float dropout, bool train, bool bidirectional, int proj_size) -> (Tensor, Tensor, Tensor)")


def packed_rnn_kernel(data, batch_sizes, hx, weights, mode, has_biases, num_layers, dropout, train, bidirectional,
                      proj_size):
    """``_VF.lstm(data, batch_sizes, hx, weights, ...)`` and the like, as one
    ``wfpass::packed_layer`` per layer and direction, or one
    ``wfpass::packed_bilayer`` per layer of a bidirectional RNN (eager's
    layer and direction structure, dropout between layers in training).
    Returns ``(out, h_n, c_n)``, ``c_n`` empty for GRUs and plain RNNs."""
    from ..cpu import packed_layer, packed_lstm_runs  # (importing them registers the layer ops)

    # ``dynamic=True`` (or a recompile after the module's dropout changed)
    # hands Dynamo's trace a symbolic float; float() specializes it, so the
    # graph is guarded on the value, as Dynamo guards eager's ``_VF.lstm``.
    dropout = float(dropout)
    dirs = 2 if bidirectional else 1
    per = (4 if has_biases else 2) + (1 if proj_size > 0 else 0)
    lstm = mode == "LSTM"
    h0 = hx[0] if len(hx) > 0 else None
    c0 = hx[1] if lstm and len(hx) > 1 else None
    # Each layer and direction takes its slice of these: a short list would
    # hand the last ones empty slices (eager's ATen checks the same).
    if len(weights) != num_layers * dirs * per:
        raise RuntimeError(f"wfpass::packed_rnn: got an incorrect number of RNN parameters: {len(weights)}, "
                           f"expected {num_layers * dirs * per}")
    for s, name in ((h0, "h0"), (c0, "c0")):
        if s is not None and (s.dim() != 3 or known_different(s.shape[0], num_layers * dirs)):
            raise RuntimeError(f"wfpass::packed_rnn: {name} must have {num_layers * dirs} layers and directions, "
                               f"got shape {tuple(s.shape)}")
    hx, weights = _autocast_inputs(data, hx, weights)
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (data, *hx, *weights))
    op = torch.ops.wfpass.packed_layer.default if need_grad else torch.ops.wfpass.packed_layer_fw.default
    if packed_lstm_runs.usable(mode, proj_size, data, need_grad):  # oneDNN's LSTM layer, run by run
        op = functools.partial(_runs_call, torch.ops.wfpass.packed_lstm_runs_fw.default)
    # Both directions of a layer in one call (``packed_bilayer``: one output,
    # the directions at once on two threads).
    pair = bidirectional and not isinstance(op, functools.partial)
    pair_op = torch.ops.wfpass.packed_bilayer.default if need_grad else torch.ops.wfpass.packed_bilayer_fw.default
    layer_in = data
    hs: List[torch.Tensor] = []
    cs: List[torch.Tensor] = []
    for layer in range(num_layers):
        if pair:
            k = 2 * layer
            layer_out, h, c, _ws_f, _ws_b = pair_op(
                layer_in, batch_sizes, list(weights[k * per:(k + 2) * per]), None if h0 is None else h0[k:k + 2],
                None if c0 is None else c0[k:k + 2], mode, has_biases, proj_size > 0, need_grad)
            hs.append(h)
            cs.append(c)
        else:
            outs = []
            for d in range(dirs):
                k = layer * dirs + d
                w = packed_layer.layer_weights(weights[k * per:(k + 1) * per], has_biases, proj_size > 0)
                out, h, c, _ws = op(layer_in, batch_sizes, *w, None if h0 is None else h0[k:k + 1],
                                    None if c0 is None else c0[k:k + 1], mode, d == 1, need_grad)
                outs.append(out)
                hs.append(h)
                cs.append(c)
            layer_out = outs[0] if dirs == 1 else torch.cat(outs, 1)
        if dropout > 0 and train and layer < num_layers - 1:
            layer_out = F.dropout(layer_out, dropout, True)
        layer_in = layer_out
    h_n = torch.cat(hs, 0)
    c_n = torch.cat(cs, 0) if lstm else data.new_empty(0)
    return layer_in, h_n, c_n


def _autocast_inputs(data, hx, weights):
    """Under autocast, the weights and states in the data's dtype, as eager
    computes a packed batch: ``_VF.lstm(data, batch_sizes, ...)`` has no
    autocast rule of its own, and over bf16 data (what a linear before it
    gives under autocast) it runs in bf16 (bits equal to the module cast to
    bf16). The casts are ordinary ops, so the gradients reach the fp32
    parameters. Without autocast a dtype mismatch stays eager's error."""
    if not torch.is_autocast_enabled(data.device.type) or not data.is_floating_point():
        return list(hx), list(weights)
    dt = data.dtype

    def cast(ts):
        return [t.to(dt) if t.is_floating_point() and t.dtype != dt else t for t in ts]
    return cast(hx), cast(weights)


def _runs_call(op, data, batch_sizes, w_ih, w_hh, b_ih, b_hh, w_hr, h0, c0, mode, reverse, train):
    """``wfpass::packed_lstm_runs`` called as ``wfpass::packed_layer`` is (no projection, an LSTM)."""
    return op(data, batch_sizes, w_ih, w_hh, b_ih, b_hh, h0, c0, reverse, train)


#: The graph targets ``fuse_rnn`` matches (Dynamo records the op as called).
PACKED_RNN = (torch.ops.wfpass.packed_rnn, torch.ops.wfpass.packed_rnn.default)


def packed_path(spec, x: torch.Tensor, need_grad: bool) -> str:
    """The kernel of a packed batch: cuDNN's packed mode on CUDA where
    ``rnn={"cuda": "cudnn"}``; on the CPU without grad oneDNN's LSTM layer
    over each run of equal batch size (``packed_onednn``: LSTMs without a
    projection, in a dtype oneDNN runs here; ``packed_rnn_kernel`` asks the
    same), else the C++ layer loop (``packed``)."""
    if x.device.type == "cuda" and spec.options.cuda == "cudnn":
        return "cudnn"
    from ..cpu.packed_lstm_runs import usable

    return "packed_onednn" if usable(spec.mode, spec.proj_size, x, need_grad) else "packed"


class PackedRnnForward:
    """The graph's call of one RNN over a packed batch after ``fuse_rnn``:
    ``(data, batch_sizes, hx, *weights) -> (out, h_n, c_n)``, the weights
    passed one by one (views of the flat block; the CPU kernel reads each
    where it is, so a lost layout changes no result)."""

    def __init__(self, spec, path: str, train: bool):
        self.spec, self.path, self.train = spec, path, train
        self.__name__ = self.__qualname__ = f"rnn_packed_{path}"

    __module__ = __name__

    def __call__(self, data, batch_sizes, hx, *weights):
        spec = self.spec
        if self.path == "cudnn":  # cuDNN's own packed mode, from the flat buffer
            from ..cuda.cudnn_packed import cudnn_packed_call

            need_grad = torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (data, *hx, *weights))
            return cudnn_packed_call(spec, data, batch_sizes, list(hx), weights, need_grad, self.train)
        return torch.ops.wfpass.packed_rnn(data, batch_sizes, list(hx), list(weights), spec.mode, spec.has_biases,
                                           spec.num_layers, spec.dropout, self.train, spec.bidirectional,
                                           spec.proj_size)

    def __repr__(self) -> str:
        return f"PackedRnnForward({self.spec.name}, path={self.path!r})"


# CompositeImplicitAutograd: Dynamo records one node (what fuse_rnn matches
# and rewrites); AOTAutograd traces through it into the layer ops, whose
# own formulas give the gradients.
_LIB.impl("packed_rnn", packed_rnn_kernel, "CompositeImplicitAutograd")


# -- what Dynamo traces instead of the eager functions -------------------------------------------

_NOT_CAPTURED = ("pack_padded_sequence / pad_packed_sequence run eagerly for this backend, as without wfpass "
                 "(backend='wformat' puts them into the graph)")


def _lengths_tensor(lengths) -> torch.Tensor:
    if isinstance(lengths, torch.Tensor):
        return lengths.to(dtype=torch.int64)
    return torch.as_tensor(lengths, dtype=torch.int64, device="cpu")


def pack_padded_sequence(input, lengths, batch_first=False, enforce_sorted=True):
    """``torch.nn.utils.rnn.pack_padded_sequence`` as Dynamo traces it
    for a wformat backend (same signature and values; registered with
    ``torch.compiler.substitute_in_graph``). Other backends: a graph break
    at this call, as without wfpass."""
    if not _hooks.packed_capture_wanted():  # decided while Dynamo traces
        _hooks.graph_break(_NOT_CAPTURED)
    lengths = _lengths_tensor(lengths)
    if enforce_sorted:
        sorted_indices = None
    else:
        lengths, sorted_indices = torch.sort(lengths, descending=True)
        sorted_indices = sorted_indices.to(input.device)
    # The sort's index_select is folded into the op (one copy of each row).
    data, batch_sizes = torch.ops.wfpass.pack_padded(input, lengths, batch_first, sorted_indices)
    return PackedSequence(data, batch_sizes, sorted_indices, invert_permutation(sorted_indices))


def pad_packed_sequence(sequence, batch_first=False, padding_value=0.0, total_length=None):
    """``torch.nn.utils.rnn.pad_packed_sequence`` as Dynamo traces it for
    a wformat backend (see ``pack_padded_sequence``). Eager's check that
    ``total_length`` covers the longest sequence reads the lengths' values:
    the op makes it when it runs, with eager's ``ValueError``."""
    if not _hooks.packed_capture_wanted():
        _hooks.graph_break(_NOT_CAPTURED)
    unsorted_indices = sequence.unsorted_indices
    # Unsorting (eager's index_select) is folded into the op.
    padded, lengths = torch.ops.wfpass.pad_packed(sequence.data, sequence.batch_sizes, batch_first,
                                                  float(padding_value), -1 if total_length is None else total_length,
                                                  unsorted_indices)
    if unsorted_indices is not None:
        return padded, lengths[unsorted_indices.cpu()]
    return padded, lengths


def _check_packed_args(module, data, states, weights) -> None:
    """Eager's checks of a packed call's input and states, made while Dynamo
    traces (``nn.GRU/RNN.forward``'s ``check_forward_args``; ``nn.LSTM``'s
    ATen kernel raises for the same inputs). Without them a feature size
    other than input_size ran and returned values. A raise here sends the
    call to eager, which raises its own error, the module named where
    ``capture.name_errors`` named it. The states' batch is a value
    (batch_sizes[0]): the layer kernels check it when they run."""
    lstm = rnn_mode(module) == "LSTM"
    L = module.num_layers * (2 if module.bidirectional else 1)
    proj = getattr(module, "proj_size", 0)
    widths = [proj if proj > 0 else module.hidden_size, module.hidden_size]
    name = lambda: _display_name(module)  # noqa: E731 - only on the error path
    if data.dim() != 2:
        raise RuntimeError(f"{name()}: input must have 2 dimensions, got {data.dim()}")
    if data.shape[-1] != module.input_size:
        raise RuntimeError(f"{name()}: input.size(-1) must be equal to input_size. Expected {module.input_size}, "
                           f"got {data.shape[-1]}")
    if weights and data.dtype != weights[0].dtype and not torch.is_autocast_enabled(data.device.type):
        raise ValueError(f"{name()}: RNN input dtype ({data.dtype}) does not match weight dtype "
                         f"({weights[0].dtype})")
    for k, (s, w) in enumerate(zip(states, widths)):
        if s.dim() != 3 or s.shape[0] != L or s.shape[2] != w:
            which = f"hidden[{k}]" if lstm else "hidden"
            raise RuntimeError(f"{name()}: Expected {which} size ({L}, batch_sizes[0], {w}), got {list(s.shape)}")


def _display_name(module) -> str:
    """The name ``capture.name_errors`` gave the module's errors, else its class."""
    f = module.__dict__.get("check_forward_args")
    if isinstance(f, functools.partial) and len(f.args) > 1 and isinstance(f.args[1], str):
        return f.args[1]
    return f"nn.{type(module).__name__}"


def rnn_forward(module, input, hx=None):
    """An ``nn.LSTM/GRU/RNN``'s ``forward`` for wfpass-captured modules:
    a PackedSequence in a wformat trace goes to ``wfpass::packed_rnn``;
    everything else is the class's own ``forward``, unchanged.

    Why: eager's ``forward`` reads ``batch_sizes[0]`` as a Python int (the
    zero state's size) and calls ``_VF.lstm(data, batch_sizes, ...)``,
    which has no fake kernel (pytorch#162375): both stop Dynamo."""
    if isinstance(input, PackedSequence) and _hooks.packed_capture_wanted():
        if rnn_mode(module) is not None:
            return _packed_call(module, input, hx)
        return _subclass_packed_call(module, input, hx)
    if not torch.compiler.is_compiling():  # an eager run: inside a compiled call, the report counts it
        from ..eager_calls import note_eager_call

        note_eager_call(module, isinstance(input, PackedSequence))
    return type(module).forward(module, input, hx)


@torch.compiler.disable
def _subclass_packed_call(module, input, hx):
    """A packed call of a subclass with a ``forward`` of its own, from a
    wformat trace: its ``forward`` runs eagerly (wfpass does not know what
    it does; Dynamo would break inside it on ``batch_sizes[0]`` anyway), one
    clean graph break at the call, counted on its report row."""
    from ..eager_calls import note_eager_call

    note_eager_call(module, True, where="subclass")
    return type(module).forward(module, input, hx)


def _packed_call(module, input, hx):
    data, batch_sizes, sorted_indices, unsorted_indices = input
    mode = rnn_mode(module)
    lstm = mode == "LSTM"
    if hx is None:  # eager's zeros, B bound once (see packed_zero_state)
        L = module.num_layers * (2 if module.bidirectional else 1)
        Hh = module.proj_size if getattr(module, "proj_size", 0) > 0 else module.hidden_size
        h0 = torch.ops.wfpass.packed_zero_state(batch_sizes, L, Hh, data.dtype, data.device)
        states = [h0, h0.new_zeros((L, h0.shape[1], module.hidden_size))] if lstm else [h0]
    else:
        hx = module.permute_hidden(hx, sorted_indices)
        states = [hx[0], hx[1]] if lstm else [hx]
    weights = [getattr(module, n) for n in flat_weight_names(module)]
    _check_packed_args(module, data, states, weights)
    out, h_n, c_n = torch.ops.wfpass.packed_rnn(data, batch_sizes, states, weights, mode, bool(module.bias),
                                                module.num_layers, float(module.dropout), module.training,
                                                module.bidirectional, getattr(module, "proj_size", 0))
    output = PackedSequence(out, batch_sizes, sorted_indices, unsorted_indices)
    hidden = (h_n, c_n) if lstm else h_n
    return output, module.permute_hidden(hidden, unsorted_indices)


def install_forward(module: torch.nn.Module) -> None:
    """Give a captured RNN ``rnn_forward`` (an instance attribute, a
    ``functools.partial`` of a module-level function: deepcopy and pickle
    keep working; ``wfpass.restore`` removes it). A subclass with a
    ``forward`` of its own gets it too, for the report only: its calls run
    its own ``forward``, and those that run eagerly inside a compiled call are
    counted."""
    if not isinstance(module, torch.nn.RNNBase) or "forward" in module.__dict__ or overrides_forward(module):
        # A class's own forward keeps its own signature (``lengths=``,
        # ``enforce_sorted=``): an instance attribute would shadow it, in
        # compiled and eager calls alike.
        return
    module.__dict__["forward"] = functools.partial(rnn_forward, module)


def uninstall_forward(module: torch.nn.Module) -> bool:
    f = module.__dict__.get("forward")
    if isinstance(f, functools.partial) and f.func is rnn_forward:
        del module.__dict__["forward"]
        return True
    return False


def install() -> None:
    """Have Dynamo trace the two functions above for wformat backends
    (called by the ``fuse_rnn`` format's ``install``)."""
    _hooks.install_packed_functions(pack_padded_sequence, pad_packed_sequence)
