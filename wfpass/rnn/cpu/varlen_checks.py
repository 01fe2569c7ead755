"""The mode tables and argument checks of ``wfpass::packed_layer`` (and of
``packed_bilayer`` / ``packed_lstm_runs``), which the op's fakes and both
kernels share: ``MODES``, ``gate_count``, ``workspace_width``,
``check_args``, ``hidden_sizes``, and ``check_shapes``, ``check_states``,
``as_rows`` and ``steps``: every size checked before a row is read (the C++
kernels' checks, ``native/rnn/varlen_rnn.cpp``), RuntimeError as eager
raises.

Separate from ``varlen_layer_py.py`` (the Python kernel's forward) and the
bottom of the op's modules: the fakes (``varlen_layer.py``), the Python
kernels (``varlen_layer_py.py``, ``varlen_layer_py_backward.py``), oneDNN's
runs (``varlen_lstm_runs.py``) and the packed RNN's own checks
(``varlen/sequence.py``, ``varlen/pad_ops.py``: ``known_different``) import
these, and this module imports none of them: shapes only, no kernel.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..._torch.tensors import fake_tensor_type

__all__ = ["MODES", "gate_count", "workspace_width", "as_rows", "check_args", "hidden_sizes", "known_different",
           "check_shapes", "check_states", "steps"]

#: The cells this op runs.
MODES = ("LSTM", "GRU", "RNN_TANH", "RNN_RELU")

_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}
_WIDTH = {"LSTM": 6, "GRU": 4, "RNN_TANH": 0, "RNN_RELU": 0}


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


def check_args(mode: str, w_hr, c0) -> None:
    _check_mode(mode)
    if mode != "LSTM" and (w_hr is not None or c0 is not None):
        raise ValueError(f"wfpass::packed_layer: w_hr and c0 are LSTM arguments, got one for mode {mode!r}")


def hidden_sizes(mode: str, w_ih, w_hr) -> Tuple[int, int]:
    """(H, H_out): the hidden size and the size of h (H_out < H with a projection)."""
    H = w_ih.shape[0] // _GATES[mode]
    return H, (w_hr.shape[0] if w_hr is not None else H)


def known_different(a, b) -> bool:
    """``a != b`` as far as the sizes say now: for a fake's symbolic sizes,
    only where no value could make them equal (a fake checks its shapes
    without adding a guard; the kernels check every call's)."""
    return statically_known_true(a != b)


def check_shapes(mode: str, data, w_ih, w_hh, b_ih, b_hh, w_hr, op: str = "wfpass::packed_layer"):
    """The weights against each other and against data ``[N, I]``, before
    any is read (the C++ kernels' ``check_weights``): RuntimeError, as eager
    raises for a packed batch whose feature size is not the RNN's input_size
    (the input GEMM ran over rows of the wrong length). Shapes only: the
    fakes check them too. Returns ``(H, H_out)``."""
    _check_mode(mode)
    if data.dim() != 2:
        raise RuntimeError(f"{op}: data must be 2-D (a PackedSequence's rows), got {data.dim()}-D")
    G = _GATES[mode]
    if w_ih.dim() != 2 or known_different(w_ih.shape[0] % G, 0) or statically_known_true(w_ih.shape[0] == 0):
        raise RuntimeError(f"{op}: w_ih must be 2-D with {G} rows a hidden unit, got {list(w_ih.shape)}")
    H = w_ih.shape[0] // G
    if known_different(data.shape[1], w_ih.shape[1]):
        raise RuntimeError(f"{op}: data: input.size(-1) must be equal to input_size. Expected {w_ih.shape[1]} "
                           f"(w_ih's columns), got {data.shape[1]}")
    Hout = H
    if w_hr is not None:
        if w_hr.dim() != 2 or known_different(w_hr.shape[1], H):
            raise RuntimeError(f"{op}: w_hr must have shape (proj_size, {H}), got {list(w_hr.shape)}")
        Hout = w_hr.shape[0]
    if w_hh.dim() != 2 or known_different(w_hh.shape[0], G * H) or known_different(w_hh.shape[1], Hout):
        raise RuntimeError(f"{op}: w_hh must have shape ({G * H}, {Hout}), got {list(w_hh.shape)}")
    for b, name in ((b_ih, "b_ih"), (b_hh, "b_hh")):
        if b is not None and (b.dim() != 1 or known_different(b.shape[0], G * H)):
            raise RuntimeError(f"{op}: {name} must have shape ({G * H}), got {list(b.shape)}")
    for t, name in ((w_ih, "w_ih"), (w_hh, "w_hh"), (b_ih, "b_ih"), (b_hh, "b_hh"), (w_hr, "w_hr")):
        _check_like(t, data, op, name)
    return H, Hout


def _check_like(t, data, op: str, name: str) -> None:
    if t is not None and (t.dtype != data.dtype or t.device != data.device):
        raise RuntimeError(f"{op}: {name} is {t.dtype} on {t.device}, data {data.dtype} on {data.device}")


def check_states(states, data, L: int, B, op: str = "wfpass::packed_layer") -> None:
    """Each ``(tensor, width, name)`` of ``states`` (a state or its
    gradient, where given) is ``[L, B, width]`` in data's dtype: RuntimeError,
    eager's type for an h0 of the wrong batch or hidden size. B is
    ``batch_sizes[0]``."""
    for s, w, name in states:
        if s is None:
            continue
        if tuple(s.shape) != (L, B, w):
            raise RuntimeError(f"{op}: {name} must have shape {(L, B, w)} (batch_sizes[0] = {B} sequences), "
                               f"got {tuple(s.shape)}")
        _check_like(s, data, op, name)


def as_rows(data, batch_sizes, op: str = "wfpass::packed_layer"):
    """``(rows, batch_sizes, B)``. A full batch, ``data`` ``[T, B, I]`` with
    an empty ``batch_sizes`` (a plain RNN input, every step B rows), as its
    ``T * B`` rows ``[T * B, I]`` and the batch sizes of its T steps (left
    empty for a fake tensor, which is never read); B is that batch, or None
    for packed rows ``[N, I]``, returned as given. The C++ kernels'
    ``as_rows``: a graph that calls the op on a full batch needs no
    batch_sizes tensor of its own."""
    if data.dim() != 3:
        return data, batch_sizes, None
    if batch_sizes.numel() != 0:
        raise RuntimeError(f"{op}: data of 3 dimensions is a full batch [T, B, I] and takes an empty batch_sizes, "
                           f"got {batch_sizes.numel()} batch sizes")
    T, B = data.shape[0], data.shape[1]
    rows = data.reshape(T * B, data.shape[2])
    if isinstance(data, fake_tensor_type()) or data.device.type == "meta":
        return rows, batch_sizes, B
    if T < 1 or B < 1:
        raise RuntimeError(f"{op}: a full batch [T, B, I] needs T >= 1 and B >= 1, got {list(data.shape)}")
    return rows, torch.full((T,), B, dtype=torch.int64), B


def steps(batch_sizes: torch.Tensor, N: int, op: str = "wfpass::packed_layer") -> Tuple[list, list]:
    """``batch_sizes`` read once (one ``.tolist()``), checked, and its row
    offsets. RuntimeError, as eager's packed RNN raises for data rows that do
    not match batch_sizes: every step's rows are read at these offsets."""
    if batch_sizes.dim() != 1 or batch_sizes.dtype != torch.int64 or batch_sizes.device.type != "cpu":
        raise RuntimeError(f"{op}: batch_sizes must be a 1-D int64 CPU tensor (a PackedSequence's)")
    bs = batch_sizes.tolist()
    if not bs or bs[-1] < 1 or any(a < b for a, b in zip(bs, bs[1:])) or sum(bs) != N:
        raise RuntimeError(f"{op}: batch_sizes must be positive, non-increasing and sum to "
                           f"data.shape[0] = {N} (data's rows); got {bs[:8]}{'...' if len(bs) > 8 else ''}")
    off, acc = [], 0
    for n in bs:
        off.append(acc)
        acc += n
    return bs, off
