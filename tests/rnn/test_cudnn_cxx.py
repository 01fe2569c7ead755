"""The C++ bodies of the cuDNN RNN ops (``wfpass/native/rnn/cudnn.cpp``).

Registered for the CUDA key, they take over ``wfpass::cudnn_rnn``,
``cudnn_packed_rnn``, their ``_fw`` twins and backwards from the Python
bodies, which stay for what the C++ leaves to them (dropout between layers
in training, weights out of cuDNN's layout) and where the C++ kernels are
not built. Without a GPU the tests here check that they are built and
registered on every torch the suite runs on, and their two pointer checks
(the flat weight buffer, the gradient buffer) against the Python rules on
CPU tensors; with one (``gpu``), each op's C++ body against its Python body
on the same arguments, bit for bit, and the fallbacks.
"""
from __future__ import annotations

import math

import pytest
import torch

import wfpass  # noqa: F401 - defines the ops
from wfpass import native
from wfpass._torch import kernels
from wfpass.rnn.cuda import cudnn, cudnn_varlen  # noqa: F401 - the packed op's schema
from wftest import needs_cuda_build, needs_gpu

gpu = needs_gpu()
needs_cxx = pytest.mark.skipif(not native.loaded(), reason=f"the C++ kernels are not in use: {native.status()}")
I, H, T, B = 8, 16, 5, 3
LSTM, GRU = kernels.CUDNN_MODES["LSTM"], kernels.CUDNN_MODES["GRU"]


def _one_layer_lstm_block(device):
    """A one-layer LSTM's weights as views of one block, one after another,
    and their offsets with the block's size last."""
    shapes = [(4 * H, I), (4 * H, H), (4 * H,), (4 * H,)]
    block = torch.zeros(sum(math.prod(s) for s in shapes), device=device)
    ws, offsets, off = [], [], 0
    for s in shapes:
        ws.append(block[off:off + math.prod(s)].view(s))
        offsets.append(off)
        off += math.prod(s)
    return ws, offsets + [off]


@needs_cxx
def test_the_cuda_kernels_are_registered_where_the_cxx_kernels_load():
    """A CPU-only torch accepts a kernel for the CUDA key too, and the
    schemas the Python side defines match the C++ signatures (a mismatch
    fails at import)."""
    assert native.cudnn_cxx()


@needs_cxx
def test_the_cxx_hands_its_fallbacks_to_the_python_bodies_with_their_arguments(monkeypatch):
    """The C++ kernels call the Python bodies (dropout in training, weights
    out of the layout) through the dispatcher with typed arguments, which it
    does not check against the schemas Python defined. The functions that
    make those four calls, run from C++ on CPU tensors with ATen's cuDNN
    calls stubbed here, reach
    the Python bodies with every argument as the schema says, and their
    outputs come back."""
    seen = []

    def fw_stub(x, ws, per, buf, hx, cx, mode, hidden, proj, layers, batch_first, p, train, bidir, sizes, state):
        seen.append(("fw", x.shape, len(ws), per, buf.numel(), tuple(hx.shape), tuple(cx.shape), mode, hidden, layers,
                     train, bidir, list(sizes), p))
        rows = x.shape[:-1]
        return (torch.full((*rows, hidden), 1.0), torch.full((layers, hx.shape[1], hidden), 2.0),
                torch.full((layers, hx.shape[1], hidden), 3.0), torch.arange(5, dtype=torch.uint8), torch.empty(0))

    def bw_stub(x, ws, per, buf, hx, cx, out, g_out, g_hy, g_cy, mode, hidden, proj, layers, batch_first, p, train,
                bidir, sizes, state, reserve, mask):
        seen.append(("bw", x.shape, g_hy, g_cy, reserve.tolist(), list(mask), list(sizes)))
        dw = [buf.new_full(w.shape, 4.0) for w in ws]
        return torch.full(x.shape, 5.0), torch.full(hx.shape, 6.0), torch.full(cx.shape, 7.0), dw

    monkeypatch.setattr(kernels, "cudnn_rnn", fw_stub)
    monkeypatch.setattr(kernels, "cudnn_rnn_backward", bw_stub)
    ws, offsets = _one_layer_lstm_block("cpu")
    off = offsets[-1]
    x, data, batch_sizes = torch.randn(T, B, I), torch.randn(6, I), torch.tensor([3, 2, 1])
    got = torch.ops.wfpass._cudnn_python_bodies(x, data, batch_sizes, ws, offsets)
    assert len(got) == 16
    fw, bw, pfw, pbw = got[0:4], got[4:8], got[8:12], got[12:16]
    assert torch.equal(fw[0], torch.full((T, B, H), 1.0)) and fw[3].tolist() == list(range(5))
    assert torch.equal(pfw[0], torch.full((6, H), 1.0)) and pfw[1].shape == (1, 3, H)
    for d, rows in ((bw, (T, B, I)), (pbw, (6, I))):
        assert torch.equal(d[0], torch.full(rows, 5.0)) and bool((d[1] == 6.0).all()) and bool((d[2] == 7.0).all())
        assert d[3].numel() == off and bool((d[3] == 4.0).all())  # the weights' gradients as one buffer
    assert seen[0] == ("fw", (T, B, I), 4, 4, off, (1, B, H), (1, B, H), LSTM, H, 1, True, False, [], 0.0)
    assert seen[1] == ("bw", (T, B, I), None, None, list(range(5)), [True] * 4, [])
    assert seen[2][0] == "fw" and seen[2][-2] == [3, 2, 1] and seen[2][5] == (1, 3, H)
    assert seen[3][0] == "bw" and seen[3][-1] == [3, 2, 1]


