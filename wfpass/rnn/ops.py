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
from ..native import schemas as _schemas

__all__ = ["define_rnn_op"]


def define_rnn_op(name: str, *, forward: Callable,
                  forward_fake: Callable, backward: Callable, backward_fake: Callable, setup: Callable,
                  grad: Callable, tags: Sequence[torch.Tag] = (), python_bodies: bool = False) -> torch.library.Library:
    """Define ``wfpass::NAME``, its ``_fw`` twin and ``wfpass::NAME_backward``,
    with their schemas from ``native/schemas.py``;
    register the kernels (CompositeExplicitAutograd: a C++ kernel registered
    for the CPU or CUDA key later comes first), the fakes, the autograd formula
    (``setup``, ``grad``) and the twin. ``python_bodies``: also define
    ``wfpass::_NAME_python`` and ``wfpass::_NAME_backward_python`` (the same
    schemas, the Python kernels only), which a C++ kernel calls for the cases
    it leaves to Python (``native/rnn/cudnn.cpp``). Returns the library,
    which the caller keeps alive (its registrations go with it)."""
    lib = torch.library.Library("wfpass", "FRAGMENT")
    twins = _schemas.twins(name, python_bodies)
    _schemas.define(lib, name, tags)
    lib.define(f"{name}_fw" + twins[f"{name}_fw"], tags=tuple(tags))
    _schemas.define(lib, f"{name}_backward")
    for op, kernel, fake in ((name, forward, forward_fake), (f"{name}_fw", forward, forward_fake),
                             (f"{name}_backward", backward, backward_fake)):
        lib.impl(op, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"wfpass::{op}", fake, lib=lib)
    if python_bodies:
        # Called only from inside a C++ kernel, at run time: never traced, no fake.
        lib.define(f"_{name}_python" + twins[f"_{name}_python"], tags=tuple(tags))
        lib.define(f"_{name}_backward_python" + twins[f"_{name}_backward_python"])
        lib.impl(f"_{name}_python", forward, "CompositeExplicitAutograd")
        lib.impl(f"_{name}_backward_python", backward, "CompositeExplicitAutograd")
    torch.library.register_autograd(f"wfpass::{name}", grad, setup_context=setup, lib=lib)
    ns = torch.ops.wfpass
    _aot.register_twin(getattr(ns, name).default, getattr(ns, f"{name}_fw").default)
    return lib
