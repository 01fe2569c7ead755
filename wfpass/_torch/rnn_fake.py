"""The example value Dynamo computes for a whole-sequence RNN call on CUDA.

While Dynamo traces ``nn.LSTM/GRU/RNN.forward`` it runs ``torch.lstm``
(``gru``, ``rnn_tanh``, ``rnn_relu``) on fake tensors, under the Python
dispatcher. There torch's own Python decomposition answers
(``torch/_decomp/decompositions.py``: ``lstm_impl`` and the like, registered
with ``py_impl`` for ``Autograd``, ``CompositeImplicitAutograd`` and
``Meta``). On the CPU it calls oneDNN's layer op, which keeps a symbolic
length symbolic. On CUDA it unrolls the sequence with ``unbind``, which
specializes the length: every new length is a recompile (measured on an
H100, torch 2.11: five graphs for five lengths).

For a frame wformat compiles with RNNs on cuDNN (``rnn={"cuda": "cudnn"}``),
``fuse_rnn`` replaces that call anyway; only its example value is needed.
There it comes from ``aten._cudnn_rnn``, the op eager PyTorch runs on CUDA
(its meta kernel keeps every size symbolic, its autograd formula gives the
outputs their ``grad_fn``). Everywhere else (CUDA autocast, eager code, other backends,
AOTAutograd's own trace, CPU tensors) torch's decomposition runs as before.

Private API: ``OpOverload.py_kernels`` and ``_dispatch_cache``, and
``FakeTensor``; checked on torch 2.11.0, 2.13.0 and 2.15.0 (the three keys
above on the four ``.input`` overloads).
"""
from __future__ import annotations

from typing import Callable, List

import torch

from .dynamo import compiler_fn_of, current_tx
from .kernels import CUDNN_MODES

__all__ = ["install_cuda_rnn_example_values"]

_aten = torch.ops.aten
#: the overload -> cuDNN's mode number (``cudnnRNNMode_t``).
_MODES = {_aten.rnn_relu.input: CUDNN_MODES["RNN_RELU"], _aten.rnn_tanh.input: CUDNN_MODES["RNN_TANH"],
          _aten.lstm.input: CUDNN_MODES["LSTM"], _aten.gru.input: CUDNN_MODES["GRU"]}
_KEYS = (torch._C.DispatchKey.Autograd, torch._C.DispatchKey.CompositeImplicitAutograd, torch._C.DispatchKey.Meta)

#: ``policy(compiler_fn) -> bool``: does this backend put CUDA RNNs on cuDNN?
_POLICY: List = [None]
_INSTALLED: List[bool] = [False]


def _in_dynamo_fake_prop(x) -> bool:
    """``x`` is one of Dynamo's fake CUDA tensors (not AOTAutograd's
    functional wrappers or a real tensor), in a trace for a backend whose
    policy says yes."""
    from torch._subclasses.fake_tensor import FakeTensor

    if type(x) is not FakeTensor or x.device.type != "cuda" or _POLICY[0] is None:
        return False
    if torch.is_autocast_enabled("cuda"):
        # Autocast's own kernel for ``_cudnn_rnn`` flattens the weights on
        # the device; torch's decomposition gives the fp16 example value.
        return False
    tx = current_tx()
    if tx is None:
        return False
    try:
        return bool(_POLICY[0](compiler_fn_of(tx)))
    except Exception:  # never break a trace over this
        return False


def _cudnn_example(op, input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """What the C++ ``_cudnn_impl`` (``aten/src/ATen/native/cudnn/RNN.cpp``)
    calls, from the weights where they are."""
    lstm = op is _aten.lstm.input
    h, c = (hx[0], hx[1]) if lstm else (hx, None)
    hidden = c.size(2) if lstm else h.size(2)
    proj = h.size(2) if lstm and h.size(2) != c.size(2) else 0
    stride0 = (4 if has_biases else 2) + (1 if proj else 0)
    out, hy, cy, _reserve, _buf = _aten._cudnn_rnn.default(
        input, list(params), stride0, None, h, c, _MODES[op], hidden, proj, num_layers, batch_first, dropout, train,
        bidirectional, [], None)
    return (out, hy, cy) if lstm else (out, hy)


def _wrap(op, original: Callable) -> Callable:
    def kernel(*args, **kwargs):
        if not kwargs and len(args) == 9 and _in_dynamo_fake_prop(args[0]):
            return _cudnn_example(op, *args)
        return original(*args, **kwargs)

    kernel.__name__ = f"wfpass_cuda_{op.name().split('::')[-1].replace('.', '_')}"
    return kernel


def install_cuda_rnn_example_values(policy: Callable) -> None:
    """Take the example values of CUDA RNN calls from ``aten._cudnn_rnn``
    in traces for backends where ``policy(compiler_fn)`` is true."""
    _POLICY[0] = policy
    if _INSTALLED[0]:
        return
    for op in _MODES:
        for key in _KEYS:
            original = op.py_kernels.get(key)
            if original is not None:
                op.py_kernels[key] = _wrap(op, original)
        op._dispatch_cache.clear()
    _INSTALLED[0] = True
