"""An inference LSTM's weights in oneDNN's own layout (``rnn/cpu/lstm_prepack.py``).

oneDNN's LSTM layer reorders plain weights into its layout on every call; a
compiled inference graph keeps each layer direction's weights as such a copy
beside the parameters, made once, checked on every call, within
``prepack.max_bytes``, freed with the parameters. Every test compares with the
same model run eagerly on a deep copy.
"""
from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn as nn

import wfpass
from wfpass.prepack import kernel as pk
from wfpass.rnn.cpu import lstm_prepack
from wftest import TOL

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")

# oneDNN's layer op for every size ("eager": the C++ loop would take these small LSTMs).
ONEDNN = {"cpu_kernel": "eager", "seq_threshold": 1}
# Inputs here have more than 16 rows (T x batch): the op runs calls of at
# most that many on wfpass's C++ loop, which reads the parameters, no copy
# (native/rnn/short_lstm.h; test_short_calls_make_no_copy_and_equal_eager).


class Tagger(nn.Module):
    """An LSTM over a projection of its input, called twice (the same
    weights), with a residual that reuses the input."""

    def __init__(self, bidirectional: bool = True, layers: int = 2):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        # Sizes where oneDNN's layout pads nothing (at 16x16 its copy is twice the weights).
        self.rnn = nn.LSTM(32, 64, num_layers=layers, bidirectional=bidirectional)
        self.out = nn.Linear(64 * (2 if bidirectional else 1), 32)

    def forward(self, x):
        h = self.inp(x)
        y, _ = self.rnn(h)
        y2, _ = self.rnn(h.flip(0))
        return self.out(y + y2) + h


def _rnn_row(model):
    rows = wfpass.report(model).find("rnn", "rewritten")
    assert len(rows) == 1, rows
    return rows[0]


def _compiled(model, **options):
    return torch.compile(model, backend=wfpass.backend(inner="aot_eager", rnn=ONEDNN, **options))


def _close(a, b):
    rtol, atol = TOL[torch.float32]
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidirectional", "one-direction"])
def test_an_inference_lstm_reads_a_copy_in_onednns_layout(bidirectional):
    torch.manual_seed(0)
    model = Tagger(bidirectional).eval()
    ref = copy.deepcopy(model)
    gc.collect()  # earlier tests' models, and their copies
    before = pk.packed_bytes_alive()
    fn = _compiled(model)
    x = torch.randn(6, 3, 8)
    with torch.no_grad():
        for _ in range(3):
            _close(fn(x), ref(x))
    row = _rnn_row(model)
    pairs = 2 * (2 if bidirectional else 1)  # layers x directions
    # 3 calls of the model, 2 LSTM calls each, every layer direction from its copy
    assert row.stats["packed_calls"] == 3 * 2 * pairs, row.stats
    weights = sum(p.numel() * p.element_size() for n, p in model.rnn.named_parameters() if n.startswith("weight"))
    assert row.stats["packed_bytes"] == pk.packed_bytes_alive() - before
    assert weights <= row.stats["packed_bytes"] <= 2 * weights, (row.stats, weights)
    assert "copy in its own layout" in row.reason and "(packed_calls, packed_bytes)" in row.reason


def test_a_weight_changed_in_place_or_through_data_makes_the_copy_again():
    torch.manual_seed(0)
    model = Tagger().eval()
    ref = copy.deepcopy(model)
    fn = _compiled(model)
    x = torch.randn(6, 3, 8)
    with torch.no_grad():
        fn(x)
        for m in (model, ref):
            m.rnn.weight_hh_l0.mul_(0.5)  # in place: the version counter moves
        _close(fn(x), ref(x))
        new = torch.randn_like(model.rnn.weight_ih_l1_reverse)
        for m in (model, ref):
            m.rnn.weight_ih_l1_reverse.data.copy_(new)  # through .data: only the bits tell
        _close(fn(x), ref(x))
    row = _rnn_row(model)
    assert row.stats.get("repacked", 0) >= 2, row.stats
    assert row.stats["packed_calls"] > 0


