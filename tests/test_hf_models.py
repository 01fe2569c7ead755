"""Real third-party models, built from a small config (no downloads), through
``backend="wformat"`` with its default inner compiler (Inductor); the ResNet
checkpoint test uses inner ``aot_eager`` (the same pass; Inductor's cold
compile of its training graph takes about 35 s here)."""
from __future__ import annotations

import copy
import os

import pytest
import torch

import wfpass
from wftest import TOL, assert_same_fwd_bwd

transformers = pytest.importorskip("transformers")


class Logits(torch.nn.Module):
    """Return one tensor so the comparison sees the whole output."""

    def __init__(self, model, key):
        super().__init__()
        self.model, self.key = model, key

    def forward(self, ids):
        return getattr(self.model(input_ids=ids), self.key)


def _bert():
    # One layer (each layer's groups are alike; Inductor's compile time grows with the layers).
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return Logits(transformers.BertModel(cfg), "last_hidden_state"), 1 * 1  # 1 layer x Q/K/V


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Logits(transformers.LlamaForCausalLM(cfg), "logits"), 1 * 2  # 1 layer x (Q/K/V + gate/up)


@pytest.mark.parametrize("build", [_bert, _llama], ids=["bert", "llama"])
def test_hf_model_equal_to_eager(build):
    torch.manual_seed(0)
    model, groups = build()
    ids = torch.randint(0, 100, (1, 8))
    assert_same_fwd_bwd(model, lambda m: torch.compile(m, backend="wformat"), [ids], rtol=1e-4, atol=1e-4)
    rep = wfpass.last_report()
    rewritten = rep.find("linear", "rewritten")
    assert len(rewritten) == groups, str(rep)
    # M = 8 rows: the split path under the default fused_max_rows; one call counted on it.
    assert all(r.stats[f"{r.detail['path']}_calls"] == 1 and r.stats["fallback_calls"] == 0 for r in rewritten)
    assert any(".self_attn.q_proj.weight" in p or ".attention.self.query.weight" in p for r in rewritten for p in r.params)


BN_TENSORS = ("weight", "bias", "running_mean", "running_var")


def _resnet_bf16():
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                    layer_type="basic")
    return transformers.ResNetModel(cfg).to(torch.bfloat16)


def _is_bn_tensor(key, bns):
    mod, leaf = key.rsplit(".", 1)
    return mod in bns and leaf in BN_TENSORS


def _safetensors_sizes(d):
    """(file bytes, tensor-data bytes) of ``d/model.safetensors``: the data is
    what follows the 8-byte header length and the JSON header."""
    path = d / "model.safetensors"
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    total = os.path.getsize(path)
    return total, total - 8 - header


