"""CPU RNNs through wfpass's C++ loop (the ``cxx`` path).

``wfpass::packed_layer`` / ``packed_bilayer`` take a full batch ``[T, B, I]``
with an empty ``batch_sizes``; a compiled float32 GRU or plain RNN, and a
small LSTM, run their layers through them (``rnn={"cpu_kernel": "auto"}``,
the default). Checked here: the
full batch gives the packed batch's bits, forward and backward; the compiled
model matches eager (outputs, final states, every gradient, SGD steps, a
weight changed in place between calls); the graphs hold one op per layer and
the report names the kernel; the rule and the option pick the kernels they
say.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

import wfpass
from wfpass import native
from wfpass.rnn.cpu import varlen_layer  # noqa: F401  (registers the ops)
from wfpass.rnn.cpu.varlen_layer_py import _packed_layer
from wfpass.rnn.cpu.varlen_layer_py_backward import _packed_layer_backward

fast = pytest.mark.skipif(not native.fast_loop(),
                          reason="the C++ loop's fast steps need the C++ kernels and AVX-512 or AVX2 with FMA")
ops = torch.ops.wfpass
NO_SIZES = torch.empty(0, dtype=torch.int64)


def _weights(I, H, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(4 * H, I, generator=g) * 0.3, torch.randn(4 * H, H, generator=g) * 0.3]
    if bias:
        w += [torch.randn(4 * H, generator=g) * 0.1, torch.randn(4 * H, generator=g) * 0.1]
    return w


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("states", [False, True])
def test_a_full_batch_is_the_packed_batch_of_equal_steps_bit_for_bit(reverse, states):
    """Forward and backward of ``[T, B, I]`` with no batch sizes against the
    same rows ``[T*B, I]`` with batch sizes ``[B] * T``: the same bits, and
    the data gradient in data's shape."""
    T, B, I, H = 5, 3, 6, 7
    x = torch.randn(T, B, I)
    w_ih, w_hh, b_ih, b_hh = _weights(I, H)
    h0, c0 = (torch.randn(1, B, H), torch.randn(1, B, H)) if states else (None, None)
    full = ops.packed_layer_fw(x, NO_SIZES, w_ih, w_hh, b_ih, b_hh, None, h0, c0, "LSTM", reverse, True)
    rows = ops.packed_layer_fw(x.reshape(T * B, I), torch.full((T,), B), w_ih, w_hh, b_ih, b_hh, None, h0, c0,
                               "LSTM", reverse, True)
    for a, b in zip(full, rows):
        assert torch.equal(a, b)
    g_out = torch.randn(T * B, H)
    g_hn = torch.randn(1, B, H)
    bw_full = ops.packed_layer_backward(x, NO_SIZES, w_ih, w_hh, b_ih, b_hh, None, h0, c0, *full, g_out, g_hn, None,
                                        "LSTM", reverse)
    bw_rows = ops.packed_layer_backward(x.reshape(T * B, I), torch.full((T,), B), w_ih, w_hh, b_ih, b_hh, None, h0,
                                        c0, *rows, g_out, g_hn, None, "LSTM", reverse)
    assert bw_full[0].shape == x.shape
    assert torch.equal(bw_full[0].reshape(T * B, I), bw_rows[0])
    for a, b in zip(bw_full[1:], bw_rows[1:]):
        assert torch.equal(a, b)
    # The Python kernels (used where the C++ library is absent) read a full
    # batch the same way.
    py = _packed_layer(x, NO_SIZES, w_ih, w_hh, b_ih, b_hh, None, h0, c0, "LSTM", reverse, True)
    torch.testing.assert_close(py[0], full[0], rtol=1e-5, atol=1e-6)
    py_bw = _packed_layer_backward(x, NO_SIZES, w_ih, w_hh, b_ih, b_hh, None, h0, c0, *py, g_out, g_hn, None, "LSTM",
                                   reverse)
    assert py_bw[0].shape == x.shape
    torch.testing.assert_close(py_bw[0], bw_full[0], rtol=1e-5, atol=1e-6)


