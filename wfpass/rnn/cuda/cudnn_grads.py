"""The weights' gradients of a cuDNN RNN call, without a copy.

``_cudnn_rnn_backward`` writes every weight's gradient into one buffer laid
out like the flat weight buffer (cuDNN 9: every layer's matrices, then the
biases) and returns views of it. The backward ops hand that buffer on, and
each weight's gradient is a view of it at the weight's own offset: the same
layout as the parameters' own flat block, no ``cat`` per training step.
"""
from __future__ import annotations

from typing import List, Sequence

import torch

__all__ = ["buffer_numel", "grad_buffer", "weight_grads"]


def buffer_numel(weights: Sequence[torch.Tensor], offsets: Sequence[int]) -> int:
    """Elements of the flat buffer (and of its gradient buffer): the size
    entry after the offsets, else where the last weight ends; the weights'
    own total where no layout is given."""
    if len(offsets) > len(weights):
        return int(offsets[-1])
    if offsets:
        return max(int(o) + w.numel() for o, w in zip(offsets, weights))
    return sum(w.numel() for w in weights)


def grad_buffer(dw: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], offsets: Sequence[int], like):
    """The weights' gradients as one buffer in the flat buffer's layout.

    ``_cudnn_rnn_backward`` writes every weight's gradient into one buffer
    laid out like the weight buffer (``weight_buf``), and returns views of
    it: that buffer is the answer, no copy. cuDNN 9's layout puts every
    layer's matrices before the biases, so the views are not one after
    another in list order (an earlier version concatenated them, a copy of
    the weights' size on every training step). Each weight's gradient is
    then a view of this buffer at the weight's own offset (``weight_grads``).
    Only where the views are not at the offsets (never seen) are they
    copied into a new buffer."""
    n = buffer_numel(weights, offsets)
    if not dw or any(g is None for g in dw) or len(offsets) < len(dw):
        out = like.new_zeros((n,))
        for g, off in zip(dw or (), offsets):
            if g is not None:
                out.narrow(0, int(off), g.numel()).copy_(g.reshape(-1))
        return out
    storage = dw[0].untyped_storage()
    base = dw[0].storage_offset() - int(offsets[0])
    in_place = base >= 0 and (base + n) * dw[0].element_size() <= storage.nbytes() and all(
        g.untyped_storage().data_ptr() == storage.data_ptr() and g.is_contiguous()
        and g.storage_offset() - base == int(off) for g, off in zip(dw, offsets))
    if in_place:
        return dw[0].new_empty(0).set_(storage, base, (n,))
    out = like.new_zeros((n,))
    for g, off in zip(dw, offsets):
        out.narrow(0, int(off), g.numel()).copy_(g.reshape(-1))
    return out


def weight_grads(flat: torch.Tensor, weights: Sequence[torch.Tensor], offsets: Sequence[int]) -> List[torch.Tensor]:
    """Each weight's gradient as a view of the gradient buffer at the
    weight's offset: the same layout as the parameters' own flat block."""
    if len(offsets) < len(weights):  # no layout given: list order
        ends = [0]
        for w in weights:
            ends.append(ends[-1] + w.numel())
        offsets = ends[:-1]
    return [flat.narrow(0, int(off), w.numel()).view(w.shape) for off, w in zip(offsets, weights)]
