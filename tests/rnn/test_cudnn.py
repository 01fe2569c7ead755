"""RNNs on CUDA inside the compiled graph, as one cuDNN call each
(``wfpass/rnn/cuda/cudnn.py``), checked without a GPU.

A CUDA build of torch (the CPU build refuses CUDA tensors, fake or not)
lets a model be built with ``device="cuda"`` inside ``FakeTensorMode``:
Dynamo captures it, wfpass rewrites it, and the graph that reaches the inner
compiler is read here. Autograd on fake CUDA tensors needs a GPU ("hasPrimaryContext
expects a valid device index"), so the joint forward/backward trace runs on
fake CPU tensors of the same shapes through the same rewritten graph. Tests
marked ``gpu`` need a real one and skip without it.
"""
from __future__ import annotations

import copy
import math
import operator

import pytest
import torch
import torch.nn as nn

import wfpass
from wfpass._torch import kernels
from wfpass.tools.bench_models import built_in_dtype
from wfpass.rnn.cuda import cudnn
from wfpass.rnn.paths import RnnForward
from wfpass.core.storage import fused_storage_of
from wftest import fake_mode as _fake_mode, needs_cuda_build, needs_gpu

gpu = needs_gpu()

VARIANTS = {
    "lstm-2layer": (nn.LSTM, dict(num_layers=2)),
    "lstm-bi-batch_first": (nn.LSTM, dict(bidirectional=True, batch_first=True)),
    "lstm-proj": (nn.LSTM, dict(proj_size=4)),
    "lstm-nobias": (nn.LSTM, dict(bias=False)),
    "gru-2layer-bi": (nn.GRU, dict(num_layers=2, bidirectional=True)),
    "rnn-tanh": (nn.RNN, dict()),
    "rnn-relu-2layer": (nn.RNN, dict(num_layers=2, nonlinearity="relu")),
}
I, H, T, B = 8, 16, 5, 3
#: The option that puts RNNs on CUDA into the graph (default: left to cuDNN eagerly).
CUDNN = {"cuda": "cudnn"}


class Net(nn.Module):
    """An RNN between two linears, with a residual that reads its input twice."""

    def __init__(self, cls, device=None, **kw):
        super().__init__()
        self.inp = nn.Linear(I, I, device=device)
        self.rnn = cls(I, H, device=device, **kw)
        out = (kw.get("proj_size") or H) * (2 if kw.get("bidirectional") else 1)
        self.out = nn.Linear(out, I, device=device)

    def forward(self, x):
        y = self.inp(x)
        h = self.rnn(y + x)[0]
        return self.out(h) + y