def test_a_full_batch_with_batch_sizes_is_refused_before_anything_is_read():
    x = torch.randn(4, 2, 3)
    w = _weights(3, 5)
    for fn in (ops.packed_layer_fw, _packed_layer):
        with pytest.raises(RuntimeError, match="full batch .* empty batch_sizes"):
            fn(x, torch.full((4,), 2), *w, None, None, None, "LSTM", False, False)
    with pytest.raises(RuntimeError, match="T >= 1 and B >= 1"):
        ops.packed_layer_fw(torch.randn(4, 0, 3), NO_SIZES, *w, None, None, None, "LSTM", False, False)


def test_the_fakes_give_a_full_batch_its_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(6, 4, 3)
        w = [torch.randn(40, 3), torch.randn(40, 10), torch.randn(40), torch.randn(40)]
        out, h_n, c_n, ws = ops.packed_layer(x, torch.empty(0, dtype=torch.int64), *w, None, None, None, "LSTM",
                                             False, True)
        assert out.shape == (24, 10) and h_n.shape == (1, 4, 10) and c_n.shape == (1, 4, 10) and ws.shape == (24, 60)
        bi = ops.packed_bilayer(x, torch.empty(0, dtype=torch.int64), w + w, None, None, "LSTM", True, False, True)
        assert bi[0].shape == (24, 20) and bi[1].shape == (2, 4, 10)


class Net(nn.Module):
    """The RNN with a residual around it, its final states read."""

    def __init__(self, I=16, H=32, layers=2, bidirectional=False, batch_first=False, bias=True, cls=nn.LSTM, **kw):
        super().__init__()
        self.inp = nn.Linear(I, I)
        self.rnn = cls(I, H, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first, bias=bias, **kw)
        self.out = nn.Linear(H * (2 if bidirectional else 1), I)

    def forward(self, x, hx=None):
        y, state = self.rnn(self.inp(x), hx)
        if isinstance(state, tuple):
            return self.out(y) + x, state[0].sum(0), state[1].sum(0)
        return self.out(y) + x, state.sum(0)


def _loss(outs, Rs):
    return sum((o * r).sum() for o, r in zip(outs, Rs))


def _compare(model, x, hx=None, options=None, inner="inductor"):
    """Compiled (wformat) against an eager deep copy: outputs and every
    gradient (each grad error scaled by the largest grad)."""
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=wfpass.backend(inner=inner, **(options or {})))
    xr = x.detach().clone().requires_grad_(True)
    xc = x.detach().clone().requires_grad_(True)
    states = (hx,) if isinstance(hx, torch.Tensor) else hx
    hr = None if hx is None else tuple(h.detach().clone().requires_grad_(True) for h in states)
    hc = None if hx is None else tuple(h.detach().clone().requires_grad_(True) for h in states)
    as_arg = (lambda h: h[0]) if isinstance(hx, torch.Tensor) else (lambda h: h)
    out_r = ref(xr, as_arg(hr)) if hx is not None else ref(xr)
    out_c = fn(xc, as_arg(hc)) if hx is not None else fn(xc)
    g = torch.Generator().manual_seed(3)
    Rs = [torch.randn(o.shape, generator=g) for o in out_r]
    for a, b in zip(out_c, out_r):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    _loss(out_r, Rs).backward()
    _loss(out_c, Rs).backward()
    grads_r = [xr.grad] + [p.grad for p in ref.parameters()] + ([h.grad for h in hr] if hr else [])
    grads_c = [xc.grad] + [p.grad for p in model.parameters()] + ([h.grad for h in hc] if hc else [])
    scale = max(gr.abs().max().item() for gr in grads_r)
    for a, b in zip(grads_c, grads_r):
        assert (a - b).abs().max().item() <= 2e-5 * scale
    return fn


def _row(model):
    (row,) = [r for r in wfpass.report(model).find("rnn", "rewritten")]
    return row


