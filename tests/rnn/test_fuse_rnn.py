"""fuse_rnn: nn.LSTM/GRU/RNN over a flat weight block, lowered to ATen ops.

Numerics run through ``inner="aot_eager"`` (AOTAutograd traces the call and
its backward exactly as for Inductor); a few tests go end to end through
Inductor. N (``seq_threshold``) is 4 unless a test says otherwise, and the
lengths 2 / 4 / 7 sit below / at / above it.
"""
from __future__ import annotations

import copy
import operator
import re

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence

import wfpass
from wfpass.rnn import paths as rnn_ops
from wfpass.rnn.auto import auto_threshold_cache
from wfpass.core.storage import fused_storage_of
from wftest import TOL, assert_same_fwd_bwd, needs_gpu, param_ids, train_steps

N = 4
LENGTHS = {"below": 2, "at": N, "above": 7}

# (class, kwargs): every variant of the issue, small sizes (input 5, hidden 6).
VARIANTS = {
    "lstm": (nn.LSTM, {}),
    "lstm-2layer": (nn.LSTM, dict(num_layers=2)),
    "lstm-bi-batch_first": (nn.LSTM, dict(num_layers=2, bidirectional=True, batch_first=True)),
    "lstm-nobias": (nn.LSTM, dict(num_layers=2, bias=False)),
    "lstm-proj": (nn.LSTM, dict(num_layers=2, proj_size=3, bidirectional=True)),
    "gru-2layer-bi": (nn.GRU, dict(num_layers=2, bidirectional=True)),
    "gru-nobias-batch_first": (nn.GRU, dict(bias=False, batch_first=True)),
    "rnn-tanh-2layer": (nn.RNN, dict(num_layers=2)),
    "rnn-relu-nobias": (nn.RNN, dict(nonlinearity="relu", bias=False)),
}


class Net(nn.Module):
    """An RNN between two linears; returns the output and (optionally) the state."""

    def __init__(self, cls, use_state=True, **kw):
        super().__init__()
        self.rnn = cls(5, 6, **kw)
        out = (kw.get("proj_size") or 6) * (2 if kw.get("bidirectional") else 1)
        self.head = nn.Linear(out, 2)
        self.use_state = use_state

    def forward(self, x, *state):
        y, h = self.rnn(x, *state)
        if not self.use_state:
            return self.head(y)
        return self.head(y), h


class TNet(Net):
    """``Net`` with an optional state argument, for ``torch.fx.symbolic_trace``."""

    def forward(self, x, state=None):
        y, h = self.rnn(x, state)
        if not self.use_state:
            return self.head(y)
        return self.head(y), h


def make_inputs(cls, kw, T, B=3, dtype=torch.float32, state=False):
    bf = kw.get("batch_first", False)
    x = torch.randn((B, T, 5) if bf else (T, B, 5), dtype=dtype, requires_grad=True)
    if not state:
        return [x]
    layers = kw.get("num_layers", 1) * (2 if kw.get("bidirectional") else 1)
    h0 = torch.randn(layers, B, kw.get("proj_size") or 6, dtype=dtype, requires_grad=True)
    if cls is nn.LSTM:
        return [x, (h0, torch.randn(layers, B, 6, dtype=dtype, requires_grad=True))]
    return [x, h0]


def wformat(expect="rnn", **options):
    """The transform the tests compare with eager; ``assert_same_fwd_bwd``
    also checks that an RNN was rewritten (``expect=None``: a test of a
    skip)."""
    options.setdefault("inner", "aot_eager")
    options.setdefault("seq_threshold", N)

    def transform(m):
        return torch.compile(m, backend=wfpass.backend(**options))

    transform.expect = expect
    return transform


def rnn_record():
    recs = wfpass.last_report().find("rnn", "rewritten")
    assert len(recs) == 1, wfpass.last_report()
    return recs[0]


class Recorder:
    """A wformat backend that keeps the graphs its inner compiler receives
    (after the passes) and counts compilations."""

    def __init__(self, **options):
        self.graphs = []
        be = wfpass.backend(**options)
        inner = be.config.inner

        def keep(gm, example_inputs):
            self.graphs.append(gm)
            from wfpass.compiler import _resolve_inner

            return _resolve_inner(inner)(gm, example_inputs)

        self.backend = wfpass.backend(**{**options, "inner": keep})

    @property
    def compiles(self):
        return len(self.graphs)


def count_targets(gm, target):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


# -- numerics -------------------------------------------------------------------


@pytest.mark.parametrize("where", list(LENGTHS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_backward_equal_eager(variant, where):
    """Every variant, state given and (h, c) used at one length, neither at the others."""
    cls, kw = VARIANTS[variant]
    state = where != "below"
    model = Net(cls, use_state=state, **kw)
    inputs = make_inputs(cls, kw, LENGTHS[where], state=state)
    assert_same_fwd_bwd(model, wformat(), inputs)
    rec = rnn_record()
    path = "unfused_calls" if LENGTHS[where] <= N else "fused_calls"
    assert rec.stats[path] == 1, rec.stats


@pytest.mark.parametrize("variant", ["lstm-proj", "lstm-nobias", "gru-2layer-bi", "rnn-relu-nobias", "lstm-bi-batch_first"])
def test_python_loop_unfused_path_equal_eager(variant):
    """The per-step loop the unfused path uses off the CPU, checked on the CPU."""
    cls, kw = VARIANTS[variant]
    model = Net(cls, **kw)
    assert_same_fwd_bwd(model, wformat(rnn=wfpass.RnnOptions(unfused_impl="loop")), make_inputs(cls, kw, 3, state=True))
    assert rnn_record().stats["unfused_calls"] == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", ["lstm-2layer", "gru-2layer-bi"])
def test_half_precision_equal_eager(variant, dtype):
    # Both paths; eager picks oneDNN or the native kernel by dtype, so allow
    # the dtype's rounding over a few steps.
    cls, kw = VARIANTS[variant]
    rtol, atol = TOL[dtype]
    for T in (2, 7):
        torch._dynamo.reset()
        model = Net(cls, **kw).to(dtype)
        assert_same_fwd_bwd(model, wformat(), make_inputs(cls, kw, T, dtype=dtype), rtol=4 * rtol, atol=4 * atol, dtype=dtype)


@pytest.mark.parametrize("T", [2, 7])
@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_dropout_in_training_equal_eager_with_seed(cls, T):
    """Dropout between layers draws from the global generator exactly as eager does."""
    model = Net(cls, num_layers=3, dropout=0.5).train()
    ref = copy.deepcopy(model)
    fn = wformat()(model)
    x = torch.randn(T, 3, 5)
    torch.manual_seed(123)
    out = fn(x)
    torch.manual_seed(123)
    expected = ref(x)
    torch.testing.assert_close(out, expected)
    out[0].sum().backward()
    expected[0].sum().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    # It really is random: another seed, another output.
    torch.manual_seed(7)
    assert not torch.allclose(fn(x)[0], out[0])


def test_dropout_in_eval_is_off():
    model = Net(nn.LSTM, num_layers=2, dropout=0.5).eval()
    assert_same_fwd_bwd(model, wformat(), make_inputs(nn.LSTM, {}, 7))


def test_unbatched_input_equal_eager():
    model = Net(nn.GRU, num_layers=2)
    x = torch.randn(7, 5, requires_grad=True)
    assert_same_fwd_bwd(model, wformat(), [x])


def test_no_grad_inference_and_grad_mask():
    # Frozen RNN weights, input requiring grad: only the input gets a gradient.
    model = Net(nn.LSTM, num_layers=2)
    model.rnn.requires_grad_(False)
    assert_same_fwd_bwd(model, wformat(), make_inputs(nn.LSTM, {}, 7))
    with torch.no_grad():
        torch._dynamo.reset()
        fn = wformat()(model)
        x = torch.randn(7, 3, 5)
        torch.testing.assert_close(fn(x), model(x))


# -- training, parameters, state_dict ------------------------------------------


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_five_training_steps_equal_eager(inner):
    model = Net(nn.LSTM, num_layers=2, bidirectional=True)
    ref = copy.deepcopy(model)
    fn = wformat(inner=inner)(model)
    # Lengths on both sides of N: each compiles once (static shapes).
    batches = [(torch.randn(T, 3, 5),) for T in (2, 7, 2, 7, 2)]
    losses = train_steps(model, fn, lambda i: batches[i], torch.optim.Adam, steps=5, lr=1e-2)
    ref_losses = train_steps(ref, ref, lambda i: batches[i], torch.optim.Adam, steps=5, lr=1e-2)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-4, atol=1e-5)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=n)


