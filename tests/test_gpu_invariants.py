"""The project's invariants on CUDA (issue 37): what docs/guarantees.md
promises for the RNN, BatchNorm and linear formats, checked on a GPU with
RNNs as one cuDNN call each (``wfpass.backend(rnn={"cuda": "cudnn"})``).

Equal to eager forward and backward, the same Parameter objects, ties,
hooks, ``state_dict`` round trips, the ``.to()`` / ``.half()`` /
``load_state_dict`` lifecycle, regional compilation, a dynamic length after
a recompile, gradient checkpointing, autocast, dropout, variable-length
batches (``pack_padded_sequence -> nn.LSTM -> pad_packed_sequence`` in one
graph), training through Inductor, and no host-device synchronisation in a
steady-state training step.

Every test is marked ``gpu`` and takes ``device="cuda"``, skipped where no
GPU is; on a GPU machine ``python -m pytest -m gpu`` runs them with every
other test that needs a GPU, in a few minutes (``benchmarks/gpu/bench_gpu.py``
runs that first). Most compile with ``inner="aot_eager"``: AOTAutograd
traces the rewritten graph as it does for Inductor, and these tests are
about what wfpass does, not about Inductor's kernels; the training test
of all three formats and the sync test go end to end through Inductor, the
compiler users run.

**Dry run without a GPU** (a private debug switch, not a wfpass setting)::

    WFPASS_GPU_TESTS_ON_CPU=1 python -m pytest tests/test_gpu_invariants.py

adds ``device="cpu"``: the same test bodies on the CPU's paths (oneDNN,
the per-step loop, the packed C++ kernel), so that a broken test is found
before a GPU is at hand. Checks that only hold on CUDA (the cuDNN path,
the flat block in cuDNN's layout, cuDNN's dropout masks) are made on CUDA
only; where the CPU differs by design, the dry run skips, saying why. On
the CPU without the switch every test here skips: the CPU suite's own
tests already cover the CPU.
"""
from __future__ import annotations

import contextlib
import copy
import io
import os
import traceback
import warnings

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import wfpass
from models import QKV
from wfpass.core.storage import fused_storage_of
from wftest import Capture, TOL, assert_same_fwd_bwd, param_ids, train_steps

DRY_RUN = os.environ.get("WFPASS_GPU_TESTS_ON_CPU") == "1"
DEVICES = [pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]
if DRY_RUN:
    DEVICES.append("cpu")
pytestmark = [pytest.mark.gpu, pytest.mark.parametrize("device", DEVICES)]

#: RNNs on CUDA as one cuDNN call inside the graph (the default leaves them to eager cuDNN).
CUDNN = {"cuda": "cudnn"}


# -- helpers ------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def full_fp32():
    """fp32 math for every comparison here: cuDNN may run an fp32 RNN with
    TF32 tensor cores (``torch.backends.cudnn.allow_tf32``, on by default),
    and where the compiled side takes another kernel than eager (a GRU left
    to AOTAutograd's per-step matmuls, say) that alone differs by ~1e-4
    relative (seen on an H100), more than these tolerances. TF32 is a
    precision the user picks, the same with or without wfpass."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved



def backend(inner="aot_eager", **options):
    return wfpass.backend(inner=inner, rnn=CUDNN, **options)


def cpu_differs(device: str, why: str) -> None:
    """Skip the rest of a test in the dry run where the CPU differs from
    CUDA by design (never on a GPU)."""
    if device == "cpu":
        pytest.skip(f"dry run on the CPU: {why}")


def rnn_rows(model, device, n=1, action="rewritten"):
    """The model's ``n`` RNN rows with ``action``; on CUDA each rewritten
    one took the cuDNN path at every length it was compiled for, and every
    call it counted ran cuDNN."""
    rows = wfpass.report(model).find("rnn", action)
    assert len(rows) == n, wfpass.report(model)
    if device == "cuda" and action == "rewritten":
        for rec in rows:
            assert set(rec.detail["paths"].values()) == {"cudnn"}, rec.detail
            assert rec.stats.get("cudnn_calls", 0) == calls(rec) > 0, rec.stats
    return rows


def calls(rec) -> int:
    """Calls counted on an RNN row, on either side of N (on CUDA N is 0)."""
    return rec.stats.get("fused_calls", 0) + rec.stats.get("unfused_calls", 0)


def assert_one_block(rnn: nn.Module, device: str) -> None:
    """The RNN's Parameters are views of one flat block (on CUDA, the
    block in cuDNN's layout that the op hands to cuDNN)."""
    ws = [getattr(rnn, n) for n in rnn._flat_weights_names]
    assert all(isinstance(w, nn.Parameter) for w in ws)
    fs = fused_storage_of(ws[0])
    assert fs is not None and all(fs.is_member(w) for w in ws), "not views of one block"
    assert len({w.untyped_storage().data_ptr() for w in ws}) == 1
    if device == "cuda":
        assert fs.kind == "rnn.cudnn", fs.kind


def one_storage(*ts) -> bool:
    return len({t.untyped_storage().data_ptr() for t in ts}) == 1


def proj_loss(out, seed=0):
    """``sum(out * R)`` with a fixed random R per output (float32): every
    output element gets its own gradient, on any device."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    g = torch.Generator().manual_seed(seed)
    total = 0
    for o in outs:
        if isinstance(o, torch.Tensor) and o.is_floating_point():
            total = total + (o.float() * torch.randn(o.shape, generator=g).to(o.device)).sum()
    return total


def assert_grads_close(model, ref, rel, what=""):
    """Every parameter's grad within ``rel`` of the largest reference grad."""
    top = max(q.grad.abs().max().item() for q in ref.parameters() if q.grad is not None)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), n
            continue
        assert p.grad is not None, f"no grad reached {n}"
        err = (p.grad.float() - q.grad.float()).abs().max().item()
        assert err <= rel * top, f"{what}grad of {n}: {err:.3e} > {rel} x {top:.3e}"