def test_hf_resnet_bf16_batchnorm_format_save_pretrained_both_ways(tmp_path):
    """The batchnorm format through HuggingFace ``save_pretrained`` /
    ``from_pretrained`` (safetensors). The checkpoint holds what
    ``state_dict()`` holds: the BatchNorm weight, bias and running statistics in
    fp32, everything else bf16; the file is larger than the plain bf16 model's
    by exactly 2 bytes per BatchNorm element, and the same size after
    ``wfpass.restore``."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = _resnet_bf16().train()
    bns = {n for n, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)}
    assert len(bns) == 6  # stem, 2 in stage 1, 2 + the shortcut's in stage 2
    graphs = []
    inner = wfpass.backend(inner="aot_eager")

    def counting(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)

    fn = torch.compile(model, backend=counting)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    batch = lambda: torch.randn(2, 3, 32, 32, generator=g).mul(2).add(0.5).to(torch.bfloat16)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        fn(pixel_values=batch()).pooler_output.float().pow(2).sum().backward()
        opt.step()
    rep = wfpass.last_report()
    recs = rep.find("batchnorm", "rewritten")
    assert {p.rsplit(".", 1)[0] for r in recs for p in r.params} == bns, str(rep)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k, v in sd.items():
        if _is_bn_tensor(k, bns):
            assert v.dtype == torch.float32, k
        elif k.endswith("num_batches_tracked"):
            assert v.dtype == torch.int64 and v.item() == 3, k
        else:
            assert v.dtype == torch.bfloat16, k
    bn_elements = sum(v.numel() for k, v in sd.items() if _is_bn_tensor(k, bns))
    assert bn_elements == 4 * (16 + 2 * 16 + 3 * 32)

    # A plain bf16 model of the same config, never compiled, with its own
    # values (running statistics moved by two eager training-mode batches).
    torch.manual_seed(1)
    plain = _resnet_bf16().train()
    with torch.no_grad():
        for _ in range(2):
            plain(pixel_values=batch())
    passed_dir, plain_dir, restored_dir = tmp_path / "passed", tmp_path / "plain", tmp_path / "restored"
    model.save_pretrained(passed_dir, safe_serialization=True)
    plain.save_pretrained(plain_dir, safe_serialization=True)

    # The file holds exactly the passed model's state_dict, dtypes included.
    saved = load_file(passed_dir / "model.safetensors")
    assert set(saved) == set(sd)
    for k, v in sd.items():
        assert saved[k].dtype == v.dtype and torch.equal(saved[k], v), k

    # Into a plain model: from_pretrained takes the config's dtype (bf16) and
    # loads without complaint, the fp32 BatchNorm values rounded to bf16 ...
    loaded, info = transformers.ResNetModel.from_pretrained(passed_dir, output_loading_info=True)
    assert not any(info.values()), info
    lsd = loaded.state_dict()
    assert list(lsd) == list(sd)
    for k, v in sd.items():
        assert lsd[k].dtype == (torch.int64 if k.endswith("num_batches_tracked") else torch.bfloat16), k
        assert torch.equal(lsd[k], v.to(lsd[k].dtype)), k
    # ... and with dtype=torch.float32 every entry comes back bit for bit
    # (bf16 -> fp32 is exact).
    exact = transformers.ResNetModel.from_pretrained(passed_dir, dtype=torch.float32).state_dict()
    for k, v in sd.items():
        if v.is_floating_point():
            assert exact[k].dtype == torch.float32 and torch.equal(exact[k], v.float()), k
            assert torch.equal(exact[k].to(v.dtype), v), k
        else:
            assert torch.equal(exact[k], v), k

    # File size: the fp32 statistics make the passed model's file larger.
    (passed_total, passed_data), (plain_total, plain_data) = _safetensors_sizes(passed_dir), _safetensors_sizes(plain_dir)
    assert passed_data - plain_data == 2 * bn_elements, (passed_data, plain_data)
    assert passed_total > plain_total, (passed_total, plain_total)

    # Reverse: the plain bf16 checkpoint into the compiled model. The
    # BatchNorm tensors stay fp32 (same objects, values cast up exactly), and
    # the next compiled call runs the same graph and equals eager with the
    # BatchNorms moved to fp32 by hand.
    back = transformers.ResNetModel.from_pretrained(plain_dir)
    objects = {k: t for k, t in list(model.named_parameters()) + list(model.named_buffers())}
    model.load_state_dict(back.state_dict())
    now = model.state_dict()
    after = {k: t for k, t in list(model.named_parameters()) + list(model.named_buffers())}
    for k, v in back.state_dict().items():
        assert after[k] is objects[k], k
        assert now[k].dtype == (torch.float32 if _is_bn_tensor(k, bns) else v.dtype), k
        assert torch.equal(now[k], v.to(now[k].dtype)), k
    ref = copy.deepcopy(back).train()
    for name in bns:
        ref.get_submodule(name).float()
    x = batch()
    n_graphs = len(graphs)
    out, ref_out = fn(pixel_values=x), ref(pixel_values=x)
    assert len(graphs) == n_graphs  # the load kept the format: no recompile
    rtol, atol = TOL[torch.bfloat16]
    torch.testing.assert_close(out.last_hidden_state, ref_out.last_hidden_state, rtol=rtol, atol=atol)
    torch.testing.assert_close(out.pooler_output, ref_out.pooler_output, rtol=rtol, atol=atol)
    rsd = ref.state_dict()
    for k, v in model.state_dict().items():
        if _is_bn_tensor(k, bns):
            assert v.dtype == torch.float32 and rsd[k].dtype == torch.float32, k
            torch.testing.assert_close(v, rsd[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")

    # wfpass.restore casts the BatchNorm tensors back to bf16: the file is
    # then exactly the plain model's size and holds the values cast down.
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    wfpass.restore(model)
    model.save_pretrained(restored_dir, safe_serialization=True)
    assert _safetensors_sizes(restored_dir) == (plain_total, plain_data)
    restored = load_file(restored_dir / "model.safetensors")
    for k, v in before.items():
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert restored[k].dtype == want.dtype and torch.equal(restored[k], want), k


def _encodec():
    cfg = transformers.EncodecConfig(target_bandwidths=[1.5], sampling_rate=8000, audio_channels=1, hidden_size=16,
                                     num_filters=4, num_residual_layers=1, upsampling_ratios=[2, 2],
                                     codebook_size=16, codebook_dim=16, num_lstm_layers=2)
    return transformers.EncodecModel(cfg)


def _encodec_lstm_block(model):
    """The encoder's ``EncodecLSTM`` block (it holds the ``nn.LSTM``)."""
    return next(m for m in model.encoder.layers if type(m).__name__ == "EncodecLSTM")


