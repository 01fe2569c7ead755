"""Sibling-linear fusion: numerics, storage, skips, report, end to end."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import wfpass
from wfpass.linear.kernel import fused_linear
from wfpass.core.storage import fused_storage_of
from wfpass.linear.guards import fusion_keeps_dag as _fusion_keeps_dag
from wfpass.linear.match import dependency_graph as _dependency_graph

from models import QKV, Chain, Functional, SwiGLU
from wftest import Capture, assert_applied, assert_same_fwd_bwd, param_ids, train_steps


def _storage_bytes(model):
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _compile(inner="aot_eager", **kw):
    return lambda m: torch.compile(m, backend=wfpass.backend(inner=inner, **kw))


def _count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


@pytest.mark.parametrize("model_cls", [QKV, SwiGLU, Functional])
@pytest.mark.parametrize("rows", [(1, 1), (4, 8)])  # fused path at M=1, split path at M=32 with the default fused_max_rows
def test_forward_backward_equal_eager(model_cls, rows):
    torch.manual_seed(0)
    model = model_cls()
    x = torch.randn(*rows, 32 if model_cls is not Functional else 16, requires_grad=True)
    assert_same_fwd_bwd(model, _compile(), [x])
    (rec,) = wfpass.last_report().find("linear", "rewritten")
    assert rec.detail["path"] == ("fused" if rows == (1, 1) else "split")


@pytest.mark.parametrize("path", ["fused", "split"])
def test_forced_paths_and_op_counts(path):
    torch.manual_seed(0)
    model = QKV()
    cap = Capture()
    x = torch.randn(2, 5, 32, requires_grad=True)
    assert_same_fwd_bwd(model, _compile(inner=cap, linear_path=path), [x])
    gm = cap.graphs[0]
    linears = _count(gm, torch._C._nn.linear)
    if path == "fused":
        assert _count(gm, fused_linear) == 1 and linears == 1  # only o stays
    else:
        assert _count(gm, fused_linear) == 0 and linears == 4
    # Either way the storage is fused: q, k, v weights are views of one buffer.
    ptrs = {m.weight.untyped_storage().data_ptr() for m in (model.q, model.k, model.v)}
    assert len(ptrs) == 1 and model.o.weight.untyped_storage().data_ptr() not in ptrs


def test_params_identity_state_dict_and_zero_extra_memory():
    torch.manual_seed(0)
    model = SwiGLU()  # no biases: no zero slots, so exactly zero extra bytes
    ids, sd = param_ids(model), {k: v.clone() for k, v in model.state_dict().items()}
    before = _storage_bytes(model)
    compiled = torch.compile(model, backend=wfpass.backend(inner="aot_eager"))
    compiled(torch.randn(1, 32))
    assert param_ids(model) == ids
    assert all(isinstance(p, nn.Parameter) and p.is_leaf for p in model.parameters())
    new_sd = model.state_dict()
    assert list(new_sd) == list(sd)
    for k in sd:
        assert new_sd[k].shape == sd[k].shape and torch.equal(new_sd[k], sd[k])
    assert _storage_bytes(model) == before
    assert model.gate.weight.untyped_storage().data_ptr() == model.up.weight.untyped_storage().data_ptr()
    # A checkpoint of the fused model loads into a plain one, and back.
    plain = SwiGLU()
    plain.load_state_dict(model.state_dict())
    model.load_state_dict(plain.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values()))


def test_mixed_bias_keeps_biases_apart_and_costs_no_bytes():
    """A member without a bias: the bias vector (zeros in its slot) is
    assembled per call; the biases keep their own storage, so neither memory
    nor a checkpoint grows. (Zero slots in a shared bias buffer would be
    written by torch.save, which writes a view's whole storage.)"""
    model = QKV(k_bias=False)
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager", linear_path="fused"))
    for _ in range(2):
        fn(torch.randn(1, 32))
    (rec,) = wfpass.last_report().find("linear", "rewritten")
    assert rec.detail["zero_bias_slots"] == 16 and rec.detail["extra_bytes"] == 0
    assert rec.detail["bias_layout"] == "per call"
    assert rec.stats["bias_cat_calls"] == 2 and rec.stats["fused_calls"] == 2 and "bias_fallback_calls" not in rec.stats
    assert rec.params == ["q.weight", "q.bias", "k.weight", "v.weight", "v.bias"]
    assert model.q.bias.untyped_storage().data_ptr() != model.v.bias.untyped_storage().data_ptr()


def test_all_biases_served_from_their_buffer_without_copy():
    model = QKV(k_bias=True)
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager", linear_path="fused"))
    for _ in range(3):
        fn(torch.randn(1, 32))
    (rec,) = wfpass.last_report().find("linear", "rewritten")
    assert rec.detail["bias_layout"] == "one buffer"
    assert rec.stats["fused_calls"] == 3 and rec.stats.get("bias_fallback_calls", 0) == 0, rec.stats
    assert fused_storage_of(model.q.bias) is not None


@pytest.mark.parametrize("kind", ["linear-mixed-bias", "lstm-no-bias"])
def test_checkpoint_no_larger_than_plain_with_zero_slots(kind, tmp_path):
    """Where the fused kernels need zeros (a member without a bias; an RNN with
    bias=False on the CPU), the zeros are kept out of the parameters' storage,
    so the saved file is no larger than the plain model's. Sizes chosen so the
    zeros would be visible: 4096 rows without a bias; a 2-layer LSTM."""

    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(8, 4096, bias=False)
            self.value = nn.Linear(8, 1)

        def forward(self, h):
            return self.lm_head(h), self.value(h)

    if kind == "linear-mixed-bias":
        model, x = Heads(), torch.randn(2, 8)
        options = dict(linear_path="fused")
    else:
        model, x = nn.LSTM(16, 64, num_layers=2, bias=False), torch.randn(5, 2, 16)
        options = {}
    plain = copy.deepcopy(model)
    torch.compile(model, backend=wfpass.backend(inner="aot_eager", **options))(x)
    assert wfpass.last_report().rewritten
    sizes = {}
    for name, m in (("wformat", model), ("plain", plain)):
        torch.save(m.state_dict(), tmp_path / name)
        sizes[name] = (tmp_path / name).stat().st_size
    assert sizes["wformat"] <= sizes["plain"], sizes


@pytest.mark.parametrize("opt_cls,kw", [(torch.optim.SGD, dict(lr=0.1, momentum=0.9)), (torch.optim.Adam, dict(lr=1e-2))])
def test_five_optimizer_steps_equal_eager(opt_cls, kw):
    torch.manual_seed(0)
    model = QKV(k_bias=True)
    ref = copy.deepcopy(model)
    batches = [torch.randn(1, 3, 32) for _ in range(5)]
    compiled = torch.compile(model, backend=wfpass.backend(inner="aot_eager", linear_path="fused"))
    train_steps(model, compiled, lambda i: (batches[i],), opt_cls, **kw)
    train_steps(ref, ref, lambda i: (batches[i],), opt_cls, **kw)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    (rec,) = wfpass.last_report().find("linear", "rewritten")
    assert rec.stats["fused_calls"] == 5 and rec.stats["fallback_calls"] == 0
    # The optimizer's in-place updates kept the layout: still one buffer.
    assert len({m.weight.untyped_storage().data_ptr() for m in (model.q, model.k, model.v)}) == 1


@pytest.mark.parametrize("path", ["fused", "split"])
def test_apply_graph_names_a_parameter_that_changed_shape(path):
    """A member replaced by a Parameter of another shape after tracing: the
    rewritten graph says which parameter, not a split-size error."""
    model = QKV()
    gm = fx.symbolic_trace(model)
    wfpass.apply(gm, prepack={"mode": "off"}, linear_path=path)
    gm(torch.randn(2, 32))
    model.k.weight = nn.Parameter(torch.randn(8, 32))
    with pytest.raises(RuntimeError, match=r"'k\.weight' has shape \(8, 32\).*changed shape after the model was traced"):
        gm(torch.randn(2, 32))


def test_symbolic_trace_apply_and_idempotence():
    torch.manual_seed(0)
    model = QKV()
    gm = fx.symbolic_trace(model)
    n_modules = sum(1 for n in gm.graph.nodes if n.op == "call_module")
    report = wfpass.apply(gm, prepack={"mode": "off"})  # the graph this test counts is fuse_linears' alone
    assert len(report.rewritten) == 1
    assert _count(gm, fused_linear) == 1
    assert sum(1 for n in gm.graph.nodes if n.op == "call_module") == n_modules - 3
    x = torch.randn(3, 32, requires_grad=True)
    assert_same_fwd_bwd(model, lambda m: gm, [x])  # gm shares model's parameters
    code, ptr = gm.code, model.q.weight.untyped_storage().data_ptr()
    again = wfpass.apply(gm, prepack={"mode": "off"})
    assert not again.rewritten and gm.code == code
    assert model.q.weight.untyped_storage().data_ptr() == ptr


def test_recompile_of_fused_model_reuses_storage():
    model = QKV()
    torch.compile(model, backend=wfpass.backend(inner="aot_eager"))(torch.randn(1, 32))
    (first,) = wfpass.last_report().find("linear", "rewritten")
    ptr = model.q.weight.untyped_storage().data_ptr()
    torch.compile(model, backend=wfpass.backend(inner="aot_eager"))(torch.randn(1, 32))
    (rec,) = wfpass.last_report().find("linear", "rewritten")
    # The layout and its record belong to the parameters: the second graph
    # finds both, moves nothing, and its calls count on the same record.
    assert rec is first and rec.stats["fused_calls"] == 2
    assert model.q.weight.untyped_storage().data_ptr() == ptr
    assert [r.stats["fused_calls"] for r in wfpass.report(model).rewritten] == [2]


def test_skip_tied_same_parameter_in_group():
    model = QKV(dq=16)
    model.k.weight = model.q.weight  # same Parameter object in two members
    x = torch.randn(2, 32, requires_grad=True)
    assert_same_fwd_bwd(model, _compile(), [x])
    rep = wfpass.last_report()
    tied = [r for r in rep.find("linear", "skipped") if "same weight" in r.reason]
    # Dynamo passes the tied Parameter once, under its first name.
    assert [r.params[0] for r in tied] == ["q.weight", "q.weight"]
    assert not rep.rewritten  # v alone is not a group
    assert model.k.weight is model.q.weight


def test_skip_shared_storage_between_different_parameters():
    model = QKV(dq=16)
    model.k.weight = nn.Parameter(model.q.weight.data)  # different objects, one storage
    torch.compile(model, backend=wfpass.backend(inner="aot_eager"))(torch.randn(2, 32))
    rep = wfpass.last_report()
    reasons = " ".join(r.reason for r in rep.skipped)
    assert "shares storage" in reasons or "held by" in reasons
    assert model.k.weight.data_ptr() == model.q.weight.data_ptr()  # still tied
    with torch.no_grad():
        model.q.weight.add_(1.0)
    assert torch.equal(model.k.weight, model.q.weight)


def test_skip_alias_held_outside_the_model():
    model = SwiGLU()
    alias = model.gate.weight.detach()  # the user kept a view of the weight
    torch.compile(model, backend=wfpass.backend(inner="aot_eager"))(torch.randn(2, 32))
    assert any("held by" in r.reason for r in wfpass.last_report().skipped)
    assert alias.data_ptr() == model.gate.weight.data_ptr()


def test_skip_mixed_dtype_in_traced_graph():
    model = QKV(k_bias=True)
    model.k.double()
    report = wfpass.apply(fx.symbolic_trace(model))
    (skip,) = report.find("linear", "skipped")
    assert skip.params == ["k.weight", "k.bias"] and "torch.float64" in skip.reason
    (rw,) = report.find("linear", "rewritten")
    assert rw.params == ["q.weight", "q.bias", "v.weight", "v.bias"]


def test_dependent_linears_are_not_fused():
    model = Chain()
    report = wfpass.apply(fx.symbolic_trace(model))
    assert not report.find("linear", "rewritten")


def test_cycle_check_detects_data_dependence():
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.placeholder("w")
    a = g.call_function(torch._C._nn.linear, (x, w))
    s = g.call_function(torch.sum, (a,))
    b = g.call_function(torch._C._nn.linear, (x, w, s))  # b's bias depends on a
    c = g.call_function(torch._C._nn.linear, (x, w))
    g.output((b, c))
    gm = fx.GraphModule(nn.Module(), g)
    dep = _dependency_graph(gm)
    assert not _fusion_keeps_dag(dep, [a, b])
    assert _fusion_keeps_dag(dep, [a, c])


def test_layout_lost_re_fuses_or_falls_back():
    torch.manual_seed(0)
    model = QKV(k_bias=True)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=wfpass.backend(inner="aot_eager", linear_path="fused"))
    x = torch.randn(1, 32)
    compiled(x)
    (rec,) = wfpass.last_report().find("linear", "rewritten")
    # 1. param.data replaced: re-fused on the next call, counted.
    model.q.weight.data = model.q.weight.data.clone()
    torch.testing.assert_close(compiled(x), ref(x))
    assert rec.stats["re_fused"] == 1 and rec.stats["fallback_calls"] == 0
    assert model.q.weight.untyped_storage().data_ptr() == model.k.weight.untyped_storage().data_ptr()
    # 2. replaced by a tensor the user still holds: re-fusing would untie it,
    #    so this call concatenates (counted) and stays right.
    held = torch.randn_like(model.v.weight)
    model.v.weight.data = held
    ref.v.weight.data = held.clone()
    torch.testing.assert_close(compiled(x), ref(x))
    assert rec.stats["fallback_calls"] == 1
    assert model.v.weight.data_ptr() == held.data_ptr()
    # 3. load_state_dict(assign=True): new Parameter objects.
    sd = {k: v.clone() + 1 for k, v in ref.state_dict().items()}
    ref.load_state_dict(sd)
    del held
    model.load_state_dict({k: v.clone() for k, v in sd.items()}, assign=True)
    torch.testing.assert_close(compiled(x), ref(x))


