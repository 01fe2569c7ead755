"""RNNs in an exported program: each ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``
traced by ``torch.export`` as wfpass's layer ops, symbolic in the sequence
length T.

Stock ``torch.export`` traces ``torch._VF.lstm``, whose decomposition runs
the steps one by one: T specializes to the example's length ("You marked T
as dynamic but your code specialized it") and the graph grows with T (722
nodes for a 2-layer LSTM at T 16). While ``wfpass.export`` traces the
model, each RNN it serves runs the kernel path a compiled graph would take
for a symbolic T (``rnn/plan.py``: oneDNN's LSTM layer, ATen's GRU/RNN
layer, or wfpass's C++ loop, one op per layer and direction), through the
same ``RnnForward`` the compiled graph calls. Graph (2-layer ``nn.LSTM``)::

    before: out, (h_n, c_n) = self.lstm(x)              # torch._VF.lstm, unrolled over T
    after:  y0, h0, c0, _ = wfpass.lstm_layer_fw(x, w_ih_l0, w_hh_l0, b_ih_l0, b_hh_l0, None, None, False, 64, True, False)
            y1, h1, c1, _ = wfpass.lstm_layer_fw(y0, w_ih_l1, ...)
            h_n, c_n = cat([h0, h1]), cat([c0, c1])

The ops read the module's own Parameters (the program's ``state_dict`` has
the model's keys, nothing is copied); they are registered for the CPU by
the C++ kernels (Python kernels where those are not built), with fakes, so
AOTInductor calls them as extern kernels. Nothing is installed for good:
the module's ``forward`` is swapped for the trace only (:func:`swapped`).

On CUDA, as under ``torch.compile``, an RNN is left to ``torch.export`` by
default (cuDNN is opt-in until measured on a GPU); with ``rnn={"cuda":
"cudnn"}`` it is one ``wfpass::cudnn_rnn_fw`` call for all its layers
(``wfpass::cudnn_packed_rnn_fw`` for a packed batch), T symbolic, over the
weights in cuDNN's layout (``rnn/cuda/cudnn.py``).
"""
from __future__ import annotations

import contextlib
import types
from typing import Iterator, List, Optional

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from .._torch import kernels as _kernels
from ..config import Config, default_seq_threshold
from ..core.records import Report
from ..rnn.paths import RnnForward
from ..rnn.guards import flat_layout
from ..rnn.plan import plan_call
from ..rnn.varlen.sequence import PackedRnnForward
from ..rnn.spec import RnnSpec, flat_weight_names, overrides_forward, rnn_mode

__all__ = ["swapped", "spec_of"]

#: Paths that trace per step (``loop``) or through ``torch._VF`` (``aten``):
#: in a program they specialize T; wfpass's C++ loop op takes their calls.
_SPECIALIZING = ("loop", "aten")


def spec_of(mod: nn.RNNBase, name: str, config: Config) -> RnnSpec:
    """The module's ``RnnSpec``, with its flat block's layout (cuDNN's on
    CUDA, the weights one after another elsewhere: ``rnn.guards.flat_layout``,
    as a compiled graph's)."""
    ws = [getattr(mod, n) for n in flat_weight_names(mod)]
    mode = rnn_mode(mod)
    offsets, numel = flat_layout(ws, mode, mod.input_size, mod.hidden_size, mod.proj_size, mod.num_layers,
                                 mod.batch_first, mod.bidirectional)
    return RnnSpec(name=f"{name!r} ({type(mod).__name__})", mode=mode, input_size=mod.input_size,
                   hidden_size=mod.hidden_size, proj_size=mod.proj_size, num_layers=mod.num_layers,
                   bidirectional=mod.bidirectional, batch_first=mod.batch_first, has_biases=mod.bias,
                   dropout=float(mod.dropout), offsets=tuple(offsets), numel=numel,
                   threshold=default_seq_threshold(ws[0].device.type) if config.rnn.seq_threshold is None
                   else config.rnn.seq_threshold, options=config.rnn)


#: Where a CUDA RNN is left to ``torch.export`` (``rnn.cuda="eager"``, the default).
CUDA_LEFT = ("on cuda: traced as it is (torch's own RNN call, so T may specialize), as torch.compile leaves a CUDA RNN "
             "to PyTorch's cuDNN path by default; rnn={'cuda': 'cudnn'} puts wfpass's cuDNN op in the program "
             "(checked on fake CUDA tensors, not yet measured on a GPU)")