class Keep:
    """An inner compiler that keeps the rewritten graphs and runs nothing."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def _cuda_autocast(dtype):
    """``torch.autocast("cuda", dtype)`` without a GPU: its constructor
    turns itself off where ``torch.cuda.is_available()`` is False (a
    warning, no error); on fake CUDA tensors it is wanted on."""
    from unittest import mock

    with mock.patch.object(torch.cuda, "is_available", lambda: True), \
            mock.patch.object(torch.cuda, "is_bf16_supported", lambda *a, **k: True):
        return torch.autocast("cuda", dtype=dtype)


def _input(kw, device):
    return torch.randn((B, T, I) if kw.get("batch_first") else (T, B, I), device=device)


def _capture(variant, train=False):
    cls, kw = VARIANTS[variant]
    keep = Keep()
    with _fake_mode():
        model = Net(cls, device="cuda", **kw).train(train)
        x = _input(kw, "cuda")
        with torch.set_grad_enabled(train):
            torch.compile(model, backend=wfpass.backend(inner=keep, rnn=CUDNN))(x)
    return model, keep


def _run_where_eager_parts_need_a_gpu(fn, x):
    """``fn(x)`` where a part left to eager PyTorch (an RNN Dynamo graph-broke
    on) may need a real GPU: on fake CUDA tensors eager cuDNN reaches the
    driver. That failure is expected without a GPU; the graphs and records
    made before it are what these tests read."""
    try:
        fn(x)
    except Exception as e:  # noqa: BLE001
        if torch.cuda.is_available() or ("CUDA" not in str(e) and "driver" not in str(e)):
            raise


def _rnn_calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, RnnForward)]


@needs_cuda_build
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_captured_on_fake_cuda_as_one_cudnn_call_with_the_flat_buffer(variant):
    model, keep = _capture(variant)
    assert len(keep.graphs) == 1, "a graph break: the RNN was not captured"
    gm = keep.graphs[0]
    calls = _rnn_calls(gm)
    assert len(calls) == 1 and calls[0].target.path == "cudnn", gm.graph
    # No per-step cell ops and no eager RNN entry point left in the graph.
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert not targets & {torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu}, targets
    (rec,) = wfpass.report(model).find("rnn")
    assert rec.action == "rewritten" and "moved into one flat block" in rec.reason, rec.reason
    assert set(rec.detail["paths"].values()) == {"cudnn"}
    # The model's Parameters are the same objects, views of one block.
    ws = [getattr(model.rnn, n) for n in model.rnn._flat_weights_names]
    assert all(isinstance(w, nn.Parameter) for w in ws)
    layouts = [fused_storage_of(w) for w in ws]
    assert all(fs is not None for fs in layouts) and len({id(fs) for fs in layouts}) == 1


@needs_cuda_build
def test_by_default_an_rnn_on_cuda_is_left_to_pytorchs_cudnn_path_and_the_report_says_so():
    keep = Keep()
    with _fake_mode():
        model = Net(nn.LSTM, device="cuda").eval()
        x = _input({}, "cuda")
        with torch.no_grad():
            _run_where_eager_parts_need_a_gpu(torch.compile(model, backend=wfpass.backend(inner=keep)), x)
    assert all(not _rnn_calls(g) for g in keep.graphs)
    (rec,) = wfpass.report(model).find("rnn")
    assert rec.action == "skipped" and "rnn={'cuda': 'cudnn'}" in rec.reason, rec.reason


def test_the_cuda_option_is_checked():
    with pytest.raises(ValueError, match="rnn.cuda"):
        wfpass.backend(rnn={"cuda": "cuDNN"})


def _op_nodes(g, *ops):
    return [n for n in g.graph.nodes if n.op == "call_function" and n.target in ops]


@needs_cuda_build
@pytest.mark.parametrize("train", [True, False])
def test_dropout_between_layers_is_cudnns_in_training_and_off_in_eval(train):
    """Dropout between layers goes to cuDNN with the op (its p in the call)
    in training, with or without grad, as eager's cuDNN call; in eval the
    op gets p = 0. The joint trace of a training step holds the op with p
    and the backward op with the same p."""
    keep = Keep()
    with _fake_mode():
        model = Net(nn.LSTM, device="cuda", num_layers=2, dropout=0.3).train(train)
        torch.compile(model, backend=wfpass.backend(inner=keep, rnn=CUDNN))(_input({}, "cuda"))
    (gm,) = keep.graphs
    assert len(_rnn_calls(gm)) == 1
    (rec,) = wfpass.report(model).find("rnn")
    assert rec.action == "rewritten", rec.reason
    graphs = _joint_trace(gm)
    (fw,) = _op_nodes(graphs["fw"], torch.ops.wfpass.cudnn_rnn.default, torch.ops.wfpass.cudnn_rnn_fw.default)
    p = fw.args[11]
    assert p == (0.3 if train else 0.0), fw.args
    (bw,) = _op_nodes(graphs["bw"], torch.ops.wfpass.cudnn_rnn_backward.default)
    assert bw.args[16] == p
    # Random: the compiler may neither merge two calls nor recompute one.
    assert torch.Tag.nondeterministic_seeded in torch.ops.wfpass.cudnn_rnn.default.tags


def _cpu_twin_inputs(gm, example, mode=None):
    """Fake CPU tensors of the same shapes and strides as the graph's inputs
    (symbolic sizes kept: made in the fake mode that holds them); other
    inputs (SymInts) as they are."""
    return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu").normal_()
            if isinstance(t, torch.Tensor) else t for t in example]


def _joint_trace(gm, region=None, compile_graph=None, decompositions=None):
    """AOTAutograd's forward and backward graphs of ``gm`` (a graph captured
    on fake CUDA), traced on fake CPU twins of its inputs (autograd on fake
    CUDA needs a driver), inside ``region`` (e.g. the autocast the graph was
    captured in): ``{"fw": graph, "bw": graph}``. ``compile_graph(g,
    example)`` is also called on each (an Inductor compile, say)."""
    import contextlib

    from functorch.compile import aot_function, make_boxed_func

    example = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
    graphs = {}

    def keep_as(name):
        def compiler(g, ex):
            graphs[name] = g
            if compile_graph is not None:
                compile_graph(g, ex)
            return make_boxed_func(g.forward)
        return compiler

    with _fake_mode():
        args = [a.requires_grad_(e.requires_grad) for a, e in zip(_cpu_twin_inputs(gm, example), example)]
        with region if region is not None else contextlib.nullcontext():
            outs = aot_function(gm, fw_compiler=keep_as("fw"), bw_compiler=keep_as("bw"),
                                **({"decompositions": decompositions} if decompositions else {}))(*args)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        sum(o.float().sum() for o in outs if o.requires_grad).backward()
        graphs["grads"] = [a.grad for a in args if a.requires_grad]
    return graphs


@needs_cuda_build
@pytest.mark.parametrize("variant", ["lstm-2layer", "gru-2layer-bi", "lstm-proj", "lstm-bi-batch_first"])
def test_joint_trace_holds_the_op_forward_and_its_backward(variant):
    """AOTAutograd's joint trace of the rewritten graph: the forward graph
    calls the cuDNN op once, the backward graph its backward op once, and no
    per-step ops appear in either."""
    cls, kw = VARIANTS[variant]
    keep = Keep()
    with _fake_mode():
        model = Net(cls, device="cuda", **kw).train()
        torch.compile(model, backend=wfpass.backend(inner=keep, rnn=CUDNN))(_input(kw, "cuda"))
    graphs = _joint_trace(keep.graphs[0])

    def count(g, op):
        return sum(1 for n in g.graph.nodes if n.op == "call_function" and n.target is op)

    assert count(graphs["fw"], torch.ops.wfpass.cudnn_rnn.default) == 1, graphs["fw"].graph
    assert count(graphs["bw"], torch.ops.wfpass.cudnn_rnn_backward.default) == 1, graphs["bw"].graph
    for g in (graphs["fw"], graphs["bw"]):
        names = {str(n.target) for n in g.graph.nodes if n.op == "call_function"}
        assert not any("lstm" in s or "gru" in s or "rnn_tanh" in s for s in names), names


@needs_cuda_build
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_op_outputs_have_the_shapes_and_strides_of_atens_cudnn_rnn(variant):
    """The op's fake against ``aten._cudnn_rnn``'s own meta kernel, time-major
    (the op never runs batch-first: a transpose in the graph does)."""
    cls, kw = VARIANTS[variant]
    with _fake_mode():
        m = cls(I, H, device="cuda", **{k: v for k, v in kw.items() if k != "batch_first"})
        ws = list(m._flat_weights)
        x = torch.randn(T, B, I, device="cuda")
        D = 2 if m.bidirectional else 1
        out_h = m.proj_size or H
        hx = torch.zeros(m.num_layers * D, B, out_h, device="cuda")
        cx = torch.zeros(m.num_layers * D, B, H, device="cuda") if cls is nn.LSTM else None
        mode = kernels.CUDNN_MODES[m.mode]
        per = len(ws) // (m.num_layers * D)
        ref = kernels.cudnn_rnn(x, ws, per, None, hx, cx, mode, H, m.proj_size, m.num_layers, False, 0.0, False,
                                m.bidirectional, [], None)
        got = torch.ops.wfpass.cudnn_rnn_fw(x, ws, hx, cx, mode, H, m.proj_size, m.num_layers, False,
                                            m.bidirectional, [], 0.0)
    for i in (0, 1) + ((2,) if cls is nn.LSTM else ()):
        assert got[i].shape == ref[i].shape and got[i].stride() == ref[i].stride(), (i, got[i].shape, ref[i].shape)
        assert got[i].device.type == "cuda" and got[i].dtype == ref[i].dtype


class TwoRnns(nn.Module):
    """An LSTM feeding a GRU, with a residual around the GRU."""

    def __init__(self, device=None):
        super().__init__()
        self.lstm = nn.LSTM(I, H, num_layers=2, device=device)
        self.gru = nn.GRU(H, H, bidirectional=True, batch_first=True, device=device)
        self.out = nn.Linear(2 * H, H, device=device)

    def forward(self, x):
        h = self.lstm(x)[0].transpose(0, 1)
        return self.out(self.gru(h)[0]) + h


def _op_calls(code, op):
    return code.count(f"torch.ops.wfpass.{op}.default(")


@needs_cuda_build
@pytest.mark.parametrize("variant", ["lstm-2layer", "lstm-bi-batch_first", "gru-2layer-bi", "lstm-proj"])
def test_inductors_cuda_code_calls_cudnn_once_per_rnn(variant):
    """Inductor's wrapper code for the inference graph, written for an H100
    without one (``wfpass._torch.fake_cuda``): the op is one extern call on
    CUDA buffers, no per-step kernel loop around it."""
    from wfpass._torch.fake_cuda import inductor_wrapper_code, stopped_after_codegen

    cls, kw = VARIANTS[variant]
    torch._dynamo.reset()
    with inductor_wrapper_code() as codes, _fake_mode():
        model = Net(cls, device="cuda", **kw).eval()
        with torch.no_grad(), pytest.raises(Exception) as err:
            torch.compile(model, backend=wfpass.backend(rnn=CUDNN))(_input(kw, "cuda"))
    assert stopped_after_codegen(err.value), err.value
    (code,) = codes
    assert _op_calls(code, "cudnn_rnn_fw") == 1, code
    assert "device='cuda:0'" in code and "lstm_cell" not in code and "for " not in code.split("def call")[1], code


@needs_cuda_build
def test_inductors_cuda_code_for_two_rnns_has_two_calls():
    from wfpass._torch.fake_cuda import inductor_wrapper_code

    torch._dynamo.reset()
    with inductor_wrapper_code() as codes, _fake_mode():
        model = TwoRnns(device="cuda").eval()
        with torch.no_grad(), pytest.raises(Exception):
            torch.compile(model, backend=wfpass.backend(rnn=CUDNN))(torch.randn(T, B, I, device="cuda"))
    (code,) = codes
    assert _op_calls(code, "cudnn_rnn_fw") == 2, code
    assert len(wfpass.report(model).find("rnn")) == 2


@needs_cuda_build
def test_inductor_compiles_the_training_graphs_with_one_forward_and_one_backward_call():
    """The training step through Inductor: AOTAutograd's forward and
    backward graphs (traced on fake CPU twins, see the module docstring),
    each compiled by Inductor to wrapper code that calls the op once."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table

    from wfpass._torch.fake_cuda import inductor_wrapper_code, stopped_after_codegen

    cls, kw = VARIANTS["lstm-2layer"]
    keep = Keep()
    with _fake_mode():
        model = Net(cls, device="cuda", **kw).train()
        torch.compile(model, backend=wfpass.backend(inner=keep, rnn=CUDNN))(_input(kw, "cuda"))

    def inductor(g, ex):
        try:
            compile_fx_inner(g, ex)
        except Exception as e:  # noqa: BLE001
            if not stopped_after_codegen(e):
                raise

    with inductor_wrapper_code() as codes:
        _joint_trace(keep.graphs[0], compile_graph=inductor, decompositions=select_decomp_table())
    assert len(codes) == 2, len(codes)
    fw_code, bw_code = codes
    assert _op_calls(fw_code, "cudnn_rnn") + _op_calls(fw_code, "cudnn_rnn_fw") == 1, fw_code
    assert _op_calls(bw_code, "cudnn_rnn_backward") == 1, bw_code


