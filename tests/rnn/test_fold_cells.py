"""Python loops of RNN cells folded into one RNN call (rnn/cells/).

Every form is checked against eager on a deep copy (forward, input and
parameter grads), and by counting the ops of the graph the inner compiler
receives: T cell steps before, one RNN call after.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import wfpass
from wfpass.rnn.cells.match import CELL_FUNCTIONS
from wfpass.rnn.eager import CellLoopCall
from wfpass.rnn.paths import RnnForward

from wftest import TOL, Capture, assert_same_fwd_bwd, param_ids, train_steps

I, H, B = 6, 8, 3


def _cell(kind: str, i: int = I, bias: bool = True) -> nn.Module:
    if kind == "RNN_RELU":
        return nn.RNNCell(i, H, bias=bias, nonlinearity="relu")
    return {"LSTM": nn.LSTMCell, "GRU": nn.GRUCell, "RNN": nn.RNNCell}[kind](i, H, bias=bias)


class Loop(nn.Module):
    """One cell stepped over x in a Python loop, in the forms users write."""

    def __init__(self, kind="LSTM", form="index", state="zero", gather="stack", bias=True, layers=1):
        super().__init__()
        self.kind, self.form, self.state, self.gather = kind, form, state, gather
        self.cells = nn.ModuleList([_cell(kind, I if i == 0 else H, bias) for i in range(layers)])

    def steps(self, x):
        T = x.shape[1] if self.form == "batch_first" else x.shape[0]
        if self.form == "index":
            return [x[t] for t in range(T)]
        if self.form == "batch_first":
            return [x[:, t] for t in range(T)]
        if self.form == "unbind":
            return list(x.unbind(0))
        if self.form == "split":
            return [s.squeeze(0) for s in x.split(1)]
        if self.form == "independent":  # any tensors that do not depend on the loop
            return [torch.tanh(x[t]) * 2 for t in range(T)]
        raise ValueError(self.form)

    def forward(self, x, h0=None):
        lstm = self.kind == "LSTM"
        xs = self.steps(x)
        sts = []
        for cell in self.cells:
            if self.state == "zero":
                sts.append(None)
            elif self.state == "given":
                sts.append((h0, h0 * 0.5) if lstm else h0)
            else:  # zeros built by the user
                z = torch.zeros(xs[0].shape[0], H)
                sts.append((z, z) if lstm else z)
        outs = []
        for xt in xs:
            inp = xt
            for k, cell in enumerate(self.cells):
                sts[k] = cell(inp) if sts[k] is None else cell(inp, sts[k])
                inp = sts[k][0] if lstm else sts[k]
            outs.append(inp)
        last = sts[-1][1] if lstm else sts[-1]
        if self.gather == "stack":
            return torch.stack(outs, 1 if self.form == "batch_first" else 0), last
        if self.gather == "cat":
            return torch.cat([o.unsqueeze(0) for o in outs]), last
        return inp, last  # only the last state


def _cells(t) -> bool:
    return t in CELL_FUNCTIONS


def _rnn(t) -> bool:
    return isinstance(t, RnnForward)


def _records(model):
    return [r for r in wfpass.report(model).records if r.pattern == "rnn"]


def _check(model, x, *extra, inner="capture", dtype=torch.float32, T=None):
    cap = Capture()

    def transform(m):
        return torch.compile(m, backend=wfpass.backend(inner=cap if inner == "capture" else inner))

    rtol, atol = TOL[dtype]
    if dtype == torch.float32:
        # Fused kernels sum in another order than T separate cell GEMMs.
        rtol, atol = 1e-4, 1e-5
    assert_same_fwd_bwd(model, transform, [x, *extra], rtol=rtol, atol=atol, dtype=dtype)
    return cap


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN", "RNN_RELU"])
def test_each_cell_kind_folds_to_one_rnn_call(kind):
    m = Loop(kind)
    x = torch.randn(7, B, I, requires_grad=True)
    cap = _check(m, x)
    assert cap.count(_cells) == 0 and cap.count(_rnn) == 1
    (rec,) = _records(m)
    assert rec.action == "rewritten" and "7 steps" in rec.reason
    assert rec.params == [f"cells.0.{n}" for n, _ in m.cells[0].named_parameters()]
    # Same Parameter objects, now views of one flat block.
    ptrs = {p.untyped_storage().data_ptr() for p in m.parameters()}
    assert len(ptrs) == 1


@pytest.mark.parametrize("form", ["batch_first", "unbind", "split", "independent"])
def test_step_input_forms(form):
    m = Loop("LSTM", form=form)
    x = torch.randn(B, 6, I) if form == "batch_first" else torch.randn(6, B, I)
    cap = _check(m, x.requires_grad_())
    assert cap.count(_cells) == 0 and cap.count(_rnn) == 1


@pytest.mark.parametrize("state,gather,bias", [
    ("given", "stack", True), ("zeros", "cat", True), ("zero", "last", False), ("given", "last", False)])
def test_states_gathers_and_bias(state, gather, bias):
    m = Loop("LSTM", state=state, gather=gather, bias=bias)
    x = torch.randn(5, B, I, requires_grad=True)
    extra = [torch.randn(B, H, requires_grad=True)] if state == "given" else []
    cap = _check(m, x, *extra)
    assert cap.count(_cells) == 0 and cap.count(_rnn) == 1


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_stacked_cells_become_one_multi_layer_rnn(kind):
    m = Loop(kind, layers=2)
    x = torch.randn(6, B, I, requires_grad=True)
    cap = _check(m, x)
    assert cap.count(_cells) == 0 and cap.count(_rnn) == 1
    (node,) = [n for g in cap.graphs for n in g.graph.nodes if _rnn(n.target)]
    assert node.target.spec.num_layers == 2
    (rec,) = _records(m)
    assert "2 stacked" in rec.reason and len(rec.params) == 8


def test_inductor_bf16_and_training_steps_match_eager():
    torch.manual_seed(1)
    m = Loop("LSTM", layers=2)
    ref = copy.deepcopy(m)
    ids = param_ids(m)
    xs = [torch.randn(9, B, I) for _ in range(5)]
    # The float32 training steps through aot_eager (AOTAutograd's forward and
    # backward of the folded loop, as Inductor gets them); the bf16 model
    # below goes end to end through Inductor, backward included, so a folded
    # loop is still trained through Inductor here with one compile less.
    cm = torch.compile(m, backend=wfpass.backend(inner="aot_eager"))
    got = train_steps(m, cm, lambda i: (xs[i],), torch.optim.SGD, lr=0.1)
    want = train_steps(ref, ref, lambda i: (xs[i],), torch.optim.SGD, lr=0.1)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-4, atol=1e-4)
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    assert param_ids(m) == ids
    assert set(m.state_dict()) == set(ref.state_dict())
    (rec,) = _records(m)
    assert rec.stats["fused_calls"] >= 1
    # bf16: the oneDNN kernel in bf16 against the bf16 cells, each error
    # scaled by the largest value it is compared with (bf16 keeps 8 bits).
    mb = Loop("LSTM").to(torch.bfloat16)
    rb = copy.deepcopy(mb)
    xb = torch.randn(8, B, I, dtype=torch.bfloat16)
    Rb = torch.randn(8, B, H, dtype=torch.bfloat16)
    outs = []
    for mod, fn in ((mb, torch.compile(mb, backend="wformat")), (rb, rb)):
        out, last = fn(xb)
        ((out * Rb).sum() + (last * Rb[0]).sum()).backward()
        outs.append((out, last))
    for a, b in zip(*outs):
        assert (a - b).abs().max() / b.abs().max() < 2e-2
    for (n, p), q in zip(mb.named_parameters(), rb.parameters()):
        assert (p.grad - q.grad).abs().max() / q.grad.abs().max() < 2e-2, n
    assert _records(mb)[0].action == "rewritten"


def test_dynamic_shapes_with_changing_length():
    m = Loop("GRU")
    ref = copy.deepcopy(m)
    cap = Capture()
    cm = torch.compile(m, backend=wfpass.backend(inner=cap), dynamic=True)
    for T in (5, 9, 12):
        x = torch.randn(T, B + T % 2, I)
        torch.testing.assert_close(cm(x)[0], ref(x)[0], rtol=1e-4, atol=1e-5)
    assert cap.count(_cells) == 0 and cap.count(_rnn) == len(cap.graphs) >= 2


# -- left alone, with the reason, and still right -------------------------------


class Feedback(nn.Module):
    """Each step's input depends on the previous state (an attention/feedback decoder)."""

    def __init__(self):
        super().__init__()
        self.cell, self.back = nn.LSTMCell(I, H), nn.Linear(H, I)

    def forward(self, x):
        h = c = torch.zeros(x.shape[1], H)
        outs = []
        for t in range(x.shape[0]):
            h, c = self.cell(x[t] + self.back(h), (h, c))
            outs.append(h)
        return torch.stack(outs)


