"""The runtime between compiled graphs and fused storage: what the compiler
must see (aliases, gradient formulas), layouts owned by the parameters, and
reports per model.

Each test is one of the failures real code met with the previous runtime:
an RNN whose input is read again after it (wrong weight_hh grads), a hook or
``clamp_`` that writes a fused weight (stale block), one compiled graph
serving many layers (weights moved on every call), state that outlived its
model, and counters lost across recompiles.
"""
from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn as nn

import wfpass
from wfpass.core.storage import fused_storage_of, live_layouts
from wftest import assert_applied


def _grads_close(model, ref, rtol=1e-4):
    """Every grad within ``rtol`` of the largest grad of the eager model."""
    gmax = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if q.grad is not None:
            err = (p.grad - q.grad).abs().max().item() / gmax
            assert err <= rtol, f"{n}: grad error {err:.2e} of the largest grad"


# -- RNN gradients in every graph context ------------------------------------------


class RnnContext(nn.Module):
    """One RNN inside the graph contexts that broke the tape design."""

    def __init__(self, cls, context, layers=1, bidirectional=False, proj=0):
        super().__init__()
        kw = dict(num_layers=layers, bidirectional=bidirectional)
        if proj:
            kw["proj_size"] = proj
        self.rnn = cls(8, 8 if not bidirectional else 4, **kw)
        self.rnn2 = cls(8, 8 if not bidirectional else 4, **kw)
        out = (proj or 8)
        self.head = nn.Linear(out, 8)
        self.gate = nn.Linear(8, 8)
        self.context = context

    def forward(self, x, state=None):
        c = self.context
        if c == "given_state":
            y, h = self.rnn(x, state)
        else:
            y, h = self.rnn(x)
        hn = h[0] if isinstance(h, tuple) else h
        if c == "residual":  # the input is read again after the RNN (HF EncodecLSTM)
            return self.head(y) + x
        if c == "gate":  # gated by its own projection
            return self.head(y) * torch.sigmoid(self.gate(x))
        if c == "two_rnns":  # one input into two RNNs
            return self.head(y) + self.head(self.rnn2(x)[0])
        if c == "h_n":  # the final state used
            return self.head(y) + hn[-1].unsqueeze(0)
        if c == "output_reused":
            return self.head(y) + self.head(y * y)
        return self.head(y)


CONTEXTS = ["residual", "gate", "two_rnns", "h_n", "output_reused", "given_state"]


def _state(cls, model, x, dtype):
    rnn = model.rnn
    L = rnn.num_layers * (2 if rnn.bidirectional else 1)
    h = torch.randn(L, x.shape[1], rnn.proj_size or rnn.hidden_size, dtype=dtype, requires_grad=True)
    if cls is nn.LSTM:
        return (h, torch.randn(L, x.shape[1], rnn.hidden_size, dtype=dtype, requires_grad=True))
    return h


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("cls,layers,T", [(nn.LSTM, 1, 4), (nn.LSTM, 3, 16), (nn.GRU, 2, 16), (nn.RNN, 1, 4)])
def test_rnn_grads_equal_eager_in_every_graph_context(context, cls, layers, T):
    torch.manual_seed(0)
    model = RnnContext(cls, context, layers)
    ref = copy.deepcopy(model)
    # Inductor (what users run) for every context of the 3-layer LSTM and for
    # every class in the "residual" context (the one that broke weight_hh's
    # grads); the other cases check the same rewrite and its gradient
    # formulas under aot_eager, without an Inductor compile of each (24 of
    # them took about 80 s on CI's 2 cores).
    inner = "inductor" if (cls is nn.LSTM and layers == 3) or context == "residual" else "aot_eager"
    fn = torch.compile(model, backend=wfpass.backend(inner=inner))
    x = torch.randn(T, 2, 8, requires_grad=True)
    R = torch.randn(T, 2, 8)
    args = [x] + ([_state(cls, model, x, torch.float32)] if context == "given_state" else [])
    ref_args = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) else tuple(
        t.detach().clone().requires_grad_() for t in a) for a in args]
    out, ref_out = fn(*args), ref(*ref_args)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    (out * R).sum().backward()
    (ref_out * R).sum().backward()
    torch.testing.assert_close(x.grad, ref_args[0].grad, rtol=1e-4, atol=1e-5)
    _grads_close(model, ref)
    assert wfpass.last_report().find("rnn", "rewritten")