@needs_cuda_build
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["lstm-2layer", "gru-2layer-bi", "lstm-proj"])
def test_under_cuda_autocast_the_rnn_runs_in_fp16_as_eager_cudnn_does(variant, dtype):
    """Eager PyTorch runs a cuDNN RNN in fp16 inside any CUDA autocast region
    (AutocastRNN.cpp): so does the op, reading one fp16 block cast in the
    graph; the linears around it follow autocast's own rules."""
    cls, kw = VARIANTS[variant]
    keep = Keep()
    with _fake_mode():
        model = Net(cls, device="cuda", **kw).eval()
        with torch.no_grad(), _cuda_autocast(dtype):
            out = torch.compile(model, backend=wfpass.backend(inner=keep, rnn=CUDNN))(_input(kw, "cuda"))
    assert len(keep.graphs) == 1 and len(_rnn_calls(keep.graphs[0])) == 1
    assert out.dtype == dtype  # the last linear's autocast dtype, fed the fp16 RNN output
    seen = {}

    def spy(*args):
        seen["dtypes"] = {args[0].dtype} | {w.dtype for w in args[1]}
        return real(*args)

    real = torch.ops.wfpass.cudnn_rnn_fw.default
    spec = _rnn_calls(keep.graphs[0])[0].target.spec
    with _fake_mode():
        x = torch.randn(T, B, I, device="cuda", dtype=dtype)
        ws = [torch.randn(w.shape, device="cuda") for w in model.rnn._flat_weights]
        hx = [None] * (2 if cls is nn.LSTM else 1)
        with _cuda_autocast(dtype):
            x16, hx16, ws16 = cudnn.autocast_half(spec, x, hx, ws)
        out16 = real(x16, ws16, None, None, kernels.CUDNN_MODES[spec.mode], spec.hidden_size, spec.proj_size,
                     spec.num_layers, False, spec.bidirectional, list(spec.offsets), 0.0)
    assert {x16.dtype, out16[0].dtype} | {w.dtype for w in ws16} == {torch.float16}
    # One block: each weight at its offset, as the op's flat-buffer check wants.
    assert cudnn.flat_buffer(ws16, spec.offsets) is not None