def test_nothing_outlives_the_graph_outputs():
    """Everything the backward needs is a traced value that AOTAutograd saves
    and frees: the oneDNN workspace dies with the output it belongs to."""
    import gc
    import weakref as _weakref

    fn = wformat(inner="inductor")(Net(nn.LSTM, num_layers=2))
    out = fn(torch.randn(7, 3, 5))[0]
    node = out.grad_fn
    saved = [t for t in getattr(node, "saved_tensors", ()) if isinstance(t, torch.Tensor)] if hasattr(node, "saved_tensors") else []
    ref = _weakref.ref(out)
    del out, node, saved
    gc.collect()
    assert ref() is None


def test_parameters_same_objects_views_of_one_block_state_dict_unchanged():
    model = Net(nn.LSTM, num_layers=2, bias=False)
    ids = param_ids(model)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    wformat()(model)(torch.randn(7, 3, 5))
    assert param_ids(model) == ids
    flat = list(model.rnn._flat_weights)
    fs = fused_storage_of(flat[0])
    assert fs is not None and all(fs.is_member(w) for w in flat)
    assert len({w.untyped_storage().data_ptr() for w in flat}) == 1
    # bias=False: the oneDNN kernel gets zero biases built in the graph, none
    # in the block, so a checkpoint (torch.save writes a view's whole storage) holds no zeros.
    assert fs.numel == sum(w.numel() for w in flat)
    new_sd = model.state_dict()
    assert list(new_sd) == list(sd)
    for k in sd:
        assert new_sd[k].shape == sd[k].shape
        torch.testing.assert_close(new_sd[k], sd[k], rtol=0, atol=0)
    # A checkpoint loads into an un-passed model and back.
    plain = Net(nn.LSTM, num_layers=2, bias=False)
    plain.load_state_dict(model.state_dict())
    model.load_state_dict(plain.state_dict())
    assert wfpass.restore(model) == len(flat)
    assert len({w.untyped_storage().data_ptr() for w in model.rnn._flat_weights}) == len(flat)


# -- graph shape ------------------------------------------------------------------


def test_one_rnn_node_for_any_length():
    """T = 1, 8, 200: one RNN call in the graph the inner compiler
    receives, the same graph size each time; T = 200 end to end through
    Inductor. (The recorded graph is taken before the inner compiler, which
    wfpass sees as the same callable either way, so T = 1 and 8 run the
    cheaper aot_eager behind it: the graphs compared are the same.)"""
    node_counts = []
    for T in (1, 8, 200):
        torch._dynamo.reset()
        model = Net(nn.LSTM, num_layers=2)
        rec = Recorder(inner="inductor" if T == 200 else "aot_eager", seq_threshold=N)
        fn = torch.compile(model, backend=rec.backend)
        out, _ = fn(torch.randn(T, 2, 5, requires_grad=True))
        out.sum().backward()
        (gm,) = rec.graphs
        assert sum(isinstance(n.target, rnn_ops.RnnForward) for n in gm.graph.nodes) == 1
        assert count_targets(gm, torch.lstm) == 0
        node_counts.append(len(gm.graph.nodes))
    assert len(set(node_counts)) == 1, node_counts


@pytest.mark.parametrize("variant", ["lstm-bi-batch_first", "lstm-proj", "gru-2layer-bi"])
def test_zero_or_given_initial_state(variant):
    """Called without a state, nn.LSTM/GRU/RNN.forward builds zeros in the
    graph; a given state is passed through; both equal eager."""
    cls, kw = VARIANTS[variant]
    for state in (False, True):
        torch._dynamo.reset()
        model = Net(cls, **kw)
        rec = Recorder(inner="aot_eager", seq_threshold=N)
        inputs = make_inputs(cls, kw, T=6, state=state)
        assert_same_fwd_bwd(model, lambda m: torch.compile(m, backend=rec.backend), inputs)
        (gm,) = rec.graphs
        (call,) = [n for n in gm.graph.nodes if isinstance(n.target, rnn_ops.RnnForward)]
        assert len(call.args[1]) == (2 if cls is nn.LSTM else 1)


