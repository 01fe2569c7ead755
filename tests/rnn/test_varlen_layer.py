"""``wfpass::packed_layer``: one layer and direction of an LSTM / GRU / RNN
over a packed batch, against eager PyTorch's packed RNN on the same weights.

Each case runs an ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` (one layer;
bidirectional for the reverse direction, whose ``_reverse`` weights and
output half the op must reproduce) on ``pack_padded_sequence(...)`` and
compares ``out.data``, ``h_n``, ``c_n`` and the gradients of the packed
data, of every weight of that direction, of h0 and c0, under a loss that
reaches every output: a fixed random projection of ``out``, ``h_n`` and
``c_n``. Gradient errors are scaled by the largest gradient of the tensor.

Both kernels: the op with its autograd formula (the C++ kernel,
``native/rnn/varlen_rnn.cpp``, where it builds; the Python one in a
``WFPASS_NATIVE=0`` run), and the Python kernel (``_packed_layer`` /
``_packed_layer_backward``) called directly with the loss's output
gradients. A further test checks the two kernels give the same bits.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

from wfpass import native
from wfpass.rnn.cpu import varlen_layer as pl

# The C++ kernels, where they build (WFPASS_NATIVE=0: the Python ones), for
# every call of the op in this file: loaded before the first test runs.
native.load()

OP = torch.ops.wfpass.packed_layer.default
OP_BACKWARD = torch.ops.wfpass.packed_layer_backward.default

# name -> (module class, its kwargs, the op's mode)
CELLS = {
    "lstm": (nn.LSTM, {}, "LSTM"),
    "lstm_proj": (nn.LSTM, {"proj_size": 3}, "LSTM"),
    "gru": (nn.GRU, {}, "GRU"),
    "rnn_tanh": (nn.RNN, {"nonlinearity": "tanh"}, "RNN_TANH"),
    "rnn_relu": (nn.RNN, {"nonlinearity": "relu"}, "RNN_RELU"),
}
# Sorted longest first, as pack_padded_sequence(enforce_sorted=True) wants.
LENGTHS = {
    "equal": [6, 6, 6, 6],
    "one_of_length_1": [6, 5, 3, 1],
    "decreasing": [7, 5, 4, 3, 2],
    "repeats": [6, 6, 4, 4, 4, 1],
}
I, H = 5, 6
# Largest error allowed, relative to the largest value of each tensor.
TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}


@pytest.fixture(autouse=True)
def _one_thread():
    # The cases are tiny: one thread is as fast, and a busy machine's spinning
    # OpenMP workers made them 10x slower (seen with 2 threads on 2 cores).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Case:
    """One layer's inputs, eager PyTorch's answer and its gradients."""

    def __init__(self, cell: str, lengths, bias: bool, states: bool, reverse: bool, dtype=torch.float32,
                 seed: int = 0, sizes=None):
        cls, kw, self.mode = CELLS[cell]
        I, H = (sizes[0], sizes[1]) if sizes else (globals()["I"], globals()["H"])
        if sizes and "proj_size" in kw:
            kw = dict(kw, proj_size=sizes[2])
        self.H = H
        torch.manual_seed(seed)
        self.lstm = self.mode == "LSTM"
        self.reverse, self.dtype = reverse, dtype
        D = 2 if reverse else 1
        # The reference runs in float32 on the same (rounded) values as the op.
        self.module = cls(I, H, bias=bias, bidirectional=reverse, **kw)
        if dtype != torch.float32:
            with torch.no_grad():
                for p in self.module.parameters():
                    p.copy_(p.to(dtype))
        self.H_out = kw.get("proj_size") or H
        B, T = len(lengths), lengths[0]
        x = torch.randn(T, B, I).to(dtype).float()
        packed = pack_padded_sequence(x, lengths)
        self.batch_sizes = packed.batch_sizes
        self.data = packed.data.clone().requires_grad_()
        N = self.data.shape[0]
        self.h0_all = torch.randn(D, B, self.H_out).to(dtype).float().requires_grad_() if states else None
        self.c0_all = torch.randn(D, B, H).to(dtype).float().requires_grad_() if states and self.lstm else None
        sfx = "_reverse" if reverse else ""
        self.weights = {n: getattr(self.module, f"{n}_l0{sfx}", None)
                        for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr")}
        # The loss: a fixed random projection of every output.
        self.R, self.Rh = torch.randn(N, self.H_out), torch.randn(1, B, self.H_out)
        self.Rc = torch.randn(1, B, H) if self.lstm else None

        self.ref, self.ref_grads = self.run_eager()

    def run_eager(self, dtype=torch.float32):
        """Eager PyTorch's packed RNN (in ``dtype``): the direction's outputs and the loss's gradients."""
        ins = self.grad_inputs()
        if dtype == torch.float32:
            module, leaves = self.module, ins
        else:  # a copy in dtype, its own leaves
            module = copy.deepcopy(self.module).to(dtype)
            leaves = {k: v.detach().to(dtype).requires_grad_() for k, v in ins.items()}
            sfx = "_reverse" if self.reverse else ""
            leaves.update({k: getattr(module, f"{k}_l0{sfx}") for k in self.weights if k in ins})
        h0, c0 = leaves.get("h0"), leaves.get("c0")
        state = ((h0, c0) if self.lstm else h0) if h0 is not None else None
        y, hn = module(PackedSequence(leaves["data"], self.batch_sizes), state)
        h_n, c_n = (hn[0], hn[1]) if self.lstm else (hn, None)
        d = 1 if self.reverse else 0
        outs = {"out": y.data[:, d * self.H_out:(d + 1) * self.H_out], "h_n": h_n[d:d + 1],
                "c_n": c_n[d:d + 1] if self.lstm else None}
        f = lambda t: t.float() if t is not None else None  # noqa: E731
        grads = torch.autograd.grad(self.loss(f(outs["out"]), f(outs["h_n"]), f(outs["c_n"])),
                                    list(leaves.values()))
        return ({k: (v.detach() if v is not None else None) for k, v in outs.items()},
                {k: g.detach() for k, g in zip(leaves, grads)})

    def grad_inputs(self):
        ins = {"data": self.data}
        ins.update({k: w for k, w in self.weights.items() if w is not None})
        if self.h0_all is not None:
            ins["h0"] = self.h0_all
        if self.c0_all is not None:
            ins["c0"] = self.c0_all
        return ins

    def loss(self, out, h_n, c_n):
        total = (out * self.R).sum() + (h_n * self.Rh).sum()
        return total + (c_n * self.Rc).sum() if self.lstm else total

    def op_args(self, train=True, detach=False):
        """The op's arguments in the op's dtype (autograd leaves unless ``detach``)."""
        d = 1 if self.reverse else 0
        cast = (lambda t: t.detach().to(self.dtype)) if detach else (lambda t: t.to(self.dtype))
        opt = lambda t: cast(t) if t is not None else None  # noqa: E731
        h0 = self.h0_all[d:d + 1] if self.h0_all is not None else None
        c0 = self.c0_all[d:d + 1] if self.c0_all is not None else None
        w = self.weights
        return (cast(self.data), self.batch_sizes, cast(w["weight_ih"]), cast(w["weight_hh"]), opt(w["bias_ih"]),
                opt(w["bias_hh"]), opt(w["weight_hr"]), opt(h0), opt(c0), self.mode, self.reverse, train)

    def run_op(self):
        """The op (its C++ kernel where built) and its autograd formula: outputs and gradients of the loss."""
        args = self.op_args()
        out, h_n, c_n, ws = OP(*args)
        assert ws.shape == (out.shape[0], pl.workspace_width(self.mode, self.H))
        ins = self.grad_inputs()
        grads = torch.autograd.grad(self.loss(out.float(), h_n.float(), c_n.float() if self.lstm else None),
                                    list(ins.values()))
        return {"out": out, "h_n": h_n, "c_n": c_n}, dict(zip(ins, grads))

    def run_python(self):
        """The Python kernels, called directly; the output gradients are the loss's (R, Rh, Rc)."""
        args = self.op_args(detach=True)
        out, h_n, c_n, ws = pl._packed_layer(*args)
        g = lambda t: t.to(self.dtype) if t is not None else None  # noqa: E731
        d_data, d_w_ih, d_w_hh, d_b_ih, d_b_hh, d_w_hr, d_h0, d_c0 = pl._packed_layer_backward(
            *args[:9], out, h_n, c_n, ws, g(self.R), g(self.Rh), g(self.Rc), self.mode, self.reverse)
        grads = {"data": d_data, "weight_ih": d_w_ih, "weight_hh": d_w_hh, "bias_ih": d_b_ih, "bias_hh": d_b_hh,
                 "weight_hr": d_w_hr}
        # h0 / c0: the gradient of the direction's slice of the module's state.
        d = 1 if self.reverse else 0
        for name, full, dd in (("h0", self.h0_all, d_h0), ("c0", self.c0_all, d_c0)):
            if full is not None:
                g_full = torch.zeros_like(full)
                g_full[d:d + 1] = dd
                grads[name] = g_full
        return {"out": out, "h_n": h_n, "c_n": c_n}, {k: grads[k] for k in self.grad_inputs()}

    def errors(self, outs, grads):
        """Each output's and gradient's largest error against float32 eager,
        relative to its largest value; checks shapes and dtypes on the way."""
        errs = {}
        for k, ref in self.ref.items():
            if ref is None:
                assert outs[k] is None or outs[k].shape == (0,), k  # c_n: eager None, the op [0]
                continue
            got = outs[k].detach()
            assert got.shape == ref.shape and got.dtype == self.dtype, (k, got.shape, ref.shape)
            errs[k] = float((got.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-12))
        assert grads.keys() == self.ref_grads.keys()
        for k, ref in self.ref_grads.items():
            got = grads[k]
            assert got is not None and got.shape == ref.shape, (k, None if got is None else got.shape)
            errs[f"d_{k}"] = float((got.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-12))
        return errs

    def check(self, outs, grads):
        errs = self.errors(outs, grads)
        bad = {k: e for k, e in errs.items() if not e <= TOL[self.dtype]}
        assert not bad, bad
        return errs