@pytest.mark.parametrize("variant", ["bi", "proj", "threshold_path", "eval"])
def test_rnn_residual_variants(variant):
    """Bidirectional, proj_size, the unfused path (T <= N) and eval mode,
    all with the residual read of the input."""
    torch.manual_seed(0)
    kw = dict(bidirectional=variant == "bi", proj=4 if variant == "proj" else 0, layers=2)
    model = RnnContext(nn.LSTM, "residual" if variant != "proj" else "gate", **kw)
    if variant == "eval":
        model.eval()
    ref = copy.deepcopy(model)
    T = 2 if variant == "threshold_path" else 12
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager", seq_threshold=2))
    x = torch.randn(T, 3, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    R = torch.randn(T, 3, 8)
    (fn(x) * R).sum().backward()
    (ref(x2) * R).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-5)
    _grads_close(model, ref)
    assert_applied(model, "rnn")
    (rec,) = wfpass.report(model).find("rnn", "rewritten")
    assert rec.stats["unfused_calls" if variant == "threshold_path" else "fused_calls"] == 1, rec.stats


def test_rnn_bf16_residual():
    torch.manual_seed(0)
    model = RnnContext(nn.LSTM, "residual", 2).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager"))
    x = torch.randn(8, 2, 8, dtype=torch.bfloat16)
    R = torch.randn(8, 2, 8, dtype=torch.bfloat16)
    (fn(x) * R).float().sum().backward()
    (ref(x) * R).float().sum().backward()
    _grads_close(model, ref, rtol=3e-2)
    assert_applied(model, "rnn")


# -- writes to fused weights inside the graph ------------------------------------


class QKV(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 8), nn.Linear(16, 8)
        self.mode = mode

    def forward(self, x):
        if self.mode == "clamp_":
            with torch.no_grad():
                self.k.weight.clamp_(-0.05, 0.05)
        elif self.mode == "copy_":
            with torch.no_grad():
                self.v.weight.copy_(self.v.weight * 2)
        elif self.mode == "setitem":
            with torch.no_grad():
                self.q.weight[0] = 0.0
        return torch.cat([self.q(x), self.k(x), self.v(x)], -1)


def _halve(mod, args):
    with torch.no_grad():
        mod.weight.mul_(0.5)


@pytest.mark.parametrize("mode", ["pre_hook", "clamp_", "copy_", "setitem"])
def test_in_graph_write_to_a_member_is_seen(mode):
    """A hook or an in-place op in forward writes a member of a group: the
    group is left unfused (with the reason), and every call equals eager."""
    torch.manual_seed(0)
    model = QKV(mode)
    if mode == "pre_hook":
        model.k.register_forward_pre_hook(_halve)
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager", linear_path="fused"))
    for _ in range(3):
        x = torch.randn(1, 16)
        torch.testing.assert_close(fn(x), ref(x))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    rep = wfpass.last_report()
    assert any("written in place inside the graph" in r.reason for r in rep.skipped), rep