@needs_cuda_build
def test_a_dtype_mismatch_fails_when_traced_not_on_the_gpu():
    with _fake_mode():
        m = nn.LSTM(I, H, device="cuda")
        x = torch.randn(T, B, I, device="cuda", dtype=torch.float16)
        with pytest.raises(RuntimeError, match="one dtype"):
            torch.ops.wfpass.cudnn_rnn_fw(x, list(m._flat_weights), None, None, kernels.CUDNN_MODES["LSTM"], H, 0,
                                          1, False, False, [], 0.0)


@needs_cuda_build
def test_autocast_training_trace_casts_the_weights_once_and_differentiates_through_the_cast():
    """The joint trace under CUDA autocast (fake CPU twins, as above): the
    forward graph casts the fp32 weights into one fp16 block for the op; the
    backward graph calls the backward op and returns fp32 weight gradients."""
    cls, kw = VARIANTS["lstm-2layer"]
    keep = Keep()
    with _fake_mode():
        model = Net(cls, device="cuda", **kw).train()
        with _cuda_autocast(torch.bfloat16):
            torch.compile(model, backend=wfpass.backend(inner=keep, rnn=CUDNN))(_input(kw, "cuda"))
    # In the region the graph was captured in.
    graphs = _joint_trace(keep.graphs[0], region=_cuda_autocast(torch.bfloat16))
    grads = graphs["grads"]
    fw_ops = [n for n in graphs["fw"].graph.nodes if n.op == "call_function"]
    (op,) = [n for n in fw_ops if n.target is torch.ops.wfpass.cudnn_rnn.default]
    assert op.meta["val"][0].dtype == torch.float16
    assert sum(1 for n in fw_ops if n.target is torch.ops.aten.cat.default) == 1
    bw_ops = [n.target for n in graphs["bw"].graph.nodes if n.op == "call_function"]
    assert bw_ops.count(torch.ops.wfpass.cudnn_rnn_backward.default) == 1
    assert grads and all(g is not None and g.dtype == torch.float32 for g in grads)


@needs_cuda_build
def test_reduce_overhead_puts_the_whole_inference_graph_rnn_included_under_cuda_graphs():
    """``mode="reduce-overhead"`` reaches Inductor through wformat; Inductor
    finds nothing in the graph that CUDA graphs cannot hold: no skip, and
    where it partitions graphs around such ops (torch 2.15), one partition."""
    from torch._dynamo.utils import counters

    from wfpass._torch.fake_cuda import inductor_wrapper_code

    torch._dynamo.reset()
    counters.clear()
    with inductor_wrapper_code() as codes, _fake_mode():
        model = Net(nn.LSTM, device="cuda", num_layers=2).eval()
        compiled = torch.compile(model, backend=wfpass.backend(rnn=CUDNN), mode="reduce-overhead")
        with torch.no_grad(), pytest.raises(Exception):  # the first call needs the GPU
            compiled(_input({}, "cuda"))
    (code,) = codes
    assert codes.cudagraphs == [True] and _op_calls(code, "cudnn_rnn_fw") == 1
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert "partition_1" not in code


