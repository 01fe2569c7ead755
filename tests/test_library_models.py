"""Models written the way third-party libraries write them, compiled with
wformat and compared with eager on a deep copy (forward, every gradient
scaled by the largest, SGD steps):

* pytorch-forecasting's ``nn.LSTM`` / ``nn.GRU`` subclasses, whose
  ``forward(x, hx=None, lengths=None, enforce_sorted=True)`` packs inside
  (DeepAR, TFT, RecurrentNetwork): their padded calls are rewritten, their
  packed calls run eagerly, nothing is installed on them, and the model
  called eagerly afterwards is eager's;
* a compile that fails leaves the model exactly as it was;
* speechbrain's CRDNN shape (conv + BatchNorm + GRU/LSTM) trained under CPU
  bf16 autocast: the RNN is rewritten, and each step's errors against
  float32 are within eager autocast's and Inductor's;
* the report's rows across ``load_state_dict(assign=True)``, ``.to()``,
  ``module.apply(init)`` and ``parametrize``;
* a cell loop in pieces counted as the whole loop.
"""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize
from torch.nn.utils import rnn as rnn_utils

import wfpass


def _grad_error(model, ref):
    """Largest gradient difference, scaled by the largest gradient."""
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()) if q.grad is not None]
    scale = max(b.abs().max().item() for _, b in pairs)
    return max((a.float() - b.float()).abs().max().item() for a, b in pairs) / scale


def _loss(out, seed=7):
    g = torch.Generator().manual_seed(seed)
    return (out.float() * torch.randn(out.shape, generator=g)).sum()


# -- pytorch-forecasting's RNN subclasses ------------------------------------------

class _ForecastingRNN:
    """pytorch-forecasting 1.8's ``RNN`` mixin (models/nn/rnn.py), as its
    ``LSTM`` / ``GRU`` define it: lengths packed inside ``forward``."""

    def forward(self, x, hx=None, lengths=None, enforce_sorted=True):
        max_length = x.size(1)
        if lengths is not None:
            pack = rnn_utils.pack_padded_sequence(x, lengths.cpu(), enforce_sorted=enforce_sorted,
                                                  batch_first=self.batch_first)
            out, hidden = super().forward(pack, hx=hx)
            out, _ = rnn_utils.pad_packed_sequence(out, batch_first=self.batch_first, total_length=max_length)
        else:
            out, hidden = super().forward(x, hx=hx)
        return out, hidden


class ForecastingLSTM(_ForecastingRNN, nn.LSTM):
    pass


class ForecastingGRU(_ForecastingRNN, nn.GRU):
    pass


class DeepARLike(nn.Module):
    """Encoder over the observed lengths (packed), decoder from its state."""

    def __init__(self, cls):
        super().__init__()
        self.rnn = cls(6, 16, num_layers=2, batch_first=True)
        self.dec = cls(6, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 2)

    def forward(self, x, y, lengths):
        enc, hidden = self.rnn(x, lengths=lengths, enforce_sorted=False)
        out, _ = self.dec(y, hidden)
        return self.head(out) + self.head(enc).mean(1, keepdim=True)


@pytest.mark.parametrize("cls", [ForecastingLSTM, ForecastingGRU])
def test_forecasting_subclass_keeps_its_forward(cls):
    torch.manual_seed(0)
    model = DeepARLike(cls)
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend="wformat")
    g = torch.Generator().manual_seed(1)
    for lengths in ([9, 7, 4], [5, 9, 2]):
        x, y, L = torch.randn(3, 9, 6, generator=g), torch.randn(3, 4, 6, generator=g), torch.tensor(lengths)
        model.zero_grad(), ref.zero_grad()
        out, exp = fn(x, y, L), ref(x, y, L)
        torch.testing.assert_close(out, exp, rtol=1e-5, atol=1e-6)
        _loss(out).backward()
        _loss(exp).backward()
        assert _grad_error(model, ref) < 1e-5
    for m in (model.rnn, model.dec):  # nothing installed: the class's own forward, its signature intact
        assert not {"forward", "check_forward_args"} & set(m.__dict__)
        assert "lengths" in inspect.signature(m.forward).parameters
    rows = {r.params[0].split(".")[0]: r for r in wfpass.report(model).find("rnn")}
    assert rows["dec"].action == "rewritten", rows["dec"].reason  # the padded call its forward makes: one fused call
    assert rows["rnn"].action == "skipped" and "overrides forward" in rows["rnn"].reason
    # Eagerly afterwards: eager's values.
    x, y, L = torch.randn(3, 9, 6), torch.randn(3, 4, 6), torch.tensor([3, 9, 1])
    torch.testing.assert_close(model(x, y, L), ref(x, y, L), rtol=1e-5, atol=1e-6)


