"""Real third-party models, built from a small config (no downloads), through
``backend="wformat"`` with its default inner compiler (Inductor)."""
from __future__ import annotations

import pytest
import torch

import wfpass
from wftest import assert_same_fwd_bwd

transformers = pytest.importorskip("transformers")


class Logits(torch.nn.Module):
    """Return one tensor so the comparison sees the whole output."""

    def __init__(self, model, key):
        super().__init__()
        self.model, self.key = model, key

    def forward(self, ids):
        return getattr(self.model(input_ids=ids), self.key)


def _bert():
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return Logits(transformers.BertModel(cfg), "last_hidden_state"), 2 * 1  # 2 layers x Q/K/V


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Logits(transformers.LlamaForCausalLM(cfg), "logits"), 2 * 2  # 2 layers x (Q/K/V + gate/up)


@pytest.mark.parametrize("build", [_bert, _llama], ids=["bert", "llama"])
def test_hf_model_equal_to_eager(build):
    torch.manual_seed(0)
    model, groups = build()
    ids = torch.randint(0, 100, (1, 8))
    assert_same_fwd_bwd(model, lambda m: torch.compile(m, backend="wformat"), [ids], rtol=1e-4, atol=1e-4)
    rep = wfpass.last_report()
    rewritten = rep.find("linear", "rewritten")
    assert len(rewritten) == groups, str(rep)
    assert all(r.stats["fused_calls"] == 1 and r.stats["fallback_calls"] == 0 for r in rewritten)
    assert any(".self_attn.q_proj.weight" in p or ".attention.self.query.weight" in p for r in rewritten for p in r.params)