@pytest.mark.parametrize("kernel", ["op", "python_kernel"])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("states", [True, False], ids=["h0", "zero_state"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("cell", list(CELLS))
def test_packed_layer_equals_eager(cell, bias, states, reverse, kernel):
    """Forward and backward, float32, every length pattern, against eager's packed RNN."""
    for i, lengths in enumerate(LENGTHS.values()):
        case = Case(cell, lengths, bias, states, reverse, seed=i)
        case.check(*(case.run_op() if kernel == "op" else case.run_python()))


@pytest.mark.parametrize("kernel", ["op", "python_kernel"])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_packed_layer_half_precision(dtype, cell, kernel):
    """bf16 / fp16: the op's answer against float32 eager on the same
    rounded values, within the dtype's accuracy, and no worse than twice
    eager's own packed RNN in that dtype (whose worst error here is
    0.6-1.2% in bf16, ~0.1% in fp16)."""
    for reverse in (False, True):
        case = Case(cell, LENGTHS["repeats"], True, True, reverse, dtype=dtype)
        ours = max(case.check(*(case.run_op() if kernel == "op" else case.run_python())).values())
        eager = max(case.errors(*case.run_eager(dtype)).values())
        assert ours <= 2 * eager, (ours, eager)


@pytest.mark.parametrize("cell", list(CELLS))
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_wider_layers_equal_eager(cell, reverse):
    """Widths the raw-pointer loop (``native.fast_loop``) runs in 16-lane
    blocks plus a tail: input 33, hidden 40, projection 24; 12 sequences of
    1-30 steps, several of equal length. Forward and every gradient."""
    g = torch.Generator().manual_seed(5)
    lengths = sorted(torch.randint(1, 31, (12,), generator=g).tolist(), reverse=True)
    lengths[0], lengths[-1] = 30, 1
    for bias, states in ((True, True), (False, False)):
        case = Case(cell, lengths, bias, states, reverse, sizes=(33, 40, 24))
        case.check(*case.run_op())


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh"])
def test_saturated_gates_equal_eager(cell):
    """Inputs 30x larger: gates and tanh saturate (pre-activations in the
    hundreds, where the raw-pointer loop's exp clamps its argument);
    forward and gradients still equal eager's."""
    case = Case(cell, LENGTHS["repeats"], True, True, False)
    with torch.no_grad():
        case.data.mul_(30)
    case.ref, case.ref_grads = case.run_eager()
    case.check(*case.run_op())


def _same_or_close(a, b, exact):
    assert a.dtype == b.dtype and a.stride() == b.stride()
    if exact:
        assert torch.equal(a, b)
    else:
        scale = float(a.abs().max()) if a.numel() else 1.0
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * max(scale, 1e-12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_and_python_kernels_give_the_same_bits(dtype):
    """The C++ kernels' ATen loop makes the same ATen calls in the same
    order as the Python kernels: every output, workspace and gradient equal
    bit for bit (so the suite, run on the C++ kernels, speaks for the Python
    ones too). fp32 on the raw-pointer loop (``native.fast_loop()``: its own
    GEMM and gate math) agrees to rounding instead, 1e-5 of each tensor's
    largest value; ``test_the_aten_loop_gives_the_python_kernels_bits``
    checks the bits with that loop switched off."""
    if not native.loaded():
        pytest.skip(native.status())
    exact = not (dtype == torch.float32 and native.fast_loop())
    torch.manual_seed(0)
    for lengths in (LENGTHS["repeats"], LENGTHS["one_of_length_1"]):
        for cell in CELLS:
            for reverse in (False, True):
                for bias, states, with_gout in ((True, True, True), (False, False, False)):
                    case = Case(cell, lengths, bias, states, reverse, dtype=dtype)
                    args = case.op_args(detach=True)
                    py = pl._packed_layer(*args)
                    cpp = torch.ops.wfpass.packed_layer_fw(*args)
                    for a, b in zip(py, cpp):
                        _same_or_close(a, b, exact)
                    g = lambda t: t.to(dtype) if t is not None else None  # noqa: E731
                    bargs = (*args[:9], *py, g(case.R) if with_gout else None, g(case.Rh), g(case.Rc),
                             case.mode, reverse)
                    for a, b in zip(pl._packed_layer_backward(*bargs), OP_BACKWARD(*bargs)):
                        _same_or_close(a, b, exact)


def test_the_aten_loop_gives_the_python_kernels_bits():
    """With ``WFPASS_FAST_LOOP=0`` the C++ kernels take their ATen loop for
    fp32 too, and give the Python kernels' bits (in a fresh process: the
    switch is read once)."""
    if not native.fast_loop():
        pytest.skip("the raw-pointer loop is not in use here: the test above checks the bits already")
    import os
    import subprocess
    import sys

    env = dict(os.environ, WFPASS_FAST_LOOP="0")
    code = ("import torch, pytest, sys; from wfpass import native; assert not native.fast_loop(); "
            "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', __import__('os').environ['WF_TEST'] + "
            "'::test_cpp_and_python_kernels_give_the_same_bits']))")
    env["WF_TEST"] = __file__
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                       cwd=os.path.dirname(__file__))
    assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def _fake_outputs(op, args):
    """``op`` run under FakeTensorMode on fakes of ``args``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        return op(*fargs)


@pytest.mark.parametrize("cell", list(CELLS))
def test_fake_matches_the_kernels(cell):
    """The fakes promise the real outputs' shapes, dtypes and strides, with
    and without a training workspace (h0 given: B from its shape)."""
    case = Case(cell, LENGTHS["repeats"], True, True, True)
    for train in (True, False):
        args = case.op_args(train=train, detach=True)
        real = OP(*args)
        fake = _fake_outputs(OP, args)
        for r, f in zip(real, fake):
            assert (tuple(r.shape), r.dtype, r.stride(), r.device) == (tuple(f.shape), f.dtype, f.stride(), f.device)
        if not train:
            assert real[3].shape == (0,)
    args = case.op_args(detach=True)
    real = OP(*args)
    g = (torch.randn_like(real[0]), torch.randn_like(real[1]), torch.randn_like(real[2]) if case.lstm else None)
    bargs = (*args[:9], *real, *g, case.mode, True)
    for r, f in zip(OP_BACKWARD(*bargs), _fake_outputs(OP_BACKWARD, bargs)):
        assert (tuple(r.shape), r.dtype, r.stride()) == (tuple(f.shape), f.dtype, f.stride())


@pytest.mark.parametrize("cell,bias", [("lstm_proj", True), ("gru", False), ("rnn_relu", True)])
def test_opcheck(cell, bias):
    """torch.library's own checker: schema (no aliasing, no mutation), fake,
    autograd registration, and AOTAutograd (static and dynamic shapes)
    through the op and its backward. h0 / c0 given: with None, B comes from
    ``batch_of`` only inside a compile (a size noted on the graph's
    batch_sizes, else one learned at run time)."""
    case = Case(cell, LENGTHS["decreasing"], bias, True, False)
    args = case.op_args()
    torch.library.opcheck(OP, args)
    out = OP(*case.op_args(detach=True))
    g = (torch.randn_like(out[0]), torch.randn_like(out[1]), torch.randn_like(out[2]) if case.lstm else None)
    bargs = (*case.op_args(detach=True)[:9], *out, *g, case.mode, False)
    torch.library.opcheck(OP_BACKWARD, bargs, test_utils=("test_schema", "test_faketensor"))


def _both_directions(case):
    """A bidirectional case's weights as ``wfpass::packed_bilayer`` takes
    them (the forward direction's, then the reverse's, in the module's
    order), and whether they hold a projection."""
    names = [n for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr")
             if getattr(case.module, f"{n}_l0", None) is not None]
    return [getattr(case.module, f"{n}_l0{sfx}") for sfx in ("", "_reverse") for n in names], "weight_hr" in names


@pytest.mark.parametrize("cell,bias", [("lstm_proj", True), ("gru", False)])
def test_bilayer_opcheck(cell, bias):
    """torch.library's checker on ``wfpass::packed_bilayer`` (a Tensor[] of
    both directions' weights, whose gradients come back as a list)."""
    case = Case(cell, LENGTHS["decreasing"], bias, True, True)
    weights, proj = _both_directions(case)
    args = (case.data, case.batch_sizes, weights, case.h0_all, case.c0_all, case.mode, bias, proj, True)
    torch.library.opcheck(torch.ops.wfpass.packed_bilayer.default, args)


def test_backward_of_a_call_without_train_raises():
    case = Case("gru", LENGTHS["repeats"], True, True, False)
    out, h_n, _, ws = OP(*case.op_args(train=False))
    assert ws.shape == (0,)
    with pytest.raises(RuntimeError, match="train=False"):
        out.sum().backward()
    # The backward op itself names the missing workspace.
    args = case.op_args(detach=True)
    with pytest.raises(RuntimeError, match="train=False"):
        OP_BACKWARD(*args[:9], out.detach(), h_n.detach(), torch.empty(0), ws, torch.ones_like(out), None, None,
                    "GRU", False)


def test_bad_arguments_are_named():
    case = Case("gru", LENGTHS["repeats"], True, True, False)
    args = list(case.op_args(detach=True))
    with pytest.raises(ValueError, match="mode must be one of"):
        OP(*args[:9], "LSTMX", False, True)
    with pytest.raises(RuntimeError, match="batch_sizes"):  # eager's type for rows that do not match them
        OP(args[0], torch.tensor([1, 2, 3]), *args[2:])
    with pytest.raises(ValueError, match="LSTM arguments"):
        OP(*args[:8], torch.zeros(1, 6, H), *args[9:])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bilayer_gives_the_two_directions_bits(dtype, threads):
    """``wfpass::packed_bilayer`` (both directions of a layer, into one
    output; on the raw-pointer path each direction writes its half in place,
    on two threads where torch has them) gives the bits of the two
    ``packed_layer`` calls it replaces, concatenated: outputs, final states
    and workspaces, with and without grad, and its backward the bits of the
    two ``packed_layer_backward`` calls; every cell, with and without biases
    and states."""
    torch.set_num_threads(threads)  # the fixture puts 1 back
    for lengths in (LENGTHS["repeats"], LENGTHS["one_of_length_1"]):
        for cell in CELLS:
            for bias, states in ((True, True), (False, False)):
                case = Case(cell, lengths, bias, states, True, dtype=dtype, sizes=(33, 40, 24))
                weights, proj = _both_directions(case)
                weights = [w.detach().to(dtype) for w in weights]
                h0 = case.h0_all.detach().to(dtype) if states else None
                c0 = case.c0_all.detach().to(dtype) if states and case.lstm else None
                data = case.data.detach().to(dtype)
                for train in (False, True):
                    args = (data, case.batch_sizes, weights, h0, c0, case.mode, bias, proj, train)
                    got = torch.ops.wfpass.packed_bilayer_fw(*args)
                    want = pl._bilayer(*args)  # the two packed_layer(_fw) calls, concatenated
                    for a, b in zip(got, want):
                        assert a.shape == b.shape and torch.equal(a, b), (cell, bias, states, train)
                    fake = pl._bilayer_fake(*args)
                    assert [t.shape for t in fake] == [t.shape for t in got]
                # the backward: each direction's packed_layer_backward, the data gradients summed
                g = [torch.randn_like(t) for t in got[:3]]
                bargs = (*args[:5], *got, g[0], g[1], g[2] if case.lstm else None, case.mode, bias, proj)
                got_b = torch.ops.wfpass.packed_bilayer_backward(*bargs)
                want_b = pl._bilayer_backward(*bargs)
                assert torch.equal(got_b[0], want_b[0]) and torch.equal(got_b[2], want_b[2])
                assert torch.equal(got_b[3], want_b[3])
                assert len(got_b[1]) == len(weights) and all(torch.equal(a, b) for a, b in zip(got_b[1], want_b[1]))


@pytest.mark.parametrize("kernel", ["op", "python_kernel"])
@pytest.mark.parametrize("cell", ["lstm", "lstm_proj", "gru", "rnn_tanh"])
def test_strided_arguments_give_the_values_of_their_contiguous_copies(cell, kernel):
    """Weights whose columns are not unit-stride (a transposed storage),
    biases and states that are strided views, packed rows and an output
    gradient with a row stride wider than their width: the same call on
    contiguous copies must give the same values, forward and backward. The
    raw-pointer loop (``native.fast_loop()``: the C++ op in fp32) reads them
    through pointers and leading dims or copies them, so there the bits are
    the same; the ATen loop and the Python kernel may take another GEMM
    path for a strided operand (rounding). Before the fix, a GRU's input
    GEMM on oneDNN read ``b_ih[2H:]`` of a strided bias as contiguous
    (errors of 0.1)."""
    if kernel == "op" and not native.loaded():
        pytest.skip(native.status())
    fw = torch.ops.wfpass.packed_layer_fw if kernel == "op" else pl._packed_layer
    bw = OP_BACKWARD if kernel == "op" else pl._packed_layer_backward
    exact = kernel == "op" and native.fast_loop()
    torch.manual_seed(0)
    case = Case(cell, LENGTHS["repeats"], True, True, False)
    args = list(case.op_args(detach=True))

    def strided(t):
        if t is None or not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            return t
        if t is args[0]:  # the packed rows as a column slice: unit column stride, row stride 2 I
            return torch.cat([t, t], 1)[:, :t.shape[1]]
        if t.dim() == 2:  # the same values in column-major storage
            return t.t().contiguous().t()
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1])  # every other element of a wider buffer
        wide[..., ::2] = t
        return wide[..., ::2]

    s_args = [strided(a) for a in args]
    assert all(not a.is_contiguous() for a in s_args[:9] if isinstance(a, torch.Tensor) and a.dtype == torch.float32)
    ref, got = fw(*args), fw(*s_args)
    for a, b in zip(ref, got):
        _same_or_close(a, b, exact)
    g_out = torch.cat([case.R, case.R], 1)[:, :case.R.shape[1]]  # a column slice: row stride 2 H_out
    assert not g_out.is_contiguous()
    tail = (case.Rh, case.Rc, case.mode, False)
    for a, b in zip(bw(*args[:9], *ref, case.R, *tail), bw(*s_args[:9], *got, g_out, *tail)):
        _same_or_close(a, b, exact)