@fast
@pytest.mark.parametrize("kw", [dict(), dict(layers=1), dict(bidirectional=True), dict(batch_first=True),
                                dict(bias=False), dict(layers=3, bidirectional=True, batch_first=True)],
                         ids=["2layers", "1layer", "bidirectional", "batch_first", "no_bias", "3layers_bi_bf"])
@pytest.mark.parametrize("cls,extra", [(nn.LSTM, {}), (nn.GRU, {}), (nn.RNN, {}), (nn.RNN, {"nonlinearity": "relu"})],
                         ids=["lstm", "gru", "rnn_tanh", "rnn_relu"])
def test_a_small_rnn_trains_through_the_cxx_loop_as_eager(kw, cls, extra):
    # Each kind goes end to end through Inductor once, in the case with every
    # knob at once (3 layers, bidirectional, batch-first); the other layouts
    # through aot_eager, whose AOTAutograd forward and backward graphs hold
    # the same loop ops with the same fakes (an Inductor compile apiece
    # made this test the file's slowest).
    torch.manual_seed(0)
    model = Net(cls=cls, **kw, **extra)
    T, B = 6, 3
    x = torch.randn(B, T, 16) if kw.get("batch_first") else torch.randn(T, B, 16)
    _compare(model, x, inner="inductor" if kw == dict(layers=3, bidirectional=True, batch_first=True) else "aot_eager")
    row = _row(model)
    name = {nn.LSTM: "LSTM", nn.GRU: "GRU"}.get(cls, "RNN")
    assert f"C++ {name} loop" in row.reason and row.stats["cxx_loop_calls"] == 1, row


@fast
@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
def test_given_states_get_their_gradients(cls):
    torch.manual_seed(1)
    model = Net(layers=2, bidirectional=True, cls=cls)
    h = torch.randn(4, 3, 32)
    # The LSTM through Inductor, the GRU through aot_eager (the same state
    # inputs and their gradient outputs of the same ops).
    _compare(model, torch.randn(5, 3, 16), (h, torch.randn(4, 3, 32)) if cls is nn.LSTM else h,
             inner="inductor" if cls is nn.LSTM else "aot_eager")
    assert _row(model).stats["cxx_loop_calls"] == 1


@fast
def test_a_gru_compiled_with_dynamic_sizes_keeps_the_loop_at_each_size():
    """``dynamic=True``: every length the pass sees (the pass specializes T
    against the threshold) takes the loop, matching eager at each size."""
    torch.manual_seed(5)
    model = Net(cls=nn.GRU)
    ref = copy.deepcopy(model)
    # aot_eager: the path is the pass's choice at each size, before the inner
    # compiler (a GRU on the loop at symbolic sizes through Inductor, trained:
    # test_fuse_rnn.py's test_training_after_dynamic_recompile_stays_one_op_per_layer[gru]).
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager"), dynamic=True)
    for T, B in ((5, 3), (7, 2), (9, 4)):
        x = torch.randn(T, B, 16)
        for a, b in zip(fn(x), ref(x)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    paths = _row(model).detail["paths"]
    assert paths and set(paths.values()) == {"cxx"}, paths


@fast
def test_a_training_lstm_after_a_dynamic_recompile_keeps_the_loop_at_each_size():
    """A training graph recompiled with symbolic sizes specializes them (the
    oneDNN workspace has no size formula): at those sizes the rule takes
    the loop as a static graph does (hidden 128, batch 2 and 4: the loop's
    training sizes), not oneDNN's layer because the sizes were once
    symbolic. Every gradient and an SGD step against eager."""
    torch.manual_seed(6)
    model = Net(H=128, layers=2)
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager"))  # dynamic=None: recompiles symbolic
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    g = torch.Generator().manual_seed(0)
    for T, B in ((5, 4), (7, 2), (9, 4)):  # batches the loop takes in training at any thread count
        x = torch.randn(T, B, 16, generator=g)
        Rs = [torch.randn(o.shape, generator=g) for o in ref(x)]
        for m, f, opt in ((model, fn, opts[0]), (ref, ref, opts[1])):
            opt.zero_grad()
            _loss(f(x), Rs).backward()
        scale = max(q.grad.abs().max().item() for q in ref.parameters())
        for p, q in zip(model.parameters(), ref.parameters()):
            assert (p.grad - q.grad).abs().max().item() <= 2e-5 * scale
        for opt in opts:
            opt.step()
    row = _row(model)
    assert "specialized" in row.detail, row.detail  # the recompiled graph's sizes
    assert row.detail["paths"] == {"T=5, training": "cxx", "T=7, training": "cxx", "T=9, training": "cxx"}, row.detail
    assert row.stats["cxx_loop_calls"] == 3 and row.stats.get("onednn_lstm_calls", 0) == 0, row.stats


@fast
def test_seq_threshold_auto_is_measured_at_the_sizes_a_recompiled_training_graph_specialized():
    """``seq_threshold="auto"`` measures N at a call's static sizes; the
    sizes a recompiled training graph specialized count as static (before,
    that graph took the default N unmeasured)."""
    torch.manual_seed(7)
    model = Net(H=32, layers=1)
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager", rnn={"seq_threshold": "auto",
                                                                               "auto_lengths": (1, 2)}))
    for T, B in ((5, 2), (7, 3)):
        fn(torch.randn(T, B, 16))[0].sum().backward()
    row = _row(model)
    assert "specialized" in row.detail, row.detail
    measured = row.detail.get("auto_thresholds", {})
    assert any(k.startswith("batch=3") for k in measured), measured  # the recompiled graph's batch


