"""The RNN format's guards, and the layout of its flat block.

Each guard is a skip record when it fails (the call is left as it was):
not a PackedSequence call; every weight a Parameter/buffer of the model and
not a distributed tensor; one floating dtype and device, the input's too
(under autocast: the dtypes autocast gives the call, ``autocast_cast``); no weight twice; the weights add up to the layers and
directions the call declares. (A weight written in place inside the graph
is fine: the call reads it as a graph value.) Weights that share storage
with other tensors are not moved but still rewritten (``rewrite.new_group``:
the kernels read them where they are), so ties stay tied.
"""
from __future__ import annotations

import itertools

from typing import Optional, Tuple

import torch

from .._torch import kernels as _kernels
from ..config import Config, default_seq_threshold
from ..core.graph import PassContext, meta_value
from ..core.storage import first_unmovable
from .match import RnnCall
from .spec import GATES, RnnSpec

__all__ = ["call_problem", "autocast_cast", "emulates_half"]


def call_problem(s: RnnCall, ctx: PassContext) -> Optional[str]:
    """The RNN format's guards, in order, on one matched call: what the
    matcher found, a distributed weight, the weights' dtype and device, the
    layer layout. None when the call can be rewritten (``s.spec`` is then
    its spec). ``fold_cells`` asks the same of the call a loop would become."""
    if s.problem is None:
        # A DTensor/FSDP2 weight: not even the fallback op may run on it.
        s.problem = first_unmovable((r.name, r.tensor) for r in s.weights)
    if s.problem is None:
        s.problem = _weights_problem(s, ctx.config)
    if s.problem is None:
        s.spec, s.problem = _build_spec(s, ctx.config)
    return s.problem


def _weights_problem(s: RnnCall, config: Config) -> Optional[str]:
    """One floating dtype and device for the weights and the input; under
    autocast the dtypes it gives the call (``autocast_cast``; on cuDNN as
    eager does: ``cudnn.autocast_half``); no weight twice."""
    ws = [r.tensor for r in s.weights]
    if len({(w.dtype, w.device) for w in ws}) != 1:
        return "weights differ in dtype or device"
    if not ws[0].is_floating_point():
        return f"weights are {ws[0].dtype}, not floating point"
    device = ws[0].device.type
    on_cudnn_autocast = device == "cuda" and config.rnn.cuda == "cudnn" and torch.is_autocast_enabled("cuda")
    x_val = meta_value(s.x)
    if on_cudnn_autocast or not torch.is_autocast_enabled(device):
        if isinstance(x_val, torch.Tensor) and (x_val.device != ws[0].device or
                                                (x_val.dtype != ws[0].dtype and not on_cudnn_autocast)):
            return f"input is {x_val.dtype}/{x_val.device}, weights {ws[0].dtype}/{ws[0].device}"
    elif s.module is not None:  # symbolic_trace: RnnModuleCall runs eager's dtype rules per call
        return "autocast is enabled: left to the inner compiler"
    else:
        if not isinstance(x_val, torch.Tensor) or x_val.device != ws[0].device:
            return "under autocast the input's device or dtype is unknown at compile time"
        s.cast = autocast_cast(s.mode, x_val.dtype, ws[0].dtype, device, packed=s.batch_sizes is not None)
        if s.cast is None:
            return (f"under {device} autocast ({_autocast_dtype(device)}) an input of {x_val.dtype} with weights "
                    f"of {ws[0].dtype}: autocast does not cast this call, eager's kernel mixes them")
    if len({id(w) for w in ws}) != len(ws):
        return "the same tensor appears twice among the weights"
    return None


def _autocast_dtype(device: str) -> torch.dtype:
    return torch.get_autocast_dtype(device)


def autocast_cast(mode: str, x_dtype: torch.dtype, w_dtype: torch.dtype, device: str,
                  packed: bool = False) -> Optional[Tuple[torch.dtype, ...]]:
    """Under ``torch.autocast`` on ``device`` (enabled now, while the graph
    compiles: Dynamo guards the autocast state), the dtype the RNN call
    computes in and the dtype it returns, as eager gives them (and, where
    ``emulates_half``, float32 as the dtype it really computes in); None where
    autocast leaves the call mixed (weights that are not float32 and not
    the input's dtype).

    * Weights of float32 are cast per call (an ordinary ``to``, so their
      gradients reach the float32 Parameters; eager's autocast casts them
      per step) to the autocast dtype, the input and states too, and the
      call runs with autocast off inside it.
    * The output: an LSTM's is in the autocast dtype (eager runs it as
      ``mkldnn_rnn_layer``, on autocast's lower-precision list); a GRU's or
      plain RNN's is in the input's dtype (eager's per-step GEMMs are cast,
      the state keeps the input's dtype).
    * A packed batch computes in its data's dtype, as eager's
      ``_VF.lstm(data, batch_sizes, ...)``, which has no autocast rule."""
    low = _autocast_dtype(device)
    if w_dtype not in (torch.float32, x_dtype) or x_dtype not in (torch.float32, low):
        return None
    if packed:
        return x_dtype, x_dtype
    half = low if w_dtype == torch.float32 else w_dtype
    out = half if mode == "LSTM" else x_dtype
    # (autocast dtype, output dtype[, compute dtype]): rounded to ``half``,
    # computed in float32 where this CPU has no instructions for it.
    return (half, out, torch.float32) if emulates_half(device, half) else (half, out)