class Masked(nn.Module):
    """The state is reset per sequence between steps (an RL rollout's ``done``)."""

    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(I, H)

    def forward(self, x, done):
        h = torch.zeros(x.shape[1], H)
        outs = []
        for t in range(x.shape[0]):
            h = self.cell(x[t], h * (1 - done[t]))
            outs.append(h)
        return torch.stack(outs)


class PerStep(nn.Module):
    """A different cell at every step."""

    def __init__(self, T=5):
        super().__init__()
        self.cells = nn.ModuleList([nn.GRUCell(I, H) for _ in range(T)])

    def forward(self, x):
        h = torch.zeros(x.shape[1], H)
        for t, cell in enumerate(self.cells):
            h = cell(x[t], h)
        return h


class Tied(nn.Module):
    """The cell's input weight is also another module's weight."""

    def __init__(self):
        super().__init__()
        self.cell = nn.RNNCell(I, H)
        self.other = nn.Linear(I, H)
        self.other.weight = self.cell.weight_ih

    def forward(self, x):
        h = torch.zeros(x.shape[1], H)
        outs = []
        for t in range(x.shape[0]):
            h = self.cell(x[t], h)
            outs.append(h)
        return torch.stack(outs) + self.other(x).sum()


@pytest.mark.parametrize("case", ["feedback", "masked", "per_step", "short"])
def test_unfoldable_loops_are_left_as_they_were_with_the_reason(case):
    x = torch.randn(5, B, I, requires_grad=True)
    extra = []
    if case == "feedback":
        m, why = Feedback(), "depends on an earlier step's state"
    elif case == "masked":
        m, why = Masked(), "passes through other operations between steps"
        extra = [(torch.rand(5, B, 1) > 0.7).float()]
    elif case == "per_step":
        m, why = PerStep(), "different weights"
    else:
        m, why = Loop("LSTM"), "<= seq_threshold 2"
        x = torch.randn(2, B, I, requires_grad=True)
    cap = _check(m, x, *extra)
    steps = x.shape[0]
    assert cap.count(_cells) == steps and cap.count(_rnn) == 0
    recs = _records(m)
    assert recs and all(r.action == "skipped" for r in recs)
    assert any(why in r.reason for r in recs), [r.reason for r in recs]
    # Every chain of cells is in the report.
    covered = {p for r in recs for p in r.params}
    assert covered == {n for n, p in m.named_parameters() if "cell" in n}