@needs_cuda_build
def test_nothing_keeps_a_static_training_step_out_of_cuda_graphs():
    """The training graphs (AOTAutograd, fake CPU twins as above) against
    Inductor's own test for what CUDA graphs cannot hold: nothing."""
    from wfpass._torch.fake_cuda import cudagraph_blocker

    keep = Keep()
    with _fake_mode():
        model = Net(nn.LSTM, device="cuda", num_layers=2).train()
        torch.compile(model, backend=wfpass.backend(inner=keep, rnn=CUDNN))(_input({}, "cuda"))
    graphs = _joint_trace(keep.graphs[-1])
    assert {name: cudagraph_blocker(graphs[name]) for name in ("fw", "bw")} == {"fw": None, "bw": None}


def test_with_a_symbolic_length_the_training_reserve_keeps_the_graph_out_of_cuda_graphs():
    """cuDNN's training reserve has a size only the GPU knows: for a
    symbolic T or batch the op's fake gives it a size known at run time,
    and Inductor leaves such a graph out of CUDA graphs (the limit
    docs/rnn.md states). Inference has no reserve and is not affected."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from wfpass._torch.fake_cuda import cudagraph_blocker

    m = nn.LSTM(I, H)
    ws = [w.detach() for w in m._flat_weights]
    mode = kernels.CUDNN_MODES["LSTM"]

    def call(train):
        def f(x, *ws):
            return torch.ops.wfpass.cudnn_rnn_fw(x, list(ws), None, None, mode, H, 0, 1, train, False, [], 0.0)[0]
        return make_fx(f, tracing_mode="symbolic")(torch.randn(T, B, I), *ws)

    blocker = cudagraph_blocker(call(True))
    assert blocker is not None and "cudnn_rnn_fw" in blocker, blocker
    assert cudagraph_blocker(call(False)) is None


@needs_cuda_build
@pytest.mark.parametrize("variant", ["lstm-2layer", "lstm-bi-batch_first", "lstm-proj", "gru-2layer-bi",
                                     "rnn-relu-2layer"])
def test_a_new_length_after_the_recompile_is_served_by_the_symbolic_graph(variant):
    """Five lengths in inference: Dynamo's static first graph, then one
    graph with T symbolic for the other four (on a GPU, torch 2.11, each
    length was its own graph: torch's decomposition of ``torch.lstm``
    unrolls the sequence on CUDA, and its example value fixed T). Then
    three training lengths, a graph each. Each graph's RNN is one cuDNN call."""
    cls, kw = VARIANTS[variant]
    keep = Keep()
    with _fake_mode():
        model = Net(cls, device="cuda", **kw)
        fn = torch.compile(model, backend=wfpass.backend(inner=keep, rnn=CUDNN))

        def x_of(steps, grad=False):
            shape = (B, steps, I) if kw.get("batch_first") else (steps, B, I)
            return torch.randn(shape, device="cuda", requires_grad=grad)

        with torch.no_grad():
            for steps in (4, 7, 9, 40, 5):
                fn(x_of(steps))
        assert len(keep.graphs) == 2, f"{len(keep.graphs)} graphs for 5 lengths: the length was specialized"
        for steps in (6, 11, 13):
            fn(x_of(steps, grad=True))
    # Training specializes each length, as documented: cuDNN's training
    # reserve has a size only cuDNN knows, and Dynamo's shape environment
    # refuses sizes known at run time (unless capture_dynamic_output_shape_ops).
    assert len(keep.graphs) == 5, f"{len(keep.graphs)} graphs"
    for gm in keep.graphs:
        calls = _rnn_calls(gm)
        assert len(calls) == 1 and calls[0].target.path == "cudnn", gm.graph
    (rec,) = wfpass.report(model).find("rnn", "rewritten")
    assert "T=symbolic" in rec.detail["paths"], rec.detail


def test_the_cuda_example_values_leave_the_cpu_and_other_backends_alone():
    """Outside a wformat trace with RNNs on cuDNN, ``torch.lstm``'s example
    value is torch's own: eager calls run as before, and a CPU trace for
    wformat keeps its length symbolic as it always did."""
    import wfpass.capture  # noqa: F401  (installs the example values)
    from wfpass._torch import rnn_fake

    m = nn.LSTM(I, H)
    x = torch.randn(T, B, I)
    torch.testing.assert_close(torch.lstm(x, [torch.zeros(1, B, H)] * 2, m._flat_weights, True, 1, 0.0, False,
                                          False, False)[0], m(x)[0])
    assert not rnn_fake._in_dynamo_fake_prop(x)