def test_training_reads_the_parameters_and_inference_after_a_step_is_fresh():
    torch.manual_seed(0)
    model = Tagger()
    ref = copy.deepcopy(model)
    fn = _compiled(model)
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
    x = torch.randn(6, 3, 8)
    r = torch.randn(6, 3, 32)
    for _ in range(2):
        for f, o in ((fn, opt), (ref, opt_ref)):
            o.zero_grad()
            (f(x) * r).sum().backward()
            o.step()
    row = _rnn_row(model)
    assert row.stats.get("packed_calls", 0) == 0, row.stats  # training graphs never read a copy
    with torch.no_grad():
        _close(fn(x), ref(x))
        assert _rnn_row(model).stats["packed_calls"] > 0
    # one more step, then inference again: the copy is made from the stepped weights
    for f, o in ((fn, opt), (ref, opt_ref)):
        o.zero_grad()
        (f(x) * r).sum().backward()
        o.step()
    with torch.no_grad():
        _close(fn(x), ref(x))
    assert _rnn_row(model).stats.get("repacked", 0) >= 1


def test_a_budget_of_zero_keeps_the_parameters_and_says_so():
    torch.manual_seed(0)
    model = Tagger().eval()
    ref = copy.deepcopy(model)
    fn = _compiled(model, prepack={"max_bytes": 0})
    x = torch.randn(6, 3, 8)
    with torch.no_grad():
        for _ in range(2):
            _close(fn(x), ref(x))
    row = _rnn_row(model)
    assert row.stats.get("packed_calls", 0) == 0 and row.stats.get("packed_bytes", 0) == 0, row.stats
    assert row.stats["over_bound_calls"] >= 1
    assert "over their budget" in row.reason and "prepack.max_bytes" in row.reason


def test_pack_mode_off_makes_no_copy():
    torch.manual_seed(0)
    model = Tagger().eval()
    ref = copy.deepcopy(model)
    fn = _compiled(model, prepack={"mode": "off"})
    x = torch.randn(6, 3, 8)
    with torch.no_grad():
        _close(fn(x), ref(x))
    row = _rnn_row(model)
    assert row.stats.get("packed_calls", 0) == 0 and "copy in its own layout" not in row.reason


def test_copies_go_with_the_model_and_with_restore():
    torch.manual_seed(0)
    gc.collect()  # earlier tests' models, and their copies
    before = pk.packed_bytes_alive()
    model = Tagger().eval()
    fn = _compiled(model)
    x = torch.randn(6, 3, 8)
    with torch.no_grad():
        fn(x)
    assert pk.packed_bytes_alive() > before
    wfpass.restore(model)
    assert pk.packed_bytes_alive() == before
    del model, fn
    gc.collect()
    assert pk.packed_bytes_alive() == before

    model = Tagger().eval()
    fn = _compiled(model)
    with torch.no_grad():
        fn(x)
    assert pk.packed_bytes_alive() > before
    del model, fn
    gc.collect()
    assert pk.packed_bytes_alive() == before


def test_the_python_kernel_reads_the_copy_as_the_cpp_one_does():
    """Without the C++ build the op's Python kernel makes the same check."""
    from wfpass.core.records import Record
    from wfpass.rnn.cpu.lstm_layer import _lstm_layer

    torch.manual_seed(0)
    lstm = nn.LSTM(32, 64)
    w_ih, w_hh, b_ih, b_hh = (p.detach() for p in lstm.parameters())
    rec = Record("rnn", "rewritten", "test", ["w_ih", "w_hh"])
    lstm_prepack.allow(rec, [(w_ih, w_hh)], None)
    x = torch.randn(5, 3, 32)
    with torch.no_grad():
        want = lstm(x)[0]
        for _ in range(2):
            y = _lstm_layer(x, w_ih, w_hh, b_ih, b_hh, None, None, False, 64, True, False)[0]
            _close(y, want)
        w_hh.mul_(-1.0)  # the module's weight too (one storage): the copy is stale, made again
        _close(_lstm_layer(x, w_ih, w_hh, b_ih, b_hh, None, None, False, 64, True, False)[0], lstm(x)[0])
    rec.stats._sync()
    assert rec.stats["packed_calls"] == 3 and rec.stats["repacked"] == 1, rec.stats