@fast
def test_graphs_hold_one_loop_op_per_layer_and_one_backward_op_each():
    """AOTAutograd's forward graph calls the loop op once per layer
    (both directions in one ``packed_bilayer``), its backward graph one
    backward op per layer, and no oneDNN layer op."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = {}

    def keep(name):
        def compiler(gm, _):
            graphs[name] = gm
            return gm.forward
        return compiler

    torch._dynamo.reset()
    model = Net(layers=2, bidirectional=True)
    fn = torch.compile(model, backend=wfpass.backend(inner=aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))))
    sum(o.sum() for o in fn(torch.randn(6, 3, 16)))
    sum(o.sum() for o in fn(torch.randn(6, 3, 16))).backward()

    def targets(gm):
        return [n.target for n in gm.graph.nodes if n.op == "call_function"]

    fw, bw = targets(graphs["fw"]), targets(graphs["bw"])
    # (the op with its autograd formula: wfpass swaps in its twin when it
    # compiles the forward graph itself, test_fuse_rnn.py checks that)
    assert fw.count(ops.packed_bilayer.default) == 2, fw
    assert bw.count(ops.packed_bilayer_backward.default) == 2, bw
    assert ops.lstm_layer.default not in fw and torch.ops.aten.mkldnn_rnn_layer.default not in fw


@fast
def test_sgd_steps_and_a_weight_changed_in_place_match_eager():
    """Five SGD steps, then a weight written in place between calls: the
    compiled model reads the Parameters it was given, as eager does."""
    torch.manual_seed(2)
    model = Net(layers=2)
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend="wformat")
    opt, opt_r = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(4)
    for _ in range(5):
        x = torch.randn(7, 4, 16, generator=g)
        R = torch.randn(7, 4, 16, generator=g)
        for f, o in ((fn, opt), (ref, opt_r)):
            o.zero_grad()
            (f(x)[0] * R).sum().backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        model.rnn.weight_hh_l1.mul_(0.5)
        ref.rnn.weight_hh_l1.mul_(0.5)
        x = torch.randn(7, 4, 16)
        torch.testing.assert_close(fn(x)[0], ref(x)[0], rtol=1e-4, atol=1e-5)
    assert _row(model).stats["cxx_loop_calls"] >= 6


@fast
@pytest.mark.parametrize("H,B,expect", [(64, 32, "cxx"), (64, 33, "mkldnn"), (128, 4, "mkldnn"), (128, 5, "mkldnn"),
                                        (128, 8, "mkldnn"), (256, 1, "mkldnn"), (65, 5, "mkldnn")])
def test_the_rule_takes_the_loop_for_small_lstms_and_every_gru(H, B, expect):
    from wfpass.config import RnnOptions
    from wfpass.rnn.plan import choose_path
    from wfpass.rnn.spec import RnnSpec

    spec = RnnSpec(name="lstm", mode="LSTM", input_size=8, hidden_size=H, proj_size=0, num_layers=1,
                   bidirectional=False, batch_first=False, has_biases=True, dropout=0.0, threshold=2, offsets=(),
                   numel=0, options=RnnOptions())
    assert choose_path(spec, torch.randn(10, B, 8), 10, 2) == expect
    # A training graph also takes the loop up to hidden 128 with batch 8 at 1 thread (batch 4 at
    # more), where its backward won.
    before = torch.get_num_threads()
    try:
        for threads, most in ((1, 8), (2, 4)):
            torch.set_num_threads(threads)
            train_expect = "cxx" if H <= 128 and B <= most or H <= 64 and B <= 32 else expect
            assert choose_path(spec, torch.randn(10, B, 8), 10, 2, train=True) == train_expect, threads
    finally:
        torch.set_num_threads(before)
    assert choose_path(spec, torch.randn(10, B, 8), None, 2) == "mkldnn"  # a symbolic length: oneDNN's
    assert choose_path(spec, torch.randn(10, B, 8, dtype=torch.float64), 10, 2) != "cxx"
    onednn = dataclasses.replace(spec, options=RnnOptions(cpu_kernel="eager"))
    assert choose_path(onednn, torch.randn(10, B, 8), 10, 2) == "mkldnn"
    gru = dataclasses.replace(spec, mode="GRU")
    if native.fast_isa() == "avx512f":  # every GRU, any size (AVX2: below)
        assert choose_path(gru, torch.randn(10, B, 8), 10, 2) == "cxx"
        assert choose_path(gru, torch.randn(10, B, 8), None, 2) == "cxx"
    assert choose_path(dataclasses.replace(gru, options=RnnOptions(cpu_kernel="eager")), torch.randn(10, B, 8),
                       10, 2) == "native"


@fast
@pytest.mark.parametrize("isa", ["avx512f", "avx2"])
def test_the_rule_for_grus_and_plain_rnns_follows_the_isa(isa, monkeypatch):
    """With AVX-512 every GRU and plain RNN takes the loop; with AVX2 only,
    whose per-step GEMMs are slower, a GRU up to hidden 128 in inference and
    256 in training, a plain RNN up to 256, static or symbolic sizes."""
    from wfpass.config import RnnOptions
    from wfpass.rnn.plan import choose_path
    from wfpass.rnn.spec import RnnSpec

    monkeypatch.setattr(native, "fast_isa", lambda: isa)
    for mode in ("GRU", "RNN_TANH", "RNN_RELU"):
        for H in (64, 128, 256, 512):
            spec = RnnSpec(name="rnn", mode=mode, input_size=8, hidden_size=H, proj_size=0, num_layers=1,
                           bidirectional=False, batch_first=False, has_biases=True, dropout=0.0, threshold=2,
                           offsets=(), numel=0, options=RnnOptions())
            x = torch.randn(10, 4, 8)
            for steps in (10, None):
                for train in (False, True):
                    bound = 256 if train or mode != "GRU" else 128
                    loop = isa == "avx512f" or H <= bound
                    assert choose_path(spec, x, steps, 2, train=train) == ("cxx" if loop else "native"), \
                        (mode, H, steps, train)
            eager = dataclasses.replace(spec, options=RnnOptions(cpu_kernel="eager"))
            assert choose_path(eager, x, 10, 2) == "native"
            cxx = dataclasses.replace(spec, options=RnnOptions(cpu_kernel="cxx"))
            assert choose_path(cxx, x, 10, 2) == "cxx"


@pytest.mark.skipif(not native.fast_loop() or native.fast_isa() != "avx512f",
                    reason="on a CPU without AVX-512 the whole suite runs the AVX2 build")
def test_the_avx2_build_equals_eager_on_an_avx512_cpu():
    """The gate math is compiled twice (fast_gates.h); an AVX-512 machine
    runs the AVX2 one only when asked (WFPASS_FAST_ISA=avx2): the packed
    layer's equality tests against eager, in a process that asks."""
    from wftest import pytest_in_a_process

    pytest_in_a_process({"WFPASS_FAST_ISA": "avx2"}, "from wfpass import native; assert native.fast_isa() == 'avx2'",
                        ["tests/rnn/test_varlen_layer.py", "tests/rnn/test_cxx_rnn.py", "-k",
                         "equals_eager or as_eager or wider_layers or saturated or given_states"])