def test_the_layout_without_a_gpu_matches_every_layout_recorded_on_a_gpu():
    """cuDNN 9 puts every layer's matrices first and the biases after them,
    and keeps the bias space of an RNN without biases: the buffer can end
    past the last weight. The rule wfpass follows without a GPU, against
    the layouts cuDNN gave on an H200 (``benchmarks/gpu/probe_cudnn_layout.py``):
    every mode, 1-3 layers, bidirectional, projections, no biases, fp32 and
    fp16, two sizes."""
    import json
    import pathlib

    from wfpass.rnn.guards import cudnn_layout_without_gpu

    doc = json.loads((pathlib.Path(__file__).parents[1] / "data" / "cudnn_layouts.json").read_text())
    gates = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}
    assert len(doc["entries"]) == 240 and doc["cudnn"] >= 90000
    past_the_weights = set()
    for e in doc["entries"]:
        kw = e["kwargs"]
        pseudo = kw["num_layers"] * (2 if kw["bidirectional"] else 1)
        offsets, numel = cudnn_layout_without_gpu([tuple(s) for s in e["shapes"]], pseudo,
                                                  gates[e["mode"]] * e["hidden_size"])
        assert (list(offsets), numel) == (e["offsets"], e["numel"]), e
        if numel > sum(math.prod(s) for s in e["shapes"]):
            past_the_weights.add(kw["bias"])
        if kw["bias"] and kw["num_layers"] > 1:  # a later layer's matrix before the first layer's bias
            assert e["offsets"][4] < e["offsets"][2]
    assert past_the_weights == {False}  # only an RNN without biases keeps space past its weights


@needs_cuda_build
def test_fake_cuda_rnn_without_biases_gets_cudnns_buffer_size():
    """On fake CUDA the fused block of an RNN without biases has cuDNN's
    size (the zero bias space included), so the op's buffer is the one
    cuDNN checks against."""
    with _fake_mode():
        model = Net(nn.LSTM, device="cuda", bias=False).eval()
        with torch.no_grad():
            torch.compile(model, backend=wfpass.backend(inner=Keep(), rnn=CUDNN))(_input({}, "cuda"))
    fs = fused_storage_of(model.rnn.weight_ih_l0)
    ws = list(model.rnn._flat_weights)
    assert fs is not None and fs.numel == sum(w.numel() for w in ws) + 2 * 4 * H


def test_autocast_block_follows_cudnns_order_and_size():
    """Under CUDA autocast the fp16 block is one ``cat``: in offset order
    (biases after the matrices, not in the list's order), zeros in gaps and
    up to the buffer's size. On the CPU, with autocast reported on."""
    from types import SimpleNamespace
    from unittest import mock

    # a layer's w_ih, w_hh, b_ih, b_hh, then the next layer's w_ih, which
    # cuDNN puts before the first layer's biases; a gap, and space at the end
    ws = [torch.randn(8, 2), torch.randn(8, 4), torch.randn(8), torch.randn(8), torch.randn(8, 4)]
    spec = SimpleNamespace(offsets=(0, 16, 84, 92, 48), numel=104)
    with mock.patch.object(torch, "is_autocast_enabled", lambda *a: True):
        x, hx, got = cudnn.autocast_half(spec, torch.randn(3, 1, 2), [], ws)
    base = got[0].storage_offset()
    assert got[0].untyped_storage().nbytes() == 104 * 2 and x.dtype == torch.float16
    for w, g, off in zip(ws, got, spec.offsets):
        assert g.dtype == torch.float16 and g.storage_offset() - base == off and torch.equal(g, w.half())
    flat = torch.empty(0, dtype=torch.float16).set_(got[0].untyped_storage(), base, (104,))
    assert torch.equal(flat[80:84], torch.zeros(4, dtype=torch.float16))  # the gap
    assert torch.equal(flat[100:], torch.zeros(4, dtype=torch.float16))  # up to the buffer's size


def test_dropout_state_is_made_with_the_modules_p():
    """cuDNN's dropout state is made with ``p > 0`` (``p == 0`` trips an
    internal assert in ``_cudnn_init_dropout_state``, seen on an H200,
    torch 2.11.0): the op passes its dropout on. Without a GPU, with the
    CUDA generator and the state's maker stood in for."""
    from unittest import mock

    made = []

    class Gen:
        def initial_seed(self):
            return 7

        def get_offset(self):
            return 0

    cudnn._DROPOUT_STATES.clear()
    with mock.patch.object(torch.cuda, "default_generators", (Gen(),)), \
            mock.patch.object(torch.cuda, "current_device", lambda: 0), \
            mock.patch.object(torch, "randint", lambda *a, **k: torch.tensor([5])), \
            mock.patch.object(kernels, "cudnn_dropout_state", lambda dev, seed, p: made.append(p) or torch.empty(0)):
        p, state = cudnn.dropout_args(torch.empty(0), True, 0.25)
    cudnn._DROPOUT_STATES.clear()
    assert p == 0.25 and made == [0.25]


def test_flat_buffer_found_only_where_every_weight_sits_at_its_offset():
    block = torch.zeros(40)
    a, b, c = block[0:12].view(3, 4), block[12:20].view(2, 4), block[20:24]
    buf = cudnn.flat_buffer([a, b, c], [0, 12, 20])
    assert buf is not None and buf.numel() == 24 and buf.data_ptr() == block.data_ptr()
    assert cudnn.flat_buffer([a, b, c], [0, 12, 21]) is None  # a weight not where cuDNN reads it
    assert cudnn.flat_buffer([a, b.clone(), c], [0, 12, 20]) is None  # another storage
    assert cudnn.flat_buffer([a, block[12:20].view(4, 2).t(), c], [0, 12, 20]) is None  # not contiguous
    # with the buffer's size as a last entry: the buffer ends there, past the
    # last weight (cuDNN's bias space of an RNN without biases)
    assert cudnn.flat_buffer([a, b, c], [0, 12, 20, 30]).numel() == 30
    assert cudnn.flat_buffer([a, b, c], [0, 12, 20, 41]) is None  # past the storage