#: What a program's cuDNN op reads (``rnn/cuda/cudnn.py``, ``flat_buffer``).
CUDNN_BUFFER = ("; it reads cuDNN's flat buffer where the weights are views of one in cuDNN's layout (as "
                "torch's RNN modules keep them on a GPU), else flattens a copy of them per call, as eager PyTorch "
                "does for such weights (an AOTInductor package loads each weight apart)")


def _skip_reason(mod: nn.Module, config: Config) -> Optional[str]:
    if overrides_forward(mod):
        return (f"its class {type(mod).__name__} defines its own forward: traced as it is (torch's own RNN call, so T may "
                "specialize)")
    if rnn_mode(mod) is None:
        return f"{type(mod).__name__} overrides the methods nn.RNNBase.forward calls"
    device = getattr(mod, flat_weight_names(mod)[0]).device.type
    if device == "cuda" and config.rnn.cuda != "cudnn":
        return CUDA_LEFT
    if device not in ("cpu", "cuda"):
        return f"on {device}: traced as it is (wfpass's RNN ops run on the CPU and, with rnn={{'cuda': 'cudnn'}}, CUDA)"
    if not config.runs("fuse_rnn"):
        return "the RNN format is not in passes="
    return None


def _forward_for(spec: RnnSpec, path: str, training: bool):
    # A module in training mode: the ops with gradient formulas (and dropout
    # between layers); in eval mode their twins without, which keep no
    # workspace for a backward.
    fwd = RnnForward(spec, path, train=training, need_grad=None if training else False)
    # A packed batch: cuDNN's packed mode where the dense calls take cuDNN,
    # else wfpass's C++ layer loop.
    varlen = PackedRnnForward(spec, "cudnn" if path == "cudnn" else "packed", training,
                              need_grad=None if training else False)
    names = None

    def forward(self, input, hx=None):
        nonlocal names
        names = names or flat_weight_names(self)
        weights = [getattr(self, n) for n in names]  # the Parameters export tracks, not a list holding the real ones
        if isinstance(input, PackedSequence):
            return _packed(self, varlen, input, hx, weights)
        unbatched = input.dim() == 2  # as nn.RNNBase.forward: a batch of one, squeezed again after
        batch_dim = 0 if spec.batch_first else 1
        if unbatched:
            input = input.unsqueeze(batch_dim)
        lstm = spec.mode == "LSTM"
        if hx is None:
            states = [None, None] if lstm else [None]
        else:
            states = list(hx) if lstm else [hx]
            if unbatched:
                states = [h.unsqueeze(1) for h in states]
        outs = fwd(input, states, *weights)
        out, h_n = outs[0], outs[1]
        if unbatched:
            out = out.squeeze(batch_dim)
            h_n = h_n.squeeze(1)
        if lstm:
            c_n = outs[2].squeeze(1) if unbatched else outs[2]
            return out, (h_n, c_n)
        return out, h_n

    return forward


#: id(batch_sizes) -> (batch_sizes, B) for the batches packed during a trace.
_BATCH: dict = {}


def _packed(mod, varlen, seq: PackedSequence, hx, weights):
    """A variable-length batch: wfpass's packed RNN op (the C++ loop that
    steps each layer's shrinking batch), the states in the batch's sorted
    order and back, as ``nn.RNNBase.forward`` does."""
    spec = varlen.spec
    lstm = spec.mode == "LSTM"
    states = [] if hx is None else (list(hx) if lstm else [hx])
    if seq.sorted_indices is not None:
        states = [h.index_select(1, seq.sorted_indices) for h in states]
    batch = _BATCH.get(id(seq.batch_sizes), (None, None))[1]
    if not states and batch is not None:
        # The zero state at the padded input's batch size (a size the
        # program knows): left to the ops, B would be batch_sizes[0], a
        # value, which AOTInductor then bounds by the example's range.
        rows = spec.num_layers * spec.directions
        states = [seq.data.new_zeros(rows, batch, spec.out_hidden)]
        if lstm:
            states.append(seq.data.new_zeros(rows, batch, spec.hidden_size))
    outs = varlen(seq.data, seq.batch_sizes, states, *weights)
    finals = [h if seq.unsorted_indices is None else h.index_select(1, seq.unsorted_indices)
              for h in outs[1:(3 if lstm else 2)]]
    out = PackedSequence(outs[0], seq.batch_sizes, seq.sorted_indices, seq.unsorted_indices)
    return (out, tuple(finals)) if lstm else (out, finals[0])


