"""The two ops that pack and pad a variable-length batch in the compiled
graph, ``wfpass::pack_padded`` and ``wfpass::pad_packed`` (with their
backward ops, fakes and autograd formulas), and the functions Dynamo traces
in place of ``torch.nn.utils.rnn.pack_padded_sequence`` /
``pad_packed_sequence`` for a wformat backend, which call them.

Separate from ``sequence.py``, which holds the RNN over the packed batch
(``wfpass::packed_rnn``, its zero state, the modules' ``forward``) and
installs these functions (``sequence.install``): packing and padding are
eager's ATen kernels with eager's checks and values, and know nothing of
the RNN between them. ``sequence.py``'s docstring shows the graph they make.
"""
from __future__ import annotations

import torch
from torch.nn.utils.rnn import PackedSequence, invert_permutation

from ..._torch import dynamo_hooks as _hooks, kernels as _kernels, tensors as _tensors
from ..cpu.varlen_checks import known_different
from .meta import batch_of, note_batch
from ...native import schemas as _schemas

__all__ = ["pack_padded_sequence", "pad_packed_sequence"]

_LIB = torch.library.Library("wfpass", "FRAGMENT")

# -- pack_padded / pad_packed: eager's ATen kernels as ops with fakes ----------------------------

# ``order``: the batch's reordering, folded into the copy (the index_select
# eager runs around packing an unsorted batch): packing reads column
# ``order[b]`` into slot b (``sorted_indices``); padding writes slot
# ``order[j]`` into column j (``unsorted_indices``). On the CPU the C++
# kernels (``native/rnn/varlen_sequence.cpp``) copy each row once; these Python
# kernels, used elsewhere, run eager's index_select and ATen's kernel.
for _name in ("pack_padded", "pack_padded_backward", "pad_packed", "pad_packed_backward"):
    _schemas.define(_LIB, _name)


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
    # What the kernel checks, told to the compiler: no length is over the
    # input's steps, so ``pad_packed_sequence(..., total_length=T)``'s check
    # ``total_length < max(lengths)`` is decided while tracing (torch.export
    # fails on it otherwise: a guard on a data-dependent size).
    _tensors.tell_compiler(steps <= input.shape[1 if batch_first else 0])
    _tensors.tell_compiler(rows <= steps * B)
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
    B = order.shape[0] if order is not None else batch_of(batch_sizes)  # the order's size where there is one
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