# -- on a GPU ---------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_equal_to_eager_cudnn_forward_and_backward_on_a_gpu(variant):
    cls, kw = VARIANTS[variant]
    torch.manual_seed(0)
    model = Net(cls, device="cuda", **kw).train()
    ref = copy.deepcopy(model)
    x = _input(kw, "cuda")
    out = torch.compile(model, backend=wfpass.backend(inner="aot_eager", rnn=CUDNN))(x)
    expected = ref(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    R = torch.randn_like(out)
    (out * R).sum().backward()
    (expected * R).sum().backward()
    scale = max(p.grad.abs().max().item() for p in ref.parameters())
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-4 * scale, n
    assert set(wfpass.report(model).find("rnn")[0].detail["paths"].values()) == {"cudnn"}


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["lstm-2layer", "gru-2layer-bi", "lstm-proj"])
def test_under_autocast_equal_to_eager_cudnn_on_a_gpu(variant, dtype):
    cls, kw = VARIANTS[variant]
    torch.manual_seed(0)
    model = Net(cls, device="cuda", **kw).train()
    ref = copy.deepcopy(model)
    x = _input(kw, "cuda")
    compiled = torch.compile(model, backend=wfpass.backend(inner="aot_eager", rnn=CUDNN))
    with torch.autocast("cuda", dtype=dtype):
        out, expected = compiled(x), ref(x)
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    R = torch.randn_like(out, dtype=torch.float32)
    (out.float() * R).sum().backward()
    (expected.float() * R).sum().backward()
    scale = max(p.grad.abs().max().item() for p in ref.parameters())
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32 and (p.grad - q.grad).abs().max().item() <= 2e-2 * scale, n


@gpu
def test_dropout_in_training_on_a_gpu_is_seeded_and_differentiated_right():
    """Dropout masks are cuDNN's: not eager's draws, so compared by their
    properties. Reproducible after ``torch.manual_seed``, different from
    call to call, eval equal to eager; and the gradient is the derivative
    of the function the forward computed (same seed: the same masks),
    checked against central differences in float64."""
    torch.manual_seed(0)
    model = built_in_dtype(torch.float64, lambda: Net(nn.LSTM, device="cuda", num_layers=3, dropout=0.5)).train()
    ref = copy.deepcopy(model).eval()
    compiled = torch.compile(model, backend=wfpass.backend(inner="aot_eager", rnn=CUDNN))
    x = _input({}, "cuda").double().requires_grad_()

    def run(seed, inp):
        torch.manual_seed(seed)
        return compiled(inp)

    a, b, c = run(1, x), run(1, x), run(2, x)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(compiled(x), compiled(x))
    R = torch.randn_like(a)
    (a * R).sum().backward()
    d = torch.randn_like(x)
    eps = 1e-6
    with torch.no_grad():
        fd = ((run(1, x + eps * d) * R).sum() - (run(1, x - eps * d) * R).sum()) / (2 * eps)
    torch.testing.assert_close((x.grad * d).sum(), fd, rtol=1e-4, atol=1e-6)
    model.eval()
    torch.testing.assert_close(compiled(x), ref(x), rtol=1e-7, atol=1e-9)


@gpu
def test_the_layout_without_a_gpu_is_cudnns():
    """Without a GPU wfpass computes cuDNN's layout by rule
    (``cudnn_layout_without_gpu``); on a GPU it asks cuDNN. They must agree,
    or a model traced on fake CUDA describes a buffer cuDNN would read
    wrongly."""
    from wfpass.rnn.guards import cudnn_layout_without_gpu

    for variant, (cls, kw) in VARIANTS.items():
        m = cls(I, H, device="cuda", **{k: v for k, v in kw.items() if k != "batch_first"})
        ws = list(m._flat_weights)
        D = 2 if m.bidirectional else 1
        per = len(ws) // (m.num_layers * D)
        got = kernels.cudnn_flat_layout(ws, per, I, m.mode, H, m.proj_size, m.num_layers, False, m.bidirectional)
        assert got is not None, variant
        rule = cudnn_layout_without_gpu([tuple(w.shape) for w in ws], m.num_layers * D, ws[0].shape[0])
        assert (list(got[0]), got[1]) == (list(rule[0]), rule[1]), variant


class CellLoop(nn.Module):
    """A Python loop of cell steps, two layers, outputs stacked."""

    def __init__(self, cell, device=None):
        super().__init__()
        self.c1, self.c2 = cell(I, H, device=device), cell(H, H, device=device)

    def forward(self, x):
        s1 = s2 = None
        outs = []
        for t in range(x.shape[0]):
            s1 = self.c1(x[t]) if s1 is None else self.c1(x[t], s1)
            h1 = s1[0] if isinstance(s1, tuple) else s1
            s2 = self.c2(h1) if s2 is None else self.c2(h1, s2)
            outs.append(s2[0] if isinstance(s2, tuple) else s2)
        return torch.stack(outs)


