"""fp32_batchnorm: half-precision BatchNorm keeps fp32 weight, bias and statistics.

References: an fp32 model given the same (half-rounded) inputs, and the eager
half model. Most tests run through ``wfpass.apply`` (call_module graphs) or
``backend="wformat"`` with ``inner="aot_eager"``; one runs Inductor end to end.
"""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import wfpass
from wfpass.batchnorm.kernels import held_in_fp32
from wftest import needs_gpu

HALF = (torch.bfloat16, torch.float16)
# Relative (norm-wise) error allowed between a half model and an fp32 one.
REL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


class ConvBN(nn.Module):
    """conv -> BatchNorm{1,2,3}d -> relu -> conv: one BN, both neighbours trainable."""

    def __init__(self, dim: int, c: int = 6, **bn_kw):
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dim]
        bn = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dim]
        self.dim = dim
        self.c1 = conv(3, c, 3, padding=1)
        self.bn = bn(c, **bn_kw)
        self.c2 = conv(c, 4, 1)

    def forward(self, x):
        return self.c2(F.relu(self.bn(self.c1(x))))

    def example(self, dtype, n=6, size=5):
        shape = (n, 3) + (size,) * self.dim
        return (torch.randn(shape) * 2 + 0.5).to(dtype)


class FunctionalBN(nn.Module):
    """``F.batch_norm`` over bare Parameters/buffers (traced through by symbolic_trace)."""

    def __init__(self, c=6):
        super().__init__()
        self.lin = nn.Linear(4, c)
        self.w = nn.Parameter(torch.rand(c) + 0.5)
        self.b = nn.Parameter(torch.randn(c) / 4)
        self.register_buffer("rm", torch.zeros(c))
        self.register_buffer("rv", torch.ones(c))

    def forward(self, x):
        return F.batch_norm(self.lin(x), self.rm, self.rv, self.w, self.b, self.training, 0.1, 1e-5)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def close(a: torch.Tensor, b: torch.Tensor, tol: float, atol: float = 1e-4) -> bool:
    """Norm-wise relative closeness with an absolute floor per element (a conv
    bias in front of a training-mode BatchNorm has a gradient of zero, up to
    rounding)."""
    a, b = a.detach().double(), b.detach().double()
    return (a - b).norm().item() <= tol * b.norm().item() + atol * b.numel() ** 0.5


def bn_tensors(bn):
    """The BatchNorm's own tensor objects (state_dict() would detach them)."""
    names = ("weight", "bias", "running_mean", "running_var")
    return {k: getattr(bn, k) for k in names if getattr(bn, k, None) is not None}


def wf_compile(model, inner="aot_eager", **kw):
    return torch.compile(model, backend=wfpass.backend(inner=inner, **kw))


def wf_apply(model, **kw):
    gm = torch.fx.symbolic_trace(model)
    wfpass.apply(gm, **kw)
    return gm


def run_step(fn, x, training):
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    out.float().pow(2).mean().backward()
    return out, x.grad


# -- outputs, grads and statistics against fp32 and eager half --------------------