@contextlib.contextmanager
def _packing_ops() -> Iterator[None]:
    """``pack_padded_sequence`` / ``pad_packed_sequence`` (however the model
    imported them) pack and pad through wfpass's ops for the trace: ATen's
    ``_pack_padded_sequence`` has no fake for lengths that are data, so
    upstream export of a packed batch fails. ``torch._VF``'s two functions
    are what both call (``_torch.kernels.packing_functions``); restored after."""
    from ..rnn.varlen import pad_ops  # noqa: F401  (defines wfpass::pack_padded / pad_packed)

    def pack(input, lengths, batch_first):
        data, batch_sizes = torch.ops.wfpass.pack_padded(input, lengths, batch_first, None)
        _BATCH[id(batch_sizes)] = (batch_sizes, input.shape[0 if batch_first else 1])
        return data, batch_sizes

    def pad(data, batch_sizes, batch_first, padding_value, total_length):
        batch = _BATCH.get(id(batch_sizes), (None, None))[1]
        # With the input's B known, an identity order of B rows: the op's
        # output then has that size (one the program knows) instead of a new
        # one read from batch_sizes when it runs, which AOTInductor bounds by
        # the example's range (a batch of 1 failed its check). It costs one
        # copy of the padded output.
        order = None if batch is None else torch.arange(batch)
        return torch.ops.wfpass.pad_packed(data, batch_sizes, batch_first, float(padding_value), total_length, order)

    try:
        with _kernels.packing_functions(pack, pad):
            yield
    finally:
        _BATCH.clear()


@contextlib.contextmanager
def swapped(model: nn.Module, config: Config, report: Report) -> Iterator[List[nn.Module]]:
    """For the trace only: each RNN of ``model`` wfpass serves runs its
    planned layer ops; every other one is left as it is, with a row saying
    why. Yields the modules swapped; their ``forward`` is restored after,
    whatever the trace did."""
    done: List[nn.Module] = []
    before = {}  # a forward already in a module's __dict__ (wformat's own, a user's): put back after
    try:
        for name, mod in model.named_modules():
            if not isinstance(mod, nn.RNNBase):
                continue
            params = [f"{name}.{n}" if name else n for n in flat_weight_names(mod)]
            why = _skip_reason(mod, config)
            if why is not None:
                report.add("rnn", "skipped", f"{name}: {why}", params)
                continue
            spec = spec_of(mod, name, config)
            w0 = getattr(mod, flat_weight_names(mod)[0])
            probe = w0.new_empty(1, 1, spec.input_size)  # the plan asks the call's device and dtype: the weights'
            plan = plan_call(spec, probe, None, spec.threshold if spec.threshold != "auto" else 0, mod.training)
            path = "cxx" if plan.path in _SPECIALIZING else plan.path
            if "forward" in mod.__dict__:
                before[id(mod)] = mod.__dict__["forward"]
            mod.__dict__["forward"] = types.MethodType(_forward_for(spec, path, mod.training), mod)
            done.append(mod)
            kernel = plan.kernel if path == plan.path else "wfpass's C++ loop (wfpass::packed_layer)"
            ops = "one op per layer and direction" if path != "cudnn" else f"one op for the {spec.num_layers} layer(s)"
            report.add("rnn", "rewritten",
                       f"{spec.mode}, {spec.summary()}; T=symbolic: {kernel}, {ops}, whatever T"
                       f"{'; with gradient formulas (training mode)' if mod.training else ''}"
                       f"{CUDNN_BUFFER if path == 'cudnn' else ''}", params, kernel=kernel, path=path)
        with _packing_ops():
            yield done
    finally:
        for mod in done:
            if id(mod) in before:
                mod.__dict__["forward"] = before[id(mod)]
            else:
                mod.__dict__.pop("forward", None)