def test_user_zeros_of_another_dtype_still_raise_like_eager():
    """A user's float64 zero state for a float32 GRU must still fail as in eager."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(5, 6)

        def forward(self, x):
            return self.rnn(x, torch.zeros(1, x.shape[1], 6, dtype=torch.float64))[0]

    m, x = M(), torch.randn(3, 2, 5)
    with pytest.raises(RuntimeError) as eager:
        m(x)
    with pytest.raises(RuntimeError) as compiled:
        torch.compile(m, backend=wfpass.backend(inner="aot_eager"))(x)
    assert str(compiled.value).splitlines()[-1].endswith(str(eager.value).splitlines()[-1]), (compiled.value, eager.value)


def test_double_backward_works_in_apply_graphs():
    """``wfpass.apply`` graphs run the RNN under eager autograd, so
    create_graph=True gives eager's second derivative. (Under torch.compile
    AOTAutograd refuses double backward for any model.)"""
    model = TNet(nn.LSTM, use_state=False)
    gm = fx.symbolic_trace(copy.deepcopy(model))
    wfpass.apply(gm)
    x = torch.randn(3, 2, 5, requires_grad=True)
    (g,) = torch.autograd.grad(model(x).pow(2).sum(), x, create_graph=True)
    gg = torch.autograd.grad(g.pow(2).sum(), x)[0]
    assert gg.abs().sum() > 0  # eager: a real second derivative
    (g1,) = torch.autograd.grad(gm(x).pow(2).sum(), x, create_graph=True)
    torch.testing.assert_close(g1, g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(g1.pow(2).sum(), x)[0], gg, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("zero_state", [False, True])
@pytest.mark.parametrize("train", [False, True])
def test_lstm_layer_op_passes_torch_library_opcheck(train, zero_state):
    """PyTorch's own checker on ``wfpass::lstm_layer``: schema (no aliasing,
    no mutation), fake implementation (shapes, dtypes, strides, the oneDNN
    workspace size included) and the registered autograd formula."""
    torch.manual_seed(0)
    H, I = 6, 5
    x = torch.randn(4, 2, I, requires_grad=train)
    ws = [torch.randn(4 * H, I), torch.randn(4 * H, H), torch.randn(4 * H), torch.randn(4 * H)]
    ws = [w.requires_grad_(train) for w in ws]
    h, c = (None, None) if zero_state else (torch.randn(1, 2, H), torch.randn(1, 2, H))
    # Not the aot_dispatch checks: they compare every output of two runs, and
    # the workspace is oneDNN's scratch memory, whose bytes differ run to run.
    torch.library.opcheck(torch.ops.wfpass.lstm_layer.default, (x, *ws, h, c, False, H, True, train),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    if train:
        # The backward op: its fake, and what its schema cannot say. oneDNN
        # writes scratch bytes into the workspace it is given (opcheck's
        # schema test reports the mutation; eager PyTorch's own
        # MkldnnRnnLayerBackward0 does the same to its saved workspace).
        # The schema still calls it read-only, because nothing the kernel
        # reads depends on those bytes: a second backward over the same
        # workspace (retain_graph, recomputation) gives the same gradients,
        # bit for bit. Declared mutable, AOTAutograd would copy the whole
        # workspace per layer per step.
        y, hy, cy, ws_ = torch.ops.wfpass.lstm_layer.default(x, *ws, h, c, False, H, True, True)
        args = [t.detach() for t in (x, *ws)] + [h, c] + [t.detach() for t in (y, hy, cy)]
        args += [torch.randn_like(y), None, None, False, H, True, ws_]
        torch.library.opcheck(torch.ops.wfpass.lstm_layer_backward.default, tuple(args),
                              test_utils=("test_faketensor",))
        first = torch.ops.wfpass.lstm_layer_backward.default(*args)
        again = torch.ops.wfpass.lstm_layer_backward.default(*args)
        for a, b in zip(first, again):
            assert torch.equal(a, b)
        assert len({g.untyped_storage().data_ptr() for g in first}) == len(first)  # no output aliases another


@pytest.mark.parametrize("mode", ["GRU", "RNN_TANH", "RNN_RELU"])
@pytest.mark.parametrize("bias,state,reverse", [(True, True, False), (False, False, True)])
def test_rnn_layer_op_passes_opcheck_and_equals_eager_autograd(mode, bias, state, reverse):
    """``wfpass::rnn_layer`` (GRU / plain RNN as one op, hand-written
    backward) against ATen's kernel under eager autograd, float64, both
    outputs in the loss; and torch.library's opcheck. On the C++ kernels
    where they build (the Python ones run in ``WFPASS_NATIVE=0`` runs)."""
    from wfpass import native

    native.loaded()
    torch.manual_seed(0)
    g = 3 if mode == "GRU" else 1
    T, B, I, H = 6, 3, 4, 5
    mk = lambda *s: torch.randn(*s, dtype=torch.float64, requires_grad=True)  # noqa: E731
    x, w_ih, w_hh = mk(T, B, I), mk(g * H, I), mk(g * H, H)
    b_ih, b_hh = (mk(g * H), mk(g * H)) if bias else (None, None)
    hx = mk(1, B, H) if state else None
    ins = [t for t in (x, w_ih, w_hh, b_ih, b_hh, hx) if t is not None]
    R, Rh = torch.randn(T, B, H, dtype=torch.float64), torch.randn(1, B, H, dtype=torch.float64)
    out, hy = torch.ops.wfpass.rnn_layer(x, w_ih, w_hh, b_ih, b_hh, hx, mode, reverse)
    grads = torch.autograd.grad((out * R).sum() + (hy * Rh).sum(), ins)
    kernel = {"GRU": torch.gru, "RNN_TANH": torch.rnn_tanh, "RNN_RELU": torch.rnn_relu}[mode]
    h0 = hx if state else torch.zeros(1, B, H, dtype=torch.float64)
    params = [w_ih, w_hh] + ([b_ih, b_hh] if bias else [])
    rout, rhy = kernel(x.flip(0) if reverse else x, h0, params, bias, 1, 0.0, True, False, False)
    rout = rout.flip(0) if reverse else rout
    rgrads = torch.autograd.grad((rout * R).sum() + (rhy * Rh).sum(), ins)
    torch.testing.assert_close(out, rout, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hy, rhy, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, rgrads):
        assert (a - b).abs().max() <= 1e-10 * b.abs().max(), (a - b).abs().max()
    torch.library.opcheck(torch.ops.wfpass.rnn_layer.default, (x, w_ih, w_hh, b_ih, b_hh, hx, mode, reverse))


def test_assign_load_then_old_parameters_freed_mid_compile():
    """After load_state_dict(assign=True) nn.GRU's ``_flat_weight_refs`` still
    point at the old Parameters; if those die between Dynamo's trace and its
    guard building (here: inside the inner compiler; in real life whenever
    the collector gets to them), plain Dynamo with ``allow_rnn`` fails with
    ``_dispatch_keys() ... Invoked with: None``. wformat refreshes the
    references before the trace, so the recompile works and equals eager."""
    holder = []

    def inner(gm, example_inputs):
        holder.clear()  # the old Parameters die now: traced, guards not built yet
        return gm.forward

    model = nn.GRU(5, 6)
    fn = torch.compile(model, backend=wfpass.backend(inner=inner))
    fn(torch.randn(3, 2, 5))
    holder.append(list(model.parameters()))
    model.load_state_dict({k: v.detach().clone() * 0.5 for k, v in model.state_dict().items()}, assign=True)
    x = torch.randn(3, 2, 5)
    out, h = fn(x)
    ref, rh = copy.deepcopy(model)(x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(h, rh)


LAYER_OPS = {nn.LSTM: (torch.ops.wfpass.lstm_layer.default, torch.ops.wfpass.lstm_layer_backward.default),
             nn.GRU: (torch.ops.wfpass.rnn_layer.default, torch.ops.wfpass.rnn_layer_backward.default),
             nn.RNN: (torch.ops.wfpass.rnn_layer.default, torch.ops.wfpass.rnn_layer_backward.default)}


@pytest.mark.parametrize("cls", list(LAYER_OPS), ids=lambda c: c.__name__)
def test_aot_graphs_hold_one_op_per_layer_each_way(cls):
    """AOTAutograd's forward graph holds one layer op per layer (oneDNN's
    LSTM layer; ATen's native GRU / RNN) and its backward graph one backward
    op for each, the same graphs for T = 8 and 200: compile time does not
    grow with T."""
    from torch._dynamo.backends.common import aot_autograd

    sizes = []
    for T in (8, 200):
        torch._dynamo.reset()
        graphs = {}

        def fw(gm, _):
            graphs["fw"] = gm
            return gm.forward

        def bw(gm, _):
            graphs["bw"] = gm
            return gm.forward

        model = Net(cls, num_layers=2)
        # oneDNN's layer asked for: this small LSTM would take the C++ loop
        # (test_cxx_lstm.py checks that one's graphs).
        fn = torch.compile(model, backend=wfpass.backend(inner=aot_autograd(fw_compiler=fw, bw_compiler=bw), seq_threshold=N,
                                                         rnn={"cpu_kernel": "eager"}))
        fn(torch.randn(T, 2, 5))[0].sum().backward()
        fw_op, bw_op = LAYER_OPS[cls]
        assert count_targets(graphs["fw"], fw_op) == 2
        assert count_targets(graphs["bw"], bw_op) == 2
        sizes.append((len(graphs["fw"].graph.nodes), len(graphs["bw"].graph.nodes)))
    assert len(set(sizes)) == 1, sizes


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
def test_compiled_forward_graphs_call_the_ops_without_autograd_kernels(cls, monkeypatch):
    """Under Inductor, the forward graph AOTAutograd made calls the layer
    op's twin without torch.library's Python autograd kernel (a cost per
    call, run even under no_grad), the backward graph the backward op, and
    the numbers are eager's."""
    from wfpass._torch import aot

    seen = []
    real = aot.use_twins

    def spy(gm):
        before = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        n = real(gm)
        seen.append((n, before, {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}))
        return n

    monkeypatch.setattr(aot, "use_twins", spy)
    model = Net(cls, num_layers=2)
    assert_same_fwd_bwd(model, lambda m: torch.compile(m, backend=wfpass.backend(seq_threshold=N)),
                        [torch.randn(9, 3, 5, requires_grad=True)])
    fw = [after for n, before, after in seen if n]
    assert len(fw) == 1 and any(t.endswith("_fw.default") for t in fw[0]), seen
    assert any(any(t.endswith("layer_backward.default") for t in after) for _, _, after in seen)