@pytest.mark.parametrize("flavour", ["apply", "dynamo"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("dim", [1, 2, 3])
def test_matches_fp32_and_eager_half(dim, dtype, training, flavour):
    model = ConvBN(dim)
    with torch.no_grad():  # non-trivial statistics so eval mode tests them
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 3.0)
        model.bn.weight.uniform_(0.5, 1.5)
    model = model.to(dtype).train(training)
    ref32 = copy.deepcopy(model).float()
    eager = copy.deepcopy(model)
    params_before = [id(p) for p in model.parameters()]
    fn = wf_apply(model) if flavour == "apply" else wf_compile(model)
    x = model.example(dtype)

    outs = {}
    for name, f, inp in [("wf", fn, x), ("eager", eager, x), ("ref", ref32, x.float())]:
        outs[name] = run_step(f, inp, training)

    (y, gx), (ye, gxe), (yr, gxr) = outs["wf"], outs["eager"], outs["ref"]
    assert y.dtype == dtype
    assert rel(y, yr) < REL[dtype] and rel(y, ye) < REL[dtype]
    assert rel(gx, gxr) < 2 * REL[dtype] and rel(gx, gxe) < 2 * REL[dtype]
    # Every Parameter is the same object and got a grad close to fp32's.
    assert [id(p) for p in model.parameters()] == params_before
    for (n, p), (_, q), (_, e) in zip(model.named_parameters(), ref32.named_parameters(), eager.named_parameters()):
        assert p.grad is not None, n
        assert close(p.grad, q.grad, 2 * REL[dtype]), n
        assert close(p.grad, e.grad, 2 * REL[dtype]), n
    # BatchNorm tensors are fp32 now; the other layers keep the model's dtype.
    for k, t in bn_tensors(model.bn).items():
        assert t.dtype == torch.float32, k
        assert held_in_fp32(t)
    assert model.c1.weight.dtype == dtype
    assert model.bn.weight.grad.dtype == torch.float32
    # Statistics: as fp32 computes them (up to the half-rounded activations).
    for k in ("running_mean", "running_var"):
        a, r = getattr(model.bn, k), getattr(ref32.bn, k)
        assert rel(a, r) < REL[dtype] / 4, k
    assert model.bn.num_batches_tracked.item() == eager.bn.num_batches_tracked.item() == (1 if training else 0)
    rec = wfpass.last_report().find("batchnorm", "rewritten")
    assert rec and "float32" in rec[0].reason
    if flavour == "apply":  # the in-place check before the batch norm ran once
        assert rec[0].stats["fp32_calls"] == 1
    else:  # compiled for fp32 inputs: nothing of wfpass runs per call
        assert rec[0].detail["compiled_for"].startswith("float32")


def test_dynamo_no_recompile_and_first_call_right():
    """The cast happens after the inner compile; the hoisted fp32 inputs keep
    the first call right and Dynamo's guards see fp32 already: one compile for
    several training steps."""
    model = ConvBN(2).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    ref.bn.float()  # eager with the mixed kernel: what wformat should equal
    compiles = []
    be = wfpass.backend(inner="aot_eager")

    def counting(gm, ex):
        compiles.append(1)
        return be(gm, ex)

    fn = torch.compile(model, backend=counting)
    for i in range(4):
        x = model.example(torch.bfloat16)
        y, yr = fn(x), ref(x)
        torch.testing.assert_close(y, yr, rtol=0, atol=0)
        torch.testing.assert_close(model.bn.running_var, ref.bn.running_var, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean, rtol=1e-6, atol=1e-6)
    assert len(compiles) == 1
    assert model.bn.num_batches_tracked.item() == ref.bn.num_batches_tracked.item() == 4


def test_dynamo_graph_unchanged_compiled_for_fp32():
    """The Dynamo graph keeps its placeholders (no per-call prologue); the
    inner compiler is handed fp32 examples for the BatchNorm's four."""
    model = ConvBN(2).to(torch.bfloat16)
    seen = {}

    def inner(gm, ex):
        seen["targets"] = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        seen["dtypes"] = {n.name: e.dtype for n, e in zip([n for n in gm.graph.nodes if n.op == "placeholder"], ex)}
        return gm.forward

    torch.compile(model, backend=wfpass.backend(inner=inner))(model.example(torch.bfloat16))
    assert not any("wfpass" in getattr(t, "__module__", "") for t in seen["targets"])
    bn_dtypes = {k: v for k, v in seen["dtypes"].items() if "bn" in k and "num_batches" not in k}
    assert len(bn_dtypes) == 4 and set(bn_dtypes.values()) == {torch.float32}
    assert seen["dtypes"]["l_x_"] == torch.bfloat16


def test_other_reader_of_stats_skipped():
    class Peek(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(x) + self.bn.running_mean  # reads the buffer outside BN

    model = Peek().to(torch.bfloat16)
    eager = copy.deepcopy(model)
    fn = wf_compile(model)
    x = torch.randn(8, 4).to(torch.bfloat16)
    y = fn(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, eager(x))
    (rec,) = wfpass.last_report().find("batchnorm")
    assert rec.action == "skipped" and "also read by" in rec.reason


def test_inductor_end_to_end_train_then_eval():
    """Inductor: training steps with an optimizer, then eval; against eager
    with the mixed kernel (the BN moved to fp32 by hand)."""
    torch.manual_seed(0)
    model = ConvBN(2, c=8).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    ref.bn.float()
    fn = wf_compile(model, inner="inductor")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05)
    for i in range(3):
        x = model.example(torch.bfloat16, n=8, size=6)
        for f, o in ((fn, opt), (ref, opt_r)):
            o.zero_grad()
            f(x).float().pow(2).mean().backward()
            o.step()
    assert model.bn.weight.dtype == model.bn.running_var.dtype == torch.float32
    assert rel(model.bn.running_var, ref.bn.running_var) < 1e-3
    assert rel(model.bn.weight, ref.bn.weight) < 1e-2
    assert rel(model.c1.weight, ref.c1.weight) < 2e-2
    model.eval(), ref.eval()
    with torch.no_grad():
        x = model.example(torch.bfloat16, n=8, size=6)
        assert rel(fn(x), ref(x)) < 2e-2
    assert wfpass.last_report().find("batchnorm")


# -- 200 steps on a drifting stream: bf16 statistics stall, fp32 ones do not ----------

def _drifting_stream(steps, c=8, n=16, hw=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    base_mean = torch.randn(c, generator=g)
    for i in range(steps):
        t = i / steps
        mean = base_mean + 3.0 * t  # per-channel means drift slowly
        std = 2.0 + 1.0 * t          # and so does the spread: running_var 4 -> 9
        x = torch.randn(n, c, hw, hw, generator=g) * std + mean.view(1, c, 1, 1)
        yield x.to(torch.bfloat16)   # the same bf16-rounded data for every model


def test_running_var_200_steps_10x_closer_to_fp32_than_plain_bf16():
    steps = 200
    bn_half = nn.Sequential(nn.BatchNorm2d(8)).to(torch.bfloat16)
    plain = copy.deepcopy(bn_half)
    ref = copy.deepcopy(bn_half).float()
    gm = wf_apply(bn_half)
    with torch.no_grad():
        for x in _drifting_stream(steps):
            gm(x), plain(x), ref(x.float())
    err_wf = rel(bn_half[0].running_var, ref[0].running_var)
    err_plain = rel(plain[0].running_var, ref[0].running_var)
    err_mean_wf = rel(bn_half[0].running_mean, ref[0].running_mean)
    print(f"running_var rel. error after {steps} steps: wformat {err_wf:.2e}, plain bf16 {err_plain:.2e}, ratio {err_plain / err_wf:.0f}x")
    assert err_plain >= 10 * err_wf
    assert err_wf < 1e-3 and err_mean_wf < 1e-3
    assert bn_half[0].num_batches_tracked.item() == steps


def test_fp16_variance_above_65504_stays_finite():
    x = (torch.randn(32, 4, 4, 4) * 600).half()  # variance ~360000 > fp16 max
    assert torch.isfinite(x).all()
    plain = nn.Sequential(nn.BatchNorm2d(4)).half()
    ref = copy.deepcopy(plain).float()
    wf_model = copy.deepcopy(plain)
    dyn_model = copy.deepcopy(plain)
    gm = wf_apply(wf_model)
    fn = wf_compile(dyn_model)
    for _ in range(3):
        plain(x), gm(x), fn(x), ref(x.float())
    assert not torch.isfinite(plain[0].running_var).all()  # the problem is real
    for m in (wf_model, dyn_model):
        rv = m[0].running_var
        assert rv.dtype == torch.float32 and torch.isfinite(rv).all()
        assert rel(rv, ref[0].running_var) < 1e-3
    # The output itself is normalized, hence representable in fp16.
    assert torch.isfinite(fn(x)).all()


# -- module options ----------------------------------------------------------------

@pytest.mark.parametrize("flavour", ["apply", "dynamo"])
@pytest.mark.parametrize("bn_kw", [dict(momentum=None), dict(affine=False), dict(track_running_stats=False),
                                   dict(affine=False, track_running_stats=False)],
                         ids=["momentum_none", "affine_false", "no_running_stats", "neither"])
def test_bn_options_as_eager(bn_kw, flavour):
    """Against eager with the BatchNorm's tensors moved to fp32 by hand, which
    is what the format is: equal statistics, num_batches_tracked and output."""
    model = ConvBN(2, **bn_kw).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    ref.bn.float()
    fn = wf_apply(model) if flavour == "apply" else wf_compile(model)
    for i in range(3):
        x = model.example(torch.bfloat16)
        torch.testing.assert_close(fn(x), ref(x), rtol=1e-2, atol=1e-2)
    for (k, a), (_, r) in zip(model.bn.state_dict().items(), ref.bn.state_dict().items()):
        assert a.dtype == r.dtype, k
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6, msg=k)
    recs = wfpass.last_report().find("batchnorm")
    if not bn_kw.get("affine", True) and not bn_kw.get("track_running_stats", True):
        assert recs[0].action == "skipped" and "no weight, bias or statistics" in recs[0].reason
    elif not (flavour == "dynamo" and "momentum" in bn_kw):  # that record is an earlier graph's: see below
        assert recs[0].action == "rewritten"
        assert not any(t.dtype in HALF for t in bn_tensors(model.bn).values())  # apex left these half


def _collecting(model, **kw):
    """torch.compile with a wformat backend that keeps every graph's report
    (a graph break splits the model into several graphs; last_report() is
    the last one)."""
    be = wfpass.backend(inner="aot_eager", **kw)
    reports = []

    def collect(gm, example_inputs):
        out = be(gm, example_inputs)
        reports.append(wfpass.last_report())
        return out

    return torch.compile(model, backend=collect), reports


def _eager_records(reports):
    # last_report() holds every graph of one call, so records repeat: by identity
    recs = {id(r): r for rep in reports for r in rep.records}.values()
    return [r for r in recs if r.pattern == "batchnorm" and r.detail.get("flavour") == "eager"]


def test_last_report_holds_every_graph_of_a_call_split_by_a_graph_break():
    model = ConvBN(2, momentum=None).to(torch.bfloat16)
    fn = wf_compile(model)
    fn(model.example(torch.bfloat16))
    rep = wfpass.last_report()
    assert "graphs of one call" in rep.title
    assert [r.detail.get("flavour") for r in rep.find("batchnorm")] == ["eager"]
    assert len(rep.find("batchnorm", "rewritten")) == 1


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_momentum_none_in_training_graph_break_runs_mixed_kernel_with_fp32_stats(dim):
    """torch 2.13's Dynamo graph-breaks on ``float(self.num_batches_tracked)``
    and runs that BatchNorm eagerly. The pass finds it while compiling the
    frame's first graph (conv c1), holds its tensors in fp32 and adds a
    pre-hook: the eager call runs the mixed kernel. Against eager with the
    BatchNorm moved to fp32 by hand: same statistics (bit for bit: the same
    kernel), outputs and grads."""
    model = ConvBN(dim, momentum=None).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    ref.bn.float()
    plain = copy.deepcopy(model)
    fn, reports = _collecting(model)
    for _ in range(4):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        x = model.example(torch.bfloat16)
        out, gx = run_step(fn, x, True)
        ref_out, ref_gx = run_step(ref, x, True)
        plain(x)
        # bf16 convs: Dynamo/aot_eager vs eager may order sums differently
        torch.testing.assert_close(out, ref_out, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(gx, ref_gx, rtol=1e-2, atol=1e-2)
        for (k, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-2, msg=k)
    for k, t in bn_tensors(model.bn).items():
        assert t.dtype == torch.float32, k
        torch.testing.assert_close(t, getattr(ref.bn, k), rtol=1e-5, atol=1e-6, msg=k)
    assert model.bn.num_batches_tracked.item() == 4
    # not vacuous: plain bf16 statistics differ from the fp32 ones
    assert not torch.equal(plain.bn.running_var.float(), model.bn.running_var)
    (rec,) = _eager_records(reports)
    assert rec.action == "rewritten" and "momentum=None" in rec.reason and "'bn'" in rec.reason
    assert rec.detail["half_calls_before"] == 0 and rec.stats["fp32_calls"] == 4
    # Eval mode has no float(num_batches_tracked), and the statistics are already fp32.
    model.eval()
    with torch.no_grad():
        fn(x)
    in_graph = any(r.pattern == "batchnorm" and "already held in fp32" in r.reason for r in reports[-1].records)
    # torch 2.13-2.15 compile the hooked BatchNorm's eval forward; 2.11's
    # Dynamo does not (the hook's call breaks the graph), so the call runs
    # eagerly through the hook, with fp32 statistics, and the row counts it.
    assert in_graph or rec.stats["fp32_calls"] == 5, rec.stats


def test_momentum_none_graph_break_format_kept_by_hook_and_undone_by_restore():
    model = ConvBN(2, momentum=None).to(torch.bfloat16)
    fn, reports = _collecting(model)
    x = model.example(torch.bfloat16)
    fn(x)
    (rec,) = _eager_records(reports)
    model.bn.to(torch.bfloat16)  # the format is lost; the pre-hook casts it back, counted
    fn(x)
    assert model.bn.running_var.dtype == torch.float32 and rec.stats["recast"] >= 1
    clone = copy.deepcopy(model)  # the copy's hook checks the copy
    clone.bn.to(torch.bfloat16)
    clone(x)
    assert clone.bn.running_var.dtype == torch.float32
    wfpass.restore(model)
    assert model.bn.running_var.dtype == torch.bfloat16 and not model.bn._forward_pre_hooks
    model(x)  # plain eager again: nothing casts it
    assert model.bn.running_var.dtype == torch.bfloat16


def test_momentum_none_batchnorm_first_in_its_frame_says_it_ran_once_in_half():
    """When the BatchNorm is the first thing its frame runs, Dynamo compiles no
    graph before calling it: the first call's update is in bf16, and the
    record says so (found while compiling the graph after it)."""

    class BNFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4, momentum=None)
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(self.bn(x))

    model = BNFirst().to(torch.bfloat16)
    fn, reports = _collecting(model)
    for _ in range(3):
        fn(torch.randn(8, 4).to(torch.bfloat16))
    (rec,) = _eager_records(reports)
    assert rec.detail["half_calls_before"] == 1 and "already run 1 training call(s) with bfloat16" in rec.reason
    assert model.bn.running_var.dtype == torch.float32


def test_functional_batch_norm_apply_and_dynamo():
    for flavour in ("apply", "dynamo"):
        torch._dynamo.reset()
        model = FunctionalBN().to(torch.bfloat16)
        ref = copy.deepcopy(model)
        for n in ("w", "b", "rm", "rv"):
            getattr(ref, n).data = getattr(ref, n).data.float()
        fn = wf_apply(model) if flavour == "apply" else wf_compile(model)
        for i in range(2):
            x = torch.randn(16, 4).to(torch.bfloat16)
            torch.testing.assert_close(fn(x), ref(x), rtol=1e-2, atol=1e-2)
        assert model.rv.dtype == model.w.dtype == torch.float32
        torch.testing.assert_close(model.rv, ref.rv)
        assert wfpass.last_report().find("batchnorm", "rewritten"), flavour


# -- skipped cases ---------------------------------------------------------------------

def test_fp32_model_skipped_with_reason():
    model = ConvBN(2)
    fn = wf_compile(model)
    fn(model.example(torch.float32))
    (rec,) = wfpass.last_report().find("batchnorm")
    assert rec.action == "skipped" and "input is float32" in rec.reason
    assert model.bn.running_var.dtype == torch.float32 and not held_in_fp32(model.bn.running_var)


def test_autocast_with_fp32_params_skipped_with_reason():
    model = ConvBN(2)
    before = copy.deepcopy(model.state_dict())
    fn = wf_compile(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fn(model.example(torch.float32))
    recs = wfpass.last_report().find("batchnorm")
    assert recs and all(r.action == "skipped" for r in recs)
    assert "autocast" in recs[0].reason and "already float32" in recs[0].reason, recs[0].reason
    assert all(v.dtype == before[k].dtype for k, v in model.state_dict().items())


def test_shared_storage_skipped_with_reason():
    model = ConvBN(2).to(torch.bfloat16)
    # running_mean is a view of a bigger buffer: moving it would untie them.
    model.register_buffer("stats", torch.zeros(12, dtype=torch.bfloat16))
    model.bn.running_mean = model.stats[:6]
    fn = wf_compile(model)
    fn(model.example(torch.bfloat16))
    (rec,) = wfpass.last_report().find("batchnorm")
    # (stats is not read by forward, so it is not in the Dynamo graph: the
    # storage's use count catches it.)
    assert rec.action == "skipped" and "storage" in rec.reason and "untie" in rec.reason
    assert model.bn.running_mean.dtype == torch.bfloat16
    assert model.bn.running_mean.untyped_storage().data_ptr() == model.stats.untyped_storage().data_ptr()


# -- state_dict, objects, restore, drift ------------------------------------------------

def test_state_dict_round_trips_both_ways():
    model = ConvBN(2).to(torch.bfloat16)
    keys = list(model.state_dict())
    ids = {k: id(v) for k, v in list(model.named_parameters()) + list(model.named_buffers())}
    gm = wf_apply(model)
    for _ in range(2):
        gm(model.example(torch.bfloat16))
    assert list(model.state_dict()) == keys
    assert {k: id(v) for k, v in list(model.named_parameters()) + list(model.named_buffers())} == ids

    # Passed -> un-passed half model (through torch.save/torch.load).
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    plain = ConvBN(2).to(torch.bfloat16)
    plain.load_state_dict(torch.load(buf))
    assert plain.bn.running_var.dtype == torch.bfloat16
    torch.testing.assert_close(plain.bn.running_var, model.bn.running_var.bfloat16())
    torch.testing.assert_close(plain.bn.weight, model.bn.weight.bfloat16())

    # Un-passed half model -> passed model: copied with a cast, stays fp32, same objects.
    other = ConvBN(2).to(torch.bfloat16)
    with torch.no_grad():
        other.bn.running_var.uniform_(1, 2)
    model.load_state_dict(other.state_dict())
    assert model.bn.running_var.dtype == torch.float32
    torch.testing.assert_close(model.bn.running_var, other.bn.running_var.float())
    assert {k: id(v) for k, v in list(model.named_parameters()) + list(model.named_buffers())} == ids
    y = gm(model.example(torch.bfloat16))
    assert y.dtype == torch.bfloat16


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.SGD])
def test_optimizer_with_state_from_before_the_pass(opt_cls):
    """An optimizer that already stepped holds bf16 state for the BN params
    (Adam would raise on the dtype mix): it follows the parameter's dtype,
    as Optimizer.load_state_dict would cast it; and back after restore."""
    model = ConvBN(2).to(torch.bfloat16)
    kw = dict(momentum=0.9) if opt_cls is torch.optim.SGD else {}
    opt = opt_cls(model.parameters(), lr=1e-2, **kw)

    def step(f):
        opt.zero_grad()
        f(model.example(torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()

    step(model)  # eager bf16 step: state in bf16
    fn = wf_compile(model)
    w0 = model.bn.weight.detach().clone()
    for _ in range(3):
        step(fn)
    assert model.bn.weight.dtype == torch.float32
    state = opt.state[model.bn.weight]
    key = "exp_avg" if opt_cls is torch.optim.Adam else "momentum_buffer"
    assert state[key].dtype == torch.float32
    assert model.c1.weight.dtype == opt.state[model.c1.weight][key].dtype == torch.bfloat16
    assert not torch.equal(model.bn.weight, w0.float())
    assert any(p is model.bn.weight for p in opt.param_groups[0]["params"])
    wfpass.restore(model)
    step(model)  # eager again, parameters back in bf16
    assert opt.state[model.bn.weight][key].dtype == torch.bfloat16


def test_restore_casts_back():
    model = ConvBN(2).to(torch.bfloat16)
    gm = wf_apply(model)
    gm(model.example(torch.bfloat16))
    objs = [model.bn.weight, model.bn.running_var]
    vals = {k: v.clone() for k, v in bn_tensors(model.bn).items()}
    assert wfpass.restore(model) >= 4
    for k, t in bn_tensors(model.bn).items():
        assert t.dtype == torch.bfloat16, k
        torch.testing.assert_close(t, vals[k].bfloat16(), msg=k)
    assert objs[0] is model.bn.weight and objs[1] is model.bn.running_var
    assert not held_in_fp32(model.bn.running_var)


def test_drift_after_cast_is_detected_and_recast():
    """``model.to(bf16)`` after the pass gives the buffers new bf16 objects:
    the next call casts them again (counted)."""
    model = ConvBN(2).to(torch.bfloat16)
    gm = wf_apply(model)
    gm(model.example(torch.bfloat16))
    model.to(torch.bfloat16)
    assert model.bn.running_var.dtype == torch.bfloat16
    y = gm(model.example(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    assert model.bn.running_var.dtype == model.bn.weight.dtype == torch.float32
    assert wfpass.last_report().find("batchnorm")[0].stats.get("recast", 0) >= 1


def test_idempotent_apply_and_dry_run():
    model = ConvBN(2).to(torch.bfloat16)
    gm = torch.fx.symbolic_trace(model)
    r1 = wfpass.apply(gm)
    code = gm.code
    r2 = wfpass.apply(gm)
    assert gm.code == code
    assert r1.find("batchnorm", "rewritten") and r2.find("batchnorm", "rewritten")[0].detail.get("idempotent")

    probe = ConvBN(2).to(torch.bfloat16)
    rep = wfpass.explain(probe, probe.example(torch.bfloat16))
    assert any(r.pattern == "batchnorm" and "dry run" in r.reason for r in rep)
    assert probe.bn.running_var.dtype == torch.bfloat16


@needs_gpu("needs CUDA (cuDNN mixed-precision BatchNorm)")
def test_cuda_fp16_inductor():
    model = ConvBN(2).half().cuda()
    ref = copy.deepcopy(model)
    ref.bn.float()
    fn = wf_compile(model, inner="inductor")
    x = model.example(torch.float16).cuda()
    torch.testing.assert_close(fn(x), ref(x), rtol=1e-2, atol=1e-2)
    assert model.bn.running_var.dtype == torch.float32
    torch.testing.assert_close(model.bn.running_var, ref.bn.running_var, rtol=1e-4, atol=1e-5)


def test_momentum_none_in_a_sequential_names_the_module_that_stopped_the_compile():
    """A bf16 ``nn.Sequential`` with a ``BatchNorm2d(momentum=None)`` in
    training: Dynamo graph-breaks on ``float(num_batches_tracked)`` inside the
    Sequential's loop, runs the whole model eagerly and calls no backend, so
    no format is applied. The user is told which module did it: a warning
    on the ``wfpass`` logger, ``last_report()``, and ``wfpass.report(model)``
    (before, ``last_report()`` said "nothing compiled yet")."""
    import logging

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3),
                          nn.BatchNorm2d(8, momentum=None)).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager"))
    seen = []

    class Catch(logging.Handler):
        def emit(self, rec):
            seen.append(rec.getMessage())

    handler = Catch(level=logging.WARNING)
    logging.getLogger("wfpass").addHandler(handler)
    try:
        for i in range(2):
            x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
            torch.testing.assert_close(fn(x), ref(x))  # eager either way: bit for bit
    finally:
        logging.getLogger("wfpass").removeHandler(handler)
    assert len([m for m in seen if "'4' (BatchNorm2d, momentum=None" in m]) == 1, seen
    rep = wfpass.last_report()
    (rec,) = rep.records
    assert rec.action == "skipped" and "Dynamo runs the whole model eagerly" in rec.reason and "momentum=0.1" in rec.reason
    assert rec.params == ["4.running_mean", "4.running_var", "4.weight", "4.bias"]
    assert [r.reason for r in wfpass.report(model)] == [rec.reason]
    assert model[4].running_mean.dtype == torch.bfloat16  # nothing converted behind the report's back