def test_in_graph_write_to_an_rnn_weight_is_seen():
    """``clamp_`` of an LSTM weight in forward: the rewritten call reads the
    clamped weight (it takes each weight as a graph value), like eager."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(4, 4)

        def forward(self, x):
            with torch.no_grad():
                self.rnn.weight_hh_l0.clamp_(-0.1, 0.1)
            return self.rnn(x)[0]

    model = M()
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager"))
    for _ in range(2):
        x = torch.randn(5, 2, 4, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        out, ref_out = fn(x), ref(x2)
        torch.testing.assert_close(out, ref_out)
        out.sum().backward()
        ref_out.sum().backward()
        torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(model.rnn.weight_hh_l0, ref.rnn.weight_hh_l0)
    # The RNN reads each weight as a graph value, after the write: rewritten.
    (rec,) = wfpass.last_report().find("rnn")
    assert rec.action == "rewritten" and "weight_hh_l0" in rec.detail["written_in_graph"]


# -- one compiled graph, many parameter sets -------------------------------------


class Block(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d // 2), nn.Linear(d, d // 2)
        self.gate, self.up = nn.Linear(d, 64, bias=False), nn.Linear(d, 64, bias=False)
        self.down = nn.Linear(64, d, bias=False)

    def forward(self, x):
        a = self.q(x) + torch.cat([self.k(x), self.v(x)], -1)
        return x + a + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


class Stack(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_regional_compilation_fuses_each_layer_once(inner):
    """``layer.compile()`` per block: Dynamo compiles one graph and runs it for
    every layer. Each layer's parameters are fused once, on their first call,
    and found again on every later one: nothing is moved again."""
    torch.manual_seed(0)
    model = Stack()
    ref = copy.deepcopy(model)
    be = wfpass.backend(inner=inner, linear_path="fused")
    for layer in model.layers:
        layer.compile(backend=be)
    # A small step: the residual stack stays well conditioned, so eager and
    # compiled weights stay close enough to compare grads step by step.
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.01), torch.optim.SGD(ref.parameters(), lr=0.01)
    for _ in range(4):
        x, R = torch.randn(1, 3, 32), torch.randn(1, 3, 32) * 0.01
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            (m(x) * R).sum().backward()
        _grads_close(model, ref)
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    rep = wfpass.report(model)
    linear = rep.find("linear", "rewritten")
    assert len(linear) == len(model.layers)  # q, k, v, gate and up read one x: one group per layer
    for rec in linear:
        assert rec.stats["re_fused"] == 0 and rec.stats["fallback_calls"] == 0, rec
        assert rec.stats["fused_calls"] == 4, rec
    names = {n for rec in linear for n in rec.params}
    assert {f"layers.{i}.q.weight" for i in range(4)} <= names
    for layer in model.layers:
        assert fused_storage_of(layer.q.weight).is_member(layer.v.weight)


def test_set_that_cannot_be_fused_takes_the_original_graph():
    """One layer's layout is lost (``.data =``) while the user holds an alias
    of the new storage: re-fusing would untie it. The graph compiled for
    fused layers then runs as Dynamo traced it for that layer (counted), the
    other layers stay on the fused graph, and every call equals eager."""
    torch.manual_seed(0)
    model = Stack(2)
    ref = copy.deepcopy(model)
    be = wfpass.backend(inner="aot_eager", linear_path="fused")
    for layer in model.layers:
        layer.compile(backend=be)
    x = torch.randn(1, 2, 32)
    torch.testing.assert_close(model(x), ref(x))
    k = model.layers[1].k.weight
    k.data = k.data.clone()
    keep = k.data  # an alias of k's new storage, held by the user
    for _ in range(2):
        x = torch.randn(1, 2, 32)
        torch.testing.assert_close(model(x), ref(x))
    assert keep.data_ptr() == k.data_ptr()  # still tied to the user's alias
    by_layer = {r.params[0].split(".")[1]: r for r in wfpass.report(model).find("linear", "rewritten")}
    assert by_layer["0"].stats["fused_calls"] == 3 and by_layer["0"].stats["fallback_calls"] == 0
    assert by_layer["1"].stats["fallback_calls"] == 2 and by_layer["1"].stats["re_fused"] == 0
    del keep
    model(torch.randn(1, 2, 32))  # nothing else holds k's storage now: re-fused
    assert by_layer["1"].stats["re_fused"] == 1


# -- state owned by what it describes --------------------------------------------


class Everything(nn.Module):
    """Every format: sibling linears, a bias-free LSTM, a foldable conv-BN."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)
        self.rnn = nn.LSTM(8, 16, bias=False)
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, img, seq):
        a = self.bn(self.conv(img)).mean()
        y = self.rnn(seq)[0]
        return self.q(y) + self.k(y) * self.v(y) + a