def assert_as_close_as_eager(got, eager, truth, what=""):
    """A half-precision (or autocast) result against eager's: within twice
    eager's own distance from an fp32 run's (``truth``), plus 1% of the
    largest value. Why not ``got`` against ``eager`` directly: a
    training-mode BatchNorm amplifies the dtype's rounding (measured on the
    CPU, bf16 eager's LSTM bias grads are 3-5% of the largest grad away
    from fp32's and the compiled model's as far on the other side), and on
    CUDA eager runs a bf16 LSTM on ATen's per-step kernels where wformat
    runs cuDNN."""
    got, eager, truth = got.detach().float(), eager.detach().float(), truth.detach().float()
    err = (got - truth).abs().max().item()
    eager_err = (eager - truth).abs().max().item()
    top = truth.abs().max().item()
    assert err <= 2 * eager_err + 1e-2 * top, (f"{what}{err:.3e} from fp32's, eager's {eager_err:.3e} "
                                               f"(largest {top:.3e})")


def assert_half_grads_close(model, ref, truth, what=""):
    """``assert_as_close_as_eager`` for every parameter's grad (1% of the
    largest grad of all)."""
    top = max(w.grad.abs().max().item() for w in truth.parameters())
    for (n, p), q, w in zip(model.named_parameters(), ref.parameters(), truth.parameters()):
        err = (p.grad.float() - w.grad).abs().max().item()
        eager_err = (q.grad.float() - w.grad).abs().max().item()
        assert err <= 2 * eager_err + 1e-2 * top, (f"{what}grad of {n}: {err:.3e} from fp32's, eager's "
                                                   f"{eager_err:.3e} (largest grad {top:.3e})")


def assert_close_tree(a, b, rtol, atol):
    if isinstance(a, torch.Tensor):
        assert a.device == b.device and a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)
    else:
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_close_tree(x, y, rtol, atol)


class Counting:
    """A wformat backend (``backend(**options)``) that counts the graphs
    Dynamo hands it (a recompile is a new graph)."""

    def __init__(self, **options):
        self.graphs = []
        be = backend(**options)

        def compile_graph(gm, example_inputs):
            self.graphs.append(gm)
            return be(gm, example_inputs)

        # capture.py finds the wformat backend a plain function closes over.
        self.backend = compile_graph


# -- models ----------------------------------------------------------------------------------------


I, H = 8, 16

RNN_VARIANTS = {
    # name: (class, kwargs, with an initial state)
    "lstm-2layer-bi-batch_first-state": (nn.LSTM, dict(num_layers=2, bidirectional=True, batch_first=True), True),
    "lstm-proj-state": (nn.LSTM, dict(num_layers=2, proj_size=4), True),
    "lstm-nobias": (nn.LSTM, dict(bias=False), False),
    "gru-2layer-bi-state": (nn.GRU, dict(num_layers=2, bidirectional=True), True),
    "rnn-relu-2layer": (nn.RNN, dict(num_layers=2, nonlinearity="relu"), False),
}


class RnnNet(nn.Module):
    """Linear -> RNN -> Linear; returns the head's output and the final state."""

    def __init__(self, cls, **kw):
        super().__init__()
        self.inp = nn.Linear(I, I)
        self.rnn = cls(I, H, **kw)
        out = (kw.get("proj_size") or H) * (2 if kw.get("bidirectional") else 1)
        self.head = nn.Linear(out, I)

    def forward(self, x, state=None):
        y, st = self.rnn(self.inp(x), state)
        return (self.head(y), *(st if isinstance(st, tuple) else (st,)))


def rnn_inputs(cls, kw, T, B, device, state):
    x = torch.randn((B, T, I) if kw.get("batch_first") else (T, B, I), device=device, requires_grad=True)
    if not state:
        return x, None
    D = kw.get("num_layers", 1) * (2 if kw.get("bidirectional") else 1)
    h0 = torch.randn(D, B, kw.get("proj_size") or H, device=device, requires_grad=True)
    if cls is nn.LSTM:
        return x, (h0, torch.randn(D, B, H, device=device, requires_grad=True))
    return x, h0


def clone_state(s):
    if s is None:
        return None
    if isinstance(s, tuple):
        return tuple(t.detach().clone().requires_grad_() for t in s)
    return s.detach().clone().requires_grad_()


class Three(nn.Module):
    """All three formats: Q/K/V siblings, a 2-layer LSTM, a BatchNorm, a head.
    Input [B, T, d]."""

    def __init__(self, d=I):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.rnn = nn.LSTM(d, d, num_layers=2, batch_first=True)
        self.bn = nn.BatchNorm1d(d)
        self.head = nn.Linear(d, d)

    def forward(self, x):
        h = self.q(x) * torch.sigmoid(self.k(x)) + self.v(x)
        y, _ = self.rnn(h)
        return self.head(self.bn(y.transpose(1, 2)).transpose(1, 2))


def bf16_three(device):
    """``Three`` in bf16, and its eager reference: the same model with the
    BatchNorm in fp32, which is what the batchnorm format makes of it."""
    model = Three().to(device, torch.bfloat16)
    ref = copy.deepcopy(model)
    ref.bn.float()
    return model, ref


class ConvBN(nn.Module):
    def __init__(self, c=6):
        super().__init__()
        self.c1, self.bn, self.c2 = nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.Conv2d(c, 4, 1)

    def forward(self, x):
        return self.c2(torch.relu(self.bn(self.c1(x))))


# -- equal to eager, same Parameter objects -------------------------------------------------------