# -- dynamic lengths -------------------------------------------------------------


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_dynamic_lengths(inner):
    """dynamic=True, with and without grad: every length equals eager."""
    model = Net(nn.LSTM, num_layers=2, batch_first=True)
    ref = copy.deepcopy(model)
    rec = Recorder(inner=inner, seq_threshold=N)
    fn = torch.compile(model, backend=rec.backend, dynamic=True)
    with torch.no_grad():
        for T in (3, 8, 9, 40):
            x = torch.randn(3, T, 5)
            out, (h, c) = fn(x)
            expected, (eh, ec) = ref(x)
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(c, ec, rtol=1e-4, atol=1e-5)
    # One graph for every length after the first (Dynamo's static first
    # graph is for T=3): the length stays symbolic through wfpass, which
    # takes the fused kernel for it, as eager and Inductor's default do.
    paths = wfpass.report(model).find("rnn")[0].detail["paths"]
    assert paths == {"T=3": "loop", "T=symbolic": "mkldnn"} or paths == {"T=symbolic": "mkldnn"}, paths
    for T in (3, 9):
        x = torch.randn(3, T, 5)
        out, _ = fn(x)
        expected, _ = ref(x)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        out.sum().backward()
        expected.sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
def test_training_after_dynamic_recompile_stays_one_op_per_layer(cls):
    """Varying batches make Dynamo recompile with a symbolic length and
    batch; training then still runs one op per layer, not an unrolled
    recurrence: the GRU on wfpass's C++ loop where it runs (else ATen's
    native GRU); the LSTM, whose sizes the training graph specializes
    (oneDNN's workspace has no size formula), at those sizes on the kernel a
    static graph takes (this small one: the C++ loop where it runs, else
    oneDNN's layer). Every gradient equals eager's (SGD steps over mixed
    shapes)."""
    from wfpass import native

    if cls is nn.LSTM:
        path = "cxx" if native.fast_loop() else "mkldnn"
    else:
        path = "cxx" if native.fast_loop() else "native"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), cls(16, 16, num_layers=2))
    ref = copy.deepcopy(model)
    rec = Recorder(inner="inductor", seq_threshold=N)
    fn = torch.compile(model, backend=rec.backend)
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    # The second batch changes both the length and the batch, so Dynamo's
    # one recompile makes both symbolic (the old (16, 3) step recompiled for
    # the batch alone, then again for the length: one Inductor compile more
    # for the same symbolic graph); the third batch reuses that graph.
    for T, B in ((16, 1), (24, 3), (9, 5)):
        tok = torch.randint(0, 50, (T, B))
        R = torch.randn(T, B, 16)
        (out, st), (rout, rst) = fn(tok), ref(tok)
        st, rst = (st, rst) if cls is nn.LSTM else ((st, st), (rst, rst))
        torch.testing.assert_close(out, rout, rtol=1e-4, atol=1e-5)
        ((out * R).sum() + st[0].sum() + 2 * st[1].sum()).backward()
        ((rout * R).sum() + rst[0].sum() + 2 * rst[1].sum()).backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            scale = q.grad.abs().max().clamp_min(1e-6)
            assert ((p.grad - q.grad).abs().max() / scale) < 1e-4, (T, B, n)
        opt.step(), ropt.step(), opt.zero_grad(), ropt.zero_grad()
    dyn = [g for g in rec.graphs if any(isinstance(d, torch.SymInt) for p in g.graph.find_nodes(op="placeholder")
                                        for d in getattr(p.meta.get("example_value"), "shape", ()))]
    assert dyn, "no graph with a symbolic shape was compiled"
    for g in dyn:
        paths = [n.target.path for n in g.graph.nodes if isinstance(n.target, rnn_ops.RnnForward)]
        assert paths == [path], paths


# -- layout lost ----------------------------------------------------------------


def test_layout_lost_after_dtype_round_trip_is_re_fused_and_counted():
    model = Net(nn.LSTM, num_layers=2)
    ref = copy.deepcopy(model)
    fn = wformat()(model)
    x = torch.randn(7, 3, 5)
    fn(x)
    rec = rnn_record()
    model.to(torch.float64)
    fn(x.double())  # a new graph for float64 (its own record)
    model.to(torch.float32)
    assert fused_storage_of(model.rnn.weight_ih_l0) is None  # .to() gave every parameter its own storage
    out = fn(x)  # the float32 graph again: its prologue re-fuses
    # Two real losses, each re-fused: by the float64 graph, then the float32 one.
    assert rec.stats.get("re_fused") == 2, rec.stats
    torch.testing.assert_close(out, ref(x))
    assert fused_storage_of(model.rnn.weight_ih_l0) is not None


