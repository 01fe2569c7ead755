"""ATen kernels and switches (torch 2.11.0-2.15.0): the fused RNN entry points,
oneDNN's on/off switch and dtype support, cuDNN's flat RNN weight layout,
the functional linear and conv kernels, BatchNorm's base class and FX's op
types. Imports nothing from wfpass."""
from __future__ import annotations

import contextlib

from typing import Optional

import torch

#: ``torch._C._nn.linear`` is what ``F.linear`` calls and what Dynamo
#: records for ``nn.Linear`` (private; torch 2.13.0).
linear = torch._C._nn.linear

#: The base class of ``nn.BatchNorm1d/2d/3d`` (private name; torch 2.13.0).
BatchNorm = torch.nn.modules.batchnorm._BatchNorm

#: FX call targets: ATen op overloads and higher-order operators
#: (``torch._ops``, private module; torch 2.13.0).
OpOverload = torch._ops.OpOverload
HigherOrderOperator = torch._ops.HigherOrderOperator


def conv_forward(conv: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor, bias):
    """``nn.ConvNd._conv_forward`` (private; torch 2.13.0): the module's
    convolution with its padding mode, on a given weight and bias."""
    return conv._conv_forward(x, weight, bias)


class mkldnn_disabled:
    """Run a CPU RNN call on ATen's native kernel instead of oneDNN's
    (``torch._C._get_mkldnn_enabled`` / ``_set_mkldnn_enabled``, private;
    torch 2.13.0; ``torch.backends.mkldnn.flags`` also resets TF32 settings
    and warns). The flag is process-global: another thread's CPU RNN call
    during the window also takes the native kernel, which only costs speed."""

    def __enter__(self):
        self._prev = torch._C._get_mkldnn_enabled()
        if self._prev:
            torch._C._set_mkldnn_enabled(False)
        return self

    def __exit__(self, *exc):
        if self._prev:
            torch._C._set_mkldnn_enabled(True)
        return False


_RNN_KERNELS: dict = {}


def rnn_kernel(mode: str):
    """The fused multi-layer RNN entry point for ``mode`` (``torch._VF.lstm``
    etc., private module; torch 2.13.0). On CPU it dispatches to oneDNN
    (LSTM) or ATen's native loop; on CUDA to cuDNN."""
    fn = _RNN_KERNELS.get(mode)
    if fn is None:
        from torch import _VF

        fn = _RNN_KERNELS[mode] = {"LSTM": _VF.lstm, "GRU": _VF.gru, "RNN_TANH": _VF.rnn_tanh, "RNN_RELU": _VF.rnn_relu}[mode]
    return fn


#: Read / set ATen's oneDNN switch without a context-manager object, for the
#: per-call hot path (same private functions as ``mkldnn_disabled``).
get_mkldnn_enabled = torch._C._get_mkldnn_enabled
set_mkldnn_enabled = torch._C._set_mkldnn_enabled


#: cuDNN's RNN mode numbers, as ``aten._cudnn_rnn`` takes them.
CUDNN_MODES = {"RNN_RELU": 0, "RNN_TANH": 1, "LSTM": 2, "GRU": 3}

#: cuDNN's multi-layer RNN and its backward, the ops eager ``nn.LSTM`` /
#: ``GRU`` / ``RNN`` reach on CUDA (``aten._cudnn_rnn`` /
#: ``aten._cudnn_rnn_backward``, private ATen ops; schemas checked on torch
#: 2.11.0 and 2.15.0). ``_cudnn_rnn`` has a meta kernel (reserve size 0);
#: ``_cudnn_rnn_backward`` has none.
cudnn_rnn = torch.ops.aten._cudnn_rnn.default
cudnn_rnn_backward = torch.ops.aten._cudnn_rnn_backward.default


