"""The report tells the truth: after graph breaks, under threads, over two
compiles that decide differently, after the model is wrapped and compiled
again, and for a backend that calls a wformat backend. Each row's counters
add up to the calls made, and every name in it is one the model uses."""
from __future__ import annotations

import functools
import os
import sys
import threading
import types

import pytest
import torch
import torch.nn as nn

import wfpass
from wfpass.core.stats import Stats


class QKV(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return self.q(x) + self.k(x) * self.v(x)


class TwoLSTMs(nn.Module):
    """Two LSTMs with a graph break between them."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.LSTM(4, 4, batch_first=True), nn.LSTM(4, 4, batch_first=True)

    def forward(self, x, scale=None):
        y, _ = self.a(x)
        torch._dynamo.graph_break()
        z, _ = self.b(y if scale is None else y * scale)
        return z


class LinLSTM(nn.Module):
    """A linear, then an LSTM (the linear's graph is compiled even where Dynamo leaves the LSTM out)."""

    def __init__(self):
        super().__init__()
        self.lin, self.lstm = nn.Linear(4, 4), nn.LSTM(4, 4)

    def forward(self, x):
        y = self.lin(x).relu()
        return self.lstm(y)[0]


class Wrapper(nn.Module):
    """A user's container: the model as ``self.inner``."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def eager_backend(**options):
    return wfpass.backend(inner="eager", **options)


def names_of(model):
    return {n for n, _ in model.named_parameters(remove_duplicate=False)} | {n for n, _ in model.named_buffers()}


def assert_names_resolve(report, model):
    tensors = dict(model.named_parameters(remove_duplicate=False))
    for r in report.records:
        assert set(r.params) <= names_of(model), (r.params, sorted(names_of(model)))
        ids = [id(tensors[p]) for p in r.params if p in tensors]
        assert len(ids) == len(set(ids)), f"a tensor listed twice: {r.params}"


def calls(report, pattern, key):
    return sum(r.stats.get(key, 0) for r in report.find(pattern, "rewritten"))


# -- last_report() after graph breaks ---------------------------------------------------


def test_last_report_holds_every_graph_of_a_call_made_with_keywords():
    """HF models are called ``model(**inputs)``: the graphs after a break
    belong to the same call, and last_report() names the tensors as the
    model does."""
    model = TwoLSTMs()
    fn = torch.compile(model, backend=eager_backend())
    with torch.no_grad():
        fn(x=torch.randn(2, 5, 4), scale=torch.tensor(2.0))
    rep = wfpass.last_report()
    rows = rep.find("rnn", "rewritten")
    assert len(rows) == 2, rep
    assert {p.split(".")[0] for r in rows for p in r.params} == {"a", "b"}
    assert_names_resolve(rep, model)


def test_last_report_of_a_hf_model_with_graph_breaks_in_submodules():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.EncodecConfig(hidden_size=16, num_filters=4, num_residual_layers=1, upsampling_ratios=[2, 2],
                                     codebook_size=16, codebook_dim=16, num_lstm_layers=1)
    model = transformers.EncodecModel(cfg).eval()
    fn = torch.compile(model, backend=eager_backend())
    with torch.no_grad():
        fn(input_values=torch.randn(1, 1, 64), padding_mask=torch.ones(1, 64, dtype=torch.long))
    rep = wfpass.last_report()
    rows = rep.find("rnn", "rewritten")
    assert len(rows) == 2 and all(r.stats["fused_calls"] == 1 for r in rows), rep
    assert_names_resolve(rep, model)
    assert {r.params[0].split(".")[0] for r in rows} == {"encoder", "decoder"}


# -- counters under threads ----------------------------------------------------------


def test_stats_lose_no_count_under_threads():
    stats = Stats()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        def work():
            t = stats.ticker("a")
            for _ in range(20000):
                next(t)
                stats.bump("b")
                stats.bump("c", 2)

        threads = [threading.Thread(target=work) for _ in range(8)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    finally:
        sys.setswitchinterval(old)
    assert stats == {"a": 160000, "b": 160000, "c": 320000}
    stats["a"] = 5
    next(stats.ticker("a"))
    assert stats["a"] == 6 and stats.pop("b") == 160000 and "b" not in stats
    assert dict(stats) == {"a": 6, "c": 320000} and stats.setdefault("d", 0) == 0


def test_counters_add_up_over_threads():
    qkv, lstm = QKV(), nn.LSTM(16, 16)
    fq = torch.compile(qkv, backend=eager_backend(linear={"path": "fused"}))
    fl = torch.compile(lstm, backend=eager_backend())
    x, s = torch.randn(2, 16), torch.randn(5, 2, 16)
    with torch.no_grad():
        fq(x), fl(s)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        def work():
            with torch.no_grad():
                for _ in range(300):
                    fq(x)
                    fl(s)

        threads = [threading.Thread(target=work) for _ in range(8)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    finally:
        sys.setswitchinterval(old)
    assert calls(wfpass.report(qkv), "linear", "fused_calls") == 2401
    assert calls(wfpass.report(lstm), "rnn", "fused_calls") == 2401


# -- one model, two configs ----------------------------------------------------------


def test_two_compiles_that_decide_differently_get_a_row_each():
    model, x = QKV(), torch.randn(2, 16)
    f1 = torch.compile(model, backend=eager_backend(linear={"path": "fused"}))
    f1(x), f1(x)
    torch._dynamo.reset()
    f2 = torch.compile(model, backend=eager_backend(linear={"path": "split"}))
    f2(x), f2(x), f2(x)
    rows = wfpass.report(model).find("linear", "rewritten")
    assert sorted((r.detail["path"], dict(r.stats)[f"{r.detail['path']}_calls"]) for r in rows) == [("fused", 2), ("split", 3)]
    assert all("split_calls" not in r.stats for r in rows if r.detail["path"] == "fused")
    assert all("fused_calls" not in r.stats for r in rows if r.detail["path"] == "split")
    (last,) = wfpass.last_report().find("linear", "rewritten")
    assert last.detail["path"] == "split" and "linear.path='split'" in last.reason
    f1(x)  # the first compiled model still counts on its own row
    assert sorted(r.stats[f"{r.detail['path']}_calls"] for r in wfpass.report(model).find("linear", "rewritten")) == [3, 3]


def test_two_compiles_that_decide_the_same_share_a_row():
    model, x = QKV(), torch.randn(2, 16)
    torch.compile(model, backend=eager_backend(linear={"path": "fused"}))(x)
    torch._dynamo.reset()
    torch.compile(model, backend=eager_backend(linear={"path": "fused"}))(x)
    (row,) = wfpass.report(model).find("linear", "rewritten")
    assert row.stats["fused_calls"] == 2


def test_a_row_whose_graphs_took_both_paths_says_so():
    """One config, two row counts on either side of fused_max_rows: one row,
    whose detail names both paths; another fused_max_rows gets its own."""
    model = QKV()
    fn = torch.compile(model, backend=eager_backend(), dynamic=False)
    fn(torch.randn(1, 16)), fn(torch.randn(8, 16)), fn(torch.randn(8, 16))
    (row,) = wfpass.report(model).find("linear", "rewritten")
    assert row.detail["path"] == "fused+split" and row.detail["rows"] == [1, 8]
    assert (row.stats["fused_calls"], row.stats["split_calls"]) == (1, 2)
    torch._dynamo.reset()
    torch.compile(model, backend=eager_backend(linear={"fused_max_rows": 8}), dynamic=False)(torch.randn(8, 16))
    rows = wfpass.report(model).find("linear", "rewritten")
    assert len(rows) == 2 and rows[1].detail["path"] == "fused" and rows[1].stats["fused_calls"] == 1


def test_rnn_thresholds_get_a_row_each():
    model, x = nn.LSTM(4, 4), torch.randn(8, 2, 4)
    with torch.no_grad():
        torch.compile(model, backend=eager_backend(rnn={"seq_threshold": 2}))(x)
        torch._dynamo.reset()
        f = torch.compile(model, backend=eager_backend(rnn={"seq_threshold": 16}))
        f(x), f(x)
    rows = {r.detail["threshold"]: r for r in wfpass.report(model).find("rnn", "rewritten")}
    assert set(rows) == {2, 16}
    assert (rows[2].stats["fused_calls"], rows[2].stats["unfused_calls"]) == (1, 0)
    assert (rows[16].stats["fused_calls"], rows[16].stats["unfused_calls"]) == (0, 2)
    from wfpass import native

    fused = "cxx" if native.fast_loop() else "mkldnn"  # a small LSTM: wfpass's C++ loop where it runs
    assert rows[2].detail["paths"] == {"T=8": fused} and rows[16].detail["paths"] == {"T=8": "loop"}


# -- wrapped after compiling ---------------------------------------------------------


def test_wrapped_and_compiled_again_lists_each_tensor_once_under_the_wrapper_s_names():
    model, x = QKV(), torch.randn(2, 16)
    torch.compile(model, backend=eager_backend())(x)
    outer = Wrapper(model)
    f = torch.compile(outer, backend=eager_backend())
    f(x), f(x)
    for rep, m in ((wfpass.report(outer), outer), (wfpass.last_report(), outer), (wfpass.report(model), model)):
        (row,) = rep.find("linear", "rewritten")
        assert len(row.params) == 6 and row.stats["fused_calls"] == 3, rep
        assert_names_resolve(rep, m)
        assert len(rep.find("prepack")) <= 1, rep  # the same decision on the same tensors: one row


def test_peft_wrapped_llama_lists_each_tensor_once():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaModel(cfg).eval()
    ids = torch.randint(0, 64, (1, 3))
    with torch.no_grad():
        torch.compile(model, backend=eager_backend())(input_ids=ids)
        torch._dynamo.reset()
        wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
        torch.compile(wrapped, backend=eager_backend())(input_ids=ids)
    for rep in (wfpass.report(wrapped), wfpass.last_report()):
        assert_names_resolve(rep, wrapped)
        (gate_up,) = [r for r in rep.find("linear", "rewritten") if any("gate_proj" in p for p in r.params)]
        assert len(gate_up.params) == 2 and gate_up.stats[f"{gate_up.detail['path']}_calls"] == 2, gate_up


# -- backends that wrap a wformat backend -----------------------------------------------

GLOBAL_BE = wfpass.backend(inner="eager")
REGISTRY = {"wf": wfpass.backend(inner="eager")}


def via_global(gm, example_inputs):
    return GLOBAL_BE(gm, example_inputs)


def via_dict(gm, example_inputs):
    return REGISTRY["wf"](gm, example_inputs)


def _closure():
    be = wfpass.backend(inner="eager")

    def via_closure(gm, example_inputs):
        return be(gm, example_inputs)

    return via_closure


class Counting:
    """A callable object holding the wformat backend as an attribute."""

    def __init__(self):
        self.inner, self.n = wfpass.backend(inner="eager"), 0

    def __call__(self, gm, example_inputs):
        self.n += 1
        return self.inner(gm, example_inputs)


def _with(gm, example_inputs, backend):
    return backend(gm, example_inputs)


LIB = types.ModuleType("userlib")
LIB.WF = wfpass.backend(inner="eager")


def via_module(gm, example_inputs):
    return LIB.WF(gm, example_inputs)


def inside(gm, example_inputs):  # builds its wformat backend per call: nothing to find beforehand
    return wfpass.backend(inner="eager")(gm, example_inputs)


def by_name(gm, example_inputs):  # finds it in Dynamo's registry by name
    from torch._dynamo import lookup_backend

    return lookup_backend("wformat")(gm, example_inputs)


@pytest.mark.parametrize("make", [lambda: via_global, lambda: via_dict, lambda: via_module, _closure, Counting,
                                  lambda: functools.partial(_with, backend=wfpass.backend(inner="eager"))],
                         ids=["global", "dict", "module-attribute", "closure", "attribute", "partial"])
def test_a_backend_that_wraps_wformat_is_recognised(make):
    model = LinLSTM()
    with torch.no_grad():
        torch.compile(model, backend=make())(torch.randn(3, 2, 4))
    for rep in (wfpass.report(model), wfpass.last_report()):
        (row,) = rep.find("rnn")
        assert row.action == "rewritten" and row.stats["fused_calls"] == 1, rep


@pytest.mark.parametrize("backend", [inside, by_name], ids=["built-inside", "by-name"])
def test_a_wrapping_backend_not_recognised_says_the_rnn_ran_eagerly(backend):
    model = LinLSTM()
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(3, 2, 4))
    for rep in (wfpass.report(model), wfpass.last_report()):
        (row,) = rep.find("rnn")
        assert row.action == "skipped" and "runs eagerly" in row.reason and backend.__name__ in row.reason, rep
        assert "README" in row.reason and ".config" in row.reason
    assert_names_resolve(wfpass.report(model), model)


def test_a_backend_given_the_options_is_seen():
    """What the skipped row says to do: the options on the backend."""

    def own(gm, example_inputs):
        return wfpass.backend(inner="eager")(gm, example_inputs)

    own.config = wfpass.backend(inner="eager").config
    model = LinLSTM()
    with torch.no_grad():
        torch.compile(model, backend=own)(torch.randn(3, 2, 4))
    (row,) = wfpass.report(model).find("rnn")
    assert row.action == "rewritten" and row.stats["fused_calls"] == 1


# -- property: random sequences of compile / call / wrap / recompile / restore ---------------

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

CONFIGS = [{}, {"linear": {"path": "fused"}}, {"linear": {"path": "split"}}, {"rnn": {"seq_threshold": 8}}]
STEPS = st.one_of(
    st.tuples(st.just("compile"), st.integers(0, len(CONFIGS) - 1)),
    st.tuples(st.just("compile"), st.integers(0, len(CONFIGS) - 1)),
    st.tuples(st.just("call"), st.integers(0, 7)),
    st.tuples(st.just("wrap"), st.just(0)),
    st.tuples(st.just("recompile"), st.just(0)),
    st.tuples(st.just("restore"), st.just(0)),
)


class Combo(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.rnn = QKV(8), nn.LSTM(8, 8)

    def forward(self, x):
        return self.rnn(self.attn(x))[0]


def _row_calls(rep, pattern, counters):
    return sum(r.stats.get(c, 0) for r in rep.find(pattern, "rewritten") for c in counters)


class _Run:
    """One sequence of steps on a fresh model, checking the reports after each."""

    def __init__(self):
        torch._dynamo.reset()
        self.root, self.x = Combo(), torch.randn(5, 2, 8)
        self.models, self.fns, self.calls, self.last = [self.root], [], 0, None

    def backend(self, target, cfg):
        be = wfpass.backend(inner="eager", passes=("fuse_linears", "fuse_rnn"), **cfg)

        def compile_it(gm, example_inputs):  # remembers which model compiled last
            self.last = target
            return be(gm, example_inputs)

        return compile_it

    def step(self, kind, arg):
        if kind == "compile":
            target = self.models[-1]
            self.fns.append(torch.compile(target, backend=self.backend(target, CONFIGS[arg])))
            self.call(len(self.fns) - 1)
        elif kind == "call" and self.fns:
            self.call(arg % len(self.fns))
        elif kind == "wrap":
            self.models.append(Wrapper(self.models[-1]))
        elif kind == "recompile":
            torch._dynamo.reset()  # the next call of every compiled model compiles again
        elif kind == "restore":
            wfpass.restore(self.root)

    def call(self, i):
        with torch.no_grad():
            self.fns[i](self.x)
        self.calls += 1

    def check(self):
        rep = wfpass.report(self.root)
        assert _row_calls(rep, "linear", ("fused_calls", "split_calls", "fallback_calls", "unfused_layout_calls")) == self.calls, rep
        assert _row_calls(rep, "rnn", ("fused_calls", "unfused_calls", "unfused_layout_calls")) == self.calls, rep
        for m in self.models:
            assert_names_resolve(wfpass.report(m), m)
        if self.last is not None:
            assert_names_resolve(wfpass.last_report(), self.last)


# 24 sequences keep the suite's time in budget (about 15 s on a 2-core AVX2 machine; the same
# 24 every run: derandomized); WFPASS_PROPERTY_EXAMPLES=120 runs the longer search this test
# was developed with.
@hypothesis.settings(max_examples=int(os.environ.get("WFPASS_PROPERTY_EXAMPLES", "24")), deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(st.lists(STEPS, min_size=1, max_size=9))
def test_rows_add_up_to_the_calls_made_and_names_resolve(steps):
    run = _Run()
    for kind, arg in steps:
        run.step(kind, arg)
        run.check()