def _cxx_flat_buffer(ws, offsets):
    got = torch.ops.wfpass._cudnn_flat_buffer(ws, offsets)
    return got[0] if got else None


def _same_view(a, b) -> bool:
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.storage_offset()
            == b.storage_offset() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)


@needs_cxx
def test_the_flat_buffer_check_agrees_with_the_python_rule():
    block = torch.zeros(48)
    a, b, c = block[4:16].view(3, 4), block[16:24].view(2, 4), block[24:28]
    cases = [
        ([a, b, c], [4, 16, 24]),  # not at the storage's start: the buffer starts 4 before
        ([a, b, c], [0, 12, 20]),  # offsets from the buffer's start
        ([a, b, c], [0, 12, 20, 30]),  # the buffer's size after the offsets, past the last weight
        ([a, b, c], [0, 12, 20, 45]),  # ... past the storage
        ([a, b, c], [0, 12, 21]),  # a weight not where cuDNN reads it
        ([a, b, c], [5, 17, 25]),  # the buffer would start before the storage
        ([a, b.clone(), c], [0, 12, 20]),  # another storage
        ([a, block[16:24].view(4, 2).t(), c], [0, 12, 20]),  # not contiguous
        ([a, b, c.double()], [0, 12, 20]),  # another dtype (and storage)
        ([a, b, c], [0, 12]),  # too few offsets
        ([], []),
    ]
    for ws, offsets in cases:
        want, got = cudnn.flat_buffer(ws, offsets), _cxx_flat_buffer(ws, offsets)
        assert (want is None) == (got is None), offsets
        if want is not None:
            assert _same_view(want, got), offsets
    assert _cxx_flat_buffer([a, b, c], [0, 12, 20]).numel() == 24


@needs_cxx
def test_the_gradient_buffer_is_cudnns_own_where_the_python_rule_keeps_it_and_a_copy_where_it_copies():
    """Views of one buffer at the offsets come back as that buffer; views
    elsewhere or separate tensors are copied into place, equal to the
    Python rule's copy."""
    weights = [torch.empty(2, 3), torch.empty(4)]
    like = torch.empty(0)
    buf = torch.arange(12.0)
    for dw, offsets in (
        ([buf.narrow(0, 0, 6).view(2, 3), buf.narrow(0, 6, 4)], [0, 6, 12]),  # in place, size entry
        ([buf.narrow(0, 0, 6).view(2, 3), buf.narrow(0, 6, 4)], [0, 6]),  # in place, no size entry
        ([buf.narrow(0, 2, 6).view(2, 3), buf.narrow(0, 8, 4)], [0, 6, 10]),  # in place, not at the storage's start
        ([buf.narrow(0, 2, 6).view(2, 3), buf.narrow(0, 8, 4)], [0, 6, 12]),  # the size runs past the storage: copied
        ([buf.narrow(0, 0, 6).view(2, 3), buf.narrow(0, 7, 4)], [0, 6, 12]),  # a view off its offset: copied
        ([torch.full((2, 3), 1.0), torch.full((4,), 2.0)], [4, 0, 10]),  # separate tensors, bias first
    ):
        want = cudnn.grad_buffer(dw, weights, offsets, like)
        got = torch.ops.wfpass._cudnn_grad_buffer(dw, weights, offsets, like)
        assert torch.equal(want, got), offsets
        shared = want.untyped_storage().data_ptr() == dw[0].untyped_storage().data_ptr()
        assert shared == (got.untyped_storage().data_ptr() == dw[0].untyped_storage().data_ptr()), offsets
        if shared:
            assert _same_view(want, got)


