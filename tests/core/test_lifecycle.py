"""A fused model across its life: checkpoints, moves and casts, optimizers,
restore (issue 5, the parts that concern fused linears)."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn

import wfpass
from models import QKV, SwiGLU
from wfpass.core.storage import fused_storage_of
from wftest import TOL, needs_gpu, param_ids, train_steps


def _fused(model, x=None, **kw):
    c = torch.compile(model, backend=wfpass.backend(inner="aot_eager", linear_path="fused", **kw))
    c(torch.randn(1, 32) if x is None else x)
    assert model.q.weight.untyped_storage().data_ptr() == model.v.weight.untyped_storage().data_ptr()
    return c


def _trained():
    torch.manual_seed(0)
    model = QKV(k_bias=False)
    c = _fused(model)
    train_steps(model, c, lambda i: (torch.randn(2, 32),), torch.optim.Adam, steps=3, lr=1e-2)
    return model


def _same(a: nn.Module, b: nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].shape == sb[k].shape and torch.equal(sa[k], sb[k]), k


def test_torch_save_load_both_directions(tmp_path):
    fused = _trained()
    torch.save(fused.state_dict(), tmp_path / "fused.pt")
    plain = QKV(k_bias=False)
    plain.load_state_dict(torch.load(tmp_path / "fused.pt"))
    _same(fused, plain)
    # A file saved by the fused model is no larger than a plain model's.
    torch.save(plain.state_dict(), tmp_path / "plain.pt")
    assert os.path.getsize(tmp_path / "fused.pt") <= os.path.getsize(tmp_path / "plain.pt")
    # And the reverse: a plain checkpoint into the fused model keeps the layout.
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(2)
    torch.save(plain.state_dict(), tmp_path / "plain2.pt")
    fused.load_state_dict(torch.load(tmp_path / "plain2.pt"), strict=True)
    _same(fused, plain)
    assert fused.q.weight.untyped_storage().data_ptr() == fused.v.weight.untyped_storage().data_ptr()


def test_load_state_dict_non_strict_and_assign():
    fused = _trained()
    src = QKV(k_bias=False)
    sd = {k: v for k, v in src.state_dict().items() if not k.startswith("o.")}
    missing, unexpected = fused.load_state_dict(sd, strict=False)
    assert set(missing) == {"o.weight", "o.bias"} and not unexpected
    for k in sd:
        assert torch.equal(fused.state_dict()[k], sd[k])
    ref = copy.deepcopy(src)
    c = torch.compile(fused, backend=wfpass.backend(inner="aot_eager", linear_path="fused"))
    fused.load_state_dict(copy.deepcopy(src.state_dict()), assign=True)
    x = torch.randn(1, 32)
    torch.testing.assert_close(c(x), ref(x))


def test_assign_load_of_a_fused_checkpoint_then_restore_gives_independent_storage(tmp_path):
    """torch.save writes a view's whole storage, so a checkpoint of a fused
    model loads as views of one storage; with assign=True even a plain model
    then shares storage between its parameters (values right; safetensors'
    save_model refuses it). wfpass.restore separates them, values intact."""
    st = pytest.importorskip("safetensors.torch")
    fused = _trained()
    torch.save(fused.state_dict(), tmp_path / "fused.pt")
    plain = QKV(k_bias=False)
    plain.load_state_dict(torch.load(tmp_path / "fused.pt"), assign=True)
    ptrs = lambda m: {p.untyped_storage().data_ptr() for p in m.parameters()}
    assert len(ptrs(plain)) < len(list(plain.parameters()))  # what torch.load gives
    with pytest.raises(RuntimeError):
        st.save_model(plain, str(tmp_path / "refused.safetensors"))
    ids = param_ids(plain)
    assert wfpass.restore(plain) > 0
    assert len(ptrs(plain)) == len(list(plain.parameters())) and param_ids(plain) == ids
    _same(fused, plain)
    st.save_model(plain, str(tmp_path / "ok.safetensors"))
    # A tie (one Parameter used twice) is not a shared storage to split.
    tied = QKV(k_bias=False)
    tied.k.weight = tied.q.weight if tied.k.weight.shape == tied.q.weight.shape else tied.k.weight
    before = {id(p): p.untyped_storage().data_ptr() for p in tied.parameters()}
    assert wfpass.restore(tied) == 0
    assert {id(p): p.untyped_storage().data_ptr() for p in tied.parameters()} == before


def test_safetensors(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    fused = _trained()
    # save_file on the state_dict works as is.
    st.save_file(fused.state_dict(), tmp_path / "a.safetensors")
    plain = QKV(k_bias=False)
    plain.load_state_dict(st.load_file(tmp_path / "a.safetensors"))
    _same(fused, plain)
    # save_model refuses storages shared by several names: it raises, nothing
    # is written wrong. The documented step is wfpass.restore first.
    with pytest.raises(RuntimeError, match="storage"):
        st.save_model(fused, str(tmp_path / "b.safetensors"))
    wfpass.restore(fused)
    st.save_model(fused, str(tmp_path / "b.safetensors"))
    again = QKV(k_bias=False)
    c = _fused(again)
    # load_model checks the target the same way: refuses a fused model...
    with pytest.raises(RuntimeError, match="storage"):
        st.load_model(again, str(tmp_path / "b.safetensors"))
    # ...and loads after restore; the next compiled call fuses again.
    wfpass.restore(again)
    st.load_model(again, str(tmp_path / "b.safetensors"))
    _same(fused, again)
    c(torch.randn(1, 32))
    assert again.q.weight.untyped_storage().data_ptr() == again.v.weight.untyped_storage().data_ptr()


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_hf_save_pretrained_round_trip(tmp_path, arch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "bert":
        cls, cfg = transformers.BertModel, transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, max_position_embeddings=32)
    else:
        cls, cfg = transformers.LlamaForCausalLM, transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = cls(cfg).eval()
    plain_dir, fused_dir = tmp_path / "plain", tmp_path / "fused"
    model.save_pretrained(plain_dir)
    torch.compile(model, backend=wfpass.backend(inner="aot_eager"))(torch.randint(0, 100, (1, 4)))
    assert wfpass.last_report().rewritten
    model.save_pretrained(fused_dir)
    size = lambda d: sum(os.path.getsize(d / f) for f in os.listdir(d) if f.endswith(".safetensors"))
    assert size(fused_dir) <= size(plain_dir)
    loaded = cls.from_pretrained(fused_dir)
    _same(model, loaded)
    # Reverse: a plain checkpoint loaded into the fused model.
    back = cls.from_pretrained(plain_dir)
    model.load_state_dict(back.state_dict())
    _same(model, back)


def test_half_float_and_apply_replacing_data():
    torch.manual_seed(0)
    model = SwiGLU()
    ref = copy.deepcopy(model)
    c = torch.compile(model, backend=wfpass.backend(inner="aot_eager", linear_path="fused"))
    x = torch.randn(1, 32)
    torch.testing.assert_close(c(x), ref(x))
    model.half().float()  # layout lost by the casts; values rounded through fp16
    ref.half().float()
    torch.testing.assert_close(c(x), ref(x))

    def renew(m):
        if isinstance(m, nn.Linear):
            m.weight.data = m.weight.data * 0.5

    model.apply(renew)
    ref.apply(renew)
    torch.testing.assert_close(c(x), ref(x))
    (rec,) = wfpass.last_report().find("linear", "rewritten")
    assert rec.stats["re_fused"] == 2 and rec.stats["fallback_calls"] == 0
    assert model.gate.weight.untyped_storage().data_ptr() == model.up.weight.untyped_storage().data_ptr()


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_optimizers_built_before_or_after_compiling(when, opt_cls):
    torch.manual_seed(0)
    model = QKV(k_bias=True)
    ref = copy.deepcopy(model)
    batches = [torch.randn(2, 32) for _ in range(5)]

    def groups(m):  # a per-group learning rate on one fused parameter
        return [{"params": [m.q.weight], "lr": 3e-3}, {"params": [p for n, p in m.named_parameters() if n != "q.weight"]}]

    kw = dict(lr=1e-2, foreach=True) if opt_cls is not torch.optim.SGD else dict(lr=1e-2, momentum=0.9, foreach=True)
    opt = opt_cls(groups(model), **kw) if when == "before" else None
    c = torch.compile(model, backend=wfpass.backend(inner="aot_eager", linear_path="fused"))
    c(batches[0])
    opt = opt or opt_cls(groups(model), **kw)
    ropt = opt_cls(groups(ref), **kw)
    for x in batches:
        for m, o, f in ((model, opt, c), (ref, ropt, ref)):
            o.zero_grad()
            f(x).pow(2).sum().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            o.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # optimizer.state_dict() round trips into a fresh optimizer on the fused model.
    sd = opt.state_dict()
    opt2 = opt_cls(groups(model), **kw)
    opt2.load_state_dict(sd)
    assert opt2.state_dict()["param_groups"] == sd["param_groups"]
    assert model.q.weight.untyped_storage().data_ptr() == model.v.weight.untyped_storage().data_ptr()


def test_clip_grad_norm_same_as_eager():
    torch.manual_seed(0)
    model = QKV(k_bias=True)
    ref = copy.deepcopy(model)
    c = _fused(model)
    x = torch.randn(3, 32)
    c(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))


def test_restore_after_training_and_checkpoint():
    fused = _trained()
    values = {k: v.clone() for k, v in fused.state_dict().items()}
    ids = param_ids(fused)
    wfpass.restore(fused)
    assert param_ids(fused) == ids
    ptrs = [p.untyped_storage().data_ptr() for p in fused.parameters()]
    assert len(set(ptrs)) == len(ptrs)
    for k, v in fused.state_dict().items():
        assert torch.equal(v, values[k])


# -- an embedding tied to the output projection, inside a fused group ------------


class TiedLM(nn.Module):
    """``lm_head.weight`` is ``emb.weight`` (one Parameter), and ``lm_head``
    has a sibling reading the same hidden state (a value head): the tied
    weight is a member of a sibling group."""

    def __init__(self, V=24, d=8):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.lm_head = nn.Linear(d, V, bias=False)
        self.lm_head.weight = self.emb.weight
        self.value = nn.Linear(d, 1)

    def forward(self, ids):
        h = torch.tanh(self.emb(ids))
        return self.lm_head(h), self.value(h)


def _assert_tied(m: TiedLM):
    assert m.emb.weight is m.lm_head.weight
    assert m.emb.weight.data_ptr() == m.lm_head.weight.data_ptr()
    assert len(list(m.parameters())) == 3  # the tie is still one Parameter


def _assert_same_training(model, fn, ref, opt, ropt, steps=3):
    """``steps`` SGD steps of ``fn`` (compiled/rewritten ``model``) and of the
    eager ``ref``: same outputs, grads and parameters after every step; the
    tie holds throughout."""
    rtol, atol = TOL[torch.float32]
    g = torch.Generator().manual_seed(steps)
    for _ in range(steps):
        ids = torch.randint(0, 24, (2, 5), generator=g)
        outs = []
        for f, o in ((fn, opt), (ref, ropt)):
            o.zero_grad(set_to_none=True)
            logits, value = f(ids)
            (logits.pow(2).mean() + value.sum()).backward()
            outs.append((logits, value))
        torch.testing.assert_close(outs[0], outs[1], rtol=rtol, atol=atol)
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=lambda m: f"grad {n}: {m}")
        opt.step()
        ropt.step()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m: f"{n}: {m}")
        _assert_tied(model)


@pytest.mark.parametrize("how", ["compile", "apply"])
def test_embedding_tied_to_output_projection_in_a_fused_group(how, tmp_path):
    """wfpass keeps the tie and fuses the group: the tied Parameter (embedding
    and lm_head) and the value head become views of one block. The tie is
    never silently lost: not by the pass, not by a dtype round trip, not by a
    checkpoint round trip, not by restore."""
    torch.manual_seed(0)
    model = TiedLM()
    ref = copy.deepcopy(model)
    _assert_tied(ref)  # deepcopy keeps the tie: the reference is a tied eager model
    ids_before = param_ids(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # built before the pass
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    if how == "compile":
        fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager", linear_path="fused"))
        fn(torch.randint(0, 24, (2, 5)))
        report = wfpass.last_report()
    else:
        fn = torch.fx.symbolic_trace(model)
        report = wfpass.apply(fn, linear_path="fused")

    def assert_fused():
        _assert_tied(model)
        assert fused_storage_of(model.emb.weight) is not None
        assert model.emb.weight.untyped_storage().data_ptr() == model.value.weight.untyped_storage().data_ptr()

    # What wfpass does: the group is rewritten with the tied weight in it (under
    # its Dynamo name emb.weight or its traced name lm_head.weight); nothing
    # is skipped.
    (rec,) = report.find("linear", "rewritten")
    assert set(rec.params) & {"emb.weight", "lm_head.weight"} and "value.weight" in rec.params, rec.params
    assert not report.find("linear", "skipped"), report
    assert_fused()
    assert param_ids(model) == ids_before
    _assert_same_training(model, fn, ref, opt, ropt)

    # A dtype round trip: the layout is lost, the tie is not; the next call re-fuses.
    for m in (model, ref):
        m.to(torch.float64)
        _assert_tied(m)
        m.float()
    _assert_tied(model)
    _assert_same_training(model, fn, ref, opt, ropt)
    assert rec.stats.get("re_fused", 0) >= 1, rec.stats
    assert_fused()

    # Checkpoint round trip: the file holds the tie (two keys, one storage) as
    # eager's does; a plain model reads it tied; loading it (and a plain
    # model's checkpoint) into the fused model keeps tie and layout.
    torch.save(model.state_dict(), tmp_path / "fused.pt")
    sd = torch.load(tmp_path / "fused.pt")
    assert list(sd) == list(ref.state_dict())
    assert sd["emb.weight"].data_ptr() == sd["lm_head.weight"].data_ptr()
    plain = TiedLM()
    plain.load_state_dict(sd)
    _assert_tied(plain)
    _same(plain, model)
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(0.5)
    torch.save(plain.state_dict(), tmp_path / "plain.pt")
    for m in (model, ref):
        m.load_state_dict(torch.load(tmp_path / "plain.pt"))
    _same(model, plain)
    assert_fused()
    _assert_same_training(model, fn, ref, opt, ropt)

    # Restore: plain independent storages, the tie kept, the same values.
    values = {k: v.clone() for k, v in model.state_dict().items()}
    wfpass.restore(model)
    _assert_tied(model)
    assert fused_storage_of(model.emb.weight) is None
    ptrs = [p.untyped_storage().data_ptr() for p in model.parameters()]
    assert len(set(ptrs)) == len(ptrs)
    for k, v in model.state_dict().items():
        assert torch.equal(v, values[k]), k
    assert param_ids(model) == ids_before
    _assert_same_training(model, fn, ref, opt, ropt)  # the rewritten graph still runs (and re-fuses)


class _RnnBN(nn.Module):
    """Q/K/V siblings, an LSTM and a BatchNorm: all three built-in formats."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.rnn = nn.LSTM(8, 8, num_layers=2, batch_first=True)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):  # x: (B, T, 8)
        h = self.q(x) * torch.sigmoid(self.k(x)) + self.v(x)
        y, _ = self.rnn(h)
        return self.bn(y.reshape(-1, 8))