@pytest.mark.parametrize("variant", list(RNN_VARIANTS))
def test_rnn_equal_to_eager_forward_and_backward_from_one_flat_block(device, variant):
    """Every RNN kind, T = 1 and T = 7, the final state used (and an
    initial state given where the variant says): output, state and every
    gradient (input, state, weights) equal eager's cuDNN call; the
    Parameters are the same objects, views of one flat block; state_dict
    keys and shapes unchanged."""
    cls, kw, state = RNN_VARIANTS[variant]
    torch.manual_seed(0)
    model = RnnNet(cls, **kw).to(device)
    ref = copy.deepcopy(model)
    ids, keys = param_ids(model), {k: v.shape for k, v in model.state_dict().items()}
    fn = torch.compile(model, backend=backend())
    for T in (1, 7):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        x, s = rnn_inputs(cls, kw, T, 3, device, state)
        xr, sr = x.detach().clone().requires_grad_(), clone_state(s)
        out, expected = fn(x, s), ref(xr, sr)
        assert_close_tree(out, expected, rtol=1e-4, atol=1e-5)
        proj_loss(out).backward()
        proj_loss(expected).backward()
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)
        for a, b in zip(s if isinstance(s, tuple) else [s] if s is not None else [],
                        sr if isinstance(sr, tuple) else [sr] if sr is not None else []):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)
        assert_grads_close(model, ref, 1e-4, f"T={T}: ")
    (rec,) = rnn_rows(model, device)
    assert calls(rec) == 2, rec.stats
    assert param_ids(model) == ids
    assert {k: v.shape for k, v in model.state_dict().items()} == keys
    assert_one_block(model.rnn, device)


@pytest.mark.parametrize("path", ["fused", "split"])
def test_linear_equal_to_eager_one_block_and_adam_steps(device, path):
    """Q/K/V (k without a bias): forward and backward equal eager's, the
    same Parameter objects, the weights views of one block; three Adam steps (foreach)
    equal eager's, still one block, no fallback."""
    torch.manual_seed(0)
    model = QKV(k_bias=False).to(device)
    ids = param_ids(model)

    def transform(m):
        return torch.compile(m, backend=backend(linear={"path": path}))

    x = torch.randn(2, 5, 32, device=device, requires_grad=True)
    assert_same_fwd_bwd(model, transform, [x])
    assert param_ids(model) == ids
    # (The biases stay apart: k has none, so the bias vector is built per call.)
    assert one_storage(model.q.weight, model.k.weight, model.v.weight)
    assert wfpass.report(model).find("linear", "rewritten")

    torch._dynamo.reset()
    model = QKV(k_bias=False).to(device)
    ref = copy.deepcopy(model)
    fn = transform(model)
    batches = [(torch.randn(2, 5, 32, device=device),) for _ in range(3)]
    losses = train_steps(model, fn, lambda i: batches[i], torch.optim.Adam, steps=3, lr=1e-2, foreach=True)
    ref_losses = train_steps(ref, ref, lambda i: batches[i], torch.optim.Adam, steps=3, lr=1e-2, foreach=True)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-4, atol=1e-5)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=n)
    (rec,) = wfpass.report(model).find("linear", "rewritten")
    assert rec.stats.get("fallback_calls", 0) == 0 and rec.detail["path"] == path, (rec.stats, rec.detail)
    assert one_storage(model.q.weight, model.k.weight, model.v.weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_batchnorm_fp32_statistics_train_like_eager_with_an_fp32_batchnorm(device, dtype):
    """A half conv-BatchNorm model in training, three SGD steps: outputs,
    gradients and running statistics equal eager's with the BatchNorm in
    fp32 (the format's definition); the BatchNorm's tensors are the same
    objects, now fp32."""
    torch.manual_seed(0)
    model = ConvBN().to(device, dtype).train()
    ref = copy.deepcopy(model)
    ref.bn.float()
    bn_ids = {k: id(getattr(model.bn, k)) for k in ("weight", "bias", "running_mean", "running_var")}
    fn = torch.compile(model, backend=backend())
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in (model, ref)]
    tol = 2 * TOL[dtype][0]
    for step in range(3):
        x = (torch.randn(6, 3, 5, 5, device=device) * 2 + 0.5).to(dtype)
        out, expected = fn(x), ref(x)
        torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)
        proj_loss(out).backward()
        proj_loss(expected).backward()
        assert_grads_close(model, ref, 3e-2, f"step {step}: ")
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        for k in ("running_mean", "running_var"):
            a, b = getattr(model.bn, k), getattr(ref.bn, k)
            assert a.dtype == torch.float32
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=k)
    assert {k: id(getattr(model.bn, k)) for k in bn_ids} == bn_ids
    assert model.bn.weight.dtype == torch.float32 and model.c1.weight.dtype == dtype
    assert wfpass.report(model).find("batchnorm", "rewritten"), wfpass.report(model)


# -- checkpoints, ties, hooks -------------------------------------------------------------------------