def test_hard_reset_splits_the_loop_into_two_folded_loops():
    class Reset(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = nn.LSTMCell(I, H)

        def forward(self, x):
            st = None
            outs = []
            for t in range(x.shape[0]):
                if t == 4:
                    st = None  # a new sequence: nothing flows from the first piece
                st = self.cell(x[t]) if st is None else self.cell(x[t], st)
                outs.append(st[0])
            return torch.stack(outs)

    m = Reset()
    cap = _check(m, torch.randn(9, B, I, requires_grad=True))
    assert cap.count(_cells) == 0 and cap.count(_rnn) == 2
    recs = _records(m)
    assert len(recs) == 1 and recs[0].action == "rewritten"  # one weight set, one record


def test_tied_weights_stay_tied_and_are_read_where_they_are():
    m = Tied()
    cap = _check(m, torch.randn(6, B, I, requires_grad=True))
    assert cap.count(_rnn) == 1
    # One Parameter object under two names: Dynamo passes it once, the
    # block holds it once, and both modules still read the same memory.
    assert m.other.weight is m.cell.weight_ih
    assert m.other.weight.data_ptr() == m.cell.weight_ih.data_ptr()
    (rec,) = _records(m)
    assert rec.action == "rewritten"


def test_residual_and_reused_outputs_around_the_loop():
    class Around(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell, self.proj = nn.LSTMCell(I, H), nn.Linear(H, I)

        def forward(self, x):
            h = c = torch.zeros(x.shape[1], H)
            acc = []
            for t in range(x.shape[0]):
                h, c = self.cell(x[t], (h, c))
                acc.append(self.proj(h) + x[t])  # read inside the loop, residual to the input
            return torch.stack(acc).sum(0) + self.proj(h), c, h

    m = Around()
    cap = _check(m, torch.randn(6, B, I, requires_grad=True))
    assert cap.count(_cells) == 0 and cap.count(_rnn) == 1


def test_dry_run_explain_changes_nothing():
    m = Loop("LSTM")
    before = [p.untyped_storage().data_ptr() for p in m.parameters()]
    rep = wfpass.explain(m, torch.randn(6, B, I))
    assert any(r.action == "would rewrite" and "6 steps" in r.reason for r in rep.records)
    assert [p.untyped_storage().data_ptr() for p in m.parameters()] == before


def test_symbolic_trace_apply_folds_call_module_cells():
    class Traced(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = nn.LSTMCell(I, H), nn.LSTMCell(H, H)

        def forward(self, x):
            s1 = s2 = None
            outs = []
            for t in range(6):
                s1 = self.c1(x[t]) if s1 is None else self.c1(x[t], s1)
                s2 = self.c2(s1[0]) if s2 is None else self.c2(s1[0], s2)
                outs.append(s2[0] * 2)
            return torch.stack(outs), s2[1]

    m = Traced()
    ref = copy.deepcopy(m)
    gm = fx.symbolic_trace(m)
    rep = wfpass.apply(gm)
    calls = [n for n in gm.graph.nodes if isinstance(n.target, CellLoopCall)]
    assert len(calls) == 1 and not any(n.op == "call_module" for n in gm.graph.nodes)
    assert [r.action for r in rep.records] == ["rewritten"]
    for x in (torch.randn(6, B, I, requires_grad=True), torch.randn(6, I, requires_grad=True)):  # batched, unbatched
        xr = x.detach().clone().requires_grad_()
        out, ref_out = gm(x), ref(xr)
        for a, b in zip(out, ref_out):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        sum(o.sum() * (i + 1) for i, o in enumerate(out)).backward()
        sum(o.sum() * (i + 1) for i, o in enumerate(ref_out)).backward()
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=n)
    assert rep.records[0].stats["fused_calls"] == 2


def test_cell_sharing_weights_with_an_lstm_keeps_the_tie():
    """A cell whose Parameters are an ``nn.LSTM``'s layer: the cell loop and
    the LSTM are one weight set, one block, one record naming both."""

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(I, H)
            self.cell = nn.LSTMCell(I, H)
            for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                setattr(self.cell, n, getattr(self.lstm, f"{n}_l0"))

        def forward(self, x):
            y, _ = self.lstm(x)
            h = c = torch.zeros(x.shape[1], H)
            outs = []
            for t in range(x.shape[0]):
                h, c = self.cell(x[t] * 0.5, (h, c))
                outs.append(h)
            return y + torch.stack(outs)

    m = Shared()
    cap = _check(m, torch.randn(6, B, I, requires_grad=True))
    assert cap.count(_cells) == 0 and cap.count(_rnn) == 2
    assert m.cell.weight_ih is m.lstm.weight_ih_l0
    (rec,) = _records(m)
    assert rec.action == "rewritten" and "nn.LSTMCell loop" in rec.reason and "'lstm' (nn.LSTM)" in rec.reason
    assert len({p.untyped_storage().data_ptr() for p in m.parameters()}) == 1