@needs_cuda_build
@pytest.mark.parametrize("cell", [nn.LSTMCell, nn.GRUCell, nn.RNNCell])
def test_a_folded_cell_loop_on_fake_cuda_becomes_the_same_cudnn_call(cell):
    keep = Keep()
    with _fake_mode():
        model = CellLoop(cell, device="cuda")
        x = torch.randn(T, B, I, device="cuda")
        try:
            model.c1(x[0])  # does this torch trace the cell on fake CUDA without a GPU?
        except RuntimeError as e:
            if torch.cuda.is_available():
                raise
            pytest.skip(f"torch {torch.__version__} runs {cell.__name__} on fake CUDA only with a GPU: "
                        f"{str(e).splitlines()[0][:100]}")
        torch.compile(model, backend=wfpass.backend(inner=keep, rnn=CUDNN))(x)
    assert len(keep.graphs) == 1
    calls = _rnn_calls(keep.graphs[0])
    assert [c.target.path for c in calls] == ["cudnn"], keep.graphs[0].graph
    targets = {n.target for n in keep.graphs[0].graph.nodes if n.op == "call_function"}
    assert not targets & {torch.lstm_cell, torch.gru_cell, torch.rnn_tanh_cell}, targets


@needs_cuda_build
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rnns_on_fake_cuda_are_one_cudnn_call_in_their_dtype(dtype):
    keep = Keep()
    with _fake_mode():
        model = built_in_dtype(dtype, lambda: Net(nn.LSTM, device="cuda", num_layers=2))
        x = torch.randn(T, B, I, device="cuda", dtype=dtype)
        torch.compile(model, backend=wfpass.backend(inner=keep, rnn=CUDNN))(x)
        with torch.no_grad():
            got = torch.ops.wfpass.cudnn_rnn_fw(x, list(model.rnn._flat_weights), None, None, 2, H, 0, 2, False,
                                                False, [], 0.0)
    (call,) = _rnn_calls(keep.graphs[0])
    assert call.target.path == "cudnn"
    assert got[0].dtype == dtype and got[1].dtype == dtype


class QKVBatchNorm(nn.Module):
    """Sibling linears reading one input, then a BatchNorm, in bf16."""

    def __init__(self, d=32):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x):
        return self.bn(self.q(x) * torch.sigmoid(self.k(x)) + self.v(x)) + x


@needs_cuda_build
@pytest.mark.parametrize("train", [False, True])
def test_linear_and_batchnorm_formats_on_fake_cuda(train):
    keep = Keep()
    with _fake_mode():
        with torch.device("cuda"):
            model = built_in_dtype(torch.bfloat16, QKVBatchNorm).train(train)
        x = torch.randn(8, 32, device="cuda", dtype=torch.bfloat16)
        with torch.set_grad_enabled(train):
            torch.compile(model, backend=wfpass.backend(inner=keep))(x)
    assert len(keep.graphs) == 1
    rep = wfpass.report(model)
    (lin,) = rep.find("linear", "rewritten")
    assert set(lin.params) == {f"{m}.{p}" for m in "qkv" for p in ("weight", "bias")}
    (bn,) = rep.find("batchnorm", "rewritten")
    assert model.bn.running_var.dtype == torch.float32 and model.bn.weight.dtype == torch.float32
    assert model.q.weight.device.type == "cuda"


def test_weight_grads_are_views_of_cudnns_gradient_buffer_in_every_recorded_layout():
    """cuDNN's backward writes the weights' gradients into one buffer laid
    out like the weight buffer and returns views of it. For every layout
    recorded on a GPU (``tests/data/cudnn_layouts.json``), the backward op
    hands that buffer on without a copy and each weight's gradient is a
    view of it at the weight's own offset, with the values cuDNN wrote."""
    import json
    import math
    import pathlib

    doc = json.loads((pathlib.Path(__file__).parents[1] / "data" / "cudnn_layouts.json").read_text())
    for e in doc["entries"]:
        shapes = [tuple(s) for s in e["shapes"]]
        offsets = list(e["offsets"]) + [e["numel"]]
        weights = [torch.empty(s) for s in shapes]
        # What _cudnn_rnn_backward returns: views of one gradient buffer at
        # the layout's offsets, each filled with a value of its own.
        buf = torch.full((e["numel"],), float("nan"))
        dw = []
        for i, (s, off) in enumerate(zip(shapes, e["offsets"])):
            g = buf.narrow(0, off, math.prod(s)).view(s)
            g.fill_(i + 1)
            dw.append(g)
        flat = cudnn.grad_buffer(dw, weights, offsets, torch.empty(0))
        assert flat.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr(), "copied"
        assert flat.numel() == e["numel"]
        grads = cudnn.weight_grads(flat, weights, offsets)
        for i, (g, w) in enumerate(zip(grads, weights)):
            assert g.shape == w.shape and g.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
            assert bool((g == i + 1).all())


def test_weight_grads_not_at_their_offsets_are_copied_into_place():
    weights = [torch.empty(2, 3), torch.empty(4)]
    offsets = [4, 0, 10]  # the bias first, then the matrix, size 10
    dw = [torch.full((2, 3), 1.0), torch.full((4,), 2.0)]  # separate tensors
    flat = cudnn.grad_buffer(dw, weights, offsets, torch.empty(0))
    assert flat.tolist() == [2.0] * 4 + [1.0] * 6
    g0, g1 = cudnn.weight_grads(flat, weights, offsets)
    assert g0.tolist() == [[1.0] * 3] * 2 and g1.tolist() == [2.0] * 4
