"""The format registry: built-ins registered, user formats, errors, examples run."""
from __future__ import annotations

import pathlib
import runpy
import subprocess
import sys

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import wfpass
from wfpass.builtin import PASS_NAMES
from models import QKV

ROOT = pathlib.Path(__file__).resolve().parents[1]


class Double(wfpass.ParamFormat):
    """A toy format for tests: weights stored in float64."""

    name = "double_linear_for_test"
    targets = (nn.Linear,)
    roles = ("weight", "bias")

    def to_format(self, t):
        return t.double()

    def from_format(self, t):
        return t.float()


def test_builtins_are_registered_in_pipeline_order():
    names = [f.name for f in wfpass.registered_formats()]
    assert names[: len(PASS_NAMES)] == list(PASS_NAMES)


def test_builtins_stay_and_ordering_constraints_are_checked():
    from wfpass import pipeline
    from wfpass.builtin import BUILTIN_FORMATS

    # Removing a built-in would change every later compile in the process.
    with pytest.raises(ValueError, match=r"Config\(passes=\.\.\.\)"):
        wfpass.unregister_format("fuse_rnn")
    by_name = {f.name: f for f in BUILTIN_FORMATS}
    for first, then in (("fuse_rnn", "fold_cells"), ("fold_batchnorm", "fp32_batchnorm")):
        swapped = [by_name[then] if f.name == first else by_name[first] if f.name == then else f for f in BUILTIN_FORMATS]
        with pytest.raises(ValueError, match="must run (before|after)"):
            pipeline.check_order(swapped)

    class Early(Double):
        name = "early_for_test"
        before = ("fuse_rnn",)  # a registered format runs after the built-ins

    class Typo(Double):
        name = "typo_for_test"
        after = ("fp32_batchnorn",)

    with pytest.raises(ValueError, match="must run before 'fuse_rnn'"):
        wfpass.register_format(Early)
    with pytest.raises(ValueError, match="'fp32_batchnorn', which is not registered"):
        wfpass.register_format(Typo)
    assert [f.name for f in wfpass.registered_formats()] == list(PASS_NAMES)
    with pytest.raises(ValueError, match="unknown names"):
        wfpass.Config(passes=("fuse_rnn", "early_for_test"))


def test_a_format_installs_once_and_restore_asks_it_for_every_module():
    """A format's whole life is on the format: ``install`` when it joins the
    pipeline, ``restore(module)`` from ``wfpass.restore`` for every module,
    with no edit to wfpass's entry points."""
    calls = {"install": 0, "restore": []}

    class Hooks(wfpass.Format):
        name = "hooks_for_test"

        def run(self, gm, ctx):
            return 0

        def install(self):
            calls["install"] += 1

        def restore(self, module):
            calls["restore"].append(module)

    wfpass.register_format(Hooks())
    try:
        assert calls["install"] == 1
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        wfpass.restore(model)
        assert calls["restore"] == list(model.modules())
    finally:
        wfpass.unregister_format("hooks_for_test")


def test_passes_option_selects_formats():
    model = QKV()
    torch.compile(model, backend=wfpass.backend(inner="aot_eager", passes=("fp32_batchnorm",)))(torch.randn(1, 32))
    assert not wfpass.last_report().records
    assert model.q.weight.untyped_storage().data_ptr() != model.v.weight.untyped_storage().data_ptr()


def test_passes_accepts_the_report_pattern_names():
    """The names the report prints select every format filing rows under
    them; an unknown name's error lists both kinds."""
    assert wfpass.Config(passes=["rnn"]).passes == ("fold_cells", "fuse_rnn")
    assert wfpass.Config(passes=("linear", "fp32_batchnorm")).passes == ("fuse_linears", "fp32_batchnorm")
    assert set(wfpass.Config(passes=("batchnorm",)).passes) == {"fold_batchnorm", "fp32_batchnorm"}
    with pytest.raises(ValueError, match=r"unknown names \['lstm'\].*'fuse_rnn'.*'rnn'"):
        wfpass.Config(passes=("lstm",))
    model = QKV()
    torch.compile(model, backend=wfpass.backend(inner="aot_eager", passes=("linear",)))(torch.randn(1, 32))
    assert {r.pattern for r in wfpass.last_report().records} == {"linear"}


