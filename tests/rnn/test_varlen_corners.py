"""Packed batches in the corners users reach: a PackedSequence made outside
the compiled function into stacked RNNs without h0, ``dynamic=True`` and a
dropout changed between calls, autocast. Each case runs eagerly on a deep
copy beside it: forward, every gradient (scaled by the largest), one SGD step.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import wfpass


def _rnn(kind, layers, bidirectional, **kw):
    cls = {"LSTM": nn.LSTM, "GRU": nn.GRU, "RNN": nn.RNN}[kind]
    return cls(5, 6, num_layers=layers, bidirectional=bidirectional, **kw)


def _projection_loss(tensors, seed=3):
    g = torch.Generator().manual_seed(seed)
    return sum((t.float() * torch.randn(t.shape, generator=g)).sum() for t in tensors)


def _grads_close(model, ref, extra=(), tol=1e-5):
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())] + list(extra)
    scale = max(b.abs().max().item() for _, b in pairs)
    for a, b in pairs:
        assert a is not None and b is not None
        assert (a.float() - b.float()).abs().max().item() / scale < tol


def _sgd_step_close(model, ref, rtol=1e-5, atol=1e-5):
    for m in (model, ref):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol)


def _backend(inductor: bool):
    """``backend="wformat"`` (Inductor, what users run) for one case of each
    test function; the others through ``inner="aot_eager"``, which traces
    the same forward and backward (AOTAutograd) after the same wfpass
    rewrite, without an Inductor compile each."""
    return "wformat" if inductor else wfpass.backend(inner="aot_eager")


def _flat(out):
    seq, state = out
    return [seq.data] + (list(state) if isinstance(state, tuple) else [state])


@pytest.mark.parametrize("kind,layers,bidirectional", [
    ("LSTM", 2, False), ("GRU", 2, False), ("RNN", 2, True), ("LSTM", 3, True), ("LSTM", 1, False),
])
def test_outside_packed_sequence_without_h0(kind, layers, bidirectional):
    """The issue's case: ``pack_padded_sequence`` called before the compiled
    RNN, no h0, 2+ layers (was Dynamo's PendingUnbackedSymbolNotFound)."""
    torch.manual_seed(0)
    model = _rnn(kind, layers, bidirectional)
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=_backend((kind, layers, bidirectional) == ("LSTM", 2, False)))
    for lengths in ([6, 4, 3, 1], [5, 5, 2], [7, 1]):  # one graph serves every batch
        model.zero_grad(), ref.zero_grad()
        x = torch.randn(max(lengths), len(lengths), 5)
        xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = fn(pack_padded_sequence(xs, torch.tensor(lengths)))
        exp = ref(pack_padded_sequence(xr, torch.tensor(lengths)))
        assert isinstance(out[0], PackedSequence)
        for a, b in zip(_flat(out), _flat(exp)):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        _projection_loss(_flat(out)).backward()
        _projection_loss(_flat(exp)).backward()
        _grads_close(model, ref, [(xs.grad, xr.grad)])
    _sgd_step_close(model, ref)
    rows = wfpass.report(model).find("rnn", "rewritten")
    assert rows and all("variable-length batch" in r.reason for r in rows)