def _live_tensors():
    """(bytes of real CPU tensors, number of fake tensors) alive now. A
    compile's fakes form reference cycles whose weak-reference callbacks free
    more on the next pass: collect until nothing more goes."""
    for _ in range(3):
        gc.collect()
    real, fake = 0, 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            if type(o).__name__ == "FakeTensor":
                fake += 1
            elif o.device.type == "cpu" and o.layout == torch.strided and not o.is_mkldnn:
                # (oneDNN's opaque tensors, e.g. weights Inductor's freezing
                # packed in another test, have no storage to measure.)
                real += o.untyped_storage().nbytes()
    return real, fake


def test_twenty_models_compiled_and_deleted_leave_nothing_alive():
    """Compile, call and delete models holding every format (sibling linears,
    a bias-free LSTM, eval conv-BN folding): what stays alive does not grow
    with the number of models, neither real tensors (blocks, zero biases,
    folded weights) nor compile-time fakes. (Six models after the warm-up,
    once twenty: one model's tensors are about 10 KB and its compile's fakes
    about 30, so two models kept alive already pass both bounds below.)"""

    def one():
        m = Everything().eval()
        # Packing off: whether it pays is measured on each compile, so the
        # count below would depend on the machine's load (4 rows when it did).
        fn = torch.compile(m, backend=wfpass.backend(inner="aot_eager", fold_batchnorm=True, linear={"path": "fused"},
                                                     prepack={"mode": "off"}))
        with torch.no_grad():
            fn(torch.randn(1, 3, 8, 8), torch.randn(6, 1, 8))
        assert len(wfpass.report(m).rewritten) == 3

    for _ in range(3):
        one()
        torch._dynamo.reset()
    base_layouts, (base_real, base_fake) = live_layouts(), _live_tensors()
    for _ in range(6):
        one()
        torch._dynamo.reset()
    real, fake = _live_tensors()
    assert live_layouts() <= base_layouts  # at most the last model's, until the next compile replaces it
    assert real - base_real < 16 * 1024, f"{real - base_real} bytes of real tensors kept alive"
    # (about 30 fakes per compile of this model: 180 if the six compiles were kept)
    assert fake <= base_fake + 10, (fake, base_fake)


# -- reports per model -------------------------------------------------------------


def test_report_adds_up_over_recompiles():
    """T = 2, 40, 3, 50 with seq_threshold=4: four static graphs, one record
    for the RNN's parameters, 2 unfused and 2 fused calls."""
    model = nn.Sequential(nn.LSTM(4, 8))
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager", seq_threshold=4))
    for T in (2, 40, 3, 50):
        fn(torch.randn(T, 1, 4))
    (rec,) = wfpass.report(model).find("rnn")
    assert rec.stats["unfused_calls"] == 2 and rec.stats["fused_calls"] == 2, rec.stats
    assert rec.params[0] == "0.weight_ih_l0"


def test_explain_leaves_last_report_and_model_alone():
    model = Stack(1)
    torch.compile(model, backend=wfpass.backend(inner="aot_eager"))(torch.randn(1, 1, 32))
    last = wfpass.last_report()
    before = str(wfpass.report(model))
    rep = wfpass.explain(model, torch.randn(1, 1, 32))
    assert {r.action for r in rep.find("linear")} == {"would rewrite"}
    assert wfpass.last_report() is last
    assert str(wfpass.report(model)) == before


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x))


def test_in_graph_write_to_a_folded_batchnorm_is_seen():
    """A pre-hook that scales a BatchNorm's weight in place, with eval-time
    folding: the fold would be computed in front of the conv, before the
    write, so it is skipped with the reason; every call equals eager."""

    torch.manual_seed(0)
    model = ConvBN().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    model.bn.register_forward_pre_hook(_halve)
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager", fold_batchnorm=True))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(1, 3, 8, 8)
            torch.testing.assert_close(fn(x), ref(x), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model.bn.weight, ref.bn.weight)
    assert any("written in place inside the graph" in r.reason for r in wfpass.last_report().find("batchnorm", "skipped"))


