"""Variable-length batches: pack_padded_sequence -> nn.LSTM/GRU/RNN ->
pad_packed_sequence in one compiled graph (wfpass/rnn/varlen/sequence.py).

Every case runs against eager PyTorch on a deep copy: forward, backward
(the input's, h0's and every weight's gradient, each scaled by the largest
gradient), and one SGD step. Most cases go through ``inner="aot_eager"``
(AOTAutograd's joint trace, as for Inductor); a few end to end through
Inductor.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import wfpass
from wfpass import native
from wfpass._torch.kernels import mkldnn_rnn_dtype
from wfpass.rnn.varlen.sequence import PackedRnnForward
from wftest import Capture


class PackedModel(nn.Module):
    """Linear -> pack -> RNN -> pad -> Linear, every knob of the issue."""

    def __init__(self, kind="LSTM", layers=1, bidirectional=False, proj=0, batch_first=False, enforce_sorted=False,
                 total_length=None, read_state=True, bias=True, nonlinearity="tanh", padding_value=0.0):
        super().__init__()
        self.inp = nn.Linear(5, 6)
        kw = dict(num_layers=layers, bidirectional=bidirectional, batch_first=batch_first, bias=bias)
        if kind == "LSTM":
            self.rnn = nn.LSTM(6, 7, proj_size=proj, **kw)
        elif kind == "GRU":
            self.rnn = nn.GRU(6, 7, **kw)
        else:
            self.rnn = nn.RNN(6, 7, nonlinearity=nonlinearity, **kw)
        out_h = (proj or 7) * (2 if bidirectional else 1)
        self.out = nn.Linear(out_h, 3)
        self.batch_first, self.enforce_sorted = batch_first, enforce_sorted
        self.total_length, self.read_state, self.padding_value = total_length, read_state, padding_value

    def forward(self, x, lengths, h0=None):
        p = pack_padded_sequence(self.inp(x), lengths, batch_first=self.batch_first,
                                 enforce_sorted=self.enforce_sorted)
        out, state = self.rnn(p, h0)
        y, lens = pad_packed_sequence(out, batch_first=self.batch_first, padding_value=self.padding_value,
                                      total_length=self.total_length)
        res = [self.out(y), lens]
        if self.read_state:
            res += list(state) if isinstance(state, tuple) else [state]
        return tuple(res)


def _loss(outs, seed=1):
    """A fixed random projection of every float output (the padded
    positions' too: their gradient must go nowhere, as in eager)."""
    g = torch.Generator().manual_seed(seed)
    total = 0
    for o in outs:
        if o.is_floating_point():
            total = total + (o * torch.randn(o.shape, generator=g, dtype=torch.float32).to(o.dtype)).sum()
    return total


def _batch(T, lengths, batch_first, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    x = torch.randn((B, T, 5) if batch_first else (T, B, 5), generator=g).to(dtype)
    return x, torch.tensor(lengths)


def _h0(model, B, dtype=torch.float32):
    r = model.rnn
    D = 2 if r.bidirectional else 1
    h = torch.randn(r.num_layers * D, B, getattr(r, "proj_size", 0) or r.hidden_size).to(dtype)
    if isinstance(r, nn.LSTM):
        return (h.requires_grad_(), torch.randn(r.num_layers * D, B, r.hidden_size).to(dtype).requires_grad_())
    return h.requires_grad_()


def _leaves(h0):
    if h0 is None:
        return []
    return list(h0) if isinstance(h0, tuple) else [h0]


def _clone_h0(h0):
    if h0 is None:
        return None
    if isinstance(h0, tuple):
        return tuple(h.detach().clone().requires_grad_() for h in h0)
    return h0.detach().clone().requires_grad_()


def check_against_eager(model, fn, x, lengths, h0=None, rtol=1e-5, atol=1e-6, grad_tol=1e-5):
    """Forward, backward and one SGD step of ``fn`` (compiled from
    ``model``) against a deep copy of ``model`` run eagerly."""
    ref = copy.deepcopy(model)
    xs, xr = x.clone().requires_grad_(x.is_floating_point()), x.clone().requires_grad_(x.is_floating_point())
    hs, hr = _clone_h0(h0), _clone_h0(h0)
    out = fn(xs, lengths, hs)
    exp = ref(xr, lengths, hr)
    assert len(out) == len(exp)
    for a, b in zip(out, exp):
        assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    _loss(out).backward()
    _loss(exp).backward()
    pairs = [(xs.grad, xr.grad)] + list(zip([h.grad for h in _leaves(hs)], [h.grad for h in _leaves(hr)]))
    pairs += [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())]
    scale = max(b.abs().max().item() for _, b in pairs if b is not None)
    for a, b in pairs:
        assert (a is None) == (b is None)
        if a is not None:
            err = (a.float() - b.float()).abs().max().item() / scale
            assert err < grad_tol, err
    for m in (model, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol * 10)


def _compile(model, inner="aot_eager"):
    cap = Capture()

    def inner_fn(gm, example_inputs):
        cap(gm, example_inputs)
        if inner == "aot_eager":
            from torch._dynamo.backends.common import aot_autograd

            return aot_autograd(fw_compiler=lambda g, _: g.forward, bw_compiler=lambda g, _: g.forward)(gm, example_inputs)
        return gm.forward

    return torch.compile(model, backend=wfpass.backend(inner=inner_fn if inner == "aot_eager" else inner)), cap


def _packed_calls(cap):
    return cap.count(lambda t: isinstance(t, PackedRnnForward))


CASES = {
    # name: (model kwargs, T, lengths, with h0)
    "lstm": (dict(), 6, [6, 3, 5, 1], False),
    "lstm-2layer-bi-h0": (dict(layers=2, bidirectional=True), 6, [4, 6, 2, 5], True),
    "lstm-proj-bi": (dict(layers=2, bidirectional=True, proj=4), 5, [5, 5, 2], True),
    "lstm-sorted": (dict(enforce_sorted=True), 6, [6, 4, 4, 1], False),
    "lstm-batch_first-total_length": (dict(batch_first=True, total_length=8), 7, [3, 7, 5], False),
    "lstm-equal-lengths": (dict(layers=2), 4, [4, 4, 4], True),
    "lstm-nobias-padding": (dict(bias=False, padding_value=-1.0), 6, [2, 6, 3], False),
    "lstm-max-shorter-than-T": (dict(bidirectional=True), 9, [5, 3, 4], False),
    "gru": (dict(kind="GRU"), 6, [1, 6, 3, 5], False),
    "gru-2layer-bi-h0-batch_first": (dict(kind="GRU", layers=2, bidirectional=True, batch_first=True), 5, [5, 2, 4], True),
    "gru-sorted-nobias": (dict(kind="GRU", enforce_sorted=True, bias=False), 6, [6, 5, 1], False),
    "rnn-tanh-bi": (dict(kind="RNN", bidirectional=True), 6, [3, 6, 1], True),
    "rnn-relu-2layer": (dict(kind="RNN", nonlinearity="relu", layers=2, total_length=7), 6, [6, 2, 4], False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_packed_rnn_matches_eager_in_one_graph(name):
    kwargs, T, lengths, with_h0 = CASES[name]
    model = PackedModel(**kwargs)
    fn, cap = _compile(model)
    x, L = _batch(T, lengths, model.batch_first)
    h0 = _h0(model, len(lengths)) if with_h0 else None
    check_against_eager(model, fn, x, L, h0)
    assert len(cap.graphs) == 1, "pack -> RNN -> pad must be one graph (no graph break)"
    assert _packed_calls(cap) == 1
    (row,) = wfpass.report(model).find("rnn", "rewritten")
    assert "variable-length batch" in row.reason and row.stats["fused_calls"] == 1
    # A training graph: the C++ per-step loop, whose backward is the fastest here.
    assert row.detail["paths"] == {"T=variable": "packed"}
    assert row.stats["packed_loop_calls"] == 1, row.stats


@pytest.mark.parametrize("name", ["lstm", "lstm-2layer-bi-h0", "lstm-nobias-padding", "lstm-max-shorter-than-T",
                                  "lstm-proj-bi", "gru"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_equal_to_eager_on_onednns_lstm_run_by_run(name, dtype):
    """Without grad, a CPU LSTM without a projection runs oneDNN's LSTM
    layer over each run of equal batch size (``wfpass::packed_lstm_runs``)
    where the per-step loop has no raw-pointer path for its dtype (bf16;
    fp32 on a CPU with neither AVX-512 nor AVX2, or with ``WFPASS_FAST_LOOP=0``); with a
    projection, for GRUs, and fp32 on the raw-pointer loop, the per-step
    loop. Equal to eager (bf16: 3e-2), h_n and c_n included, in one graph."""
    kwargs, T, lengths, with_h0 = CASES[name]
    model = PackedModel(**kwargs).to(dtype).eval()
    fn, cap = _compile(model)
    x, L = _batch(T, lengths, model.batch_first, dtype)
    h0 = _h0(model, len(lengths), dtype) if with_h0 else None
    with torch.no_grad():
        out, exp = fn(x, L, h0), copy.deepcopy(model)(x, L, h0)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for a, b in zip(out, exp):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert len(cap.graphs) == 1 and _packed_calls(cap) == 1
    (row,) = wfpass.report(model).find("rnn", "rewritten")
    onednn = (kwargs.get("kind", "LSTM") == "LSTM" and not kwargs.get("proj") and mkldnn_rnn_dtype(dtype)
              and not (dtype == torch.float32 and native.fast_loop()))
    assert row.detail["paths"] == {"T=variable": "packed_onednn" if onednn else "packed"}, row.detail
    assert row.stats["packed_onednn_calls" if onednn else "packed_loop_calls"] == 1, row.stats
    if onednn:
        assert "oneDNN LSTM over each run of equal batch size" in row.reason, row.reason


def test_twenty_batches_of_different_sizes_and_lengths_recompile_once():
    model = PackedModel(layers=2, bidirectional=True)
    fn, cap = _compile(model)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    for i in range(20):
        B = int(torch.randint(2, 9, (1,), generator=g))
        T = int(torch.randint(3, 12, (1,), generator=g))
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        lengths[0] = T if i % 2 else lengths[0]  # sometimes the longest fills T, sometimes not
        x = torch.randn(T, B, 5, generator=g)
        with torch.no_grad():
            for a, b in zip(fn(x, lengths), ref(x, lengths)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # The first batch compiles with static sizes; the second brings the
    # dynamic recompile; every later batch reuses that graph.
    assert len(cap.graphs) == 2, len(cap.graphs)
    (row,) = wfpass.report(model).find("rnn", "rewritten")
    assert row.stats["fused_calls"] == 20


def test_lengths_as_a_list():
    model = PackedModel(kind="GRU")
    fn, cap = _compile(model)
    x, _ = _batch(5, [5, 2, 4], False)
    check_against_eager(model, lambda x, L, h: fn(x, [5, 2, 4], h), x, torch.tensor([5, 2, 4]))
    assert len(cap.graphs) == 1 and _packed_calls(cap) == 1


class SplitModules(nn.Module):
    """The PackedSequence made in one module, consumed in another, and its
    ``.data`` read directly beside the RNN."""

    class Packer(nn.Module):
        def forward(self, x, lengths):
            return pack_padded_sequence(x, lengths, enforce_sorted=False)

    def __init__(self):
        super().__init__()
        self.packer, self.rnn, self.out = self.Packer(), nn.LSTM(5, 6, bidirectional=True), nn.Linear(12, 2)

    def forward(self, x, lengths, h0=None):
        p = self.packer(x, lengths)
        out, (h, c) = self.rnn(p)
        y, _ = pad_packed_sequence(out)
        return self.out(y), h, p.data.sum(0) + out.data.sum(0)[:5], out.batch_sizes.float()


def test_packed_sequence_across_modules_and_data_read_directly():
    model = SplitModules()
    fn, cap = _compile(model)
    x, L = torch.randn(6, 4, 5), torch.tensor([2, 6, 3, 4])
    check_against_eager(model, fn, x, L)
    assert len(cap.graphs) == 1 and _packed_calls(cap) == 1


def test_bf16():
    model = PackedModel(layers=2, bidirectional=True).to(torch.bfloat16)
    fn, _ = _compile(model)
    x, L = _batch(6, [6, 3, 5, 1], False, dtype=torch.bfloat16)
    check_against_eager(model, fn, x, L, rtol=3e-2, atol=3e-2, grad_tol=5e-2)


@pytest.mark.parametrize("batch_first", [False, True])
def test_inductor_training_steps(batch_first):
    """Through Inductor, which checks every op's output strides against its
    fake (batch-first: the gradient of pack_padded_sequence's input, which
    ATen returns as a transposed view)."""
    model = PackedModel(kind="LSTM", layers=2, bidirectional=True, batch_first=batch_first)
    ref = copy.deepcopy(model)
    # dynamic=True: one Inductor graph (forward and backward) serves the
    # three batches, its ops' strides checked against their fakes at every
    # step; by default the first batch got a static graph and the second a
    # dynamic recompile, two Inductor compiles for the same checks (a static
    # packed graph through Inductor, trained: test_regional_compilation).
    fn = torch.compile(model, backend="wformat", dynamic=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref)]
    for step, (T, lengths) in enumerate([(6, [6, 2, 5]), (8, [3, 8, 1, 7]), (5, [5, 5])]):
        x, L = _batch(T, lengths, batch_first, seed=step)
        for m, f, opt in ((model, fn, opts[0]), (ref, ref, opts[1])):
            opt.zero_grad()
            _loss(f(x, L)).backward()
            opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    (row,) = wfpass.report(model).find("rnn", "rewritten")
    assert row.stats["packed_loop_calls"] == 3, row.stats


def test_regional_compilation():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(5, 5, bidirectional=False)
            self.norm = nn.LayerNorm(5)

        def forward(self, x, lengths):
            out, _ = self.rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))
            return self.norm(pad_packed_sequence(out, total_length=x.shape[0])[0] + x)

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))

        def forward(self, x, lengths, h0=None):
            for b in self.blocks:
                x = b(x, lengths)
            return (x,)

    model = Stack()
    ref = copy.deepcopy(model)
    for b in model.blocks:
        b.compile(backend="wformat")
    x, L = torch.randn(6, 3, 5), torch.tensor([6, 1, 4])
    xs, xr = x.clone().requires_grad_(x.is_floating_point()), x.clone().requires_grad_(x.is_floating_point())
    a, b = model(xs, L), ref(xr, L)
    torch.testing.assert_close(a[0], b[0], rtol=1e-4, atol=1e-5)
    _loss(a).backward()
    _loss(b).backward()
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    rows = [r for r in wfpass.report(model).find("rnn", "rewritten")]
    assert len(rows) == 3 and all("variable-length batch" in r.reason for r in rows)


def test_packed_sequence_from_outside_the_compiled_function():
    model = nn.LSTM(5, 6, num_layers=2)
    ref = copy.deepcopy(model)
    packed = pack_padded_sequence(torch.randn(7, 3, 5), torch.tensor([7, 4, 2]))
    h0 = (torch.randn(2, 3, 6), torch.randn(2, 3, 6))
    out, (h, c) = torch.compile(model, backend=wfpass.backend(inner="aot_eager"))(packed, h0)
    e_out, (eh, ec) = ref(packed, h0)
    assert isinstance(out, PackedSequence)
    torch.testing.assert_close(out.data, e_out.data, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(h, eh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(c, ec, rtol=1e-4, atol=1e-5)


def test_other_backends_still_graph_break_on_pack():
    model = PackedModel()
    ref = copy.deepcopy(model)
    cap = Capture()
    x, L = _batch(6, [6, 3, 5, 1], False)
    out = torch.compile(model, backend=cap)(x, L)
    for a, b in zip(out, ref(x, L)):
        torch.testing.assert_close(a, b)
    seen = {str(n.target) for g in cap.graphs for n in g.graph.nodes if n.op == "call_function"}
    # The break at pack_padded_sequence, as without wfpass: the graph before
    # it holds the input Linear only; pack, the RNN and pad run eagerly.
    assert not any("wfpass" in s or "lstm" in s or "pack" in s for s in seen), seen
    reasons = [b.reason for b in torch._dynamo.explain(copy.deepcopy(ref))(x, L).break_reasons]
    assert any("run eagerly for this backend" in r for r in reasons), reasons


def test_total_length_too_short_raises_eagers_error():
    model = PackedModel(total_length=3)
    fn, _ = _compile(model)
    x, L = _batch(6, [6, 3, 5], False)
    with pytest.raises(ValueError, match="total_length"):
        fn(x, L)


def test_explain_shows_the_packed_rnn_before_compiling():
    model = PackedModel(layers=2, bidirectional=True)
    x, L = _batch(6, [6, 3, 5], False)
    text = str(wfpass.explain(model, x, L))
    assert "variable-length batch" in text, text
    assert model.inp.weight.untyped_storage().data_ptr() != model.rnn.weight_ih_l0.untyped_storage().data_ptr()


# -- real models that pack their batch -------------------------------------------------------------


class TacotronEncoder(nn.Module):
    """torchaudio's Tacotron2 encoder (torchaudio/models/tacotron2.py,
    ``_Encoder``), built from its config: conv + BatchNorm blocks, then a
    packed bidirectional LSTM over the sorted batch (``enforce_sorted``'s
    default), with the symbol embedding in front as Tacotron2 has it.
    ``dropout`` is the config's (0.5 in torchaudio; 0 here so that eager and
    compiled draw nothing)."""

    def __init__(self, n_symbol=20, dim=16, n_convolution=3, kernel_size=5, dropout=0.0):
        super().__init__()
        self.embedding = nn.Embedding(n_symbol, dim)
        self.convolutions = nn.ModuleList(
            nn.Sequential(nn.Conv1d(dim, dim, kernel_size, padding=(kernel_size - 1) // 2), nn.BatchNorm1d(dim))
            for _ in range(n_convolution))
        self.lstm = nn.LSTM(dim, dim // 2, 1, batch_first=True, bidirectional=True)
        self.dropout = dropout

    def forward(self, tokens, input_lengths, h0=None):
        x = self.embedding(tokens).transpose(1, 2)
        for conv in self.convolutions:
            x = torch.nn.functional.dropout(torch.relu(conv(x)), self.dropout, self.training)
        x = x.transpose(1, 2)
        input_lengths = input_lengths.cpu()
        x = pack_padded_sequence(x, input_lengths, batch_first=True)
        outputs, _ = self.lstm(x)
        outputs, _ = pad_packed_sequence(outputs, batch_first=True)
        return (outputs,)


def test_tacotron2_encoder_trains_like_eager():
    model = TacotronEncoder()
    fn, cap = _compile(model)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 20, (4, 11), generator=g)
    lengths = torch.tensor([11, 9, 6, 2])  # Tacotron2 sorts its batch by length
    check_against_eager(model, fn, tokens, lengths)
    assert len(cap.graphs) == 1 and _packed_calls(cap) == 1
    rows = {r.pattern for r in wfpass.report(model).find(action="rewritten")}
    assert "rnn" in rows


class TextClassifier(nn.Module):
    """The textbook variable-length classifier: embedding -> packed GRU ->
    the last layer's h_n -> logits, trained with cross-entropy."""

    def __init__(self, vocab=30, dim=12, classes=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.gru = nn.GRU(dim, dim, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * dim, classes)

    def forward(self, tokens, lengths):
        packed = pack_padded_sequence(self.emb(tokens), lengths, batch_first=True, enforce_sorted=False)
        _, h_n = self.gru(packed)
        return self.head(torch.cat([h_n[-2], h_n[-1]], -1))


def test_text_classifier_training_matches_eager_over_batches():
    model = TextClassifier()
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager"))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    g = torch.Generator().manual_seed(7)
    for step in range(4):
        B, T = 3 + step, 5 + 2 * step
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        tokens = torch.randint(1, 30, (B, T), generator=g) * (torch.arange(T) < lengths[:, None])
        labels = torch.randint(0, 4, (B,), generator=g)
        losses = []
        for f, opt in ((fn, opts[0]), (ref, opts[1])):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(f(tokens, lengths), labels)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    (row,) = wfpass.report(model).find("rnn", "rewritten")
    assert row.stats["fused_calls"] == 4


def test_the_captured_rnns_forward_survives_copies_and_goes_with_restore():
    import pickle

    model = PackedModel(kind="GRU")
    fn, _ = _compile(model)
    x, L = _batch(5, [5, 2, 4], False)
    fn(x, L)
    assert "forward" in model.rnn.__dict__  # a PackedSequence goes to wfpass::packed_rnn while Dynamo traces
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert clone.rnn.forward.args[0] is clone.rnn  # the copy's forward is its own
        for a, b in zip(clone(x, L), model(x, L)):
            torch.testing.assert_close(a, b)
    wfpass.restore(model)
    assert "forward" not in model.rnn.__dict__ and "check_forward_args" not in model.rnn.__dict__


@pytest.mark.parametrize("grad", [True, False], ids=["training_step", "no_grad"])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_dropout_between_layers_in_training_mode(bidirectional, grad):
    """Dropout between layers runs where the module is in training mode,
    with or without grad (a bidirectional layer's two directions run as one
    op, ``wfpass.packed_bilayer``). With p = 1 it is deterministic: the second
    layer sees zeros, in eager and compiled alike; so every output and
    gradient must equal eager's (the first layer's weights get no gradient
    through the output, only through h_n / c_n)."""
    model = PackedModel(layers=2, bidirectional=bidirectional).train()
    model.rnn.dropout = 1.0
    ref = copy.deepcopy(model)
    fn, _ = _compile(model)
    x, L = _batch(6, [4, 6, 2, 5], False)
    with torch.set_grad_enabled(grad):
        out, exp = fn(x, L), ref(x, L)
    for a, b in zip(out, exp):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if grad:
        _loss(out).backward()
        _loss(exp).backward()
        scale = max(p.grad.abs().max() for p in ref.parameters())
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad - q.grad).abs().max() <= 1e-5 * scale, name