def test_layout_lost_with_shared_storage_falls_back_and_counts():
    model = Net(nn.LSTM, num_layers=2, bias=False)
    fn = wformat()(model)
    records = []
    for T in (2, 7):  # one graph per length (static shapes), one record each
        fn(torch.randn(T, 3, 5, requires_grad=True))
        records.append(rnn_record())
    with torch.no_grad():
        model.rnn.weight_hh_l1.data = model.rnn.weight_hh_l1.data.clone()
    keep = model.rnn.weight_hh_l1.data  # an alias held elsewhere: re-fusing would untie it
    for T in (2, 7):
        model.zero_grad(set_to_none=True)
        assert_same_fwd_bwd(model, lambda m: fn, [torch.randn(T, 3, 5, requires_grad=True)])
    # The kernels read each weight where it is: the call is right, and counted.
    assert [r.stats["unfused_layout_calls"] for r in records] == [2, 2]
    assert keep.data_ptr() == model.rnn.weight_hh_l1.data_ptr()


def test_fallback_counter_and_re_fuse_counter_on_records():
    model = Net(nn.GRU)
    fn = wformat()(model)
    x = torch.randn(7, 3, 5)
    fn(x)
    rec = rnn_record()
    keep = model.rnn.weight_ih_l0.data.clone()
    model.rnn.weight_ih_l0.data = keep  # layout lost, and ``keep`` shares the new storage
    fn(x)
    assert rec.stats["unfused_layout_calls"] == 1 and rec.stats["re_fused"] == 0, rec.stats
    del keep
    fn(x)  # nothing else holds the storage now: re-fused
    assert rec.stats["re_fused"] == 1, rec.stats


# -- skipped and other backends -------------------------------------------------


def test_packed_sequence_runs_eagerly_and_is_not_rewritten():
    model = nn.LSTM(5, 6)
    packed = pack_padded_sequence(torch.randn(7, 3, 5), torch.tensor([7, 4, 2]))
    rec = Recorder(inner="aot_eager")
    out, (h, c) = torch.compile(model, backend=rec.backend)(packed)
    expected, (eh, ec) = model(packed)
    torch.testing.assert_close(out.data, expected.data)
    torch.testing.assert_close(c, ec)
    # Dynamo graph-breaks on PackedSequence before any RNN node exists.
    assert not any(isinstance(n.target, rnn_ops.RnnForward) for g in rec.graphs for n in g.graph.nodes)


def test_packed_form_in_a_graph_is_skipped_with_a_reason():
    """aten's packed overloads (``lstm.data``) are reported, not rewritten."""

    rnn = nn.GRU(5, 6)
    graph = fx.Graph()
    data, sizes = graph.placeholder("data"), graph.placeholder("batch_sizes")
    ws = [graph.get_attr(n) for n in rnn._flat_weights_names]
    h0 = graph.call_function(torch.zeros, (1, 3, 6))
    out = graph.call_function(torch.ops.aten.gru.data, (data, sizes, h0, ws, True, 1, 0.0, False, False))
    graph.output(graph.call_function(operator.getitem, (out, 0)))
    gm = fx.GraphModule(rnn, graph)
    report = wfpass.apply(gm)
    (rec,) = report.find("rnn")
    assert rec.action == "skipped" and "PackedSequence" in rec.reason


def test_other_backends_still_graph_break():
    seen = []

    def plain(gm, example_inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    model = Net(nn.LSTM)
    torch.compile(model, backend=plain)(torch.randn(7, 3, 5))
    assert torch.lstm not in seen
    assert not torch._dynamo.config.allow_rnn
    # ... and wformat without fuse_rnn does not capture RNNs either.
    torch._dynamo.reset()
    rec = Recorder(inner="eager", passes=("fuse_linears",))
    torch.compile(model, backend=rec.backend)(torch.randn(7, 3, 5))
    assert all(count_targets(g, torch.lstm) == 0 for g in rec.graphs)


def test_registered_wformat_name_captures_rnn():
    model = Net(nn.GRU)
    x = torch.randn(7, 3, 5)
    out = torch.compile(model, backend="wformat")(x)
    torch.testing.assert_close(out, model(x))
    assert rnn_record().stats["fused_calls"] + rnn_record().stats["unfused_calls"] == 1


def test_functional_call_with_computed_weights_is_skipped():
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.RNN(5, 6)

        def forward(self, x):
            ws = [w * 1.0 for w in self.rnn._flat_weights]
            return torch.rnn_tanh(x, torch.zeros(1, x.shape[1], 6), ws, True, 1, 0.0, False, False, False)[0]

    model = Functional()
    x = torch.randn(7, 3, 5)
    out = wformat()(model)(x)
    torch.testing.assert_close(out, model(x))
    (rec,) = wfpass.last_report().find("rnn")
    assert rec.action == "skipped" and "not a Parameter" in rec.reason


def test_same_rnn_called_twice_shares_one_group():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(5, 5)

        def forward(self, x):
            y, _ = self.rnn(x)
            return self.rnn(y)[0]

    model = Twice()
    assert_same_fwd_bwd(model, wformat(), [torch.randn(7, 3, 5, requires_grad=True)])
    (rec,) = wfpass.last_report().find("rnn")
    assert rec.stats["fused_calls"] == 2


def test_tied_weights_are_left_in_place():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.GRU(5, 5)
            self.b = nn.GRU(5, 5)
            self.b.weight_hh_l0 = self.a.weight_hh_l0

        def forward(self, x):
            return self.b(self.a(x)[0])[0]

    model = Tied()
    assert_same_fwd_bwd(model, wformat(), [torch.randn(7, 3, 5, requires_grad=True)])
    recs = wfpass.last_report().find("rnn")
    assert len(recs) == 2 and any("left where they are" in r.reason for r in recs)
    assert model.a.weight_hh_l0 is model.b.weight_hh_l0


# -- seq_threshold="auto" ---------------------------------------------------------


def test_auto_threshold_measures_once_per_shape():
    auto_threshold_cache().clear()
    model = Net(nn.LSTM)
    ref = copy.deepcopy(model)
    # Static shapes: each length compiles its graph, and the path is chosen
    # at compile time from a measurement made once per shape (T aside).
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager", seq_threshold="auto",
                                                     rnn=wfpass.RnnOptions(auto_lengths=(1, 2, 4))))
    with torch.no_grad():
        for T in (3, 9, 5):
            x = torch.randn(T, 4, 5)
            torch.testing.assert_close(fn(x), ref(x))
    rec = wfpass.last_report().find("rnn")[0]
    assert rec.stats["auto_measurements"] == 1
    assert rec.detail["threshold"] == "auto" and len(rec.detail["auto_thresholds"]) == 1
    n = next(iter(auto_threshold_cache().values()))
    assert n in (0, 1, 2, 4)


@pytest.mark.parametrize("rnn, exc, words", [
    (dict(unfused_impl="fast"), ValueError, "'rnn.unfused_impl'"),
    (dict(auto_lengths=(4, 2)), ValueError, "'rnn.auto_lengths'"),
    (dict(auto_lengths=(0, 1)), ValueError, "'rnn.auto_lengths'"),
    (dict(auto_lengths=[1, 2.5]), TypeError, "'rnn.auto_lengths'"),
    (dict(auto_length=(1,)), ValueError, "'rnn.auto_length'"),
    ("loop", TypeError, "'rnn'"),
])
def test_rnn_options_are_checked_naming_the_option(rnn, exc, words):
    with pytest.raises(exc, match=re.escape(words)):
        wfpass.backend(rnn=rnn)