def test_user_param_format_on_traced_graph_and_restore():
    wfpass.register_format(Double)
    try:
        model = nn.Sequential(nn.Linear(4, 4))
        ids = [id(p) for p in model.parameters()]
        gm = fx.symbolic_trace(model)
        rep = wfpass.apply(gm, passes=("double_linear_for_test",))
        (rec,) = rep.rewritten
        assert rec.pattern == "double_linear_for_test" and rec.params == ["0.weight", "0.bias"]
        assert model[0].weight.dtype == torch.float64 and [id(p) for p in model.parameters()] == ids
        assert wfpass.apply(gm, passes=("double_linear_for_test",)).skipped[0].reason == "already in this format"
        assert wfpass.restore(model) == 2
        assert model[0].weight.dtype == torch.float32
    finally:
        wfpass.unregister_format("double_linear_for_test")


def test_user_format_skips_tied_weights():
    wfpass.register_format(Double)
    try:
        a, b = nn.Linear(4, 4), nn.Linear(4, 4)
        b.weight = nn.Parameter(a.weight.data)  # two Parameters, one storage
        model = nn.Sequential(a, b)
        rep = wfpass.apply(fx.symbolic_trace(model), passes=("double_linear_for_test",))
        assert len(rep.skipped) == 2 and all("shares storage" in r.reason for r in rep.skipped)
        assert model[0].weight.data_ptr() == model[1].weight.data_ptr()
    finally:
        wfpass.unregister_format("double_linear_for_test")


def test_registry_errors():
    with pytest.raises(TypeError, match="wfpass.Format"):
        wfpass.register_format(object())
    with pytest.raises(ValueError, match="already registered"):
        wfpass.register_format(wfpass.registered_formats()[0])

    class NoName(wfpass.ParamFormat):
        targets = (nn.Linear,)

    with pytest.raises(ValueError, match="name"):
        wfpass.register_format(NoName)

    class NoTargets(wfpass.ParamFormat):
        name = "no_targets"

    with pytest.raises(ValueError, match="targets"):
        wfpass.register_format(NoTargets)

    class NoUndo(wfpass.ParamFormat):
        name = "no_undo"
        targets = (nn.Linear,)

        def to_format(self, t):
            return t

    with pytest.raises(TypeError, match="from_format"):
        wfpass.register_format(NoUndo)
    with pytest.raises(ValueError, match="no format named"):
        wfpass.unregister_format("never_registered")
    assert "no_undo" not in [f.name for f in wfpass.registered_formats()]


#: Examples a test of their own runs and checks (with a skip where the
#: example needs what the machine lacks: a C++ compiler, wfpass's kernels).
_OWN_TEST = {"export_cpp.py": "tests/deploy/test_export.py::test_the_cpp_example_runs_the_package_with_no_python"}


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "examples").glob("*.py") if p.name not in _OWN_TEST),
                         ids=lambda p: p.name)
def test_examples_run(path):
    res = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]


def test_driver_narrows_guards_and_applies_and_a_dry_run_only_decides():
    """``pipeline.drive``: members a format's ``narrow`` leaves out get their
    own skipped rows (passed to ``skipped``), the guard decides on the rest,
    ``apply`` runs only for taken matches, and a dry run writes the plan
    without applying."""
    from wfpass import pipeline
    from wfpass.core.records import Report

    class Pair(pipeline.Match):
        def __init__(self, members):
            super().__init__(members, plan=f"would join {'+'.join(members)}")
            self.members = members

    class Joiner(pipeline.Format):
        name, pattern = "joiner_for_test", "join"

        def __init__(self):
            super().__init__()
            self.applied, self.skips = [], []

        def matches(self, gm, ctx):
            yield Pair(["a", "b", "tied"])  # "tied" is left out, the rest is joined
            yield Pair(["c", "tied"])  # one member left: the guard refuses

        def narrow(self, m, ctx):
            keep = [p for p in m.members if p != "tied"]
            return Pair(keep), [(Pair(["tied"]), "tied to another tensor")]

        def guard(self, m, ctx):
            return None if len(m.members) >= 2 else f"group of {len(m.members)}"

        def skipped(self, m, record, ctx):
            self.skips.append((tuple(m.params), record.reason))

        def apply(self, m, ctx):
            self.applied.append(tuple(m.members))
            ctx.report.add("join", "rewritten", "joined", m.params)

    for dry in (False, True):
        fmt = Joiner()
        ctx = type("Ctx", (), {"config": wfpass.Config(dry_run=dry), "report": Report(dry_run=dry)})()
        assert pipeline.drive(fmt, None, ctx) == 1
        rows = [(r.action, r.reason, tuple(r.params)) for r in ctx.report.records]
        taken = ("would rewrite", "would join a+b [dry run]") if dry else ("rewritten", "joined")
        assert rows == [("skipped", "tied to another tensor", ("tied",)), (*taken, ("a", "b")),
                        ("skipped", "tied to another tensor", ("tied",)), ("skipped", "group of 1", ("c",))], rows
        assert fmt.applied == ([] if dry else [("a", "b")])
        assert fmt.skips == [(("tied",), "tied to another tensor"), (("tied",), "tied to another tensor"),
                             (("c",), "group of 1")]