def test_state_dict_round_trips_and_restore_all_three_formats(device):
    """A bf16 model holding all three formats, after a training step:
    ``state_dict()`` has the plain model's keys and shapes; ``torch.save`` ->
    ``torch.load`` into a plain model gives every value (the BatchNorm's cast
    to bf16), and a plain model's checkpoint loads into the fused one in
    place (same objects, still one block, BatchNorm fp32), after which a call
    equals eager's loaded from the same file; ``wfpass.restore`` gives every
    tensor its own storage with the same values."""
    torch.manual_seed(0)
    model, ref = bf16_three(device)
    ids = param_ids(model)
    fn = torch.compile(model, backend=backend(linear={"path": "fused"}))
    x = torch.randn(4, 5, I, device=device, dtype=torch.bfloat16)
    proj_loss(fn(x)).backward()
    plain = Three().to(device, torch.bfloat16)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}
    assert list(model.state_dict()) == list(plain.state_dict())
    assert_one_block(model.rnn, device)
    assert one_storage(model.q.weight, model.k.weight, model.v.weight)
    assert model.bn.running_var.dtype == torch.float32

    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    plain.load_state_dict(torch.load(buf))
    for (k, a), b in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a.to(b.dtype), b), k

    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(0.5)
        plain.bn.running_var.uniform_(1, 2)
    buf = io.BytesIO()
    torch.save(plain.state_dict(), buf)
    for m in (model, ref):
        buf.seek(0)
        m.load_state_dict(torch.load(buf))
    assert param_ids(model) == ids
    assert_one_block(model.rnn, device)  # copied in place
    assert one_storage(model.q.weight, model.k.weight, model.v.weight)
    assert model.bn.running_var.dtype == torch.float32
    for (k, a), b in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b.to(a.dtype)), k
    model.eval()
    ref.eval()
    with torch.no_grad():  # (one bf16 call: cuDNN's LSTM against eager's, ATen's per-step one on CUDA)
        torch.testing.assert_close(fn(x).float(), ref(x).float(), rtol=5e-2, atol=5e-2)

    values = {k: v.clone() for k, v in model.state_dict().items()}
    wfpass.restore(model)
    assert param_ids(model) == ids
    ptrs = [p.untyped_storage().data_ptr() for p in model.parameters()]
    assert len(set(ptrs)) == len(ptrs)
    for k, v in model.state_dict().items():
        assert torch.equal(v.to(values[k].dtype), values[k]), k


class TiedLM(nn.Module):
    """``lm_head.weight`` is ``emb.weight``, and ``lm_head`` has a sibling
    (a value head): the tied Parameter is a member of a sibling group."""

    def __init__(self, V=24, d=8):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.lm_head = nn.Linear(d, V, bias=False)
        self.lm_head.weight = self.emb.weight
        self.value = nn.Linear(d, 1)

    def forward(self, ids):
        h = torch.tanh(self.emb(ids))
        return self.lm_head(h), self.value(h)


class TiedRnns(nn.Module):
    """Two LSTMs sharing one Parameter (``weight_hh_l0``)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.LSTM(I, I), nn.LSTM(I, I)
        self.b.weight_hh_l0 = self.a.weight_hh_l0

    def forward(self, x):
        return self.b(self.a(x)[0])[0]


@pytest.mark.parametrize("what", ["embedding-in-a-linear-group", "weight-shared-by-two-rnns",
                                  "batchnorm-statistics-sharing-storage"])
def test_ties_stay_tied_and_train_like_eager(device, what):
    """Never silently untied: the tied embedding is fused with its group and
    stays one Parameter (through three SGD steps and a dtype round trip);
    two RNNs sharing a weight are rewritten with their weights left in place;
    a BatchNorm statistic that is a view of a bigger buffer is skipped with
    the reason. Each trains like eager."""
    torch.manual_seed(0)
    if what == "embedding-in-a-linear-group":
        model = TiedLM().to(device)
        make = lambda g: (torch.randint(0, 24, (2, 5), generator=g).to(device),)  # noqa: E731
        fn = torch.compile(model, backend=backend(linear={"path": "fused"}))
    elif what == "weight-shared-by-two-rnns":
        model = TiedRnns().to(device)
        make = lambda g: (torch.randn(6, 3, I, generator=g).to(device),)  # noqa: E731
        fn = torch.compile(model, backend=backend())
    else:
        model = ConvBN().to(device, torch.bfloat16)
        model.register_buffer("stats", torch.zeros(12, device=device, dtype=torch.bfloat16))
        model.bn.running_mean = model.stats[:6]
        make = lambda g: (torch.randn(2, 3, 5, 5, generator=g).to(device, torch.bfloat16),)  # noqa: E731
        fn = torch.compile(model, backend=backend())
    ref = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    tol = 3e-2 if what.startswith("batchnorm") else 1e-4

    def train(steps=3, seed=0):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            batch = make(g)
            outs = []
            for f, o in ((fn, opts[0]), (ref, opts[1])):
                o.zero_grad(set_to_none=True)
                out = f(*batch)
                proj_loss(out).backward()
                o.step()
                outs.append(out)
            assert_close_tree(outs[0], outs[1], rtol=tol, atol=tol)
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.float(), q.float(), rtol=tol, atol=tol, msg=n)

    train()
    rep = wfpass.report(model)
    if what == "embedding-in-a-linear-group":
        (rec,) = rep.find("linear", "rewritten")
        assert "value.weight" in rec.params and set(rec.params) & {"emb.weight", "lm_head.weight"}, rec.params
        for m in (model, ref):  # the layout is lost, the tie is not; the next call re-fuses
            m.to(torch.float64)
            m.float()
        train(seed=1)
        assert model.emb.weight is model.lm_head.weight and len(list(model.parameters())) == 3
        assert one_storage(model.emb.weight, model.value.weight)
    elif what == "weight-shared-by-two-rnns":
        # The first RNN's block holds the shared Parameter (the same object:
        # nothing untied); the second reads its weights where they are.
        rows = rnn_rows(model, device, n=2)
        assert any("left where they are" in r.reason for r in rows), [r.reason for r in rows]
        assert model.a.weight_hh_l0 is model.b.weight_hh_l0
    else:
        (rec,) = rep.find("batchnorm")
        assert rec.action == "skipped" and "untie" in rec.reason, rec.reason
        assert model.bn.running_mean.dtype == torch.bfloat16 and one_storage(model.bn.running_mean, model.stats)


def _halve_weight(module, args):
    with torch.no_grad():
        module.weight.mul_(0.5)


def _clamp_rnn_weight(module, args):
    with torch.no_grad():
        module.weight_hh_l0.clamp_(-0.1, 0.1)


def _scale_rnn_output(module, args, out):
    return (out[0] * 0.5, out[1])


def test_hooks_run_as_in_eager(device):
    """Module hooks Dynamo traces into the graph and gradient hooks on the
    Parameters: a pre-hook writing an LSTM weight in place (the rewritten
    call reads the written weight), a pre-hook writing a member of the Q/K/V
    group (the group is left, with the reason), a forward hook changing the
    LSTM's output; gradient hooks on a fused LSTM weight and a fused linear
    weight see eager's gradients, one of them doubling it. Three SGD steps
    equal eager's."""
    torch.manual_seed(0)
    model = Three().to(device)
    model.rnn.register_forward_pre_hook(_clamp_rnn_weight)
    model.rnn.register_forward_hook(_scale_rnn_output)
    model.k.register_forward_pre_hook(_halve_weight)
    ref = copy.deepcopy(model)
    seen = {"model": [], "ref": []}
    for name, m in (("model", model), ("ref", ref)):
        m.rnn.weight_ih_l1.register_hook(lambda g, name=name: seen[name].append(g.clone()))
        m.head.weight.register_hook(lambda g: g * 2)
    fn = torch.compile(model, backend=backend())
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref)]
    for step in range(3):
        x = torch.randn(4, 6, I, device=device)
        outs = []
        for f, o in ((fn, opts[0]), (ref, opts[1])):
            o.zero_grad(set_to_none=True)
            outs.append(f(x))
            proj_loss(outs[-1]).backward()
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)
        assert_grads_close(model, ref, 1e-4, f"step {step}: ")
        for o in opts:
            o.step()
    assert len(seen["model"]) == len(seen["ref"]) == 3
    for a, b in zip(seen["model"], seen["ref"]):
        # Scaled by the largest, as assert_grads_close does: cuDNN's fp32
        # backward sums in its own order (seen on an H100: 1.6e-5 on one
        # element of 256 after two SGD steps, 2.8e-4 of that element).
        assert (a - b).abs().max() <= 1e-4 * b.abs().max(), ((a - b).abs().max(), b.abs().max())
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=n)
    rep = wfpass.report(model)
    (rec,) = rnn_rows(model, device)
    assert "weight_hh_l0" in rec.detail["written_in_graph"], rec.detail
    assert any("written in place inside the graph" in r.reason for r in rep.find("linear", "skipped")), rep