def test_rnn_options_reach_the_rnn_call_of_the_graph():
    rec = Recorder(inner="eager", seq_threshold=N, rnn={"unfused_impl": "loop", "auto_lengths": [1, 3]})
    torch.compile(Net(nn.LSTM), backend=rec.backend)(torch.randn(7, 3, 5))
    (fn,) = [n.target for g in rec.graphs for n in g.graph.nodes if isinstance(n.target, rnn_ops.RnnForward)]
    assert fn.spec.options == wfpass.RnnOptions(seq_threshold=N, unfused_impl="loop", auto_lengths=(1, 3))


def test_auto_threshold_skips_measuring_when_paths_share_a_kernel():
    model = Net(nn.GRU)
    wformat(seq_threshold="auto")(model)(torch.randn(7, 3, 5))
    assert "auto_measurements" not in rnn_record().stats


def test_auto_with_dropout_keeps_callers_random_stream():
    model = Net(nn.LSTM, num_layers=2, dropout=0.3).train()
    ref = copy.deepcopy(model)
    fn = wformat(seq_threshold="auto", rnn=wfpass.RnnOptions(auto_lengths=(1, 8)))(model)
    x = torch.randn(7, 3, 5)
    torch.manual_seed(5)
    out = fn(x)
    torch.manual_seed(5)
    torch.testing.assert_close(out, ref(x))


# -- errors ----------------------------------------------------------------------


def _traced(cls=nn.LSTM, **kw):
    model = TNet(cls, num_layers=2, **kw)
    gm = fx.symbolic_trace(model)
    wfpass.apply(gm)
    return model, gm


def test_apply_on_symbolic_trace_equal_eager():
    for cls, kw in (VARIANTS["lstm-bi-batch_first"], VARIANTS["gru-nobias-batch_first"], VARIANTS["lstm-proj"]):
        model = TNet(cls, **kw)
        gm = fx.symbolic_trace(model)
        report = wfpass.apply(gm, seq_threshold=N)
        assert not any(n.op == "call_module" and n.target == "rnn" for n in gm.graph.nodes)
        (rec,) = report.find("rnn", "rewritten")
        for T, state in ((2, False), (7, True)):
            model.zero_grad(set_to_none=True)
            ins = make_inputs(cls, kw, T, state=state)
            assert_same_fwd_bwd(model, lambda m: gm, ins)
        assert rec.stats["unfused_calls"] == 1 and rec.stats["fused_calls"] == 1


@pytest.mark.parametrize(
    "bad, kind, text",
    [
        ("input_size", RuntimeError, "input.size(-1) must be equal to input_size"),
        ("hidden", RuntimeError, "Expected hidden[0] size"),
        ("dtype", ValueError, "dtype"),
        ("dims", ValueError, "Expected input to be 2D or 3D"),
    ],
)
def test_bad_input_raises_eagers_error_naming_the_rnn(bad, kind, text):
    model, gm = _traced()
    x = torch.randn(7, 3, 5)
    args = {
        "input_size": (torch.randn(7, 3, 4),),
        "hidden": (x, (torch.zeros(2, 3, 5), torch.zeros(2, 3, 6))),
        "dtype": (x.double(),),
        "dims": (torch.randn(2, 7, 3, 5),),
    }[bad]
    with pytest.raises(kind) as eager_err:
        model(*args)
    with pytest.raises(kind, match="'rnn' \\(nn.LSTM\\)") as err:
        gm(*args)
    assert text in str(err.value) and text in str(eager_err.value)


_BAD_UNDER_COMPILE = {
    # name: (args after a good (7, 3, 5) call, eager's exception type, eager's text)
    "input_size": (lambda: (torch.randn(7, 3, 4),), RuntimeError, "input.size(-1) must be equal to input_size"),
    "hidden": (lambda: (torch.randn(7, 3, 5), (torch.zeros(2, 4, 6), torch.zeros(2, 4, 6))), RuntimeError,
               "Expected hidden[0] size"),
    "dtype": (lambda: (torch.randn(7, 3, 5, dtype=torch.float64),), ValueError, "does not match weight dtype"),
}


@pytest.mark.parametrize("first", [True, False], ids=["first-call", "after-a-good-call"])
@pytest.mark.parametrize("bad", sorted(_BAD_UNDER_COMPILE))
def test_bad_input_through_torch_compile_raises_eagers_error_naming_the_rnn(bad, first):
    """Dynamo runs nn.LSTM's own argument checks while it traces and runs the
    frame eagerly when they raise, so no graph is involved; the check that
    raises is the module's ``check_forward_args``, which wfpass names when
    Dynamo first wraps the RNN for a wformat backend (``fuse_rnn.name_errors``)."""
    make_args, kind, text = _BAD_UNDER_COMPILE[bad]

    class Outer(nn.Module):  # a nested RNN, so the name is a dotted path
        def __init__(self):
            super().__init__()
            self.enc = nn.ModuleDict({"net": Net(nn.LSTM, num_layers=2)})

        def forward(self, x, *state):
            return self.enc["net"](x, *state)

    model = Outer()
    ref = copy.deepcopy(model)
    args = make_args()
    with pytest.raises(kind) as eager_err:
        ref(*args)
    fn = wformat()(model)
    if not first:
        fn(torch.randn(7, 3, 5))
    with pytest.raises(kind) as err:
        fn(*args)
    assert type(err.value) is type(eager_err.value)
    assert str(err.value) == f"'enc.net.rnn' (nn.LSTM): {eager_err.value}"
    assert text in str(err.value)


def test_naming_the_rnn_costs_no_graph_break_and_is_undone_by_restore():
    from torch._dynamo.utils import counters

    model = Net(nn.LSTM, num_layers=2)
    counters.clear()
    assert_same_fwd_bwd(model, wformat(), make_inputs(nn.LSTM, {"num_layers": 2}, 7))
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    assert "check_forward_args" in vars(model.rnn)
    # deepcopy and pickling keep a working, self-referencing check
    for clone in (copy.deepcopy(model), _pickled(model)):
        with pytest.raises(RuntimeError, match="'rnn' \\(nn.LSTM\\): input.size"):
            clone.rnn.check_forward_args(torch.randn(7, 3, 4), None, None)
        assert clone.rnn.check_forward_args.args[0] is clone.rnn
    wfpass.restore(model)
    assert "check_forward_args" not in vars(model.rnn)


def _pickled(model):
    import io

    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_apply_subclass_with_own_forward_is_skipped():
    class MyLSTM(nn.LSTM):
        def forward(self, x, hx=None):
            return super().forward(x * 2, hx)

    model = TNet(nn.LSTM)
    model.rnn = MyLSTM(5, 6)
    tracer = fx.Tracer()
    tracer.is_leaf_module = lambda m, name: isinstance(m, nn.RNNBase) or fx.Tracer.is_leaf_module(tracer, m, name)
    gm = fx.GraphModule(model, tracer.trace(model))
    report = wfpass.apply(gm)
    (rec,) = report.find("rnn")
    assert rec.action == "skipped" and "subclass" in rec.reason


