"""The batch size of a PackedSequence while the compiler traces it.

A packed batch's ``batch_sizes`` is a CPU tensor whose values are known only
when the model runs; its first entry is the number of sequences B. The fake
implementations of the packed ops need B for the shapes of ``h_n`` / ``c_n``
and of the padded output. The op that makes ``batch_sizes`` in the graph
(``wfpass::pack_padded``) knows B from its padded input and notes it here,
against the fake ``batch_sizes`` tensor it returns; the ops that read that
tensor later find B again (``batch_of``). Where nothing was noted (a
``batch_sizes`` that came from outside the graph), B is a size the compiler
learns when the op runs (an unbacked symbol).

Weak keys: an entry lives as long as the fake tensor of one trace.
"""
from __future__ import annotations

import torch

from ..._torch.tensors import fake_tensor_type, run_time_size, weak_id_key_dict

__all__ = ["note_batch", "batch_of"]

_BATCH = weak_id_key_dict()  # keyed by identity: a tensor's == is elementwise


def note_batch(batch_sizes: torch.Tensor, batch) -> None:
    """Record that ``batch_sizes`` (a fake tensor) describes ``batch`` sequences."""
    try:
        _BATCH[batch_sizes] = batch
    except TypeError:  # not weak-referenceable: nothing to remember
        pass


def batch_of(batch_sizes: torch.Tensor):
    """B for ``batch_sizes``: the size noted when it was made, else a new
    size the compiler learns at run time (inside a fake implementation),
    else, for a real tensor, ``batch_sizes[0]``."""
    b = _BATCH.get(batch_sizes)
    if b is not None:
        return b
    if isinstance(batch_sizes, fake_tensor_type()) or batch_sizes.device.type == "meta":
        return run_time_size()
    return int(batch_sizes[0])