def test_outside_packed_sequence_unsorted_without_h0_under_no_grad():
    torch.manual_seed(0)
    model = _rnn("LSTM", 2, True).eval()
    ref = copy.deepcopy(model)
    packed = pack_padded_sequence(torch.randn(6, 4, 5), torch.tensor([3, 6, 1, 4]), enforce_sorted=False)
    with torch.no_grad():
        out = torch.compile(model, backend="wformat")(packed)
        exp = ref(packed)
    for a, b in zip(_flat(out), _flat(exp)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class PackPadModel(nn.Module):
    def __init__(self, kind="LSTM", layers=2, bidirectional=False, dropout=0.0, autocast=None):
        super().__init__()
        self.pre = nn.Linear(5, 5)
        self.rnn = _rnn(kind, layers, bidirectional, dropout=dropout)
        self.autocast = autocast

    def forward(self, x, lengths):
        with torch.autocast("cpu", dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            p = pack_padded_sequence(self.pre(x), lengths, enforce_sorted=False)
            out, state = self.rnn(p)
            y, _ = pad_packed_sequence(out, batch_first=True)
        return [y] + (list(state) if isinstance(state, tuple) else [state])


def _batches():
    g = torch.Generator().manual_seed(1)
    for lengths in ([6, 4, 3, 1], [2, 7, 3], [5, 5, 4, 1, 2], [3, 6, 1, 4]):
        yield torch.randn(max(lengths), len(lengths), 5, generator=g), torch.tensor(lengths)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_dynamic_true_and_a_dropout_changed_between_calls(kind):
    """``dynamic=True`` lifts the module's float dropout to a graph input
    (was ``float() argument must be ... not 'Node'`` in the guards); a new
    value recompiles (Dynamo guards it) and the graph uses it."""
    torch.manual_seed(0)
    model = PackPadModel(kind)
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=_backend(kind == "LSTM"), dynamic=True)
    for i, (x, lengths) in enumerate(_batches()):
        if i == 2:  # p = 1 drops everything between the layers: deterministic, and visible
            model.rnn.dropout = ref.rnn.dropout = 1.0
        model.zero_grad(), ref.zero_grad()
        out, exp = fn(x, lengths), ref(x, lengths)
        for a, b in zip(out, exp):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        _projection_loss(out).backward()
        _projection_loss(exp).backward()
        _grads_close(model, ref)
    _sgd_step_close(model, ref)
    rows = wfpass.report(model).find("rnn")
    assert rows and all(r.action == "rewritten" for r in rows), [r.reason for r in rows]


@pytest.mark.parametrize("kind,layers,bidirectional", [("LSTM", 2, False), ("LSTM", 1, True), ("GRU", 2, True),
                                                       ("RNN", 3, False)])
@pytest.mark.parametrize("grad", [True, False])
def test_autocast_bf16_inside_the_compiled_function(kind, layers, bidirectional, grad):
    """Under ``torch.autocast("cpu", bfloat16)`` the linear before the RNN
    gives bf16 data; eager then runs the packed RNN in bf16 (was ``mat1 and
    mat2 must have the same dtype`` in training, oneDNN's "could not create a
    primitive descriptor" without grad)."""
    torch.manual_seed(0)
    model = PackPadModel(kind, layers, bidirectional, autocast=torch.bfloat16)
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=_backend((kind, layers, bidirectional) == ("LSTM", 2, False)))
    x, lengths = next(_batches())
    with torch.set_grad_enabled(grad):
        out, exp = fn(x, lengths), ref(x, lengths)
    for a, b in zip(out, exp):
        assert a.dtype == b.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    if grad:
        _projection_loss(out).backward()
        _projection_loss(exp).backward()
        _grads_close(model, ref, tol=4e-2)  # bf16 rounding, accumulated over steps
        _sgd_step_close(model, ref, rtol=1e-2, atol=1e-2)


def test_autocast_outside_the_compiled_function_matches_eager():
    torch.manual_seed(0)
    model = PackPadModel("LSTM", 2, True)
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend="wformat")
    x, lengths = next(_batches())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, exp = fn(x, lengths), ref(x, lengths)
    for a, b in zip(out, exp):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    _projection_loss(out).backward()
    _projection_loss(exp).backward()
    _grads_close(model, ref, tol=4e-2)


# -- calls wfpass cannot take: the report says they ran eagerly, and why, counted ----------------

class PackedLSTM(nn.Module):
    def __init__(self, rnn=None):
        super().__init__()
        self.rnn = rnn if rnn is not None else nn.LSTM(5, 6, num_layers=2)

    def forward(self, x, lengths):
        out, _ = self.rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))
        return pad_packed_sequence(out)[0]


def _run_in_subprocess(code: str) -> str:
    """``allow_rnn`` is process-wide Dynamo config read at import: each case
    in a fresh interpreter."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


_ALLOW_RNN_CASE = """
import copy, torch, torch.nn as nn
{before}
import wfpass
{after}
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.rnn = nn.LSTM(5, 6, num_layers=2)
    def forward(s, x, l):
        return pad_packed_sequence(s.rnn(pack_padded_sequence(x, l, enforce_sorted=False))[0])[0]
torch.manual_seed(0)
m = M(); ref = copy.deepcopy(m)
c = torch.compile(m, backend={backend})
for lengths in ([6, 4, 3, 1], [2, 5, 1, 3], [6, 4, 3, 1]):
    x = torch.randn(6, 4, 5)
    torch.testing.assert_close(c(x, torch.tensor(lengths)), ref(x, torch.tensor(lengths)))