def test_dtype_round_trip_keeps_results_right():
    torch.manual_seed(0)
    model = SwiGLU()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=wfpass.backend(inner="aot_eager", linear_path="fused"))
    x = torch.randn(1, 32)
    torch.testing.assert_close(compiled(x), ref(x))
    assert_applied(model, "linear")
    model.to(torch.float64)
    torch.testing.assert_close(compiled(x.double()), ref.double()(x.double()))
    model.to(torch.float32)
    ref.float()
    torch.testing.assert_close(compiled(x), ref(x))
    # Back in float32, the group is one block again (re-fused, or a new layout).
    assert_applied(model, "linear")
    assert model.gate.weight.untyped_storage().data_ptr() == model.up.weight.untyped_storage().data_ptr()


def test_restore_gives_independent_storage_same_values():
    model = QKV(k_bias=True)
    torch.compile(model, backend=wfpass.backend(inner="aot_eager"))(torch.randn(1, 32))
    values = {k: v.clone() for k, v in model.state_dict().items()}
    ids = param_ids(model)
    assert wfpass.restore(model) == 6
    assert param_ids(model) == ids
    ptrs = [p.untyped_storage().data_ptr() for p in model.parameters()]
    assert len(set(ptrs)) == len(ptrs)
    assert all(p.storage_offset() == 0 for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, values[k])
    assert wfpass.restore(model) == 0


