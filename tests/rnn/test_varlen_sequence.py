"""``wfpass::pack_padded`` / ``pad_packed`` and their backwards with the
batch's reordering folded in (``order``): the C++ kernels
(``native/rnn/varlen_sequence.cpp``, one copy of each row) against the Python
ones (eager's ``index_select`` and ATen's kernels), bit for bit, and against
``torch.nn.utils.rnn`` itself; eager's errors."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from wfpass import native
from wfpass.rnn.varlen import pad_ops as P

ops = torch.ops.wfpass
needs_cpp = pytest.mark.skipif(not native.loaded(), reason="the C++ kernels did not build here")

CASES = list(itertools.product([False, True], [torch.float32, torch.bfloat16, torch.float64], [False, True], [0, 3]))


def _batch(batch_first, dtype, extra_steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 7, 4, 2, 1])
    T = 7 + extra_steps
    shape = (5, T, 3, 2) if batch_first else (T, 5, 3, 2)
    return torch.randn(shape, generator=g).to(dtype), lengths


@needs_cpp
@pytest.mark.parametrize("batch_first,dtype,shuffled,extra_steps", CASES)
def test_cpp_kernels_give_the_python_kernels_bits(batch_first, dtype, shuffled, extra_steps):
    x, lengths = _batch(batch_first, dtype, extra_steps)
    order = torch.randperm(5, generator=torch.Generator().manual_seed(1)) if shuffled else None
    data, sizes = ops.pack_padded(x, lengths, batch_first, order)  # CPU: sequence.cpp
    want_data, want_sizes = P._pack_padded(x, lengths, batch_first, order)
    assert torch.equal(sizes, want_sizes) and torch.equal(data, want_data)
    unsorted = P._inverse(order) if shuffled else None
    for total in (-1, x.shape[1 if batch_first else 0] + 2):
        out, lens = ops.pad_packed(data, sizes, batch_first, 1.5, total, unsorted)
        want_out, want_lens = P._pad_packed(data, sizes, batch_first, 1.5, total, unsorted)
        assert torch.equal(out, want_out) and torch.equal(lens, want_lens)
        g = torch.randn_like(out)
        assert torch.equal(ops.pad_packed_backward(g, sizes, data.shape[0], batch_first, unsorted),
                           P._pad_packed_backward(g, sizes, data.shape[0], batch_first, unsorted))
    g = torch.randn_like(data)
    assert torch.equal(ops.pack_padded_backward(g, sizes, list(x.shape), batch_first, order),
                       P._pack_padded_backward(g, sizes, list(x.shape), batch_first, order))


@pytest.mark.parametrize("batch_first", [False, True])
def test_the_functions_give_eagers_values_and_gradients(batch_first):
    """wfpass's pack_padded_sequence / pad_packed_sequence (what Dynamo
    traces for wformat) against torch's, on an unsorted batch: every value,
    and the input's gradient through a projection that also reaches the
    padded positions."""
    x, _ = _batch(batch_first, torch.float32, 2)
    lengths = torch.tensor([2, 7, 1, 7, 4])
    R = torch.randn_like(x)  # total_length 9 = T: the padded output has x's shape
    grads = []
    for pack, pad in ((pack_padded_sequence, pad_packed_sequence), (P.pack_padded_sequence, P.pad_packed_sequence)):
        xi = x.clone().requires_grad_()
        p = pack(xi, lengths, batch_first=batch_first, enforce_sorted=False)
        y, lens = pad(p, batch_first=batch_first, padding_value=-2.0, total_length=9)
        ((y * R).sum() + p.data.sum()).backward()
        grads.append((p.data, p.batch_sizes, p.sorted_indices, y, lens, xi.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_eagers_errors():
    x = torch.randn(4, 3, 2)
    with pytest.raises(RuntimeError, match="sorted in decreasing order"):
        ops.pack_padded(x, torch.tensor([2, 3, 1]), False)
    with pytest.raises(RuntimeError, match="greater than 0"):
        ops.pack_padded(x, torch.tensor([3, 2, 0]), False)
    with pytest.raises(ValueError, match="total_length"):
        ops.pad_packed(torch.randn(6, 2), torch.tensor([3, 2, 1]), False, 0.0, 2)


@needs_cpp
def test_an_order_that_is_not_a_permutation_is_refused():
    with pytest.raises(RuntimeError, match="not a permutation"):
        ops.pack_padded(torch.randn(4, 3, 2), torch.tensor([3, 2, 1]), False, torch.tensor([0, 0, 1]))
    with pytest.raises(RuntimeError, match="batch order has 2 entries"):
        ops.pad_packed(torch.randn(6, 2), torch.tensor([3, 2, 1]), False, 0.0, -1, torch.tensor([0, 1]))