def test_a_model_made_where_a_dead_one_was_gets_its_own_answer():
    """The same seed, the freed weights' addresses, the same bits: the C++
    kernel's answer for the dead model's weights (no copy: packing off)
    must not be taken for the new model's."""
    x = torch.randn(6, 3, 8)
    for options, packs in (({"prepack": {"mode": "off"}}, False), ({}, True)):
        torch.manual_seed(0)
        model = Tagger().eval()
        with torch.no_grad():
            _compiled(model, **options)(x)
        assert (_rnn_row(model).stats.get("packed_calls", 0) > 0) == packs
        del model
        gc.collect()


def test_explain_says_an_inference_lstm_will_read_a_copy():
    """``wfpass.explain`` (the defaults: oneDNN's kernel for hidden 128)
    says so, and makes no copy."""
    model = nn.Sequential(nn.LSTM(32, 128)).eval()
    report = wfpass.explain(model, torch.randn(4, 2, 32))
    row = report.find("rnn", "would rewrite")[0]
    assert "will read each layer's weights from a copy in its own layout" in row.reason, row.reason
    assert not any(lstm_prepack._PAIRS.get(p) is not None for p in model.parameters())


def test_a_hook_that_changes_the_weights_every_call_and_inference_mode():
    """A forward pre-hook that scales a weight through ``.data`` before every
    call (no version bump): each call reads the weights it sees, also under
    ``torch.inference_mode``."""
    torch.manual_seed(0)
    model = Tagger().eval()
    ref = copy.deepcopy(model)
    def shrink(mod, args):
        mod.rnn.weight_hh_l0.data.mul_(0.9)  # returns None: the call's arguments stay

    for m in (model, ref):
        m.register_forward_pre_hook(shrink)
    fn = _compiled(model)
    x = torch.randn(6, 3, 8)
    with torch.no_grad():
        for _ in range(3):
            _close(fn(x), ref(x))
    with torch.inference_mode():
        for _ in range(2):
            _close(fn(x), ref(x))
    row = _rnn_row(model)
    assert row.stats.get("repacked", 0) >= 4 and row.stats["packed_calls"] > 0, row.stats


def test_one_copy_serves_every_length_and_batch_of_a_dynamic_graph():
    """The copy is made at the first call's length and batch; a graph with
    both symbolic reads it at every other one."""
    torch.manual_seed(0)
    model = Tagger(bidirectional=False).eval()
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager", rnn=ONEDNN), dynamic=True)
    with torch.no_grad():
        for T, B in ((6, 3), (9, 3), (17, 1), (5, 4)):
            x = torch.randn(T, B, 8)
            _close(fn(x), ref(x))
    row = _rnn_row(model)
    assert row.stats["packed_calls"] == 4 * 2 * 2, row.stats  # 4 calls, 2 LSTM calls each, 2 layers
    assert row.stats.get("repacked", 0) == 0, row.stats


@pytest.mark.skipif(not __import__("wfpass._torch.kernels", fromlist=["x"]).mkldnn_rnn_dtype(torch.bfloat16),
                    reason="oneDNN's LSTM does not run bfloat16 on this CPU")