def test_rnn_and_batchnorm_formats_through_optimizer_clip_safetensors_and_non_strict_load(tmp_path):
    """The RNN and BatchNorm formats through what the linear tests check:
    AdamW (foreach) built before compiling, clip_grad_norm_, the optimizer's
    state_dict, safetensors save_file/load_file both ways, a non-strict load,
    save_model/load_model after restore. bf16 model, so the BatchNorm format
    applies; the reference is eager with the BatchNorm in fp32, which is what
    the format is. Tolerance 3e-2: bf16 kernels (oneDNN vs ATen's native
    LSTM at T <= 2; fused vs separate GEMMs) round differently."""
    st = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    model = _RnnBN().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    ref.bn.float()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for m in (model, ref)]
    be, reports = wfpass.backend(inner="aot_eager", linear_path="fused"), []

    def collect(gm, example_inputs):  # every graph's report: a new length may recompile
        out = be(gm, example_inputs)
        reports.append(wfpass.last_report())
        return out

    fn = torch.compile(model, backend=collect)
    tol = dict(rtol=3e-2, atol=3e-2)
    for step in range(3):
        x = torch.randn(4, 2 + step, 8).to(torch.bfloat16)  # lengths 2, 3, 4: both RNN paths
        # A fixed random projection: every output element gets a gradient
        # (``pow(2).mean()`` of a BatchNorm output is constant, its grads noise).
        R = torch.randn(4 * (2 + step), 8)
        norms = []
        for f, m, opt in ((fn, model, opts[0]), (ref, ref, opts[1])):
            opt.zero_grad(set_to_none=True)
            (f(x).float() * R).sum().backward()
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
            opt.step()
        torch.testing.assert_close(norms[0], norms[1], **tol)
    rep = wfpass.last_report()
    assert {r.pattern for r in rep.rewritten} == {"linear", "rnn", "batchnorm"}, rep
    rnn = {id(r): r for p in reports for r in p.find("rnn", "rewritten")}.values()
    assert sum(r.stats["unfused_calls"] for r in rnn) == 1 and sum(r.stats["fused_calls"] for r in rnn) == 2
    assert fused_storage_of(model.rnn.weight_ih_l0) is not None and model.bn.running_var.dtype == torch.float32
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert a.dtype == b.dtype, k
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=k)

    # the optimizer's state_dict round-trips into a fresh optimizer over the same params
    again = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    again.load_state_dict(opts[0].state_dict())
    for p in model.parameters():
        for key, val in opts[0].state[p].items():
            assert torch.equal(again.state[p][key], val), key

    # safetensors save_file/load_file: fused model -> plain bf16 model (BatchNorm cast down) and back
    st.save_file(model.state_dict(), tmp_path / "m.safetensors")
    plain = _RnnBN().to(torch.bfloat16)
    plain.load_state_dict(st.load_file(tmp_path / "m.safetensors"))
    for (k, a), b in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a.to(b.dtype), b), k
    with torch.no_grad():
        for p in plain.rnn.parameters():
            p.mul_(0.5)
    st.save_file(plain.state_dict(), tmp_path / "p.safetensors")
    model.load_state_dict(st.load_file(tmp_path / "p.safetensors"))
    assert torch.equal(model.rnn.weight_hh_l1, plain.rnn.weight_hh_l1)
    assert fused_storage_of(model.rnn.weight_ih_l0).is_member(model.rnn.weight_hh_l1)  # copied in place
    assert model.bn.running_var.dtype == torch.float32  # cast up on load

    # non-strict: only the LSTM's tensors; the rest keep their values
    keep = {k: v.clone() for k, v in model.state_dict().items()}
    sd = {k: v * 2 for k, v in plain.state_dict().items() if k.startswith("rnn.")}
    # (BatchNorm fills in a missing num_batches_tracked with 0, in eager too: give it)
    sd["bn.num_batches_tracked"] = keep["bn.num_batches_tracked"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) == {k for k in keep if k not in sd}
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k] if k in sd else keep[k]), k
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4, 5, 8).to(torch.bfloat16)
    # Training-mode BatchNorm divides by the batch's std, so a bf16 rounding
    # difference upstream (one fused GEMM vs three) comes out as a few bf16
    # ulps of a unit-scale output: compared at 1e-1 absolute here.
    torch.testing.assert_close(fn(x).float(), ref(x).float(), rtol=3e-2, atol=1e-1)

    # save_model / load_model need independent storage: after restore, both ways
    with pytest.raises(RuntimeError):
        st.save_model(model, str(tmp_path / "refused.safetensors"))
    wfpass.restore(model)
    st.save_model(model, str(tmp_path / "model.safetensors"))
    back = _RnnBN().to(torch.bfloat16)
    st.load_model(back, str(tmp_path / "model.safetensors"))
    for (k, a), b in zip(model.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b.to(a.dtype)), k