def cudnn_dropout_state(device: torch.device, seed: int, p: float) -> torch.Tensor:
    """cuDNN's dropout RNG state for ``device``, seeded with ``seed``
    (``torch._cudnn_init_dropout_state``, private; torch 2.11.0-2.15.0):
    what eager PyTorch keeps one of per device for RNN dropout, and cuDNN
    advances in place on every call that drops. ``p`` must be above 0 (an
    internal assert, seen on an H200 with torch 2.11.0); the state does not
    depend on it, and a call with another ``p`` restores it, as eager's
    cached state is."""
    return torch._cudnn_init_dropout_state(p, True, seed, dtype=torch.uint8, device=device)


def cudnn_flatten(weights, weights_per_layer: int, input_size: int, mode: int, hidden_size: int, proj_size: int,
                  num_layers: int, bidirectional: bool) -> torch.Tensor:
    """cuDNN's flat buffer for ``weights``, which it ``set_``s to views of it
    (``torch._cudnn_rnn_flatten_weight``, private; torch 2.11.0-2.15.0):
    pass copies."""
    return torch._cudnn_rnn_flatten_weight(weights, weights_per_layer, input_size, mode, hidden_size, proj_size,
                                           num_layers, False, bidirectional)


def cudnn_flat_layout(weights, weights_per_layer: int, input_size: int, mode: str, hidden_size: int,
                      proj_size: int, num_layers: int, batch_first: bool, bidirectional: bool):
    """Element offsets of each weight inside cuDNN's flat weight buffer and
    the buffer's size, or None where cuDNN cannot take these weights.

    ``torch._cudnn_rnn_flatten_weight`` (private; torch 2.13.0) builds the
    buffer in the layout of the installed cuDNN and ``set_``s its inputs to
    views of it; it runs on clones so the model is not touched, and
    ``storage.fuse`` then moves the real parameters to the same offsets."""
    if not weights or not weights[0].is_cuda or not torch.cuda.is_available():
        # No GPU to ask (a model traced on fake CUDA tensors): the caller
        # lays the weights out one after another, in the order of the list,
        # the layout cuDNN gives these RNNs (checked on the GPU by
        # tests/rnn/test_cudnn.py::test_the_layout_without_a_gpu_is_cudnns).
        return None
    if not torch.backends.cudnn.is_acceptable(weights[0]):
        return None
    if not torch._use_cudnn_rnn_flatten_weight():
        return None
    with torch.no_grad():
        clones = [w.detach().clone() for w in weights]
        buf = torch._cudnn_rnn_flatten_weight(
            clones, weights_per_layer, input_size, CUDNN_MODES[mode], hidden_size, proj_size,
            num_layers, batch_first, bidirectional,
        )
    ptr = buf.untyped_storage().data_ptr()
    if any(c.untyped_storage().data_ptr() != ptr for c in clones):
        return None
    base = buf.storage_offset()
    return [c.storage_offset() - base for c in clones], buf.numel()


_PROBED: dict = {}


def _runs(key: tuple, fn) -> bool:
    """Does ``fn()`` run on this machine? Tried once per process on tiny real
    tensors (outside any fake mode) and remembered. A capability flag says
    what the CPU's instructions allow; oneDNN may still have no primitive
    for the op and dtype (an f16 LSTM on a Xeon with avx512_fp16:
    "could not create a primitive descriptor", seen on torch 2.11.0 and
    2.13.0), and eager PyTorch would not have sent it there."""
    got = _PROBED.get(key)
    if got is None:
        from .aot import outside_fake_mode

        try:
            with outside_fake_mode():
                fn()
            got = True
        except Exception:  # noqa: BLE001 - any failure: this kernel is not for this dtype here
            got = False
        _PROBED[key] = got
    return got