@fast
def test_a_training_graph_and_an_inference_graph_name_their_own_kernels():
    """Hidden 128, batch 4: the training graph takes the C++ loop, the
    no_grad graph oneDNN's layer; the row keeps a bucket for each (a cell
    loop folded into one call included: the fold notes that its steps are
    differentiated)."""
    from wfpass.tools.bench_models import CellLoop

    # The Net through Inductor; the folded cell loop through aot_eager (the
    # kernel of each graph is the pass's choice, made before the inner compiler).
    for model, x, backend in ((Net(H=128), torch.randn(6, 4, 16), "wformat"),
                              (CellLoop(16, 128), torch.randn(6, 4, 16), wfpass.backend(inner="aot_eager"))):
        ref = copy.deepcopy(model)
        fn = torch.compile(model, backend=backend)
        out, ref_out = fn(x), ref(x)
        out = out[0] if isinstance(out, tuple) else out
        ref_out = ref_out[0] if isinstance(ref_out, tuple) else ref_out
        out.sum().backward()
        ref_out.sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
        with torch.no_grad():
            fn(x)
        row = _row(model)
        assert row.detail["paths"] == {"T=6, training": "cxx", "T=6": "mkldnn"}, row.detail
        assert row.stats["cxx_loop_calls"] == 1 and row.stats["onednn_lstm_calls"] == 1, row.stats