def test_hf_encodec_whole_model_lstm_residuals_and_report():
    """The whole EnCodec model under ``backend=wformat``: its decoder LSTM
    block adds the LSTM's output to its input (a residual read after the
    RNN), and Dynamo splits the model at graph breaks. Forward and every
    gradient equal eager; ``wfpass.report(model)`` holds both LSTMs, named as
    in the model, with their calls counted over every graph."""
    torch.manual_seed(0)
    cfg = transformers.EncodecConfig(target_bandwidths=[16.0], sampling_rate=8000, audio_channels=1, hidden_size=16,
                                     num_filters=4, num_residual_layers=1, upsampling_ratios=[2, 2],
                                     codebook_size=16, codebook_dim=16, num_lstm_layers=2)
    model = transformers.EncodecModel(cfg)  # 16 kbit/s: two quantizers (1.5 would give none, and eager fails too)
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager"))
    x = torch.randn(1, 1, 64)
    out = fn(x).audio_values
    ref_out = ref(x).audio_values
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    R = torch.randn_like(ref_out)
    (out * R).sum().backward()
    (ref_out * R).sum().backward()
    gmax = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert p.grad is not None, n
            assert (p.grad - q.grad).abs().max().item() <= 1e-4 * gmax, n
    rnn = wfpass.report(model).find("rnn", "rewritten")
    names = sorted(r.params[0] for r in rnn)
    assert len(rnn) == 2 and names[0].startswith("decoder.") and names[1].startswith("encoder."), names
    assert all(r.stats["fused_calls"] + r.stats["unfused_calls"] >= 1 for r in rnn)


def test_hf_encodec_rnn_format_save_pretrained_both_ways(tmp_path):
    """The rnn format through HuggingFace ``save_pretrained`` /
    ``from_pretrained`` (safetensors), on EnCodec (its encoder and decoder each
    hold a 2-layer ``nn.LSTM``). The encoder's LSTM block is compiled with
    ``backend=wformat`` and trained two steps: its Parameters are views of one
    flat buffer, which HF's shared-storage handling must neither drop nor
    refuse. The file equals the state_dict bit for bit and is exactly the size
    of a plain model's; the reverse load keeps the format."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = _encodec()
    block = _encodec_lstm_block(model)
    lstm = block.lstm
    fn = torch.compile(block, backend=wfpass.backend(inner="aot_eager"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        fn(torch.randn(2, 16, 5)).pow(2).sum().backward()
        opt.step()
    (rec,) = wfpass.last_report().find("rnn", "rewritten")
    assert rec.stats["fused_calls"] + rec.stats["unfused_calls"] == 2 and rec.stats["fallback_calls"] == 0
    assert len({p.untyped_storage().data_ptr() for p in lstm.parameters()}) == 1  # one flat buffer
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}

    passed_dir, plain_dir = tmp_path / "passed", tmp_path / "plain"
    model.save_pretrained(passed_dir, safe_serialization=True)
    torch.manual_seed(1)
    plain = _encodec()
    plain.save_pretrained(plain_dir, safe_serialization=True)
    saved = load_file(passed_dir / "model.safetensors")
    assert set(saved) == set(sd)
    for k, v in sd.items():
        assert torch.equal(saved[k], v), k
    assert _safetensors_sizes(passed_dir) == _safetensors_sizes(plain_dir)

    loaded, info = transformers.EncodecModel.from_pretrained(passed_dir, output_loading_info=True)
    assert not any(info.values()), info
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, sd[k]), k

    # Reverse: the plain model's checkpoint into the compiled one. Same
    # Parameter objects, still one buffer, and the next compiled call equals
    # eager on the plain model.
    back = transformers.EncodecModel.from_pretrained(plain_dir)
    objects = dict(lstm.named_parameters())
    model.load_state_dict(back.state_dict())
    assert all(p is objects[n] for n, p in lstm.named_parameters())
    assert len({p.untyped_storage().data_ptr() for p in lstm.parameters()}) == 1
    for k, v in back.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    ref_block = _encodec_lstm_block(back)
    x = torch.randn(2, 16, 7)
    xa, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    opt.zero_grad(set_to_none=True)
    out, ref = fn(xa), ref_block(xr)
    rtol, atol = TOL[torch.float32]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    out.pow(2).sum().backward()
    ref.pow(2).sum().backward()
    torch.testing.assert_close(xa.grad, xr.grad, rtol=rtol, atol=atol)
    for (n, p), (_, q) in zip(block.named_parameters(), ref_block.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=lambda m: f"grad of {n}: {m}")