# -- moves, casts, loads -------------------------------------------------------------------------------


def test_to_half_and_load_state_dict_lifecycle(device):
    """After compiling, the model lives on: float64 and back (the layouts
    are lost and re-fused, counted), ``.half()`` (the BatchNorm format
    applies, the RNN runs in fp16) and ``.float()``, ``load_state_dict(assign=True)``
    (new tensors, re-fused), ``param.data = ...`` on an LSTM weight, and on a
    GPU ``.cpu()`` and back to CUDA. Every call equals eager's model moved the
    same way; the Parameters stay the same objects."""
    torch.manual_seed(0)
    model = Three().to(device).eval()
    ref = copy.deepcopy(model)
    ids = param_ids(model)
    fn = torch.compile(model, backend=backend(linear={"path": "fused"}))

    def check(dtype, where=device, tol=None):
        x = torch.randn(3, 5, I, device=where).to(dtype)
        with torch.no_grad():
            got, want = fn(x), ref(x)
        assert got.dtype == want.dtype and got.device == want.device
        t = tol or TOL[dtype]
        torch.testing.assert_close(got.float(), want.float(), rtol=t[0], atol=t[1])
        assert param_ids(model) == ids

    check(torch.float32)
    (lin,) = wfpass.report(model).find("linear", "rewritten")
    (rnn,) = rnn_rows(model, device)
    for m in (model, ref):
        m.double()
    check(torch.float64)
    for m in (model, ref):
        m.float()
    check(torch.float32)
    assert lin.stats.get("re_fused", 0) >= 1 and rnn.stats.get("re_fused", 0) >= 1, (lin.stats, rnn.stats)
    assert_one_block(model.rnn, device)

    for m in (model, ref):
        m.half()
    ref.bn.float()  # the batchnorm format's definition
    check(torch.float16, tol=(1e-2, 1e-2))
    assert model.bn.running_var.dtype == torch.float32 and model.rnn.weight_ih_l0.dtype == torch.float16
    assert wfpass.report(model).find("batchnorm", "rewritten")
    for m in (model, ref):
        m.float()
    check(torch.float32)

    plain = Three().to(device)
    sd = plain.state_dict()
    for m in (model, ref):
        m.load_state_dict({k: v.clone() for k, v in sd.items()}, assign=True)
    ids = param_ids(model)  # assign=True puts new Parameters in
    check(torch.float32)
    assert_one_block(model.rnn, device)
    assert one_storage(model.q.weight, model.k.weight, model.v.weight)

    with torch.no_grad():
        w = torch.randn_like(model.rnn.weight_hh_l1)
        model.rnn.weight_hh_l1.data = w.clone()
        ref.rnn.weight_hh_l1.data = w.clone()
    check(torch.float32)
    assert_one_block(model.rnn, device)

    if device == "cuda":  # (the dry run has no other device to move to)
        for m in (model, ref):
            m.cpu()
        check(torch.float32, where="cpu")
        assert model.rnn.weight_ih_l0.device.type == "cpu"
        for m in (model, ref):
            m.cuda()
        check(torch.float32)
        assert_one_block(model.rnn, device)


# -- one graph for many layers, many lengths ------------------------------------------------------------


