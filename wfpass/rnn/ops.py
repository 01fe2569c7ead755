"""The shape every RNN op of wfpass's has, written once: ``NAME`` (with an
autograd formula), ``NAME_fw`` (the same op without one: what compiled
forward graphs call, ``aot.register_twin``) and ``NAME_backward``, each with
its kernel and its fake. ``cpu/lstm_layer.py`` (oneDNN's LSTM layer),
``cpu/native_layer.py`` (GRU / RNN layers), ``cuda/cudnn.py`` (cuDNN's whole
RNN) and the packed kernels beside them each define theirs through
``define_rnn_op``."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .._torch import aot as _aot

__all__ = ["define_rnn_op"]


def define_rnn_op(name: str, args: str, returns: str, backward_schema: str, *, forward: Callable,
                  forward_fake: Callable, backward: Callable, backward_fake: Callable, setup: Callable,
                  grad: Callable, tags: Sequence[torch.Tag] = (), python_bodies: bool = False) -> torch.library.Library:
    """Define ``wfpass::NAME(args) -> returns``, its ``_fw`` twin and
    ``wfpass::NAME_backward`` + ``backward_schema`` (``"(args) -> (...)"``);
    register the kernels (CompositeExplicitAutograd: a C++ kernel registered
    for the CPU or CUDA key later comes first), the fakes, the autograd formula
    (``setup``, ``grad``) and the twin. ``python_bodies``: also define
    ``wfpass::_NAME_python`` and ``wfpass::_NAME_backward_python`` (the same
    schemas, the Python kernels only), which a C++ kernel calls for the cases
    it leaves to Python (``native/rnn/cudnn.cpp``). Returns the library,
    which the caller keeps alive (its registrations go with it)."""
    lib = torch.library.Library("wfpass", "FRAGMENT")
    lib.define(f"{name}({args}) -> {returns}", tags=tuple(tags))
    lib.define(f"{name}_fw({args}) -> {returns}", tags=tuple(tags))
    lib.define(f"{name}_backward{backward_schema}")
    for op, kernel, fake in ((name, forward, forward_fake), (f"{name}_fw", forward, forward_fake),
                             (f"{name}_backward", backward, backward_fake)):
        lib.impl(op, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"wfpass::{op}", fake, lib=lib)
    if python_bodies:
        # Called only from inside a C++ kernel, at run time: never traced, no fake.
        lib.define(f"_{name}_python({args}) -> {returns}", tags=tuple(tags))
        lib.define(f"_{name}_backward_python{backward_schema}")
        lib.impl(f"_{name}_python", forward, "CompositeExplicitAutograd")
        lib.impl(f"_{name}_backward_python", backward, "CompositeExplicitAutograd")
    torch.library.register_autograd(f"wfpass::{name}", grad, setup_context=setup, lib=lib)
    ns = torch.ops.wfpass
    _aot.register_twin(getattr(ns, name).default, getattr(ns, f"{name}_fw").default)
    return lib