def test_report_table_json_and_env(capsys, monkeypatch):
    monkeypatch.setenv("WFPASS_REPORT", "1")
    queued = []
    monkeypatch.setattr(sys.modules["wfpass.core.history"], "_AT_EXIT", queued)
    model = QKV()
    torch.compile(model, backend=wfpass.backend(inner="aot_eager"))(torch.randn(1, 32))
    printed = capsys.readouterr()
    rep = wfpass.last_report()
    # Not printed at compile time, when every counter was still 0: queued for
    # the process's exit (the printing itself: test_cli.py).
    assert rep.title not in printed.out + printed.err
    assert len(queued) == 1 and queued[0] is rep
    assert "fused_calls=1" in str(rep) and "q.weight" in str(rep)
    d = json.loads(json.dumps(rep.to_dict()))
    (rec,) = [r for r in d["records"] if r["pattern"] == "linear"]
    assert rec["pattern"] == "linear" and rec["action"] == "rewritten"
    assert set(rec) >= {"pattern", "action", "reason", "params", "stats"}


def test_explain_changes_nothing():
    model = QKV()
    ptr = model.q.weight.untyped_storage().data_ptr()
    rep = wfpass.explain(model, torch.randn(1, 32))
    assert "dry run" in str(rep) and len(rep.rewritten) == 1
    assert model.q.weight.untyped_storage().data_ptr() == ptr