rows = wfpass.report(m).find("rnn")
print("ROWS", [(r.action, r.stats.get("fused_calls", 0), r.stats.get("eager_calls", 0)) for r in rows])
print("CONFIG", repr(torch._dynamo.config.allow_rnn), bool(torch._dynamo.config.allow_rnn))
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_allow_rnn_set_by_the_user_keeps_the_packed_rnn_in_the_graph(when):
    """``torch._dynamo.config.allow_rnn = True`` set before or after importing
    wfpass (was: a "data dependent operator" graph break inside the RNN, an
    eager LSTM and no row). wfpass keeps the user's True for every backend
    and still takes the packed call of a wformat trace."""
    line = "torch._dynamo.config.allow_rnn = True"
    # "before" end to end through Inductor; "after" through aot_eager (what
    # it checks is Dynamo's capture and wfpass's row, ahead of the inner
    # compiler), which spares a fresh process its Inductor compiles.
    backend = '"wformat"' if when == "before" else 'wfpass.backend(inner="aot_eager")'
    out = _run_in_subprocess(_ALLOW_RNN_CASE.format(before=line if when == "before" else "",
                                                    after=line if when == "after" else "", backend=backend))
    rows = eval(out.split("ROWS ", 1)[1].splitlines()[0])
    assert rows and all(a == "rewritten" for a, _, _ in rows), out
    assert sum(f for _, f, _ in rows) + sum(e for _, _, e in rows) == 3, out  # every call is on the row
    assert "CONFIG True True" in out


def test_recompile_limit_reached_is_on_the_row_with_its_calls():
    """Lengths as a Python list recompile per batch size; past Dynamo's
    recompile limit the calls run eagerly: the row counts them and says why
    (was: fused_calls=8 and nothing about the 5 eager calls)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = PackedLSTM()
    ref = copy.deepcopy(model)
    # aot_eager: the limit is Dynamo's, reached before any inner compiler
    # runs, and each of the ``limit`` compiles through Inductor cost seconds.
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager"))
    # A limit of 3 instead of Dynamo's default 8: the same limit reached,
    # with 5 compiles fewer before it.
    with torch._dynamo.config.patch(recompile_limit=3):
        limit = torch._dynamo.config.recompile_limit
        sizes = range(1, limit + 6)
        for B in sizes:
            x = torch.randn(B, B, 5)
            torch.testing.assert_close(fn(x, list(range(1, B + 1))), ref(x, list(range(1, B + 1))))
    rows = wfpass.report(model).find("rnn", "rewritten")
    compiled = sum(r.stats.get("fused_calls", 0) for r in rows)
    eager = sum(r.stats.get("eager_calls", 0) for r in rows)
    assert compiled == limit and eager == len(sizes) - limit, (compiled, eager)
    assert any("recompile limit" in r.detail.get("ran_eagerly", "") for r in rows)
    text = str(wfpass.report(model))
    assert "ran eagerly:" in text and f"eager_calls={len(sizes) - limit}" in text
    # The model called outside torch.compile is the user's eager run: not counted.
    model(torch.randn(3, 3, 5), [3, 2, 1])
    assert sum(r.stats.get("eager_calls", 0) for r in wfpass.report(model).find("rnn")) == eager


class LoggingLSTM(nn.LSTM):
    """A subclass with a forward of its own: wfpass does not know what it does."""

    def forward(self, input, hx=None):
        self.calls = getattr(self, "calls", 0) + 1
        return super().forward(input, hx)


def test_subclass_with_its_own_forward_is_left_as_it_was():
    """wfpass installs nothing on a class with a forward of its own: its
    packed call graph-breaks inside nn.LSTM.forward, as without wfpass, and
    runs eagerly; the row says why."""
    torch.manual_seed(0)
    model = PackedLSTM(LoggingLSTM(5, 6, num_layers=2))
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend="wformat")
    for lengths in ([6, 4, 3, 1], [5, 2, 2, 1], [6, 6, 1, 1]):
        x = torch.randn(6, 4, 5)
        torch.testing.assert_close(fn(x, torch.tensor(lengths)), ref(x, torch.tensor(lengths)))
    assert model.rnn.calls == 3  # its own forward ran for every call
    assert not {"forward", "check_forward_args"} & set(model.rnn.__dict__)
    (row,) = wfpass.report(model).find("rnn")
    assert row.action == "skipped" and "overrides forward" in row.reason and "installs nothing" in row.reason