def test_a_bfloat16_lstm_reads_a_copy_too():
    torch.manual_seed(0)
    model = Tagger().eval().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    fn = _compiled(model)
    x = torch.randn(4, 2, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(2):
            rtol, atol = TOL[torch.bfloat16]
            torch.testing.assert_close(fn(x), ref(x), rtol=rtol, atol=atol)
    row = _rnn_row(model)
    assert row.stats["packed_calls"] == 2 * 2 * 4, row.stats  # 2 calls, 2 LSTM calls each, 4 layer directions
    assert row.stats["packed_bytes"] > 0


class PackedTagger(nn.Module):
    """A padded batch packed by its lengths into a 2-layer bidirectional
    LSTM, unpacked, with a residual that reuses the projected input."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.rnn = nn.LSTM(32, 64, num_layers=2, bidirectional=True)
        self.out = nn.Linear(128, 32)

    def forward(self, x, lengths):
        h = self.inp(x)
        packed = nn.utils.rnn.pack_padded_sequence(h, lengths, enforce_sorted=False)
        y, _ = self.rnn(packed)
        y, _ = nn.utils.rnn.pad_packed_sequence(y, total_length=x.shape[0])
        return self.out(y) + h


_BF16 = __import__("wfpass._torch.kernels", fromlist=["x"]).mkldnn_rnn_dtype(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not _BF16, reason="oneDNN's LSTM does not run bfloat16 on this CPU"))])
def test_a_packed_batch_on_onednn_reads_the_copies_run_by_run(dtype, monkeypatch):
    """Without grad a packed LSTM runs oneDNN's layer over each run of
    equal batch size (``packed_lstm_runs``: bf16, or fp32 where the C++
    loop has no fast path, as on a CPU without AVX2, made so here): every
    run reads the layer direction's copy, with the same bits as from the
    parameters, and a weight written through ``.data`` is read fresh."""
    from wfpass import native

    if dtype == torch.float32:
        monkeypatch.setattr(native, "serves", lambda x: False)  # the fp32 loop's fast path "absent"
    torch.manual_seed(0)
    model = PackedTagger().eval().to(dtype)
    ref, plain = copy.deepcopy(model), copy.deepcopy(model)
    x, lengths = torch.randn(6, 4, 8, dtype=dtype), torch.tensor([6, 3, 4, 1])  # runs of 1, 3, 4 and 6 rows
    (planned,) = wfpass.explain(copy.deepcopy(model), x, lengths).find("rnn", "would rewrite")
    assert "will read each layer's weights from a copy in its own layout" in planned.reason, planned.reason
    fn = _compiled(model)
    fn_plain = _compiled(plain, prepack={"mode": "off"})  # the same kernels from the parameters
    rtol, atol = TOL[dtype]
    with torch.no_grad():
        for _ in range(2):
            got = fn(x, lengths)
            torch.testing.assert_close(got, ref(x, lengths), rtol=rtol, atol=atol)
            assert torch.equal(got, fn_plain(x, lengths))
        new = torch.randn_like(model.rnn.weight_hh_l1)
        for m in (model, ref, plain):
            m.rnn.weight_hh_l1.data.copy_(new)  # no version bump: only the bits tell
        got = fn(x, lengths)
        torch.testing.assert_close(got, ref(x, lengths), rtol=rtol, atol=atol)
        assert torch.equal(got, fn_plain(x, lengths))
    row = _rnn_row(model)
    assert row.detail["paths"] == {"T=variable": "packed_onednn"}, row.detail
    assert row.stats["packed_calls"] == 3 * 4, row.stats  # 3 calls, 4 layer directions, one count per call
    assert row.stats["repacked"] == 1 and row.stats["packed_bytes"] > 0, row.stats
    assert "reads each layer's weights from a copy in its own layout" in row.reason, row.reason
    assert _rnn_row(plain).stats.get("packed_calls", 0) == 0


class LstmBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(32, 32)
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.lin(y) + x  # a residual around the LSTM


def test_regional_compilation_each_blocks_lstm_reads_its_own_copy():
    """Each block compiled on its own (``block.compile``), as users compile
    a stack of repeated blocks: every block's LSTM reads a copy of its own
    weights, none another block's, and all of them fit the default budget
    (the weights of every block, counted as each compiles)."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*[LstmBlock() for _ in range(3)]).eval()
    ref = copy.deepcopy(blocks)
    for b in blocks:
        b.compile(backend=wfpass.backend(inner="aot_eager", rnn=ONEDNN))
    x = torch.randn(6, 3, 32)
    with torch.no_grad():
        for _ in range(2):
            _close(blocks(x), ref(x))
        blocks[1].rnn.weight_hh_l0.mul_(0.5)  # one block's weight: only its copy is made again
        ref[1].rnn.weight_hh_l0.mul_(0.5)
        _close(blocks(x), ref(x))
    rows = wfpass.report(blocks).find("rnn", "rewritten")
    assert sorted(r.params[0] for r in rows) == [f"{k}.rnn.weight_ih_l0" for k in range(3)], rows
    for r in rows:
        assert r.stats["packed_calls"] == 3 and r.stats.get("over_bound_calls", 0) == 0, (r.params, r.stats)
        assert r.stats.get("repacked", 0) == (1 if r.params[0].startswith("1.") else 0), (r.params, r.stats)


class StatefulLstm(nn.Module):
    """A 2-layer bidirectional LSTM given its states, with a residual."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(32, 32, num_layers=2, bidirectional=True)
        self.out = nn.Linear(64, 32)

    def forward(self, x, h, c):
        y, (hn, cn) = self.rnn(x, (h, c))
        return self.out(y) + x, hn, cn


# (T, batch): at most 16 rows each, one past it (17 rows: oneDNN's layer
# again). T >= 2: Dynamo specializes a size of 1, and a static T=1 is at the
# threshold (seq_threshold 1: the unfused path).
SHORT = ((2, 1), (2, 4), (4, 4), (16, 1), (2, 8), (17, 1))


def _short_run(model, fn):
    torch.manual_seed(1)
    outs = []
    with torch.no_grad():
        for T, B in SHORT:
            x, h, c = torch.randn(T, B, 32), torch.randn(4, B, 32), torch.randn(4, B, 32)
            outs.append((fn(x, h, c), model(x, h, c)))
    return outs


def test_short_calls_make_no_copy_and_equal_eager():
    """Calls of at most 16 rows (T x batch) of the oneDNN path's op run on
    wfpass's C++ loop, reading the parameters (no copy in oneDNN's layout):
    a graph with a symbolic T and batch gives eager's values at each size,
    given states, both directions, and makes a copy only for the 17-row call."""
    if wfpass.native.short_lstm_rows() != 16:
        pytest.skip("the C++ loop or the direct linear kernel is not in use here")
    torch.manual_seed(0)
    model = StatefulLstm().eval()
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager", rnn=ONEDNN), dynamic=True)
    gc.collect()
    before = pk.packed_bytes_alive()
    with torch.no_grad():
        for T, B in SHORT[:-1]:
            x, h, c = torch.randn(T, B, 32), torch.randn(4, B, 32), torch.randn(4, B, 32)
            for a, b in zip(fn(x, h, c), ref(x, h, c)):
                _close(a, b)
        row = _rnn_row(model)
        assert row.stats["packed_calls"] == 0 and pk.packed_bytes_alive() == before, row.stats
        assert "at most 16 rows, T x batch, on wfpass's C++ loop" in row.reason, row.reason
        x, h, c = torch.randn(17, 1, 32), torch.randn(4, 1, 32), torch.randn(4, 1, 32)
        for a, b in zip(fn(x, h, c), ref(x, h, c)):
            _close(a, b)
    row = _rnn_row(model)
    assert row.stats["packed_calls"] == 4 and pk.packed_bytes_alive() > before, row.stats  # 2 layers x 2 directions


_SHORT_BITS = """
import sys, torch, wfpass
from tests.rnn import test_lstm_prepack as t
torch.manual_seed(0)
model = t.StatefulLstm().eval()
fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager", rnn=t.ONEDNN), dynamic=True)
torch.save([a for a, _ in t._short_run(model, fn)], sys.argv[1])
"""


def test_short_calls_take_the_loop_and_longer_ones_onednn(tmp_path):
    """The loop and oneDNN's layer sum in different orders, so their bits
    differ: at most 16 rows this process's outputs differ from a process
    with the short path off (``WFPASS_RNN_AS_IS=0``), at 17 rows they are
    its bits."""
    if wfpass.native.short_lstm_rows() != 16:
        pytest.skip("the C++ loop or the direct linear kernel is not in use here")
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    got = {}
    for setting in ("", "0"):
        path = tmp_path / f"short_{setting or 'rule'}.pt"
        env = dict(os.environ, WFPASS_RNN_AS_IS=setting, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([os.path.join(root, "tests"), os.environ.get("PYTHONPATH", "")]))
        r = subprocess.run([sys.executable, "-c", _SHORT_BITS, str(path)], env=env, cwd=root, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        got[setting] = torch.load(path)
    sames = [[torch.equal(a, b) for a, b in zip(on, off)] for on, off in zip(got[""], got["0"])]
    for (T, B), same in zip(SHORT, sames):
        assert all(same) == (T * B > 16), ((T, B), same)
    for on, off in zip(got[""], got["0"]):
        for a, b in zip(on, off):
            _close(a, b)