@pytest.mark.parametrize(
    "options,err,needle",
    [
        (dict(inner="tensorrt"), ValueError, "'inner'"),
        (dict(inner=3), TypeError, "'inner'"),
        (dict(linear_path="fast"), ValueError, "'linear_path'"),
        (dict(min_group_size=1), ValueError, "'min_group_size'"),
        (dict(fused_max_rows="8"), TypeError, "'fused_max_rows'"),
        (dict(seq_threshold="never"), ValueError, "'seq_threshold'"),
        (dict(passes=("fuse_all",)), ValueError, "'passes'"),
        (dict(innr="eager"), ValueError, "innr"),
        (dict(linear={"path": "fast"}), ValueError, "'linear.path'"),
        (dict(linear={"min_group_size": 1}), ValueError, "'linear.min_group_size'"),
        (dict(linear={"rows": 8}), ValueError, "'linear.rows'"),
        (dict(linear=8), TypeError, "'linear'"),
        (dict(rnn={"seq_threshold": "never"}), ValueError, "'rnn.seq_threshold'"),
        (dict(linear_path="split", linear={"path": "fused"}), ValueError, "'linear_path' and 'linear.path' disagree"),
    ],
)
def test_bad_options_raise_clear_errors(options, err, needle):
    with pytest.raises(err, match=needle):
        wfpass.backend(**options)