class Layer(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.rnn = nn.LSTM(d, d, batch_first=True)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        h = self.q(x) * torch.sigmoid(self.k(x)) + self.v(x)
        return self.norm(x + self.rnn(h)[0])


class Stack(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_regional_compilation_fuses_each_layer_once(device):
    """``layer.compile()`` per block: one graph runs for every layer; each
    layer's Q/K/V and LSTM are fused once, on their first call, and found
    again on every later call (no re-fuse, no fallback); four SGD steps
    equal eager's."""
    torch.manual_seed(0)
    model = Stack().to(device)
    ref = copy.deepcopy(model)
    be = backend(linear={"path": "fused"})
    for layer in model.layers:
        layer.compile(backend=be)
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, ref)]
    for step in range(4):
        x = torch.randn(2, 5, 16, device=device)
        outs = []
        for m, o in ((model, opts[0]), (ref, opts[1])):
            o.zero_grad(set_to_none=True)
            outs.append(m(x))
            proj_loss(outs[-1]).backward()
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)
        assert_grads_close(model, ref, 1e-4, f"step {step}: ")
        for o in opts:
            o.step()
    rep = wfpass.report(model)
    linear = rep.find("linear", "rewritten")
    rnns = rnn_rows(model, device, n=len(model.layers))
    assert len(linear) == len(model.layers), rep
    for rec in linear + rnns:
        assert rec.stats.get("re_fused", 0) == 0 and rec.stats.get("fallback_calls", 0) == 0, rec.stats
        assert rec.stats.get("unfused_layout_calls", 0) == 0, rec.stats
    assert all(calls(r) == 4 for r in rnns), [r.stats for r in rnns]
    assert all(r.stats["fused_calls"] == 4 for r in linear), [r.stats for r in linear]
    for layer in model.layers:
        assert_one_block(layer.rnn, device)
        assert one_storage(layer.q.weight, layer.k.weight, layer.v.weight)


def test_a_dynamic_length_after_a_recompile(device):
    """Inference at five lengths: Dynamo's static first graph, then one graph
    with the length symbolic serves the rest (on CUDA on the cuDNN path);
    then training at two more lengths (a training graph's sizes may be
    specialized: cuDNN's reserve); every output and gradient equals eager's."""
    torch.manual_seed(0)
    model = nn.LSTM(I, H, num_layers=2, batch_first=True).to(device)
    ref = copy.deepcopy(model)
    counting = Counting()
    fn = torch.compile(model, backend=counting.backend)
    with torch.no_grad():
        # (No length equal to another size of the input: Dynamo would
        # duck-size them into one symbol.)
        for T in (4, 7, 9, 40, 5):
            x = torch.randn(3, T, I, device=device)
            (out, (h, c)), (eo, (eh, ec)) = fn(x), ref(x)
            torch.testing.assert_close(out, eo, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(c, ec, rtol=1e-4, atol=1e-5)
    assert len(counting.graphs) == 2, f"{len(counting.graphs)} graphs for 5 lengths: the length was specialized"
    (rec,) = rnn_rows(model, device)
    assert "T=symbolic" in rec.detail["paths"], rec.detail
    for T in (6, 11):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        x = torch.randn(3, T, I, device=device, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        out, eo = fn(x)[0], ref(xr)[0]
        torch.testing.assert_close(out, eo, rtol=1e-4, atol=1e-5)
        proj_loss(out).backward()
        proj_loss(eo).backward()
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)
        assert_grads_close(model, ref, 1e-4, f"T={T}: ")
    rnn_rows(model, device)
    assert calls(rec) == 7, rec.stats


class Checkpointed(nn.Module):
    """Q/K/V and a GRU inside a checkpointed region, an LSTM after it."""

    def __init__(self, d=I):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.inner = nn.GRU(d, d, batch_first=True)
        self.outer = nn.LSTM(d, d, batch_first=True)

    def body(self, x):
        return self.inner(self.q(x) * torch.sigmoid(self.k(x)) + self.v(x))[0]

    def forward(self, x):
        return self.outer(cp.checkpoint(self.body, x, use_reentrant=False))[0]


def test_gradient_checkpointing(device):
    """A checkpointed region: its Q/K/V are fused as outside it (the
    backward's recomputation reads the same block); the GRU inside it is
    left, with a record saying so, and runs as PyTorch traces it; the LSTM
    outside it is rewritten. Forward and backward equal eager's."""
    torch.manual_seed(0)
    model = Checkpointed().to(device)
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=backend(linear={"path": "fused"}))
    for step in range(2):
        x = torch.randn(3, 6, I, device=device, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        out, expected = fn(x), ref(xr)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        proj_loss(out).backward()
        proj_loss(expected).backward()
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)
        assert_grads_close(model, ref, 1e-4, f"step {step}: ")
    rep = wfpass.report(model)
    (lin,) = rep.find("linear", "rewritten")
    assert lin.detail.get("region") == "tag_activation_checkpoint", lin.detail
    assert one_storage(model.q.weight, model.k.weight, model.v.weight)
    (inner,) = rep.find("rnn", "skipped")
    assert "inside a tag_activation_checkpoint region" in inner.reason and any("inner" in p for p in inner.params)
    (outer,) = rnn_rows(model, device)
    assert all("outer" in p for p in outer.params), outer.params
    assert_one_block(model.outer, device)