def test_rnn_off_the_cpu_is_left_to_pytorch():
    """An RNN whose parameters are neither on the CPU nor on CUDA (here the
    meta device) is not captured: it graph-breaks and runs eagerly, as under
    torch.compile without wfpass, and its report row says why."""
    model = nn.Sequential(nn.LSTM(4, 8)).to("meta")
    seen = []
    be = wfpass.backend(inner="eager")

    def spy(gm, ex):
        seen.append(gm)
        return be(gm, ex)

    out = torch.compile(model, backend=spy)(torch.randn(5, 2, 4, device="meta"))
    assert out[0].shape == (5, 2, 8)
    assert not any(n.target in (torch.lstm,) or "rnn" in str(n.target) for g in seen for n in g.graph.nodes)
    # Its row says so, as every decision is in the report.
    (rec,) = wfpass.report(model).find("rnn")
    assert rec.action == "skipped" and "left out of the compiled graph (parameters on meta)" in rec.reason, rec.reason


def test_in_graph_write_to_an_fp32_batchnorm_is_seen():
    """bf16 model, a pre-hook scaling the BatchNorm's weight in place every
    call (training): the format would change the dtype the write sees, so
    the BatchNorm is skipped with the reason, and the model runs as eager."""

    torch.manual_seed(0)
    model = ConvBN().to(torch.bfloat16)
    model.bn.register_forward_pre_hook(_halve)
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager"))
    for _ in range(3):
        x = torch.randn(2, 3, 8, 8).to(torch.bfloat16)
        torch.testing.assert_close(fn(x), ref(x))
    torch.testing.assert_close(model.bn.weight, ref.bn.weight)
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean)
    (rec,) = wfpass.report(model).find("batchnorm")
    assert rec.action == "skipped" and "mul_" in rec.reason


class _Counting:
    """An inner compiler (aot_eager) that counts the graphs it is given."""

    def __init__(self):
        self.n = 0

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd
        from functorch.compile import make_boxed_func

        self.n += 1
        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)


def _cnn_bn():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.LazyLinear(4))


@pytest.mark.parametrize("what", ["decoder", "rnn-lm", "lstm-batch-first", "bf16-batchnorm"])
def test_a_dynamic_graph_serves_every_size_without_recompiling(what):
    """wfpass's passes must not turn a symbolic size into a static one: an
    ``int()`` of a SymInt in a pass adds a guard, and every new size then
    recompiles (after 8, Dynamo runs the frame eagerly). Called at five
    sizes after a first one, the model compiles twice (Dynamo's static first
    graph, then one with the size symbolic), and every output is eager's."""
    from wfpass.tools.bench_models import Decoder, RnnLM

    torch.manual_seed(0)
    if what == "decoder":
        model, make = Decoder(d=64, layers=2, heads=4, kv_heads=2, ffn=96).eval(), (lambda n: torch.randn(1, n, 64))
    elif what == "rnn-lm":
        model, make = RnnLM(vocab=50, hidden=32).eval(), (lambda n: torch.randint(0, 50, (n, 2)))
    elif what == "lstm-batch-first":
        model = nn.LSTM(8, 16, num_layers=2, batch_first=True).eval()
        make = lambda n: torch.randn(3, n, 8)  # noqa: E731
    else:
        model = _cnn_bn().to(torch.bfloat16).train()
        model(torch.randn(2, 3, 8, 8, dtype=torch.bfloat16))  # materialize the lazy linear
        make = lambda n: torch.randn(n, 3, 8, 8, dtype=torch.bfloat16)  # noqa: E731
    ref = copy.deepcopy(model)
    inner = _Counting()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=wfpass.backend(inner=inner))
    with torch.no_grad():
        # (No size equal to another dim of the input: AOTAutograd on 2.15
        # guards "T != 3" when T could equal the batch of 3, its own check.)
        for n in (4, 7, 5, 9, 6, 11):
            x = make(n)
            got, want = compiled(x), ref(x)
            got, want = (got[0], want[0]) if isinstance(got, tuple) else (got, want)
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert inner.n == 2, f"{inner.n} graphs compiled for 6 sizes: a pass specialized the symbolic size"