@fast
def test_the_row_says_when_the_thread_count_gave_a_training_lstm_onednns_kernel():
    """Hidden 128, batch 8, training: the C++ loop at 1 thread, oneDNN's
    layer at 2, and the row says the thread count decided it."""
    before = torch.get_num_threads()
    try:
        for threads, path in ((1, "cxx"), (2, "mkldnn")):
            torch.set_num_threads(threads)
            torch._dynamo.reset()
            model = Net(H=128, layers=1)
            fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager"))
            fn(torch.randn(6, 8, 16))[0].sum().backward()
            row = _row(model)
            assert row.detail["paths"] == {"T=6, training": path} if path == "cxx" else {"T=6": path}, row.detail
            said = "training at batch 8 with 2 threads: oneDNN's layer" in row.reason
            assert said == (threads == 2) and ("thread_bound" in row.detail) == said, row.reason
    finally:
        torch.set_num_threads(before)


@fast
def test_the_option_picks_the_kernel():
    torch.manual_seed(0)
    x = torch.randn(6, 3, 16)
    for choice, counter in (("eager", "onednn_lstm_calls"), ("cxx", "cxx_loop_calls")):
        model = Net(H=256 if choice == "cxx" else 32)
        # The kernel is the pass's choice: "eager" through aot_eager, "cxx" through Inductor.
        _compare(model, x, options={"rnn": {"cpu_kernel": choice}}, inner="inductor" if choice == "cxx" else "aot_eager")
        assert _row(model).stats[counter] == 1


def test_a_bad_cpu_kernel_value_is_refused_by_name():
    with pytest.raises(ValueError, match="rnn.cpu_kernel"):
        wfpass.backend(rnn={"cpu_kernel": "mkl"})
