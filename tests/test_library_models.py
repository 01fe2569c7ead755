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
  bf16 autocast: the RNN is rewritten, within eager-autocast's own distance
  from float32;
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


def _train(model, fn, batches, autocast):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outs = []
    for x in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = fn(x)
        _loss(out).backward()
        outs.append(out.detach().float())
        opt.step()
    return outs


def _distance(model, outs, ref, ref_outs):
    fwd = max((a - b).abs().max().item() / b.abs().max().item() for a, b in zip(outs, ref_outs))
    params = max((p - q).abs().max().item() / q.abs().max().item()
                 for p, q in zip(model.parameters(), ref.parameters()))
    return fwd, params


@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
def test_crdnn_trained_under_bf16_autocast(kind):
    """Three SGD steps under ``torch.autocast("cpu", bfloat16)``: the RNN is
    rewritten (it used to be skipped: "input is torch.bfloat16, weights
    torch.float32"), gradients reach the float32 Parameters, and its
    distance from float32 training is that of eager autocast or of Inductor
    under autocast (the larger)."""
    torch.manual_seed(0)
    model = CRDNNLike(kind)
    fp32, eager, inductor, plain_rnn = (copy.deepcopy(model) for _ in range(4))
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(4, 8, 12, generator=g) for _ in range(3)]
    outs = _train(model, torch.compile(model, backend="wformat"), batches, True)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ref_outs = _train(fp32, fp32, batches, False)
    ours = _distance(model, outs, fp32, ref_outs)
    try:
        eager_outs = _train(eager, eager, batches, True)
        theirs = _distance(eager, eager_outs, fp32, ref_outs)
    except RuntimeError:  # eager's oneDNN LSTM has no bf16 primitive on CPUs without AVX-512
        theirs = (2e-2, 2e-2)  # TOL[bfloat16]
    # Inductor under autocast, without wfpass: the compiler wformat hands its
    # graph to. On a CPU with bf16 instructions its conv + BatchNorm drift
    # from float32 training more than eager's do (BatchNorm bias after 3
    # steps: 1.33e-2, eager 1.28e-3, wformat 1.29e-2; Intel Xeon with AMX),
    # whatever the RNN runs on: that is the stock compiler's own distance.
    ind = _distance(inductor, _train(inductor, torch.compile(inductor, backend="inductor"), batches, True), fp32,
                    ref_outs)
    # And wformat without its RNN format: the same graph and compiler, the
    # RNN left as Dynamo traced it. Stock Inductor's figure alone did not
    # hold in a long run (one CI run: conv.weight 5.6e-3 there, 2.6e-2 in a
    # fresh process, wformat's 2.45e-2 in both): the parameters outside the
    # RNN drift with how the rest of the graph is compiled, and this
    # reference compiles it as wformat does.
    others = tuple(n for n in wfpass.pipeline.registered_names() if n != "fuse_rnn")
    plain = _distance(plain_rnn, _train(plain_rnn, torch.compile(plain_rnn, backend=wfpass.backend(passes=others)),
                                        batches, True), fp32, ref_outs)
    theirs = (max(theirs[0], ind[0], plain[0]), max(theirs[1], ind[1], plain[1]))
    assert ours[0] <= 1.5 * theirs[0] + 1e-3 and ours[1] <= 1.5 * theirs[1] + 1e-3, (ours, theirs)
    (row,) = wfpass.report(model).find("rnn")
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