def test_failed_compile_leaves_the_model_as_it_was():
    """The inner compiler raises: the RNN keeps no forward wrapper, its
    weights stay where they were, and the model runs eagerly as before."""

    def broken(gm, example_inputs):
        raise RuntimeError("inner compiler broke")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    model.rnn = nn.LSTM(4, 8, num_layers=2)
    seq = lambda x: model.rnn(model[0](x))[0]  # noqa: E731
    ptrs = [p.untyped_storage().data_ptr() for p in model.rnn.parameters()]
    fn = torch.compile(seq, backend=wfpass.backend(inner=broken))
    with pytest.raises(Exception, match="inner compiler broke"):
        fn(torch.randn(5, 2, 4))
    # The forward wrapper goes; the argument check that names the RNN in eager's errors stays.
    assert "forward" not in model.rnn.__dict__
    assert [p.untyped_storage().data_ptr() for p in model.rnn.parameters()] == ptrs
    ref = copy.deepcopy(model)
    x = torch.randn(5, 2, 4)
    torch.testing.assert_close(seq(x), ref.rnn(ref[0](x))[0])


# -- speechbrain's CRDNN shape under autocast ------------------------------------------

class CRDNNLike(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.conv = nn.Conv1d(8, 16, 3, padding=1)
        self.bn = nn.BatchNorm1d(16)
        self.rnn = getattr(nn, kind)(16, 24, num_layers=2, batch_first=True)
        self.out = nn.Linear(24, 5)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))).transpose(1, 2)
        y, _ = self.rnn(h)
        return self.out(y + h.mean(-1, keepdim=True))  # a residual around the RNN