def test_report_record_fields():
    model = Net(nn.LSTM, num_layers=2, bidirectional=True)
    fn = wformat(seq_threshold=3)(model)
    for T in (2, 5):
        fn(torch.randn(T, 3, 5))
    rec = wfpass.last_report().find("rnn")[0]
    assert rec.pattern == "rnn" and rec.detail["threshold"] == 3 and rec.detail["mode"] == "LSTM"
    assert set(rec.stats) >= {"fused_calls", "unfused_calls", "fallback_calls"}
    assert "'rnn' (nn.LSTM)" in rec.reason and "rnn.weight_ih_l0" in rec.params
    assert "rnn" in str(wfpass.last_report())


def test_explain_and_dry_run_change_nothing():
    model = Net(nn.GRU)
    ids = param_ids(model)
    ptrs = [p.data_ptr() for p in model.parameters()]
    before = wfpass.last_report()
    rec = Recorder(inner="eager", dry_run=True)
    torch.compile(model, backend=rec.backend)(torch.randn(7, 3, 5))
    assert param_ids(model) == ids and [p.data_ptr() for p in model.parameters()] == ptrs
    # A dry run leaves last_report() alone.
    assert wfpass.last_report() is before or str(wfpass.last_report()) == str(before)
    # wfpass.explain wraps the backend in a closure: RNNs are still captured.
    report = wfpass.explain(model, torch.randn(7, 3, 5))
    (r,) = report.find("rnn")
    assert r.action == "would rewrite" and "[dry run]" in r.reason
    assert param_ids(model) == ids and [p.data_ptr() for p in model.parameters()] == ptrs
    assert not wfpass.report(model).records  # nothing was done to the model


# -- CUDA (skipped here) ----------------------------------------------------------

cuda = needs_gpu("needs CUDA (cuDNN flat-buffer path)")


@cuda
@pytest.mark.parametrize("variant", ["lstm-2layer", "lstm-nobias", "lstm-proj", "gru-2layer-bi"])
def test_cuda_cudnn_flat_buffer_no_compaction_warning(variant, recwarn):
    import warnings

    cls, kw = VARIANTS[variant]
    model = Net(cls, **kw).cuda()
    inputs = [t.cuda() if isinstance(t, torch.Tensor) else t for t in make_inputs(cls, kw, 7)]
    inputs = [t.detach().requires_grad_() for t in inputs]

    def compiled_no_warning(m):
        # Only the compiled model's calls are watched: the deep-copied eager
        # reference has lost its own flat buffer (copying an RNN does) and warns.
        fn = wformat(inner="inductor", rnn={"cuda": "cudnn"})(m)

        def call(*args):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                out = fn(*args)
            assert not [w for w in seen if "contiguous chunk of memory" in str(w.message)]
            return out

        return call

    assert_same_fwd_bwd(model, compiled_no_warning, inputs, rtol=1e-3, atol=1e-4)
    fs = fused_storage_of(model.rnn.weight_ih_l0)
    assert fs is not None and fs.kind == "rnn.cudnn"
    # and again after the first call (steady state), forward and backward
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compiled_no_warning(model)(*inputs)[0].sum().backward()
    assert not [w for w in seen if "contiguous chunk of memory" in str(w.message)]


@cuda
def test_cuda_default_threshold_is_the_measured_zero():
    """seq_threshold=None (the default) is per device: cuDNN beat the per-step
    loop at every length measured (docs/rnn_cuda_results.md), so N = 0 on CUDA."""
    model = Net(nn.LSTM).cuda()
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager"))
    fn(torch.randn(1, 3, 5, device="cuda"))
    rec = rnn_record()
    assert rec.detail["threshold"] == 0 and rec.stats["fused_calls"] == 1 and rec.stats["unfused_calls"] == 0


def test_cpu_default_threshold_is_the_measured_two():
    model = Net(nn.LSTM)
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager"))
    for T in (2, 3):
        fn(torch.randn(T, 3, 5))
    recs = wfpass.last_report().find("rnn", "rewritten")
    assert recs[0].detail["threshold"] == 2 == wfpass.config.DEFAULT_SEQ_THRESHOLD["cpu"]


def test_bf16_linear_then_lstm_trains_like_eager():
    """oneDNN hands back some bf16 LSTM gradients in float32; the op's
    backward must give them the dtype its fake promised, or the bf16 GEMM
    before the LSTM fails in the backward (seen under aot_eager and Inductor)."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.rnn = nn.Linear(4, 8), nn.LSTM(8, 8, batch_first=True)

        def forward(self, x):
            return self.rnn(self.lin(x))[0]

    torch.manual_seed(0)
    m = M().to(torch.bfloat16)
    ref = copy.deepcopy(m)
    fn = torch.compile(m, backend=wfpass.backend(inner="aot_eager"))
    for n, s in [(2, 5), (3, 6)]:
        x = torch.randn(n, s, 4, dtype=torch.bfloat16)
        R = torch.randn(n, s, 8, dtype=torch.bfloat16)
        (fn(x) * R).float().sum().backward()
        (ref(x) * R).float().sum().backward()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.bfloat16
        err = (p.grad.float() - q.grad.float()).abs().max() / q.grad.float().abs().max()
        assert err < 3e-2, (name, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpp_and_python_kernels_of_the_layer_ops_give_the_same_bits(dtype):
    """The RNN layer ops' C++ kernels (``native/rnn/rnn.cpp``) make the
    same ATen calls as their Python kernels: every output, workspace and
    gradient equal bit for bit, so the rest of the suite, run on the C++
    kernels, also speaks for the Python ones (no compiler, WFPASS_NATIVE=0).
    The one exception, the float32 GRU forward (a loop of its own in C++),
    equals ATen's to rounding."""
    from wfpass import native
    from wfpass.rnn.cpu import lstm_layer as ll, native_layer as nl

    if not native.loaded():
        pytest.skip(native.status())
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no bf16 oneDNN on this CPU")
    g = torch.Generator().manual_seed(0)
    T, B, I, H = 7, 3, 10, 12

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    x, h0, c0 = r(T, B, I), r(1, B, H), r(1, B, H)
    w = (r(4 * H, I), r(4 * H, H), r(4 * H), r(4 * H))
    for states in ((h0, c0), (None, None)):
        for reverse in (False, True):
            py = ll._lstm_layer(x, *w, *states, reverse, H, True, True)
            cpp = torch.ops.wfpass.lstm_layer_fw(x, *w, *states, reverse, H, True, True)
            for a, b in zip(py[:3], cpp[:3]):
                assert torch.equal(a, b)
            # The workspace holds oneDNN's scratch too (bytes no one reads): its size, then the
            # backward from either workspace below.
            assert py[3].shape == cpp[3].shape and py[3].numel() > 0
            gy, ghy, gcy = r(T, B, H), r(1, B, H), r(1, B, H)
            args = (x, *w, *states, *py[:3], gy, ghy, gcy, reverse, H, True)
            py_g = ll._lstm_layer_backward(*args, py[3].clone())
            cpp_g = torch.ops.wfpass.lstm_layer_backward(*args, cpp[3].clone())
            for a, b in zip(py_g, cpp_g):
                assert a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b)
    for mode in nl.MODES:
        k = 3 if mode == "GRU" else 1
        wg = (r(k * H, I), r(k * H, H), r(k * H), r(k * H))
        for state in (h0, None):
            for reverse in (False, True):
                py = nl._rnn_layer(x, *wg, state, mode, reverse)
                cpp = torch.ops.wfpass.rnn_layer_fw(x, *wg, state, mode, reverse)
                for a, b in zip(py, cpp):
                    assert a.shape == b.shape and a.stride() == b.stride() and b.storage_offset() == 0
                    if mode == "GRU" and dtype == torch.float32:
                        # The C++ GRU forward is its own loop (bias folded, five gate
                        # ops a step): ATen's numbers to rounding, not to the bit.
                        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
                    else:
                        assert torch.equal(a, b)
                # The backward: the op's C++ kernel, the Python kernel (with the C++
                # GRU loop) and the Python kernel with its own loop, bit for bit; with
                # and without biases and each incoming gradient.
                gy, ghy = r(T, B, H), r(1, B, H)
                for weights in (wg, (*wg[:2], None, None)):
                    for grads in ((gy, ghy), (None, ghy), (gy, None)):
                        args = (x, *weights, state, py[0], *grads, mode, reverse)
                        op_g = torch.ops.wfpass.rnn_layer_backward(*args)
                        mixed_g = nl._rnn_layer_backward(*args)
                        with pytest.MonkeyPatch.context() as mp:
                            mp.setattr(nl._native, "is_loaded", lambda: False)
                            py_g = nl._rnn_layer_backward(*args)
                        for a, b, c in zip(py_g, mixed_g, op_g):
                            assert a.dtype == c.dtype and a.shape == c.shape and a.stride() == c.stride()
                            assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(ValueError, match="mode must be one of"):
        torch.ops.wfpass.rnn_layer_fw(x, *wg, None, "LSTM", False)