def emulates_half(device: str, dtype: torch.dtype) -> bool:
    """Does a call autocast runs in ``dtype`` compute in float32 here, from
    its input, states and weights rounded to ``dtype``? On a CPU without the
    instructions for ``dtype`` (no AVX-512 BF16 / AMX / AVX-512 FP16), where
    oneDNN and ATen emulate half-precision GEMMs and a bf16 RNN ran 3-10x
    slower than a float32 one (docs/results/rnn_autocast_1thread.md): the
    float32 kernels then read the same rounded values and accumulate in
    float32, as a half-precision GEMM does, and the output is rounded back.
    The state between steps keeps float32 (closer to float32 training than
    eager autocast, never farther)."""
    return device == "cpu" and dtype in (torch.bfloat16, torch.float16) and not _kernels.onednn_cpu_flag(dtype)


def _build_spec(s: RnnCall, config: Config) -> Tuple[Optional[RnnSpec], Optional[str]]:
    """The call's spec, with the layout of its flat block (each weight's
    offset and the block's size: cuDNN's own layout on CUDA, the weights one
    after another elsewhere), or the reason the weights do not make the RNN the call
    declares."""
    has_biases, num_layers, dropout, train, bidirectional, batch_first = s.consts
    ws = [r.tensor for r in s.weights]
    D = 2 if bidirectional else 1
    if num_layers < 1 or len(ws) % (num_layers * D):
        return None, f"{len(ws)} weights do not split into {num_layers} layer(s) x {D} direction(s)"
    per = len(ws) // (num_layers * D)
    proj = per - (4 if has_biases else 2)
    if proj not in (0, 1) or (proj and s.mode != "LSTM"):
        return None, f"{per} weights per layer do not match mode {s.mode} (bias={has_biases})"
    gates = GATES[s.mode]
    g = ws[0].shape[0]
    if ws[0].dim() != 2 or g % gates:
        return None, "weight_ih_l0 is not [gates * hidden, input]"
    hidden = g // gates
    proj_size = ws[per - 1].shape[0] if proj else 0
    spec = dict(
        name=s.name, mode=s.mode, input_size=ws[0].shape[1], hidden_size=hidden, proj_size=proj_size,
        num_layers=int(num_layers), bidirectional=bool(bidirectional), batch_first=bool(batch_first),
        has_biases=bool(has_biases), dropout=float(dropout),
        threshold=default_seq_threshold(ws[0].device.type) if config.rnn.seq_threshold is None else config.rnn.seq_threshold,
        options=config.rnn,
    )
    offsets, numel = flat_layout(ws, s.mode, spec["input_size"], hidden, proj_size, int(num_layers),
                                 bool(batch_first), bool(bidirectional))
    return RnnSpec(offsets=tuple(offsets), numel=numel, **spec), None


def flat_layout(ws, mode: str, input_size: int, hidden: int, proj_size: int, num_layers: int, batch_first: bool,
                bidirectional: bool):
    """Each weight's element offset in the flat block and the block's size:
    cuDNN's own layout on CUDA (asked of cuDNN where there is a GPU), the
    weights one after another elsewhere (as the CPU kernels read them)."""
    if ws[0].device.type == "cuda":
        D = 2 if bidirectional else 1
        layout = _kernels.cudnn_flat_layout(ws, len(ws) // (num_layers * D), input_size, mode, hidden, proj_size,
                                           num_layers, batch_first, bidirectional)
        if layout is None:
            layout = cudnn_layout_without_gpu([tuple(w.shape) for w in ws], num_layers * D, GATES[mode] * hidden)
        return layout
    ends = list(itertools.accumulate(w.numel() for w in ws))
    return [0] + ends[:-1], ends[-1]


def cudnn_layout_without_gpu(shapes, pseudo_layers: int, gate_rows: int):
    """cuDNN's flat weight layout where no GPU can be asked (a model traced
    on fake CUDA tensors): each weight's element offset and the buffer's
    size.

    cuDNN 9 lays out every pseudo-layer's (layer, then direction) matrices
    first, ``w_ih, w_hh[, w_hr]``, then every pseudo-layer's biases
    ``b_ih, b_hh``; an RNN without biases keeps their space. Recorded on an
    H200 with cuDNN 9.19 for every mode, 1-3 layers, bidirectional,
    projections and no biases, fp32 and fp16, in
    ``tests/data/cudnn_layouts.json``, which the tests check this against."""
    per = len(shapes) // pseudo_layers
    offsets = [0] * len(shapes)
    pos = 0
    for k in range(pseudo_layers):
        chunk = range(k * per, (k + 1) * per)
        # w_ih, w_hh, then w_hr (torch lists it after the biases)
        for i in [i for i in chunk if len(shapes[i]) == 2]:
            offsets[i] = pos
            pos += shapes[i][0] * shapes[i][1]
    for k in range(pseudo_layers):
        biases = [i for i in range(k * per, (k + 1) * per) if len(shapes[i]) == 1]
        if not biases:  # bias=False: the space stays, zeros
            pos += 2 * gate_rows
        for i in biases:
            offsets[i] = pos
            pos += shapes[i][0]
    return offsets, pos