@needs_cxx
@needs_cuda_build
def test_every_op_with_a_cxx_body_passes_opcheck_on_fake_cuda_tensors():
    """torch.library's opcheck (schema, autograd registration, fake
    kernel, AOTAutograd with dynamic shapes) of each op the C++ bodies
    serve, on fake CUDA tensors: the C++ kernels registered for CUDA leave
    what the compiler sees unchanged."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = torch.ops.wfpass
    batch_sizes = torch.tensor([2, 2, 1, 1])  # a PackedSequence's: real, on the CPU
    with FakeTensorMode(allow_non_fake_inputs=True):
        ws, offsets = _one_layer_lstm_block("cuda")
        x = torch.randn(T, B, I, device="cuda")
        h, c = torch.randn(1, B, H, device="cuda"), torch.randn(1, B, H, device="cuda")
        for op in (ops.cudnn_rnn.default, ops.cudnn_rnn_fw.default):
            for train in (False, True):
                for states in ((None, None), (h, c)):
                    torch.library.opcheck(op, (x, ws, *states, LSTM, H, 0, 1, train, False, offsets, 0.0))
        out = torch.randn(T, B, H, device="cuda")
        reserve = torch.empty(0, dtype=torch.uint8, device="cuda")
        torch.library.opcheck(ops.cudnn_rnn_backward.default,
                              (x, ws, h, c, out, torch.randn_like(out), torch.randn_like(h), torch.randn_like(c),
                               reserve, LSTM, H, 0, 1, False, offsets, [True, True, True, True], 0.0))
        data = torch.randn(6, I, device="cuda")
        for train in (False, True):
            torch.library.opcheck(ops.cudnn_packed_rnn_fw.default,
                                  (data, batch_sizes, ws, None, None, LSTM, H, 0, 1, train, False, offsets, 0.0))
        pout = torch.randn(6, H, device="cuda")
        h2, c2 = torch.randn(1, 2, H, device="cuda"), torch.randn(1, 2, H, device="cuda")
        torch.library.opcheck(ops.cudnn_packed_rnn_backward.default,
                              (data, batch_sizes, ws, h2, c2, pout, torch.randn_like(pout),
                               torch.randn_like(h2), torch.randn_like(c2), reserve, LSTM, H, 0, 1, False, offsets,
                               [True, True, True, True], 0.0))


# -- on a GPU ---------------------------------------------------------------------


def _rnn_args(mode, layers, bidirectional, train, proj=0):
    """An RNN's weights as cuDNN's flat buffer lays them out (the format's
    layout), an input and states, on the GPU."""
    import torch.nn as nn

    cls = nn.LSTM if mode == LSTM else nn.GRU
    kw = dict(proj_size=proj) if proj else {}
    m = cls(I, H, num_layers=layers, bidirectional=bidirectional, device="cuda", **kw)
    m.flatten_parameters()  # eager's own flat buffer: the weights are views of it
    ws = [w.detach() for w in m._flat_weights]
    per = len(ws) // (layers * (2 if bidirectional else 1))
    layout = kernels.cudnn_flat_layout(ws, per, I, "LSTM" if mode == LSTM else "GRU", H, proj, layers, False,
                                       bidirectional)
    offsets, numel = layout
    D = 2 if bidirectional else 1
    x = torch.randn(T, B, I, device="cuda")
    hx = torch.randn(layers * D, B, proj or H, device="cuda")
    cx = torch.randn(layers * D, B, H, device="cuda") if mode == LSTM else None
    return m, x, ws, hx, cx, [*offsets, numel]


@gpu
@pytest.mark.parametrize("mode,layers,bidirectional,proj", [(LSTM, 2, False, 0), (LSTM, 1, True, 0),
                                                            (LSTM, 2, False, 4), (GRU, 2, True, 0)])
@pytest.mark.parametrize("states", [True, False])
def test_each_op_equals_its_python_body_bit_for_bit_on_a_gpu(mode, layers, bidirectional, proj, states):
    assert native.cudnn_cxx()
    _, x, ws, hx, cx, offsets = _rnn_args(mode, layers, bidirectional, True, proj)
    if not states:
        hx = cx = None
    args = (x, ws, hx, cx, mode, H, proj, layers, True, bidirectional, offsets, 0.0)
    ops = torch.ops.wfpass
    got, want = ops.cudnn_rnn_fw(*args), ops._cudnn_rnn_python(*args)
    for g, w in zip(got[:3], want[:3]):
        assert g.shape == w.shape and torch.equal(g, w)
    # cuDNN's reserve: its bytes are cuDNN's (padding may be left unwritten), its size the same
    assert got[3].shape == want[3].shape and got[3].dtype == torch.uint8
    out, hy, cy, _ = want
    g_out, g_hy = torch.randn_like(out), torch.randn_like(hy)
    g_cy = torch.randn_like(cy) if mode == LSTM else None
    mask = [True, True, mode == LSTM, True]
    # Each backward reads (and cuDNN may write) a reserve of its own forward's.
    got = ops.cudnn_rnn_backward(x, ws, hx, cx, out, g_out, g_hy, g_cy, got[3], mode, H, proj, layers, bidirectional,
                                 offsets, mask, 0.0)
    want = ops._cudnn_rnn_backward_python(x, ws, hx, cx, out, g_out, g_hy, g_cy, want[3], mode, H, proj, layers,
                                          bidirectional, offsets, mask, 0.0)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    # the weights' gradients are cuDNN's own buffer, as the Python body hands it on
    assert got[3].numel() == offsets[-1]
    # inference: no reserve
    got = ops.cudnn_rnn_fw(x, ws, hx, cx, mode, H, proj, layers, False, bidirectional, offsets, 0.0)
    assert got[3].numel() == 0 and torch.equal(got[0], ops._cudnn_rnn_python(
        x, ws, hx, cx, mode, H, proj, layers, False, bidirectional, offsets, 0.0)[0])


@gpu
def test_the_packed_op_equals_its_python_body_on_a_gpu():
    from torch.nn.utils.rnn import pack_sequence

    _, _, ws, _, _, offsets = _rnn_args(LSTM, 2, True, True)
    seqs = [torch.randn(n, I, device="cuda") for n in (5, 3, 2)]
    p = pack_sequence(seqs)
    args = (p.data, p.batch_sizes, ws, None, None, LSTM, H, 0, 2, True, True, offsets, 0.0)
    ops = torch.ops.wfpass
    got, want = ops.cudnn_packed_rnn_fw(*args), ops._cudnn_packed_rnn_python(*args)
    for g, w in zip(got[:3], want[:3]):
        assert torch.equal(g, w)
    assert got[3].shape == want[3].shape
    out, hy, cy, _ = want
    grads = (torch.randn_like(out), torch.randn_like(hy), torch.randn_like(cy))
    rest = (LSTM, H, 0, 2, True, offsets, [True, True, True, True], 0.0)
    got = ops.cudnn_packed_rnn_backward(p.data, p.batch_sizes, ws, None, None, out, *grads, got[3], *rest)
    want = ops._cudnn_packed_rnn_backward_python(p.data, p.batch_sizes, ws, None, None, out, *grads, want[3], *rest)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


@gpu
def test_weights_out_of_the_layout_and_dropout_go_to_the_python_bodies_on_a_gpu():
    """Weights that are not views of one buffer at the offsets: the op
    flattens copies, as the Python body does, and gives the same result;
    dropout in training: the Python body's dropout state, reproducible
    after ``torch.manual_seed`` as before."""
    _, x, ws, hx, cx, offsets = _rnn_args(LSTM, 2, False, True)
    loose = [w.clone() for w in ws]
    ops = torch.ops.wfpass
    a = ops.cudnn_rnn_fw(x, loose, hx, cx, LSTM, H, 0, 2, False, False, offsets, 0.0)
    b = ops.cudnn_rnn_fw(x, ws, hx, cx, LSTM, H, 0, 2, False, False, offsets, 0.0)
    torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-7)
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(ops.cudnn_rnn_fw(x, ws, hx, cx, LSTM, H, 0, 2, True, False, offsets, 0.5)[0])
    assert torch.equal(runs[0], runs[1])
    no_drop = ops.cudnn_rnn_fw(x, ws, hx, cx, LSTM, H, 0, 2, True, False, offsets, 0.0)[0]
    assert not torch.equal(runs[0], no_drop)
    assert math.isfinite(runs[0].sum().item())
