"""Report rows name parameters as the model the user compiled names them:
keys of its ``state_dict()`` / ``named_parameters()``, whatever wraps it
(PEFT's LoRA wrappers, DistributedDataParallel, FSDP2, ``torch.compile``'s
``OptimizedModule``, a compiled submodule inside a compiled model)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import wfpass


def names_of(report):
    return {p for r in report for p in r.params}


def assert_state_dict_names(report, model):
    keys = set(model.state_dict())
    names = names_of(report)
    assert names, str(report)
    assert names <= keys, f"not in state_dict(): {sorted(names - keys)}"


class Layer(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x):
        return self.bn(self.q(x) * self.k(x))


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer, self.out = Layer(), Layer()

    def forward(self, x):
        return self.out(self.layer(x))


def proj_loss(out, seed=0):
    return (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)).sum()


def test_optimized_module_names():
    """``torch.compile(model)``: the rows of the compile name ``model``'s
    parameters; ``wfpass.report`` of the wrapper uses the wrapper's own
    ``state_dict()`` names (``_orig_mod.``), of the model the model's."""
    model = Layer()
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager"))
    fn(torch.randn(4, 8))
    assert_state_dict_names(wfpass.last_report(), model)
    assert_state_dict_names(wfpass.report(model), model)
    assert_state_dict_names(wfpass.report(fn), fn)
    assert "q.weight" in names_of(wfpass.report(model))


def test_hf_model_whose_forward_takes_args_names():
    """HF's ``LlamaForCausalLM.forward`` sits behind a decorator taking
    ``*args``: Dynamo's sources start at ``L['args'][0]``, not
    ``L['self']``. The compile's rows still use the model's keys (they were
    ``0.model.layers.0...``)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=50)
    model = transformers.LlamaForCausalLM(cfg).eval()
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager"))
    with torch.no_grad():
        fn(torch.randint(0, 50, (1, 6)))
    assert_state_dict_names(wfpass.last_report(), model)
    assert "model.layers.0.self_attn.q_proj.weight" in names_of(wfpass.last_report())


def test_nested_compile_names():
    """A submodule compiled on its own, inside a compiled model: Dynamo
    traces through the inner wrapper; the names are the outer model's
    ``state_dict()`` keys (``layer._orig_mod.q.weight``)."""
    model = TwoLayers()
    model.layer = torch.compile(model.layer, backend=wfpass.backend(inner="aot_eager"))
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager"))
    fn(torch.randn(4, 8))
    assert_state_dict_names(wfpass.last_report(), model)
    assert "layer._orig_mod.q.weight" in names_of(wfpass.last_report())
    assert_state_dict_names(wfpass.report(model), model)


def test_peft_lora_names_training_and_merge():
    """PEFT LoRA on BERT (``target_modules=["query", "value"]``): the wrapper
    keeps the model in its ``__dict__``, so Dynamo's source path reads
    ``__dict__.__dict__.encoder...``; the rows name ``base_model.model.
    encoder...``, as ``model.state_dict()`` does. Training equals eager and
    merge/unload gives eager's merged model."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.BertModel(cfg),
                                peft.LoraConfig(r=4, target_modules=["query", "value"], lora_dropout=0.0))
    with torch.no_grad():  # LoRA's B starts at zero: give it values so the adapter matters
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for step in range(5):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        out = fn(input_ids=ids).last_hidden_state
        ref_out = ref(input_ids=ids).last_hidden_state
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        proj_loss(out, step).backward()
        proj_loss(ref_out, step).backward()
        opt.step()
        ref_opt.step()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    rep = wfpass.last_report()
    assert_state_dict_names(rep, model)
    assert_state_dict_names(wfpass.report(model), model)
    fused = rep.find("linear", "rewritten")
    assert fused and any("base_model.model.encoder.layer.0.attention.self.query.base_layer.weight" in r.params for r in fused)
    ids = torch.randint(0, 64, (2, 8))
    merged, ref_merged = model.merge_and_unload(), ref.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).last_hidden_state, ref_merged(input_ids=ids).last_hidden_state,
                                   rtol=1e-4, atol=1e-5)


@pytest.fixture
def group():
    """A 1-rank gloo group for this test only (destroyed afterwards)."""
    if dist.is_initialized():  # pragma: no cover - a leaked group from elsewhere
        pytest.fail("a default process group is already initialized")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_names(group):
    """Dynamo compiles the module DDP wraps; the rows name the DDP's
    parameters (``module.q.weight``), as ``ddp.state_dict()`` does."""
    model = Layer()
    ref = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    fn = torch.compile(ddp, backend=wfpass.backend(inner="aot_eager"))
    x = torch.randn(4, 8)
    torch.testing.assert_close(fn(x), ref(x), rtol=1e-5, atol=1e-6)
    assert_state_dict_names(wfpass.last_report(), ddp)
    assert "module.q.weight" in names_of(wfpass.last_report())
    assert_state_dict_names(wfpass.report(ddp), ddp)


def test_fsdp2_names_and_model_report(group):
    """FSDP2: the graph sees the unsharded Parameters FSDP all-gathered, which
    it frees after the forward. The rows name them as ``model.state_dict()``
    does, and ``wfpass.report(model)`` (whose parameters are the sharded
    DTensors again) still shows every row, the skipped linear groups too."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model = Layer()
    fully_shard(model, mesh=DeviceMesh("cpu", [0]))
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager"))
    fn(torch.randn(4, 8))
    assert_state_dict_names(wfpass.last_report(), model)
    rep = wfpass.report(model)
    assert_state_dict_names(rep, model)
    assert {"q.weight", "k.weight"} <= names_of(rep.find("linear", "skipped")), str(rep)
