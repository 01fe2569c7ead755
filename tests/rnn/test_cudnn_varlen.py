"""cuDNN's packed mode (``wfpass/rnn/cuda/cudnn_varlen.py``): an RNN over a
PackedSequence on CUDA as one ``wfpass::cudnn_packed_rnn`` call reading the
flat weight buffer, and one ``wfpass::cudnn_packed_rnn_backward``.

Checked without a GPU as ``tests/rnn/test_cudnn.py`` does: a CUDA build of
torch makes fake CUDA tensors (the CPU build cannot: every test here that
needs them skips there). Autograd on fake CUDA tensors needs a driver, so
joint forward/backward traces run on fake CPU tensors of the same shapes
(the op's fake and formula do not depend on the device); forward-only
traces run on fake CUDA. Tests marked ``gpu`` compare against eager's
packed cuDNN call and skip without a GPU.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import wfpass
from wfpass._torch import kernels
from wfpass._torch.tensors import fake_tensor_type
from wfpass.rnn.cuda.cudnn_varlen import cudnn_packed_call
from wfpass.rnn.guards import cudnn_layout_without_gpu
from wfpass.rnn.varlen.sequence import PackedRnnForward
from wfpass.rnn.varlen.meta import note_batch
from wfpass.rnn.spec import GATES, RnnSpec, flat_weight_names, rnn_mode
from wftest import fake_mode as _fake_mode, needs_cuda_build, needs_gpu

gpu = needs_gpu()

I, H = 8, 16
LENGTHS = [5, 4, 4, 2, 1]  # longest first (a PackedSequence's order)
BATCH_SIZES = [5, 4, 4, 3, 1]  # of LENGTHS
CUDNN = {"cuda": "cudnn"}
KINDS = {
    "lstm": (nn.LSTM, dict(num_layers=2, bidirectional=True)),
    "gru": (nn.GRU, dict(num_layers=2, bidirectional=True)),
    "rnn": (nn.RNN, dict(num_layers=2, bidirectional=True)),
    "lstm-proj": (nn.LSTM, dict(proj_size=4)),
}
OPS = torch.ops.wfpass


def _spec(rnn: nn.Module) -> RnnSpec:
    """The spec the format makes for ``rnn``, with cuDNN's layout (asked of
    cuDNN on a GPU, by rule without one)."""
    mode = rnn_mode(rnn)
    ws = [getattr(rnn, n) for n in flat_weight_names(rnn)]
    D = 2 if rnn.bidirectional else 1
    layout = None
    if torch.cuda.is_available() and ws[0].is_cuda and not isinstance(ws[0], fake_tensor_type()):
        layout = kernels.cudnn_flat_layout(ws, len(ws) // (rnn.num_layers * D), rnn.input_size, mode,
                                           rnn.hidden_size, rnn.proj_size, rnn.num_layers, False, rnn.bidirectional)
    if layout is None:
        layout = cudnn_layout_without_gpu([tuple(w.shape) for w in ws], rnn.num_layers * D,
                                          GATES[mode] * rnn.hidden_size)
    offsets, numel = layout
    return RnnSpec(name="rnn", mode=mode, input_size=rnn.input_size, hidden_size=rnn.hidden_size,
                   proj_size=rnn.proj_size, num_layers=rnn.num_layers, bidirectional=rnn.bidirectional,
                   batch_first=False, has_biases=bool(rnn.bias), dropout=float(rnn.dropout), threshold=0,
                   offsets=tuple(offsets), numel=numel)


def _rnn(kind, device, **extra):
    cls, kw = KINDS[kind]
    return cls(I, H, device=device, **{**kw, **extra})


def _states(rnn, B, device):
    D = 2 if rnn.bidirectional else 1
    h = torch.randn(rnn.num_layers * D, B, rnn.proj_size or H, device=device)
    if isinstance(rnn, nn.LSTM):
        return [h, torch.randn(rnn.num_layers * D, B, H, device=device)]
    return [h]


def _count(gm, *ops):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in ops)


# -- the op and its fakes -------------------------------------------------------


@needs_cuda_build
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("kind", list(KINDS))
def test_op_and_backward_fakes_on_fake_cuda_have_the_packed_shapes(kind, train, with_state):
    """Out ``[N, D * H_out]``; hy / cy ``[L * D, B, ...]`` with B from the
    state, or from what ``pack_padded`` noted for ``batch_sizes``; the
    training reserve a size known at run time (it depends on the batch
    sizes' values), none in inference; the backward's gradients shaped as
    their inputs, the weights' as one flat tensor."""
    B = len(LENGTHS)
    with _fake_mode():
        rnn = _rnn(kind, "cuda")
        spec = _spec(rnn)
        ws = [getattr(rnn, n) for n in flat_weight_names(rnn)]
        data = torch.randn(sum(LENGTHS), I, device="cuda")
        bs = torch.tensor(BATCH_SIZES)
        note_batch(bs, B)
        lstm = spec.mode == "LSTM"
        states = _states(rnn, B, "cuda") if with_state else []
        h0 = states[0] if states else None
        c0 = states[1] if lstm and states else None
        mode = kernels.CUDNN_MODES[spec.mode]
        args = (mode, H, spec.proj_size, spec.num_layers, train, spec.bidirectional, [*spec.offsets, spec.numel], 0.0)
        out, hy, cy, reserve = OPS.cudnn_packed_rnn_fw(data, bs, ws, h0, c0, *args)
        grads = OPS.cudnn_packed_rnn_backward(data, bs, ws, h0, c0, out, torch.ones_like(out), torch.ones_like(hy),
                                              torch.ones_like(cy) if lstm else None, reserve, *args[:4], args[5],
                                              args[6], [True, True, lstm, True], 0.0)
    D = 2 if spec.bidirectional else 1
    out_h = spec.proj_size or H
    assert tuple(out.shape) == (sum(LENGTHS), D * out_h)
    assert tuple(hy.shape) == (spec.num_layers * D, B, out_h)
    assert tuple(cy.shape) == ((spec.num_layers * D, B, H) if lstm else (0,))
    assert all(t.device.type == "cuda" for t in (out, hy, cy, reserve, *grads))
    assert reserve.dtype == torch.uint8
    if train:
        assert isinstance(reserve.shape[0], torch.SymInt), reserve.shape  # known when the op runs
    else:
        assert reserve.shape == (0,)
    d_data, dhx, dcx, dw = grads
    assert d_data.shape == data.shape and tuple(dhx.shape) == tuple(hy.shape)
    assert tuple(dcx.shape) == (tuple(cy.shape) if lstm else (0,))
    assert dw.shape == (sum(w.numel() for w in ws),)


@needs_cuda_build
@pytest.mark.parametrize("kind", list(KINDS))
def test_op_outputs_have_the_shapes_and_strides_of_atens_packed_cudnn_rnn(kind):
    """The op's fake against ``aten._cudnn_rnn``'s meta kernel given the
    same ``batch_sizes`` (as ints: the schema's ``SymInt[]``)."""
    B = len(LENGTHS)
    with _fake_mode():
        rnn = _rnn(kind, "cuda")
        spec = _spec(rnn)
        ws = [getattr(rnn, n) for n in flat_weight_names(rnn)]
        data = torch.randn(sum(LENGTHS), I, device="cuda")
        states = _states(rnn, B, "cuda")
        h0, c0 = states[0], (states[1] if len(states) > 1 else None)
        mode = kernels.CUDNN_MODES[spec.mode]
        D = 2 if spec.bidirectional else 1
        ref = kernels.cudnn_rnn(data, ws, len(ws) // (spec.num_layers * D), None, h0, c0, mode, H, spec.proj_size,
                                spec.num_layers, False, 0.0, False, spec.bidirectional, BATCH_SIZES, None)
        got = OPS.cudnn_packed_rnn_fw(data, torch.tensor(BATCH_SIZES), ws, h0, c0, mode, H, spec.proj_size,
                                      spec.num_layers, False, spec.bidirectional, [], 0.0)
    for i in (0, 1) + ((2,) if spec.mode == "LSTM" else ()):
        assert got[i].shape == ref[i].shape and got[i].stride() == ref[i].stride(), (i, got[i].shape, ref[i].shape)
        assert got[i].device.type == "cuda" and got[i].dtype == ref[i].dtype


@needs_cuda_build
def test_batch_sizes_must_be_the_cpu_int64_sizes_and_one_dtype_for_all():
    with _fake_mode():
        rnn = _rnn("lstm", "cuda")
        ws = [getattr(rnn, n) for n in flat_weight_names(rnn)]
        data = torch.randn(sum(LENGTHS), I, device="cuda")
        args = (2, H, 0, 2, False, True, [], 0.0)
        with pytest.raises(RuntimeError, match="1-D CPU int64"):
            OPS.cudnn_packed_rnn_fw(data, torch.tensor(BATCH_SIZES, device="cuda"), ws, None, None, *args)
        with pytest.raises(RuntimeError, match="1-D CPU int64"):
            OPS.cudnn_packed_rnn_fw(data, torch.tensor(BATCH_SIZES, dtype=torch.int32), ws, None, None, *args)
        with pytest.raises(RuntimeError, match="one dtype"):
            OPS.cudnn_packed_rnn_fw(data.half(), torch.tensor(BATCH_SIZES), ws, None, None, *args)


@needs_cuda_build
def test_the_op_is_tagged_random_and_has_a_twin_and_a_backward():
    for name in ("cudnn_packed_rnn", "cudnn_packed_rnn_fw"):
        assert torch.Tag.nondeterministic_seeded in getattr(OPS, name).default.tags
    schema = str(OPS.cudnn_packed_rnn.default._schema)
    assert "Tensor data, Tensor batch_sizes, Tensor[] weights" in schema, schema
    assert "Tensor batch_sizes" in str(OPS.cudnn_packed_rnn_backward.default._schema)


# -- traced through AOTAutograd ---------------------------------------------------


def _packed_fn(spec, train, n_states, need_grad=True):
    """pack_padded -> ``cudnn_packed_call`` -> pad_packed, as the captured
    graph has them: N and T unknown until ``pack_padded`` runs."""

    def f(x, lengths, *rest):
        hx, ws = list(rest[:n_states]), list(rest[n_states:])
        data, batch_sizes = OPS.pack_padded(x, lengths, False)
        grad = need_grad and torch.is_grad_enabled()
        out, h_n, c_n = cudnn_packed_call(spec, data, batch_sizes, hx, ws, grad, train)
        y, _lens = OPS.pad_packed(out, batch_sizes, False, 0.0, -1)
        return (y, h_n, c_n) if spec.mode == "LSTM" else (y, h_n)

    return f


def _aot(fn, args, backward=True):
    """AOTAutograd's graphs of ``fn(*args)`` (and its backward of a sum of
    every output): ``{"fw": ..., "bw": ...}`` plus the inputs' grads. For
    the backward the traced function returns that sum: the compiled graphs
    run on fake tensors here, and an output whose size is known only at run
    time (the padded length) would be a tangent AOTAutograd's runtime asks
    about (``is_contiguous``) and cannot answer on a fake."""
    from functorch.compile import aot_function, make_boxed_func

    if backward:
        inner = fn

        def fn(*a):
            return sum(o.float().sum() for o in inner(*a)),

    graphs = {}

    def keep_as(name):
        def compiler(g, example):
            graphs[name] = g
            return make_boxed_func(g.forward)
        return compiler

    outs = aot_function(fn, fw_compiler=keep_as("fw"), bw_compiler=keep_as("bw"))(*args)
    if backward:
        sum(o.sum() for o in outs).backward()
        graphs["grads"] = [a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    graphs["outs"] = outs
    return graphs


@needs_cuda_build
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_joint_trace_of_cudnn_packed_call_has_one_forward_and_one_backward_op(kind, with_state):
    """AOTAutograd's joint trace of a training step (fake CPU tensors: the
    autograd engine needs a driver for CUDA ones; on a GPU, CUDA): one
    cuDNN packed call in the forward graph, one backward op in the backward
    graph, no per-layer ops; every input gets a gradient of its shape."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    B, T = len(LENGTHS), max(LENGTHS)
    with _fake_mode():
        rnn = _rnn(kind, device)
        spec = _spec(rnn)
        ws = [getattr(rnn, n).detach().requires_grad_() for n in flat_weight_names(rnn)]
        x = torch.randn(T, B, I, device=device, requires_grad=True)
        hx = [h.requires_grad_() for h in _states(rnn, B, device)] if with_state else []
        graphs = _aot(_packed_fn(spec, True, len(hx)), [x, torch.tensor(LENGTHS), *hx, *ws])
    fw, bw = graphs["fw"], graphs["bw"]
    assert _count(fw, OPS.cudnn_packed_rnn.default, OPS.cudnn_packed_rnn_fw.default) == 1, fw.graph
    assert _count(bw, OPS.cudnn_packed_rnn_backward.default) == 1, bw.graph
    for g in (fw, bw):
        names = {str(n.target) for n in g.graph.nodes if n.op == "call_function"}
        assert not any("packed_layer" in s or "lstm" in s or "gru" in s for s in names), names
    grads = graphs["grads"]
    assert len(grads) == 1 + len(hx) + len(ws)
    for g, a in zip(grads, [x, *hx, *ws]):
        assert g is not None and g.shape == a.shape
    # N (the packed rows) is a size known only at run time
    (op,) = [n for n in fw.graph.nodes if n.target in (OPS.cudnn_packed_rnn.default, OPS.cudnn_packed_rnn_fw.default)]
    assert isinstance(op.meta["val"][0].shape[0], torch.SymInt)
    assert tuple(op.meta["val"][1].shape)[1] == B  # B: what pack_padded noted (or the state's)


@needs_cuda_build
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_inference_trace_on_fake_cuda_is_one_op_on_cuda_with_the_sizes_on_the_cpu(kind):
    """No grad: AOTAutograd's forward graph on fake CUDA tensors calls the
    op once (the ``_fw`` twin), with ``batch_sizes`` on the CPU and the rest
    on CUDA; no reserve."""
    B, T = len(LENGTHS), max(LENGTHS)
    with _fake_mode():
        rnn = _rnn(kind, "cuda")
        spec = _spec(rnn)
        ws = [getattr(rnn, n).detach() for n in flat_weight_names(rnn)]
        x = torch.randn(T, B, I, device="cuda")
        with torch.no_grad():
            graphs = _aot(_packed_fn(spec, False, 0), [x, torch.tensor(LENGTHS), *ws], backward=False)
    fw = graphs["fw"]
    (op,) = [n for n in fw.graph.nodes if n.op == "call_function"
             and n.target in (OPS.cudnn_packed_rnn.default, OPS.cudnn_packed_rnn_fw.default)]
    assert op.args[0].meta["val"].device.type == "cuda" and op.args[1].meta["val"].device.type == "cpu"
    assert op.meta["val"][3].shape == (0,)
    assert all(o.device.type == "cuda" for o in graphs["outs"])


@needs_cuda_build
@pytest.mark.parametrize("train", [True, False])
def test_dropout_between_layers_goes_to_cudnn_in_training_only(train):
    """As eager's cuDNN call: in training (grad or not) the op gets the
    module's p and runs in training mode; in eval p = 0."""
    import dataclasses

    B, T = len(LENGTHS), max(LENGTHS)
    with _fake_mode():
        rnn = _rnn("lstm", "cuda", dropout=0.3)
        spec = dataclasses.replace(_spec(rnn), dropout=0.3)
        ws = [getattr(rnn, n).detach() for n in flat_weight_names(rnn)]
        x = torch.randn(T, B, I, device="cuda")
        with torch.no_grad():
            graphs = _aot(_packed_fn(spec, train, 0), [x, torch.tensor(LENGTHS), *ws], backward=False)
    (op,) = [n for n in graphs["fw"].graph.nodes if n.op == "call_function"
             and n.target in (OPS.cudnn_packed_rnn.default, OPS.cudnn_packed_rnn_fw.default)]
    assert op.args[12] == (0.3 if train else 0.0) and op.args[9] is train, op.args


@needs_cuda_build
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_inductors_cuda_code_calls_cudnn_once_with_the_sizes_on_the_cpu(kind):
    """Inductor's wrapper code for pack -> op -> pad on fake CUDA, written
    for an H100 without one (``wfpass._torch.fake_cuda``): one extern call
    of the op, reading ``batch_sizes`` where ``pack_padded`` left it (the
    CPU); no loop over steps or layers."""
    from wfpass._torch.fake_cuda import inductor_wrapper_code, stopped_after_codegen

    torch._dynamo.reset()
    with inductor_wrapper_code() as codes, _fake_mode():
        rnn = _rnn(kind, "cuda")
        spec = _spec(rnn)
        ws = [getattr(rnn, n).detach() for n in flat_weight_names(rnn)]
        x = torch.randn(max(LENGTHS), len(LENGTHS), I, device="cuda")
        # Caught here, not kept (``pytest.raises``): on Python 3.11.7 an
        # exception kept from this compile left pytest's later ``ast.parse``
        # with "SystemError: AST constructor recursion depth mismatch".
        stopped = None
        with torch.no_grad():
            try:
                torch.compile(_packed_fn(spec, False, 0), backend="inductor")(x, torch.tensor(LENGTHS), *ws)
            except Exception as e:  # noqa: BLE001 - the compile stops after Inductor's codegen
                stopped = "" if stopped_after_codegen(e) else repr(e)
    assert stopped == "", stopped
    (code,) = codes
    call = code.split("def call")[1]
    assert call.count("torch.ops.wfpass.cudnn_packed_rnn_fw.default(") == 1, code
    assert "for " not in call and "packed_layer" not in call, code
    # the sizes: the pack op's second output, handed on as it is (no copy to the GPU)
    line = next(ln for ln in call.splitlines() if "cudnn_packed_rnn_fw.default(" in ln)
    sizes = line.split("(", 1)[1].split(", ")[1]
    assert f"{sizes} = buf0[1]" in call.replace("        ", "").replace("    ", ""), call


class PackedNet(nn.Module):
    """pack_padded_sequence -> RNN -> pad_packed_sequence -> Linear."""

    def __init__(self, kind="lstm", device=None, enforce_sorted=False, **extra):
        super().__init__()
        self.rnn = _rnn(kind, device, **extra)
        D = 2 if self.rnn.bidirectional else 1
        self.out = nn.Linear(D * (self.rnn.proj_size or H), I, device=device)
        self.enforce_sorted = enforce_sorted

    def forward(self, x, lengths):
        p = pack_padded_sequence(x, lengths, enforce_sorted=self.enforce_sorted)
        out, state = self.rnn(p)
        y, _ = pad_packed_sequence(out)
        h = state[0] if isinstance(state, tuple) else state
        return self.out(y), h


class Keep:
    """An inner compiler that keeps the rewritten graphs and runs nothing."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


class _OnCudnn:
    """Stands in for ``PackedRnnForward`` with ``path="cudnn"`` until the
    format calls ``cudnn_packed_call`` itself: the same arguments."""

    def __init__(self, spec, train):
        self.spec, self.train = spec, train
        self.__name__ = "rnn_packed_cudnn"

    def __call__(self, data, batch_sizes, hx, *weights):
        need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (data, *hx, *weights))
        return cudnn_packed_call(self.spec, data, batch_sizes, hx, weights, need_grad, self.train)


def _packed_calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, PackedRnnForward)]


def _capture(kind="lstm", train=True, enforce_sorted=False):
    keep = Keep()
    with _fake_mode():
        model = PackedNet(kind, device="cuda", enforce_sorted=enforce_sorted).train(train)
        x = torch.randn(max(LENGTHS), len(LENGTHS), I, device="cuda")
        lengths = torch.tensor(LENGTHS if enforce_sorted else LENGTHS[::-1])
        with torch.set_grad_enabled(train):
            torch.compile(model, backend=wfpass.backend(inner=keep, rnn=CUDNN))(x, lengths)
    assert len(keep.graphs) == 1, "a graph break"
    return model, keep.graphs[0]


def _without_size_asserts(gm):
    """``gm`` without Dynamo's run-time asserts on the packed sizes
    (``u0 >= 0``): AOTAutograd saves their SymBools for the backward, and
    its runtime, run here on fake tensors, takes only ints there (on real
    tensors they are bools)."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten._assert_scalar.default:
            gm.graph.erase_node(n)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _cpu_twins(gm):
    """Fake CPU tensors shaped as the graph's inputs (a fresh fake mode must
    be active); the lengths as the longest-first lengths."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta["example_value"]
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            out.append(torch.empty_strided(v.shape, v.stride(), device="cpu").normal_().requires_grad_(v.requires_grad))
        elif isinstance(v, torch.Tensor):
            out.append(torch.tensor(LENGTHS))
        else:
            out.append(v)
    return out


@needs_cuda_build
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_the_captured_graph_with_the_cudnn_call_traces_to_one_forward_and_one_backward_op(kind):
    """Dynamo's graph of pack -> RNN (2 layers, bidirectional) -> pad on
    fake CUDA, its ``PackedRnnForward`` call made the cuDNN call, through
    AOTAutograd (fake CPU twins): one op forward, one backward op."""
    _model, gm = _capture(kind, enforce_sorted=True)
    (call,) = _packed_calls(gm)
    if call.target.path != "cudnn":  # until PackedRnnForward takes path="cudnn" itself
        call.target = _OnCudnn(call.target.spec, call.target.train)
        gm.recompile()
    with _fake_mode():
        graphs = _aot(_without_size_asserts(gm), _cpu_twins(gm))
    assert _count(graphs["fw"], OPS.cudnn_packed_rnn.default, OPS.cudnn_packed_rnn_fw.default) == 1
    assert _count(graphs["bw"], OPS.cudnn_packed_rnn_backward.default) == 1
    assert all(g is not None for g in graphs["grads"])


@needs_cuda_build
def test_a_packed_lstm_on_fake_cuda_is_captured_as_one_cudnn_call():
    """The model through ``torch.compile`` with ``rnn={"cuda": "cudnn"}``:
    one ``PackedRnnForward`` on the cuDNN path, and its joint trace one
    forward and one backward op. Skips until the format takes that path."""
    model, gm = _capture("lstm", enforce_sorted=True)
    (call,) = _packed_calls(gm)
    assert call.target.path == "cudnn"
    (rec,) = wfpass.report(model).find("rnn")
    assert rec.action == "rewritten" and "cudnn" in set(rec.detail["paths"].values()), rec.detail
    assert "T=variable: cuDNN (cudnn_calls)" in rec.reason, rec.reason
    with _fake_mode():
        graphs = _aot(_without_size_asserts(gm), _cpu_twins(gm))
    assert _count(graphs["fw"], OPS.cudnn_packed_rnn.default, OPS.cudnn_packed_rnn_fw.default) == 1
    assert _count(graphs["bw"], OPS.cudnn_packed_rnn_backward.default) == 1


@needs_cuda_build
def test_under_cuda_autocast_the_packed_call_runs_in_fp16():
    """As eager's cuDNN call in any CUDA autocast region: data, states and
    weights cast to fp16 (the weights as one block in cuDNN's layout)."""
    from unittest import mock

    B, T = len(LENGTHS), max(LENGTHS)
    with _fake_mode():
        rnn = _rnn("lstm", "cuda")
        spec = _spec(rnn)
        ws = [getattr(rnn, n).detach() for n in flat_weight_names(rnn)]
        x = torch.randn(T, B, I, device="cuda")
        with mock.patch.object(torch.cuda, "is_available", lambda: True), \
                mock.patch.object(torch.cuda, "is_bf16_supported", lambda *a, **k: True), \
                torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
            y, h_n, c_n = _packed_fn(spec, False, 0)(x, torch.tensor(LENGTHS), *ws)
    assert {y.dtype, h_n.dtype, c_n.dtype} == {torch.float16}


# -- on a GPU ----------------------------------------------------------------------


def _block_views(ws, spec):
    """One leaf block in cuDNN's layout holding copies of ``ws``, and views
    of it at the spec's offsets (the weights as the format leaves them)."""
    block = torch.zeros(spec.numel, device=ws[0].device, dtype=ws[0].dtype)
    with torch.no_grad():
        for w, off in zip(ws, spec.offsets):
            block[off:off + w.numel()].copy_(w.reshape(-1))
    block.requires_grad_()
    return block, [block[off:off + w.numel()].view(w.shape) for w, off in zip(ws, spec.offsets)]


@gpu
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn", "lstm-proj"])
def test_equal_to_eager_packed_cudnn_forward_and_backward_on_a_gpu(kind, with_state):
    """``cudnn_packed_call`` on weights in one block against eager's
    ``rnn(PackedSequence)`` on CUDA: output, h_n, c_n, and the gradients of
    the data, the state and every weight."""
    torch.manual_seed(0)
    B, T = len(LENGTHS), max(LENGTHS)
    rnn = _rnn(kind, "cuda").train()
    spec = _spec(rnn)
    names = flat_weight_names(rnn)
    block, views = _block_views([getattr(rnn, n).detach() for n in names], spec)
    x = torch.randn(T, B, I, device="cuda")
    packed = pack_padded_sequence(x, torch.tensor(LENGTHS))
    data_ref = packed.data.detach().clone().requires_grad_()
    data = packed.data.detach().clone().requires_grad_()
    states = [h.requires_grad_() for h in _states(rnn, B, "cuda")] if with_state else []
    states_ref = [h.detach().clone().requires_grad_() for h in states]
    hx_ref = None if not states else (tuple(states_ref) if len(states_ref) == 2 else states_ref[0])
    ref_out, ref_state = rnn(type(packed)(data_ref, packed.batch_sizes), hx_ref)
    ref_h, ref_c = ref_state if isinstance(ref_state, tuple) else (ref_state, None)
    out, h_n, c_n = cudnn_packed_call(spec, data, packed.batch_sizes, states, views, True, True)
    torch.testing.assert_close(out, ref_out.data, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(h_n, ref_h, rtol=1e-4, atol=1e-5)
    if ref_c is not None:
        torch.testing.assert_close(c_n, ref_c, rtol=1e-4, atol=1e-5)
    else:
        assert c_n.numel() == 0
    Ro, Rh = torch.randn_like(out), torch.randn_like(h_n)
    loss = (out * Ro).sum() + (h_n * Rh).sum()
    ref_loss = (ref_out.data * Ro).sum() + (ref_h * Rh).sum()
    if ref_c is not None:
        Rc = torch.randn_like(c_n)
        loss, ref_loss = loss + (c_n * Rc).sum(), ref_loss + (ref_c * Rc).sum()
    loss.backward()
    ref_loss.backward()
    pairs = [(data.grad, data_ref.grad)] + [(a.grad, b.grad) for a, b in zip(states, states_ref)]
    pairs += [(block.grad[off:off + getattr(rnn, n).numel()].view(getattr(rnn, n).shape), getattr(rnn, n).grad)
              for n, off in zip(names, spec.offsets)]
    scale = max(b.abs().max().item() for _, b in pairs)
    for a, b in pairs:
        assert (a - b).abs().max().item() <= 1e-4 * scale


@gpu
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_compiled_packed_model_equal_to_eager_on_a_gpu(kind):
    """The model through ``torch.compile`` (``aot_eager``) on CUDA against
    eager, forward and backward. Skips until the format takes the cuDNN
    path for packed batches."""
    (call,) = _packed_calls(_capture(kind)[1])  # on fake CUDA: which path the format takes
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = PackedNet(kind, device="cuda").train()
    ref = copy.deepcopy(model)
    x = torch.randn(max(LENGTHS), len(LENGTHS), I, device="cuda")
    lengths = torch.tensor(LENGTHS[::-1])
    out = torch.compile(model, backend=wfpass.backend(inner="aot_eager", rnn=CUDNN))(x, lengths)
    (rec,) = wfpass.report(model).find("rnn")
    assert set(rec.detail["paths"].values()) == {"cudnn"}, rec.detail
    expected = ref(x, lengths)
    for a, b in zip(out, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    R = [torch.randn_like(o) for o in out]
    sum((o * r).sum() for o, r in zip(out, R)).backward()
    sum((o * r).sum() for o, r in zip(expected, R)).backward()
    scale = max(p.grad.abs().max().item() for p in ref.parameters())
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-4 * scale, n

