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
C++ kernel that steps a shrinking batch, ``cpu/varlen_layer.py``; one
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

The packing and padding ops, and the two functions Dynamo traces instead of
torch's, are ``pad_ops.py``; this module is the RNN over the packed batch.
"""
from __future__ import annotations

import functools
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import PackedSequence

from ..._torch import dynamo_hooks as _hooks
from ..cpu.varlen_checks import known_different
from .meta import batch_of
# Importing pad_ops defines wfpass::pack_padded / pad_packed; the functions
# Dynamo traces instead of torch's are installed from here (``install``).
from .pad_ops import pack_padded_sequence, pad_packed_sequence
from ..spec import flat_weight_names, overrides_forward, rnn_mode
from ...native import schemas as _schemas

__all__ = ["PACKED_RNN", "PackedRnnForward", "packed_path", "install", "pack_padded_sequence", "pad_packed_sequence", "rnn_forward", "install_forward", "uninstall_forward",
           "packed_rnn_kernel"]

_LIB = torch.library.Library("wfpass", "FRAGMENT")

# -- the zero initial state of an RNN over a packed batch ------------------------------------------

# Eager makes it from ``int(batch_sizes[0])``. Here it is one op whose fake
# takes B from ``meta.py`` (the padded input's size where the graph packed
# the batch). Why an op, and one per RNN call: for a PackedSequence made
# outside the graph, B is a size learnt at run time (an unbacked symbol); made
# here, it is bound to one forward node that every layer then reads through
# ``h0.shape[1]``. Left to each layer op's fake, each would make a symbol of
# its own, which no output returns (Dynamo's PendingUnbackedSymbolNotFound),
# and the partitioner would find the symbol only in a gradient's shape.
_schemas.define(_LIB, "packed_zero_state")


def _packed_zero_state(batch_sizes, rows, hidden, dtype, device):
    return torch.zeros((rows, int(batch_sizes[0]) if batch_sizes.numel() else 0, hidden), dtype=dtype, device=device)


def _packed_zero_state_fake(batch_sizes, rows, hidden, dtype, device):
    return torch.empty((rows, batch_of(batch_sizes), hidden), dtype=dtype, device=device)


_LIB.impl("packed_zero_state", _packed_zero_state, "CompositeExplicitAutograd")
torch.library.register_fake("wfpass::packed_zero_state", _packed_zero_state_fake, lib=_LIB)

# -- the whole RNN over a packed batch -----------------------------------------------------------

_schemas.define(_LIB, "packed_rnn")


def packed_rnn_kernel(data, batch_sizes, hx, weights, mode, has_biases, num_layers, dropout, train, bidirectional,
                      proj_size):
    """``_VF.lstm(data, batch_sizes, hx, weights, ...)`` and the like, as one
    ``wfpass::packed_layer`` per layer and direction, or one
    ``wfpass::packed_bilayer`` per layer of a bidirectional RNN (eager's
    layer and direction structure, dropout between layers in training).
    Returns ``(out, h_n, c_n)``, ``c_n`` empty for GRUs and plain RNNs."""
    from ..cpu import varlen_layer, varlen_lstm_runs  # (importing them registers the layer ops)

    # ``dynamic=True`` (or a recompile after the module's dropout changed)
    # hands Dynamo's trace a symbolic float; float() specializes it, so the
    # graph is guarded on the value, as Dynamo guards eager's ``_VF.lstm``.
    dropout = float(dropout)
    dirs = 2 if bidirectional else 1
    per = (4 if has_biases else 2) + (1 if proj_size > 0 else 0)
    lstm = mode == "LSTM"
    h0 = hx[0] if len(hx) > 0 else None
    c0 = hx[1] if lstm and len(hx) > 1 else None
    _check_layer_inputs(weights, h0, c0, num_layers * dirs, per)
    hx, weights = _autocast_inputs(data, hx, weights)
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (data, *hx, *weights))
    op, pair, pair_op = _layer_ops(varlen_lstm_runs, mode, proj_size, data, need_grad, bidirectional)
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
                w = varlen_layer.layer_weights(weights[k * per:(k + 1) * per], has_biases, proj_size > 0)
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


def _check_layer_inputs(weights, h0, c0, layers: int, per: int) -> None:
    """``weights`` holds ``per`` tensors for each of ``layers`` layers and
    directions, and ``h0`` / ``c0`` (where given) one state each."""
    # Each layer and direction takes its slice of these: a short list would
    # hand the last ones empty slices (eager's ATen checks the same).
    if len(weights) != layers * per:
        raise RuntimeError(f"wfpass::packed_rnn: got an incorrect number of RNN parameters: {len(weights)}, "
                           f"expected {layers * per}")
    for s, name in ((h0, "h0"), (c0, "c0")):
        if s is not None and (s.dim() != 3 or known_different(s.shape[0], layers)):
            raise RuntimeError(f"wfpass::packed_rnn: {name} must have {layers} layers and directions, "
                               f"got shape {tuple(s.shape)}")


def _layer_ops(varlen_lstm_runs, mode: str, proj_size: int, data, need_grad: bool, bidirectional: bool):
    """``(op, pair, pair_op)``: the op one layer and direction runs (with
    autograd where ``need_grad``; oneDNN's LSTM layer run by run where
    ``varlen_lstm_runs`` takes it), whether both directions of a layer run
    in one call instead, and that call's op."""
    op = torch.ops.wfpass.packed_layer.default if need_grad else torch.ops.wfpass.packed_layer_fw.default
    if varlen_lstm_runs.usable(mode, proj_size, data, need_grad):  # oneDNN's LSTM layer, run by run
        op = functools.partial(_runs_call, torch.ops.wfpass.packed_lstm_runs_fw.default)
    # Both directions of a layer in one call (``packed_bilayer``: one output,
    # the directions at once on two threads).
    pair = bidirectional and not isinstance(op, functools.partial)
    pair_op = torch.ops.wfpass.packed_bilayer.default if need_grad else torch.ops.wfpass.packed_bilayer_fw.default
    return op, pair, pair_op


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
    from ..cpu.varlen_lstm_runs import usable

    return "packed_onednn" if usable(spec.mode, spec.proj_size, x, need_grad) else "packed"


class PackedRnnForward:
    """The graph's call of one RNN over a packed batch after ``fuse_rnn``:
    ``(data, batch_sizes, hx, *weights) -> (out, h_n, c_n)``, the weights
    passed one by one (views of the flat block; the CPU kernel reads each
    where it is, so a lost layout changes no result)."""

    def __init__(self, spec, path: str, train: bool, need_grad: Optional[bool] = None):
        # need_grad: None decides per call from grad mode (a compiled graph);
        # False takes the op without a gradient formula, which keeps no
        # workspace (an eval-mode exported program, traced with grad on).
        self.spec, self.path, self.train, self.need_grad = spec, path, train, need_grad
        self.__name__ = self.__qualname__ = f"rnn_packed_{path}"

    __module__ = __name__

    def __call__(self, data, batch_sizes, hx, *weights):
        spec = self.spec
        if self.path == "cudnn":  # cuDNN's own packed mode, from the flat buffer
            from ..cuda.cudnn_varlen import cudnn_packed_call

            need_grad = self.need_grad is not False and torch.is_grad_enabled() and any(
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