def _probe_lstm(dtype: torch.dtype) -> None:
    """oneDNN's LSTM layer forward (inference and training) and backward at
    T=2, batch 1, 4 features: the calls ``wfpass::lstm_layer`` makes."""
    H = 4
    x = torch.randn(2, 1, 4).to(dtype)
    w_ih, w_hh = torch.randn(4 * H, 4).to(dtype), torch.randn(4 * H, H).to(dtype)
    b = torch.zeros(4 * H, dtype=dtype)
    h = torch.zeros(1, 1, H, dtype=dtype)
    layer = torch.ops.aten.mkldnn_rnn_layer.default
    with torch.no_grad():
        layer(x, w_ih, w_hh, b, b, h, h, False, [], 2, H, 1, True, False, False, False)
    with torch.enable_grad():
        y, hy, cy, ws = layer(x, w_ih, w_hh, b, b, h, h, False, [], 2, H, 1, True, False, False, True)
        torch.ops.aten.mkldnn_rnn_layer_backward.default(
            x, w_ih, w_hh, b, b, h, h, y, hy, cy, torch.ones_like(y), torch.zeros_like(hy), torch.zeros_like(cy),
            False, 2, H, 1, True, False, False, [], False, ws)


def onednn_cpu_flag(dtype: torch.dtype) -> bool:
    """What the CPU's instructions allow for oneDNN in ``dtype``:
    ``torch.ops.mkldnn._is_mkldnn_bf16_supported`` / ``_fp16_`` (private;
    torch 2.11.0-2.15.0)."""
    if dtype == torch.float32:
        return True
    try:
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if dtype == torch.float16:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False
    return False


def mkldnn_rnn_dtype(dtype: torch.dtype) -> bool:
    """Can a CPU LSTM of this dtype run on oneDNN's LSTM kernel here? Only
    when oneDNN is built in and switched on, the CPU has the instructions
    for the dtype, and a tiny forward and backward of
    ``aten.mkldnn_rnn_layer`` in that dtype ran (probed once, cached):
    where it did not, the LSTM takes ATen's native path."""
    if not torch.backends.mkldnn.is_available() or not torch._C._get_mkldnn_enabled():
        return False
    if not onednn_cpu_flag(dtype):
        return False
    return _runs(("lstm", dtype), lambda: _probe_lstm(dtype))


def probed() -> dict:
    """What the probes found in this process: ``{("lstm", torch.float16): False, ...}``."""
    return dict(_PROBED)


# -- packed linear weights: oneDNN's and MKL's own layouts --------------------
# The ops Inductor's freezing uses (torch/_inductor/fx_passes/mkldnn_fusion.py,
# mkldnn_lowerings.py): private ``torch.ops.mkldnn`` / ``torch.ops.mkl``
# entries, checked on torch 2.13.0 (CPU build). wfpass calls them at run
# time, inside ``wfpass::packed_linear``, never as graph nodes: Inductor
# lowers them only for frozen constants.


def onednn_packs(dtype: torch.dtype) -> bool:
    """Can oneDNN pack and multiply a linear weight of ``dtype`` on this CPU?
    float32 wherever oneDNN is built in; bf16 / fp16 only with the
    instructions (``_is_mkldnn_bf16_supported`` / ``_fp16_``: fp16 needs
    avx512_fp16 or avx_ne_convert), and only where a tiny pack and multiply
    ran (probed once, cached)."""
    if not torch.backends.mkldnn.is_available() or not torch._C._get_mkldnn_enabled() or not onednn_cpu_flag(dtype):
        return False

    def probe():
        w = torch.randn(8, 16).to(dtype)
        onednn_linear(torch.randn(2, 16).to(dtype), onednn_pack(w), None)

    return _runs(("linear", dtype), probe)


