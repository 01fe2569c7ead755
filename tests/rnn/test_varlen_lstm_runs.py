"""``wfpass::packed_lstm_runs``: oneDNN's LSTM layer over each run of equal
batch size of a packed batch, against ``wfpass::packed_layer`` (the
per-step loop, itself checked against eager in test_varlen_layer.py),
forward and backward, and PyTorch's own op checks."""
from __future__ import annotations

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

from wfpass._torch.kernels import mkldnn_rnn_dtype
from wfpass.rnn.cpu import varlen_lstm_runs  # noqa: F401  (registers the op)
from wfpass.rnn.cpu import varlen_layer  # noqa: F401

pytestmark = pytest.mark.skipif(not mkldnn_rnn_dtype(torch.float32), reason="oneDNN's LSTM is not available here")

I, H = 5, 6
LENGTHS = {
    "distinct": [7, 5, 4, 2, 1],
    "equal": [4, 4, 4],
    "one-run-of-one": [6],
    "ties": [6, 6, 3, 3, 1],
}


def _batch(lengths, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(lengths), len(lengths), I, generator=g)
    p = pack_padded_sequence(x, torch.tensor(lengths), enforce_sorted=True)
    return p.data.to(dtype), p.batch_sizes


def _weights(bias, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(4 * H, I, generator=g) * 0.4, torch.randn(4 * H, H, generator=g) * 0.4]
    bs = [torch.randn(4 * H, generator=g) * 0.1, torch.randn(4 * H, generator=g) * 0.1] if bias else [None, None]
    return [w.to(dtype) if w is not None else None for w in ws + bs]


def _states(B, with_state, dtype, seed=2):
    if not with_state:
        return None, None
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, B, H, generator=g).to(dtype), torch.randn(1, B, H, generator=g).to(dtype))


def _grads(fn, inputs, proj):
    """Outputs of ``fn(*inputs)`` and the gradients of a fixed random
    projection of them with respect to every tensor input that takes one."""
    leaves = [t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
              for t in inputs]
    out, h_n, c_n = fn(*leaves)[:3]
    loss = sum((o.float() * r).sum() for o, r in zip((out, h_n, c_n), proj))
    loss.backward()
    return [out, h_n, c_n], [t.grad for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_equal_to_the_per_step_loop_forward_and_backward(lengths, reverse, bias, with_state, dtype):
    if dtype == torch.bfloat16 and not mkldnn_rnn_dtype(torch.bfloat16):
        pytest.skip("oneDNN's bf16 LSTM is not available on this CPU")
    data, bs = _batch(LENGTHS[lengths], dtype)
    w_ih, w_hh, b_ih, b_hh = _weights(bias, dtype)
    h0, c0 = _states(int(bs[0]), with_state, dtype)
    g = torch.Generator().manual_seed(3)
    proj = [torch.randn(data.shape[0], H, generator=g), torch.randn(1, int(bs[0]), H, generator=g),
            torch.randn(1, int(bs[0]), H, generator=g)]

    def runs(d, wi, wh, bi, bh, h, c):
        return torch.ops.wfpass.packed_lstm_runs(d, bs, wi, wh, bi, bh, h, c, reverse, True)

    def loop(d, wi, wh, bi, bh, h, c):
        return torch.ops.wfpass.packed_layer(d, bs, wi, wh, bi, bh, None, h, c, "LSTM", reverse, True)

    inputs = (data, w_ih, w_hh, b_ih, b_hh, h0, c0)
    got, got_g = _grads(runs, inputs, proj)
    want, want_g = _grads(loop, inputs, proj)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
    assert len(got_g) == len(want_g) == 3 + 2 * bias + 2 * with_state
    for a, b in zip(got_g, want_g):  # scaled by the largest gradient
        assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max(), (a, b)


def test_inference_call_keeps_no_states_and_refuses_a_backward():
    data, bs = _batch(LENGTHS["distinct"])
    w_ih, w_hh, b_ih, b_hh = _weights(True, torch.float32)
    out, h_n, c_n, ws = torch.ops.wfpass.packed_lstm_runs_fw(data, bs, w_ih, w_hh, b_ih, b_hh, None, None, False,
                                                             False)
    assert ws.numel() == 0 and out.shape == (data.shape[0], H) and h_n.shape == c_n.shape == (1, 5, H)
    w = w_ih.clone().requires_grad_()
    out = torch.ops.wfpass.packed_lstm_runs(data, bs, w, w_hh, b_ih, b_hh, None, None, False, False)[0]
    with pytest.raises(RuntimeError, match="train=False"):
        out.sum().backward()


def test_runs_are_the_batch_size_changes_in_processing_order():
    bs = torch.tensor([3, 3, 2, 1, 1])
    assert varlen_lstm_runs.runs(bs, False) == [(0, 2, 3), (6, 1, 2), (8, 2, 1)]
    assert varlen_lstm_runs.runs(bs, True) == [(8, 2, 1), (6, 1, 2), (0, 2, 3)]


def test_opcheck():
    data, bs = _batch(LENGTHS["ties"])
    w_ih, w_hh, b_ih, b_hh = _weights(True, torch.float32)
    h0, c0 = _states(int(bs[0]), True, torch.float32)
    args = (data.requires_grad_(), bs, w_ih.requires_grad_(), w_hh, b_ih, b_hh, h0, c0, True, True)
    torch.library.opcheck(torch.ops.wfpass.packed_lstm_runs.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