@needs_gpu("needs CUDA (.to(device) after compiling)")
def test_to_cuda_and_back_after_compiling_all_three_formats():
    """Compiled and run on the CPU, then moved with .cuda() and back with
    .cpu(): each move loses the layout (new storage on the new device);
    Dynamo's device guards recompile and the formats come back, and every
    result equals eager's moved the same way. Tolerance 3e-2: bf16."""
    torch.manual_seed(0)
    model = _RnnBN().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    ref.bn.float()
    # RNNs on CUDA go into the graph as one cuDNN call with this option only.
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager", linear={"path": "fused"},
                                                     rnn={"cuda": "cudnn"}))
    tol = dict(rtol=3e-2, atol=3e-2)
    for device in ("cpu", "cuda", "cpu"):
        model.to(device)
        ref.to(device)
        x = torch.randn(4, 5, 8, device=device).to(torch.bfloat16)
        torch.testing.assert_close(fn(x).float(), ref(x).float(), **tol)
        assert model.q.weight.device.type == device
        assert model.q.weight.untyped_storage().data_ptr() == model.v.weight.untyped_storage().data_ptr()
        assert fused_storage_of(model.rnn.weight_ih_l0) is not None
        assert fused_storage_of(model.rnn.weight_ih_l0).is_member(model.rnn.weight_hh_l1)
        assert model.bn.running_var.dtype == torch.float32
        for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
            torch.testing.assert_close(a.float(), b.float(), **tol, msg=k)