def test_options_are_shaped_per_format_and_the_flat_names_still_work_with_a_warning():
    """``linear=LinearOptions(...)`` (or its dict) and ``rnn={"seq_threshold": ...}``;
    the earlier flat names give the same config and a DeprecationWarning
    naming the new place."""
    new = wfpass.Config(linear=wfpass.LinearOptions(path="split", fused_max_rows=8), rnn={"seq_threshold": "auto"})
    with pytest.warns(DeprecationWarning, match=r"'linear_path' is now linear=\{'path'"):
        old = wfpass.Config.from_options(linear_path="split", fused_max_rows=8, seq_threshold="auto")
    assert old == new and old.linear.path == "split" and old.rnn.seq_threshold == "auto"
    # The same value given both ways is not a conflict.
    with pytest.warns(DeprecationWarning):
        assert wfpass.Config(min_group_size=3, linear={"min_group_size": 3}).linear.min_group_size == 3
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the nested names warn about nothing
        wfpass.backend(linear={"path": "fused"}, rnn={"seq_threshold": 4})
    # And they act: the forced path is the one the report names.
    model = QKV()
    torch.compile(model, backend=wfpass.backend(inner="aot_eager", linear={"path": "split"}))(torch.randn(1, 32))
    (rec,) = wfpass.report(model).find("linear", "rewritten")
    assert rec.stats["split_calls"] == 1 and rec.stats.get("fused_calls", 0) == 0


def test_apply_rejects_non_graphmodule():
    with pytest.raises(TypeError, match="GraphModule"):
        wfpass.apply(QKV())