def mkl_packs(dtype: torch.dtype) -> bool:
    """Can MKL's packed SGEMM take a weight of ``dtype``? float32 only, and
    only in builds with MKL (``torch.backends.mkl``)."""
    return dtype == torch.float32 and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def onednn_pack(w: torch.Tensor) -> torch.Tensor:
    """``w`` ([out, in], strided) reordered into oneDNN's blocked layout: an
    opaque ``torch._mkldnn`` tensor. ``batch_size=None``: one layout for
    every row count (measured as fast as the per-M layout at M = 1..256)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, None)


def onednn_nbytes(packed: torch.Tensor) -> int:
    """Bytes a oneDNN packed tensor holds (``torch.ops.mkldnn._nbytes``)."""
    return int(torch.ops.mkldnn._nbytes(packed))


def mkl_pack(w: torch.Tensor, rows: int) -> torch.Tensor:
    """``w`` packed for MKL's SGEMM at exactly ``rows`` rows (MKL's packed
    format is made for one M; ``mkl_linear`` takes the plain weight for any
    other)."""
    return torch.ops.mkl._mkl_reorder_linear_weight(w, rows)


def mkl_linear(x: torch.Tensor, packed: torch.Tensor, w: torch.Tensor, bias, rows: int) -> torch.Tensor:
    return torch.ops.mkl._mkl_linear(x, packed, w, bias, rows)


# -- packed sequences (torch._VF, private; torch 2.11.0-2.15.0) ---------------------------------

def pack_padded(input: torch.Tensor, lengths: torch.Tensor, batch_first: bool):
    """``(data, batch_sizes)``: the kernel ``pack_padded_sequence`` runs."""
    return torch._VF._pack_padded_sequence(input, lengths, batch_first)


def pad_packed(data: torch.Tensor, batch_sizes: torch.Tensor, batch_first: bool, padding_value: float,
               total_length: int):
    """``(padded, lengths)``: the kernel ``pad_packed_sequence`` runs."""
    return torch._VF._pad_packed_sequence(data, batch_sizes, batch_first, padding_value, total_length)


def onednn_linear_available() -> bool:
    """oneDNN is built in and switched on (``torch.backends.mkldnn.enabled``,
    read through ``torch._C._get_mkldnn_enabled``, private) and its linear op
    ``mkldnn::_linear_pointwise`` (private: the op Inductor's CPU linears
    call) is registered; torch 2.11.0-2.15.0."""
    return (torch.backends.mkldnn.is_available() and torch._C._get_mkldnn_enabled()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """``x @ w.T (+ b)`` by ``mkldnn::_linear_pointwise``: ``w`` plain or in
    oneDNN's layout (``onednn_pack``); ``x`` and ``b`` dense and contiguous
    (the op reads the bias as contiguous whatever its stride)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def below_autograd():
    """A context in which ATen calls skip their autograd kernels
    (``torch._C._AutoDispatchBelowADInplaceOrView``, private; torch
    2.11.0-2.15.0): for an op whose gradient is its own formula, so ATen
    records no graph nobody differentiates."""
    return torch._C._AutoDispatchBelowADInplaceOrView()


def cxx11_abi() -> bool:
    """The C++ ABI torch was built with, for wfpass's C++ kernels' build
    (``torch._C._GLIBCXX_USE_CXX11_ABI``, private; torch 2.11.0-2.15.0)."""
    return bool(torch._C._GLIBCXX_USE_CXX11_ABI)


def has_kernel_for_key(op: str, key: str) -> bool:
    """Is ``op`` ("wfpass::name") registered for dispatch key ``key``?
    (``torch._C._dispatch_has_kernel_for_dispatch_key``, private; torch
    2.11.0-2.15.0)."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op, key))


@contextlib.contextmanager
def packing_functions(pack, pad):
    """``torch._VF._pack_padded_sequence`` / ``_pad_packed_sequence``, which
    ``torch.nn.utils.rnn.pack_padded_sequence`` / ``pad_packed_sequence``
    call (torch/nn/utils/rnn.py, checked on torch 2.11-2.15), replaced by
    ``pack`` / ``pad`` inside the block and restored after."""
    from torch import _VF

    names = ("_pack_padded_sequence", "_pad_packed_sequence")
    saved = {k: _VF.__dict__.get(k) for k in names}
    _VF._pack_padded_sequence, _VF._pad_packed_sequence = pack, pad
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                _VF.__dict__.pop(k, None)
            else:
                setattr(_VF, k, v)


def packing_functions_replaced() -> bool:
    """Are they replaced now (inside ``packing_functions``)?"""
    from torch import _VF

    return "_pack_padded_sequence" in _VF.__dict__