# Calls inside the rule that reads the weights as they are (varlen_rnn.cpp,
# reads_weights_as_is: T <= H / 16 steps, T x batch <= H^2 / 512 rows; or
# H >= 512 and batch <= 16), at hidden 64 (8 rows), 128 (32 rows) and 512
# (40 steps: past H / 16): (input, hidden, projection), lengths.
AS_IS = {"h64": ((48, 64, 16), [4, 2, 1, 1]), "h128": ((96, 128, 32), [8, 6, 5, 3, 1]),
         "h512": ((80, 512, 64), [40, 7])}


@pytest.mark.parametrize("cell", list(CELLS))
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("shape", list(AS_IS))
def test_short_calls_read_the_weights_as_they_are_and_equal_eager(shape, reverse, cell):
    """Short calls over few rows read W_ih and W_hh through the direct linear
    kernel, with no per-call transpose: forward and every gradient against
    eager, with and without biases and states (a projection keeps the
    transposes: its case checks that the two mix)."""
    sizes, lengths = AS_IS[shape]
    for bias, states in ((True, True), (False, False)):
        case = Case(cell, lengths, bias, states, reverse, sizes=sizes)
        case.check(*case.run_op())


_AS_IS_RUN = """
import sys, torch
from tests.rnn import test_varlen_layer as t
out = {}
for shape, (sizes, lengths) in t.AS_IS.items():
    for cell in ("lstm", "gru", "rnn_tanh"):
        case = t.Case(cell, lengths, True, True, True, sizes=sizes)
        out[shape + cell] = torch.ops.wfpass.packed_layer_fw(*case.op_args(train=False, detach=True))[:3]
torch.save(out, sys.argv[1])
"""