def test_the_lstm_layer_op_records_no_autograd_graph_of_its_own():
    """``lstm_layer_fw`` runs oneDNN's kernel with grad mode on (for its
    workspace) inside compiled forward graphs, which run under ``no_grad``
    with parameters that require grad: the kernel's outputs carry no
    autograd node (ATen's would save eleven tensors for a graph no one
    differentiates), on the C++ kernel and the Python one; the workspace is
    still there."""
    from wfpass import native
    from wfpass.rnn.cpu import lstm_layer as ll

    native.loaded()
    T, B, I, H = 3, 2, 4, 5
    x = torch.randn(T, B, I)
    w = [torch.randn(4 * H, I, requires_grad=True), torch.randn(4 * H, H, requires_grad=True),
         torch.randn(4 * H, requires_grad=True), torch.randn(4 * H, requires_grad=True)]
    with torch.no_grad():
        for outs in (torch.ops.wfpass.lstm_layer_fw(x, *w, None, None, False, H, True, True),
                     ll._lstm_layer(x, *w, None, None, False, H, True, True)):
            assert all(o.grad_fn is None and not o.requires_grad for o in outs)
            assert outs[3].numel() > 0


def _lstm_without_onednn(monkeypatch, dtype, probe=None):
    """Compile a 2-layer LSTM of ``dtype`` where the CPU flag says oneDNN
    takes it (as on a Xeon with avx512_fp16) and the probe decides."""
    from wfpass._torch import kernels

    monkeypatch.setattr(kernels, "onednn_cpu_flag", lambda d: True)
    monkeypatch.setattr(kernels, "_PROBED", {})
    if probe is not None:
        monkeypatch.setattr(kernels, "_probe_lstm", probe)
    if kernels.mkldnn_rnn_dtype(dtype):
        pytest.skip(f"oneDNN runs a {dtype} LSTM on this CPU")
    cls, kw = VARIANTS["lstm-2layer"]
    rtol, atol = TOL[dtype]
    model = Net(cls, **kw).to(dtype)
    assert_same_fwd_bwd(model, wformat(), make_inputs(cls, kw, 7, dtype=dtype), rtol=4 * rtol, atol=4 * atol, dtype=dtype)
    rec = rnn_record()
    assert "mkldnn" not in rec.detail["paths"].values(), rec.detail
    assert "oneDNN takes no" in rec.detail["kernel"] and str(dtype).replace("torch.", "") in rec.detail["kernel"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_lstm_where_the_cpu_flag_promises_onednn_but_it_has_no_kernel(monkeypatch, dtype):
    """On a Xeon with avx512_fp16, ``_is_mkldnn_fp16_supported()`` is True
    and oneDNN still creates no f16 LSTM ("could not create a primitive
    descriptor"): the probe finds out, the LSTM takes ATen's kernels as in
    eager, and the report says why. Here the flag is forced on; where
    oneDNN really runs the dtype, the test has nothing to show and skips."""
    _lstm_without_onednn(monkeypatch, dtype)


def test_fp32_lstm_takes_aten_kernels_when_the_onednn_probe_fails(monkeypatch):
    """The same decision on every CPU: a probe that fails sends even a
    float32 LSTM to ATen's kernels, trained equal to eager."""
    def broken(dtype):
        raise RuntimeError("could not create a primitive descriptor for the LSTM forward propagation primitive")

    _lstm_without_onednn(monkeypatch, torch.float32, probe=broken)


@pytest.mark.parametrize("unbacked", [False, True])
def test_training_at_symbolic_lengths_specializes_unless_runtime_sizes_are_allowed(unbacked):
    """Training an LSTM through oneDNN saves the kernel's workspace, whose
    size only the kernel knows. Dynamo's shape environment refuses such
    sizes by default: then wfpass specializes the length (one graph per
    length, the row says so) rather than fail the compile; with
    ``capture_dynamic_output_shape_ops=True`` one graph serves every length.
    Gradients equal eager either way."""
    import torch._dynamo.config as dynamo_config

    model = Net(nn.LSTM, num_layers=2)
    ref = copy.deepcopy(model)
    graphs = []

    def inner(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.common import aot_autograd
        from functorch.compile import make_boxed_func

        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)

    torch._dynamo.reset()
    with dynamo_config.patch(capture_dynamic_output_shape_ops=unbacked):
        fn = torch.compile(model, backend=wfpass.backend(inner=inner, seq_threshold=N), dynamic=True)
        warm = 0
        for i, T in enumerate((12, 20, 33, 41)):
            if i == 2:
                warm = len(graphs)  # after the first lengths (and the recompile a first call's move may cause)
            x = torch.randn(T, 3, 5)
            out, _ = fn(x)
            expected, _ = ref(x)
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
            R = torch.randn_like(out)
            (out * R).sum().backward()
            (expected * R).sum().backward()
    scale = max(q.grad.abs().max().item() for q in ref.parameters())
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-4 * scale
    (rec,) = wfpass.report(model).find("rnn")
    if unbacked:
        assert len(graphs) == warm and "specialized" not in rec.detail, (len(graphs), warm, rec.detail)
    else:
        assert len(graphs) == warm + 2 and "sizes specialized" in rec.detail["specialized"], (len(graphs), warm)