def _errors_on_fp32_path(model, variants, batches):
    """Each variant's forward, gradient and RNN-gradient errors (the largest
    over the steps) along float32 SGD training: before each step every variant takes the float32 model's
    parameters and buffers (copied in place, so wformat's views of its flat
    block stay what they are), runs forward and backward under bf16
    autocast, and is compared with float32's output and gradients, each
    error scaled by the largest value. Comparing on one path keeps the
    check to what a step computes: three steps of separate trajectories
    through a conv + BatchNorm drift apart by far more than one step's
    rounding, and by how much changes with the compiler's rounding order
    (wformat's own trajectory ended 5x further from float32 than eager's on
    one torch release while its every step was as close or closer)."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    errors = {name: [0.0, 0.0, 0.0] for name in variants}
    rnn = [n.startswith("rnn.") for n, _ in ref.named_parameters()]
    for x in batches:
        opt.zero_grad()
        ref_out = ref(x)
        _loss(ref_out).backward()
        ref_grads = [p.grad for p in ref.parameters()]
        scale = max(g.abs().max().item() for g in ref_grads)
        for name, (m, fn) in variants.items():
            with torch.no_grad():
                for p, q in zip(m.parameters(), ref.parameters()):
                    p.copy_(q)
                for p, q in zip(m.buffers(), ref.buffers()):
                    p.copy_(q)
            m.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = fn(x)
            _loss(out).backward()
            fwd = (out.float() - ref_out).abs().max().item() / ref_out.abs().max().item()
            grads = [(p.grad - g).abs().max().item() / scale for p, g in zip(m.parameters(), ref_grads)]
            rnn_grad = max(e for e, r in zip(grads, rnn) if r)
            errors[name] = [max(a, b) for a, b in zip(errors[name], (fwd, max(grads), rnn_grad))]
        opt.step()
    return errors


@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
def test_crdnn_trained_under_bf16_autocast(kind):
    """SGD steps under ``torch.autocast("cpu", bfloat16)``: the RNN is
    rewritten (it used to be skipped: "input is torch.bfloat16, weights
    torch.float32"), gradients reach the float32 Parameters, and at every
    step its forward and gradient errors against float32 are at most those
    of eager autocast, of Inductor under autocast, or of wformat without its
    RNN format (the largest), each compiled copy from a fresh Dynamo."""
    torch.manual_seed(0)
    model = CRDNNLike(kind)
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(4, 8, 12, generator=g) for _ in range(3)]
    others = tuple(n for n in wfpass.pipeline.registered_names() if n != "fuse_rnn")
    backends = {"wformat": "wformat", "inductor": "inductor", "without the RNN format": wfpass.backend(passes=others)}
    variants = {}
    for name, backend in backends.items():
        # One code object serves every copy: a variant that found Dynamo's
        # cache full would run eagerly without a word, so each compiles
        # from a fresh Dynamo, and its first call is checked to compile.
        torch._dynamo.reset()
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        m = copy.deepcopy(model)
        variants[name] = (m, torch.compile(m, backend=backend))
        _errors_on_fp32_path(model, {name: variants[name]}, batches[:1])
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs, f"{name} compiled no graph"
    eager = copy.deepcopy(model)
    variants["eager"] = (eager, eager)
    try:
        errors = _errors_on_fp32_path(model, variants, batches)
    except RuntimeError:  # eager's oneDNN LSTM has no bf16 primitive on CPUs without AVX-512
        del variants["eager"]
        errors = _errors_on_fp32_path(model, variants, batches)
        errors["eager"] = [2e-2, 2e-2, 2e-2]  # TOL[bfloat16]
    # Forward, every gradient, and the RNN's own gradients apart: the conv's
    # bf16 gradient dominates the second (the same 6e-2 in every variant for
    # the GRU), so only the third sees the RNN's backward.
    ours = errors.pop("wformat")
    bound = [max(e[i] for e in errors.values()) for i in range(3)]
    assert all(a <= 1.5 * b + 1e-4 for a, b in zip(ours, bound)), (ours, errors)
    wf_model = variants["wformat"][0]
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in wf_model.parameters())
    (row,) = wfpass.report(wf_model).find("rnn")
    assert row.action == "rewritten" and "under autocast" in row.reason and "torch.bfloat16" in row.reason, row.reason


def test_autocast_float32_input_returns_eagers_dtype():
    """An RNN first in the model (its input float32) under autocast: it
    computes in bf16; a GRU returns float32 as eager's does."""
    torch.manual_seed(0)
    gru = nn.GRU(6, 12, batch_first=True)
    ref = copy.deepcopy(gru)
    fn = torch.compile(lambda x: gru(x)[0], backend="wformat")
    x = torch.randn(2, 7, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, exp = fn(x), ref(x)[0]
    assert out.dtype == exp.dtype == torch.float32
    torch.testing.assert_close(out, exp, rtol=2e-2, atol=2e-2)
    _loss(out).backward()
    _loss(exp).backward()
    assert _grad_error(gru, ref) < 4e-2
    (row,) = wfpass.report(gru).find("rnn")
    assert row.action == "rewritten"


# -- report rows across the module's life ----------------------------------------------

class _LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(8, 16, 2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def _assign(m):
    m.load_state_dict({k: v.clone() + 0.01 for k, v in m.state_dict().items()}, assign=True)


def _to(m):
    m.to(torch.float64)
    m.to(torch.float32)


def _init(m):
    def init(mod):
        if isinstance(mod, nn.LSTM):
            for n, p in list(mod.named_parameters()):
                setattr(mod, n, nn.Parameter(torch.randn_like(p) * 0.1))
    m.apply(init)


class _Scale(nn.Module):
    def forward(self, w):
        return 0.5 * w


def _parametrize(m):
    parametrize.register_parametrization(m.head, "weight", _Scale())


@pytest.mark.parametrize("event", [_assign, _to, _init, _parametrize], ids=["assign", "to", "apply_init", "parametrize"])
def test_report_rows_survive(event):
    torch.manual_seed(0)
    model = _LM()
    fn = torch.compile(model, backend="wformat")
    x = torch.randn(2, 6, 8)
    fn(x)
    before = sorted((r.pattern, r.action) for r in wfpass.report(model).records)
    assert ("rnn", "rewritten") in before
    event(model)
    ref = copy.deepcopy(model)
    torch.testing.assert_close(fn(x), ref(x), rtol=1e-5, atol=1e-6)
    after = sorted((r.pattern, r.action) for r in wfpass.report(model).records)
    if event is _parametrize:  # the recompiled graph's linear reads a computed weight: a row of its own
        assert set(before) <= set(after), (before, after)
    else:
        assert after == before, (before, after)


# -- a cell loop in pieces -------------------------------------------------------------

class MaskedCellLoop(nn.Module):
    """A decoder that resets its state between steps (masking): pieces of one loop."""

    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(4, 8)

    def forward(self, x, mask):
        h = c = x.new_zeros(x.shape[1], 8)
        outs = []
        for t in range(x.shape[0]):
            h, c = self.cell(x[t], (h, c))
            outs.append(h)
            h, c = h * mask[t], c * mask[t]
        return torch.stack(outs)


def test_cell_loop_pieces_counted_as_the_loop():
    torch.manual_seed(0)
    model = MaskedCellLoop()
    ref = copy.deepcopy(model)
    x, mask = torch.randn(6, 3, 4), (torch.rand(6, 3, 1) > 0.3).float()
    torch.testing.assert_close(torch.compile(model, backend="wformat")(x, mask), ref(x, mask))
    rows = [r for r in wfpass.report(model).find("rnn") if "pieces" in r.reason]
    assert rows, wfpass.report(model)
    assert all("6 steps in 6 pieces" in r.reason and "1 steps" not in r.reason for r in rows), [r.reason for r in rows]