def test_the_rule_takes_the_weights_as_they_are_inside_its_bound(tmp_path):
    """The two ways of reading the weights sum in different orders, so their
    bits differ: inside the bound this process's outputs are the bits of a
    process where every call reads the weights as they are
    (``WFPASS_RNN_AS_IS=all``), not those of one where none does (``=0``)."""
    if not (native.loaded() and native.fast_loop()):
        pytest.skip("the raw-pointer loop is not in use here")
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    got = {}
    for setting in ("", "all", "0"):
        path = tmp_path / f"as_is_{setting or 'rule'}.pt"
        env = dict(os.environ, WFPASS_RNN_AS_IS=setting, OMP_NUM_THREADS="1")
        r = subprocess.run([sys.executable, "-c", _AS_IS_RUN, str(path)], env=env, cwd=root, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        got[setting] = torch.load(path)
    for key, outs in got[""].items():
        assert all(torch.equal(a, b) for a, b in zip(outs, got["all"][key])), key
        assert not all(torch.equal(a, b) for a, b in zip(outs, got["0"][key])), key
        for a, b in zip(outs, got["0"][key]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_every_call_reading_the_weights_as_they_are_equals_eager():
    """With ``WFPASS_RNN_AS_IS=all`` (in a fresh process: read once) every
    call reads the weights as they are, outside the bound too: this file's
    float32 cases (every cell, length pattern, direction, bias and state)
    still equal eager's, forward and backward."""
    if not (native.loaded() and native.fast_loop()):
        pytest.skip("the raw-pointer loop is not in use here")
    import os
    import subprocess
    import sys

    env = dict(os.environ, WFPASS_RNN_AS_IS="all")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "packed_layer_equals_eager and op or wider_layers or saturated"],
                       env=env, capture_output=True, text=True, timeout=600, cwd=os.path.dirname(__file__))
    assert r.returncode == 0 and " passed" in r.stdout and "failed" not in r.stdout, r.stdout[-3000:]