# -- autocast, dropout -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast(device, dtype):
    """An fp32 model under autocast, two training steps: outputs and fp32
    gradients as close to an fp32 run's as eager's under the same autocast
    (``assert_as_close_as_eager``). On CUDA the LSTM is rewritten and runs
    in fp16 whatever the region's dtype (eager's rule for cuDNN RNNs), its
    fp32 Parameters still one block; the BatchNorm (fp32 Parameters) is
    skipped, saying autocast."""
    torch.manual_seed(0)
    model = Three().to(device).train()
    ref, truth = copy.deepcopy(model), copy.deepcopy(model)  # truth: no autocast
    fn = torch.compile(model, backend=backend())
    seen = []  # per step: outputs and grads of (compiled, eager, fp32), compared below
    for step in range(2):
        x = torch.randn(4, 6, I, device=device)
        for m in (model, ref, truth):
            m.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=dtype):
            out, expected = fn(x), ref(x)
        exact = truth(x)
        assert out.dtype == expected.dtype
        for o in (out, expected, exact):
            proj_loss(o).backward()
        for n, p in model.named_parameters():
            assert p.grad.dtype == torch.float32, n
        seen.append([(o.detach(), [p.grad.clone() for p in m.parameters()])
                     for o, m in ((out, model), (expected, ref), (exact, truth))])
    rep = wfpass.report(model)
    bn = rep.find("batchnorm")
    assert bn and all(r.action == "skipped" and "autocast" in r.reason for r in bn), rep
    assert all(p.dtype == torch.float32 for p in model.parameters())
    cpu_differs(device, "on the CPU an RNN inside autocast is left to the inner compiler, which runs torch's per-step "
                        "decomposition with every step's matmuls in the autocast dtype; eager runs oneDNN's whole-"
                        "sequence kernel: measured, the compiled bf16 grads are 4x further from fp32's than eager's "
                        "(CUDA rewrites it to eager's fp16 cuDNN call)")
    names = [n for n, _ in model.named_parameters()]
    for step, ((out, grads), (expected, eager_grads), (exact, exact_grads)) in enumerate(seen):
        assert_as_close_as_eager(out, expected, exact, f"step {step}, output: ")
        top = max(g.abs().max().item() for g in exact_grads)
        for n, g, e, t in zip(names, grads, eager_grads, exact_grads):
            err, eager_err = (g - t).abs().max().item(), (e - t).abs().max().item()
            assert err <= 2 * eager_err + 1e-2 * top, (f"step {step}, grad of {n}: {err:.3e} from fp32's, "
                                                       f"eager's {eager_err:.3e} (largest grad {top:.3e})")
    rnn_rows(model, device)
    assert_one_block(model.rnn, device)


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(I, I)
        self.rnn = nn.LSTM(I, H, num_layers=3, dropout=0.5)
        self.head = nn.Linear(H, I)

    def forward(self, x):
        return self.head(self.rnn(self.inp(x))[0])


def test_dropout_between_layers(device):
    """Dropout between layers in training: reproducible after
    ``torch.manual_seed``, another seed draws other masks, two calls draw
    different masks; the gradient is the derivative of the function the
    forward computed (central differences, float64, the same seed); eval
    equals eager; and the first call, the one that compiles, draws what a
    later call after the same seed draws. (On CUDA the masks are cuDNN's,
    not eager's draws, so training outputs are compared by these
    properties, not to eager.)"""
    torch.manual_seed(0)
    model = DropoutNet().to(device, torch.float64).train()
    ref = copy.deepcopy(model).eval()
    fn = torch.compile(model, backend=backend())
    x = torch.randn(5, 3, I, device=device, dtype=torch.float64, requires_grad=True)

    def run(seed, inp):
        torch.manual_seed(seed)
        return fn(inp)

    first = run(1, x)  # compiles the training graph
    with torch.no_grad():
        run(1, x)  # and the one without grad (the finite differences below)
    a, b, c = run(1, x), run(1, x), run(2, x)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(fn(x), fn(x))
    R = torch.randn_like(a)
    (a * R).sum().backward()
    d = torch.randn_like(x)
    eps = 1e-6
    with torch.no_grad():
        fd = ((run(1, x + eps * d) * R).sum() - (run(1, x - eps * d) * R).sum()) / (2 * eps)
    torch.testing.assert_close((x.grad * d).sum(), fd, rtol=1e-4, atol=1e-6)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(fn(x), ref(x), rtol=1e-7, atol=1e-9)
    rnn_rows(model, device)
    assert_one_block(model.rnn, device)
    # Last, as it names its own cause: on CUDA the compile measures cuDNN's
    # training reserve by running cuDNN with dropout (``reserve_numel``);
    # if that run advances the shared dropout state, the first call draws
    # other masks than every later call after the same seed.
    assert torch.equal(first, a), ("the first call after torch.manual_seed(1), which compiled, drew other masks "
                                   "than later calls after the same seed (a compile-time cuDNN run with dropout "
                                   "advanced the dropout state?)")


# -- variable-length batches -------------------------------------------------------------------------


class PackedNet(nn.Module):
    """Linear -> pack_padded_sequence (unsorted lengths) -> 2-layer
    bidirectional RNN -> pad_packed_sequence (back to T) -> Linear, and the
    final state."""

    def __init__(self, kind):
        super().__init__()
        self.inp = nn.Linear(5, I)
        self.rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(I, H, num_layers=2, bidirectional=True)
        self.out = nn.Linear(2 * H, 3)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(self.inp(x), lengths, enforce_sorted=False)
        y, state = self.rnn(packed)
        y, lens = pad_packed_sequence(y, total_length=x.shape[0])
        h = state[0] if isinstance(state, tuple) else state
        return self.out(y), lens, h


