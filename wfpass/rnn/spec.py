"""The static facts of one RNN, fixed when the format rewrites its call,
and the names every part of the format shares."""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple, Union

import torch
import torch.nn as nn

from ..config import RnnOptions

__all__ = ["GATES", "CLASS_NAMES", "RnnSpec", "rnn_mode", "overrides_forward", "flat_weight_names", "display_name", "module_path", "zero_state"]

#: Gates per mode: rows of ``weight_ih`` = GATES[mode] * hidden_size.
GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}
#: The ``nn`` class of each mode, for messages.
CLASS_NAMES = {"LSTM": "LSTM", "GRU": "GRU", "RNN_TANH": "RNN", "RNN_RELU": "RNN"}
_MODULES = {nn.LSTM: "LSTM", nn.GRU: "GRU"}


@dataclasses.dataclass(frozen=True)
class RnnSpec:
    """Static facts of one RNN, fixed when the pass rewrites it."""

    name: str  # for messages: "'enc.lstm' (nn.LSTM)"
    mode: str  # LSTM | GRU | RNN_TANH | RNN_RELU
    input_size: int
    hidden_size: int
    proj_size: int
    num_layers: int
    bidirectional: bool
    batch_first: bool
    has_biases: bool
    dropout: float
    threshold: Union[int, str]
    offsets: Tuple[int, ...]  # element offset of each weight in the block
    numel: int  # elements in the block
    options: RnnOptions = RnnOptions()  # Config.rnn of the compile that made this spec

    @property
    def directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def out_hidden(self) -> int:
        return self.proj_size if self.proj_size > 0 else self.hidden_size

    @property
    def weights_per_layer(self) -> int:
        return (4 if self.has_biases else 2) + (1 if self.proj_size > 0 else 0)

    def summary(self) -> str:
        """What the report says about this RNN: "2 layer(s), bidirectional"."""
        bits = [f"{self.num_layers} layer(s)"]
        if self.bidirectional:
            bits.append("bidirectional")
        if self.proj_size:
            bits.append(f"proj_size={self.proj_size}")
        if not self.has_biases:
            bits.append("bias=False")
        if self.dropout:
            bits.append(f"dropout={self.dropout}")
        return ", ".join(bits)


def rnn_mode(mod: nn.Module) -> Optional[str]:
    """The mode of an ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``, or of a
    subclass that keeps the methods their ``forward`` runs (``forward``,
    ``permute_hidden``, ``check_forward_args``: a class that only adds
    attributes or helpers); else None."""
    if type(mod) in _MODULES:
        return _MODULES[type(mod)]
    if type(mod) is nn.RNN:
        return mod.mode  # RNN_TANH | RNN_RELU
    for base in (nn.LSTM, nn.GRU, nn.RNN):
        if isinstance(mod, base) and not overrides_forward(mod) and all(
                getattr(type(mod), m) is getattr(base, m) for m in ("permute_hidden", "check_forward_args")):
            return mod.mode if base is nn.RNN else _MODULES[base]
    return None


#: The ``forward`` functions of the RNN classes wfpass knows.
_BASE_FORWARDS = frozenset({nn.LSTM.forward, nn.GRU.forward, nn.RNN.forward, nn.RNNBase.forward})


def overrides_forward(mod: nn.Module) -> bool:
    """True where ``mod``'s class (an ``nn.RNNBase`` subclass) defines a
    ``forward`` of its own (pytorch-forecasting's ``LSTM(x, hx, lengths,
    enforce_sorted)``): wfpass then installs nothing on the module; Dynamo
    traces that ``forward`` and the format matches the ``torch.lstm`` call
    it reaches."""
    return isinstance(mod, nn.RNNBase) and type(mod).forward not in _BASE_FORWARDS


def flat_weight_names(mod: nn.RNNBase) -> List[str]:
    """The weights of an ``nn.LSTM/GRU/RNN`` in the order of PyTorch's flat
    buffer: per layer and direction ``weight_ih``, ``weight_hh``, then
    ``bias_ih``, ``bias_hh`` (``bias=True``) and ``weight_hr``
    (``proj_size > 0``), suffixed ``_l{layer}`` and ``_reverse`` (the
    attribute names ``nn.LSTM`` documents)."""
    names = []
    for layer in range(mod.num_layers):
        for suffix in ("", "_reverse")[: 2 if mod.bidirectional else 1]:
            parts = ["weight_ih", "weight_hh"] + (["bias_ih", "bias_hh"] if mod.bias else [])
            parts += ["weight_hr"] if getattr(mod, "proj_size", 0) > 0 else []
            names += [f"{p}_l{layer}{suffix}" for p in parts]
    return names


def display_name(path: str, mode: str) -> str:
    """How messages name an RNN: ``'enc.lstm' (nn.LSTM)``."""
    return f"'{path}' (nn.{CLASS_NAMES[mode]})" if path else f"nn.{CLASS_NAMES[mode]}"


def module_path(weight_name: str) -> str:
    """``enc.lstm.weight_ih_l0`` -> ``enc.lstm``."""
    return weight_name.rpartition(".")[0]


def zero_state(spec: RnnSpec, x: torch.Tensor) -> List[torch.Tensor]:
    """The zero initial state ``nn.LSTM/GRU/RNN.forward`` builds when no
    ``hx`` is given. Built inside the op rather than in the graph: Inductor
    would launch a kernel for each zeros tensor (about 20 us of host time
    apiece on CUDA, measured on an H100), ``torch.zeros`` here is one fill."""
    batch = x.shape[0 if spec.batch_first else 1]
    ld = spec.num_layers * spec.directions
    h0 = x.new_zeros((ld, batch, spec.out_hidden))
    return [h0, x.new_zeros((ld, batch, spec.hidden_size))] if spec.mode == "LSTM" else [h0]