def test_user_format_with_in_bodies_runs_inside_a_checkpointed_region():
    """``in_bodies = True`` on a user format: its convs inside
    ``torch.utils.checkpoint`` are rewritten there (the parameters take the
    format, the row names the region), forward and every grad equal eager;
    without it they are left with a skipped row naming the region."""
    import torch.utils.checkpoint as cp

    from wftest import assert_same_fwd_bwd

    class ChannelsLast(wfpass.ParamFormat):
        name = "channels_last_in_bodies_for_test"
        targets = (torch.conv2d,)
        roles = ("weight",)

        def to_format(self, t):
            return t.contiguous(memory_format=torch.channels_last)

        def from_format(self, t):
            return t.contiguous()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.d = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3)

        def body(self, x):
            return self.d(torch.relu(self.c(x)))

        def forward(self, x):
            return cp.checkpoint(self.body, x, use_reentrant=False)

    for inside in (True, False):
        fmt = type("F", (ChannelsLast,), {"in_bodies": inside})()
        wfpass.register_format(fmt)
        try:
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = Net()
            be = wfpass.backend(inner="aot_eager", passes=(fmt.name,))
            assert_same_fwd_bwd(model, lambda m: torch.compile(m, backend=be), [torch.randn(2, 3, 8, 8)])
            rows = [r for r in wfpass.report(model) if r.pattern == fmt.name]
            assert {tuple(r.params) for r in rows} == {("c.weight",), ("d.weight",)}, rows
            if inside:
                assert all(r.action == "rewritten" for r in rows), rows
                assert model.c.weight.is_contiguous(memory_format=torch.channels_last)
            else:
                assert all(r.action == "skipped" and "tag_activation_checkpoint" in r.reason for r in rows), rows
                assert model.c.weight.is_contiguous()
        finally:
            wfpass.unregister_format(fmt.name)


def test_torch_compile_mode_and_options_reach_inductor_through_wformat():
    """``torch.compile(m, backend="wformat", mode=..., options=...)``: torch
    passes both to the backend; wformat hands them to Inductor as its own
    entry does, and refuses them where they would be dropped."""
    from unittest import mock

    from wfpass.compiler import inductor_settings

    assert inductor_settings("inductor", "reduce-overhead")["triton.cudagraphs"] is True
    assert inductor_settings("inductor", "max-autotune-no-cudagraphs", {"epilogue_fusion": False}) == {
        **torch._inductor.list_mode_options("max-autotune-no-cudagraphs"), "epilogue_fusion": False}
    assert inductor_settings("eager") == {} and inductor_settings("inductor", "default") == {}
    with pytest.raises(ValueError, match="mode must be one of"):
        inductor_settings("inductor", "fastest")
    with pytest.raises(ValueError, match="option 'inner' is 'aot_eager'"):
        inductor_settings("aot_eager", "reduce-overhead")
    with pytest.raises(TypeError, match="options must be a dict"):
        inductor_settings("inductor", None, ["epilogue_fusion"])

    from wfpass import compiler

    seen = []
    real = compiler._aot.inductor_compile_fx

    def spy(config_patches=None):
        seen.append(config_patches)
        return real(config_patches)

    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    x = torch.randn(4, 16)
    expected = model(x)
    torch._dynamo.reset()
    with mock.patch.object(compiler._aot, "inductor_compile_fx", spy):
        out = torch.compile(model, backend="wformat", options={"epilogue_fusion": False})(x)
    torch.testing.assert_close(out, expected)
    assert seen == [{"epilogue_fusion": False}], seen
    torch._dynamo.reset()
    with pytest.raises(Exception, match="reach Inductor only"):
        torch.compile(model, backend=wfpass.backend(inner="aot_eager"), mode="reduce-overhead")(x)