def _packed_paths(cap):
    from wfpass.rnn.varlen.sequence import PackedRnnForward

    return [n.target.path for g in cap.graphs for n in g.graph.nodes
            if n.op == "call_function" and isinstance(n.target, PackedRnnForward)]


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_variable_length_batches_in_one_graph(device, kind):
    """pack_padded_sequence -> RNN -> pad_packed_sequence in one graph (no
    graph break), on CUDA one cuDNN call in packed mode: forward, backward
    and an SGD step equal eager's (cuDNN's packed call on CUDA); batches of
    other sizes and lengths reuse one more graph (the sizes symbolic).
    The lengths stay on the CPU, as eager requires."""
    torch.manual_seed(0)
    model = PackedNet(kind).to(device)
    ref = copy.deepcopy(model)
    cap = Capture()

    def inner(gm, example_inputs):
        cap(gm, example_inputs)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)

    fn = torch.compile(model, backend=backend(inner=inner))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    batches = [(7, [3, 7, 1, 5]), (9, [9, 2, 4]), (6, [2, 6, 6, 3])]
    for i, (T, lengths) in enumerate(batches):
        x = torch.randn(T, len(lengths), 5, device=device, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        L = torch.tensor(lengths)
        for o in opts:
            o.zero_grad(set_to_none=True)
        out, expected = fn(x, L), ref(xr, L)
        assert out[1].device.type == "cpu" and torch.equal(out[1], expected[1])  # the lengths, as eager's
        assert_close_tree(out, expected, rtol=1e-4, atol=1e-5)
        proj_loss(out).backward()
        proj_loss(expected).backward()
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)
        assert_grads_close(model, ref, 1e-4, f"batch {i}: ")
        for o in opts:
            o.step()
        if i == 0:
            assert len(cap.graphs) == 1, "pack -> RNN -> pad must be one graph (no graph break)"
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=n)
    assert len(cap.graphs) == 2, f"{len(cap.graphs)} graphs for 3 batches"
    (row,) = wfpass.report(model).find("rnn", "rewritten")
    assert "variable-length batch" in row.reason and row.stats["fused_calls"] == 3, (row.reason, row.stats)
    if device == "cuda":
        assert set(_packed_paths(cap)) == {"cudnn"}, _packed_paths(cap)
    assert_one_block(model.rnn, device)


# -- end to end through Inductor ------------------------------------------------------------------


def test_all_three_formats_train_through_inductor(device):
    """A bf16 model with all three formats through Inductor (the default
    inner compiler): three SGD steps, outputs, gradients and parameters
    equal eager's with the BatchNorm in fp32 (bf16 tolerances); one graph;
    every format rewritten."""
    torch.manual_seed(0)
    model, ref = bf16_three(device)
    truth = Three().to(device)  # fp32, the same weights: how far bf16 rounding takes eager
    truth.load_state_dict(ref.state_dict())
    counting = Counting(inner="inductor", linear={"path": "fused"})
    fn = torch.compile(model, backend=counting.backend)
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (model, ref, truth)]
    for step in range(3):
        x = torch.randn(4, 6, I, device=device, dtype=torch.bfloat16)
        outs = []
        for f, o, inp in ((fn, opts[0], x), (ref, opts[1], x), (truth, opts[2], x.float())):
            o.zero_grad(set_to_none=True)
            outs.append(f(inp))
            proj_loss(outs[-1]).backward()
        assert_as_close_as_eager(outs[0], outs[1], outs[2], f"step {step}, output: ")
        assert_half_grads_close(model, ref, truth, f"step {step}: ")
        for o in opts:
            o.step()
    for (n, p), q, w in zip(model.named_parameters(), ref.parameters(), truth.parameters()):
        assert_as_close_as_eager(p, q, w, f"{n} after 3 steps: ")
    assert len(counting.graphs) == 1
    assert {r.pattern for r in wfpass.report(model).rewritten} >= {"linear", "rnn", "batchnorm"}
    rnn_rows(model, device)
    assert_one_block(model.rnn, device)
    assert model.bn.running_var.dtype == torch.float32


# -- no host-device synchronisation in a steady-state step ---------------------------------------------

SYNC_KINDS = {
    "lstm": (nn.LSTM, {}),
    "gru": (nn.GRU, {}),
    "rnn": (nn.RNN, {}),
    "lstm-2layer-dropout": (nn.LSTM, dict(num_layers=2, dropout=0.3)),
}


@contextlib.contextmanager
def sync_debug(device: str, mode: str):
    """``torch.cuda.set_sync_debug_mode(mode)`` for the block, then back
    (on the CPU, in the dry run, nothing: there is no host-device sync)."""
    if device != "cuda":
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def where_it_synced(step, device) -> str:
    """Run ``step`` once more with syncs as warnings, each seen at the
    Python line that called the op (generated graph code included: Inductor
    and FX register their source with ``linecache``): which op synced."""
    import linecache

    with warnings.catch_warnings(record=True) as seen, sync_debug(device, "warn"):
        warnings.simplefilter("always")
        step()
    lines = []
    for w in seen:
        if "synchroniz" in str(w.message):
            src = linecache.getline(w.filename, w.lineno).strip()
            lines.append(f"  {w.filename}:{w.lineno}: {src}  ({str(w.message).splitlines()[0][:120]})")
    return "\n".join(dict.fromkeys(lines)) or "  (no sync seen in warn mode)"


@pytest.mark.parametrize("kind", list(SYNC_KINDS))
def test_no_host_device_sync_in_a_steady_state_training_step(device, kind):
    """After warm-up, forward, backward and an SGD step (momentum, foreach)
    of a model compiled with the cuDNN path through Inductor run under
    ``torch.cuda.set_sync_debug_mode("error")``: no host-device sync, and
    no recompile. A sync fails the test naming the Python line (and so the
    op) that made it."""
    cls, kw = SYNC_KINDS[kind]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), _First(cls(32, 64, **kw)), nn.Linear(64, 16)).to(device).train()
    counting = Counting(inner="inductor")
    fn = torch.compile(model, backend=counting.backend)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=True)
    x = torch.randn(16, 8, 32, device=device)

    def step():
        out = fn(x)
        out.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    graphs = len(counting.graphs)
    try:
        with sync_debug(device, "error"):
            for _ in range(3):
                step()
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])
        pytest.fail(f"a host-device sync in a steady-state training step ({kind}):\n{where_it_synced(step, device)}"
                    f"\nfirst error:\n{tb}")
    if device == "cuda":
        torch.cuda.synchronize()
    assert len(counting.graphs) == graphs, "a steady-state step recompiled"
    rnn_rows(model, device)
    assert_one_block(model[1].rnn, device)


class _First(nn.Module):
    """An RNN's output sequence alone (``nn.Sequential`` passes one tensor)."""

    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        return self.rnn(x)[0]