def test_inductor_end_to_end():
    torch.manual_seed(0)
    model = QKV(k_bias=True)
    x = torch.randn(2, 1, 32, requires_grad=True)
    assert_same_fwd_bwd(model, lambda m: torch.compile(m, backend="wformat"), [x])
    (rec,) = wfpass.last_report().find("linear", "rewritten")
    assert rec.stats["fused_calls"] == 1


def test_entry_point_without_import(tmp_path):
    script = tmp_path / "ep.py"
    script.write_text(
        "import sys, torch\n"
        "m = torch.nn.Sequential(torch.nn.Linear(8, 8))\n"
        "out = torch.compile(m, backend='wformat')(torch.randn(2, 8))\n"
        "assert out.shape == (2, 8)\n"
        "print('wfpass loaded by entry point:', 'wfpass' in sys.modules)\n"
    )
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "wfpass loaded by entry point: True" in res.stdout


@pytest.mark.parametrize("flavour", ["compile", "apply"])
def test_split_path_layout_lost_comes_back_and_is_counted(flavour):
    """The split path's GEMMs read each member's own tensor, so nothing reads
    the block; a per-call check still brings a lost layout back (re_fused)."""
    torch.manual_seed(0)
    model = QKV(k_bias=True)
    ref = copy.deepcopy(model)
    if flavour == "compile":
        fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager", linear_path="split"))
    else:
        fn = fx.symbolic_trace(model)
        wfpass.apply(fn, linear_path="split")
    x = torch.randn(4, 8, 32)
    torch.testing.assert_close(fn(x), ref(x))
    (rec,) = wfpass.last_report().find("linear", "rewritten")
    assert rec.detail["path"] == "split"
    model.double().float()  # the layout is lost: each weight gets its own storage
    ref.double().float()
    assert fused_storage_of(model.q.weight) is None or not fused_storage_of(model.q.weight).is_member(model.q.weight)
    torch.testing.assert_close(fn(x), ref(x))
    # Two blocks came back: the weights' and the biases'.
    assert rec.stats["re_fused"] == 2 and not rec.stats.get("unfused_layout_calls")
    assert model.q.weight.untyped_storage().data_ptr() == model.v.weight.untyped_storage().data_ptr()



def test_layers_already_fused_get_a_record():
    """Models whose Q/K/V already live in one weight get a row saying so, not
    "no pattern found": ``nn.TransformerEncoderLayer`` (``in_proj_weight``),
    GPT-2's ``Conv1D`` ``c_attn`` (one ``addmm`` split three ways) and a
    hand-fused ``qkv`` linear whose output is split. Nothing is moved."""
    transformers = pytest.importorskip("transformers")

    class HandFused(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).split(16, -1)
            return q * k + v

    gpt2 = transformers.GPT2Model(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=32,
                                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    cases = [
        (nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True), (torch.randn(2, 5, 16),),
         "self_attn.in_proj_weight", "in_proj_weight (48 rows)"),
        (gpt2, (torch.randint(0, 64, (2, 6)),), "h.0.attn.c_attn.weight", "computes 3 outputs with one GEMM"),
        (HandFused(), (torch.randn(2, 5, 16),), "qkv.weight", "split into 3 parts"),
    ]
    for model, args, name, why in cases:
        torch._dynamo.reset()
        ref = copy.deepcopy(model)
        ptrs = [p.data_ptr() for p in model.parameters()]
        fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager"))
        out, ref_out = fn(*args), ref(*args)
        out = out if isinstance(out, torch.Tensor) else out.last_hidden_state
        ref_out = ref_out if isinstance(ref_out, torch.Tensor) else ref_out.last_hidden_state
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        recs = [r for r in wfpass.last_report().find("linear", "skipped") if name in r.params]
        assert len(recs) == 1 and recs[0].reason.startswith("already fused") and why in recs[0].reason, str(wfpass.last_report())
        assert recs[0].detail["already_fused"] is True
        assert [p.data_ptr() for p in model.parameters()] == ptrs
        assert any(r.reason == recs[0].reason for r in wfpass.report(model))
