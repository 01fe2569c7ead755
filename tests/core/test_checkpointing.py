"""Activation checkpointing: wfpass rewrites inside the checkpointed region.

Dynamo turns ``torch.utils.checkpoint`` (reentrant or not) and HF's
``gradient_checkpointing_enable()`` into a ``tag_activation_checkpoint``
call whose body is its own graph; the parameters the body reads are inputs
of the outer graph, passed to the call. wfpass fuses sibling linears inside
the body with the same guarantees as outside, and the recomputation in the
backward reads the same block.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

import wfpass

transformers = pytest.importorskip("transformers")


def proj_loss(out, seed=0):
    """``(out * R).sum()`` with a fixed random R: every output element gets its own gradient."""
    r = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return (out * r).sum()


def close_grads(model, ref, rel=1e-4):
    """Every parameter's grad within ``rel`` of the largest reference grad."""
    top = max(q.grad.abs().max().item() for q in ref.parameters() if q.grad is not None)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            # An output the loss does not use (BERT's pooler): eager leaves
            # None, any compiled graph (with or without wfpass) zeros.
            assert p.grad is None or not p.grad.any(), n
            continue
        err = (p.grad - q.grad).abs().max().item()
        assert err <= rel * top, f"grad of {n}: {err:.3e} > {rel} x {top:.3e}"


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, 8), nn.Linear(d, d)

    def forward(self, x):
        return (self.q(x) * self.v(x)).sum(-1, keepdim=True) + self.k(x).mean(-1, keepdim=True)


class Checkpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.b, self.reentrant = Block(), reentrant

    def forward(self, x):
        return cp.checkpoint(self.b, x, use_reentrant=self.reentrant)


class Capture:
    """An AOTAutograd inner compiler that keeps the forward and backward graphs."""

    def __init__(self):
        self.fw = self.bw = None

    def backend(self):
        from functorch.compile import make_boxed_func

        def fw(gm, ex):
            self.fw = gm
            return make_boxed_func(gm.forward)

        def bw(gm, ex):
            self.bw = gm
            return make_boxed_func(gm.forward)

        # Inductor's partitioner: it honours the checkpoint's recompute tags.
        return aot_autograd(fw_compiler=fw, bw_compiler=bw, partition_fn=min_cut_rematerialization_partition)


def recomputed_block_gemms(bw: torch.fx.GraphModule, rows: int, cols: int):
    """The GEMMs of the backward graph that recompute the forward over the
    fused block: ``addmm``/``mm`` whose weight is ``t(as_strided(member, (rows, cols)))``."""
    found = []
    for n in bw.graph.nodes:
        if n.op == "call_function" and n.target in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default):
            w = n.args[-1]
            if getattr(w, "target", None) is torch.ops.aten.t.default:
                src = w.args[0]
                if getattr(src, "target", None) is torch.ops.aten.as_strided.default and list(src.args[1]) == [rows, cols]:
                    found.append(n)
    return found


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_block_fused_and_recomputation_reads_the_block(reentrant):
    model = Checkpointed(reentrant)
    ref = copy.deepcopy(model)
    cap = Capture()
    fn = torch.compile(model, backend=wfpass.backend(inner=cap.backend(), linear_path="fused"))
    # The input requires grad: a reentrant checkpoint gives no parameter
    # gradients otherwise, in eager too.
    x = torch.randn(2, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, ref_out = fn(x), ref(x_ref)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    proj_loss(out).backward()
    proj_loss(ref_out).backward()
    close_grads(model, ref, 1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    (rec,) = wfpass.last_report().find("linear", "rewritten")
    assert rec.detail["region"] == "tag_activation_checkpoint" and "recomputed in the backward" in rec.reason
    assert rec.stats["fused_calls"] == 1 and rec.stats["fallback_calls"] == 0
    # One block: every member a view of it, in graph order q, v, k.
    base = model.b.q.weight.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in (model.b.k.weight, model.b.v.weight))
    # The forward saves no activation of the region (only the inputs), and the
    # backward recomputes the one GEMM over the block, read from the first
    # member's storage: the same block the forward read.
    assert len(recomputed_block_gemms(cap.fw, 40, 16)) == 1
    assert len(recomputed_block_gemms(cap.bw, 40, 16)) == 1, cap.bw.code
    saved = [n.name for n in cap.fw.graph.output_node().args[0][1:]]
    assert all(s.startswith("primals") for s in saved), saved


def test_region_with_an_rnn_and_a_batchnorm_says_why_they_are_left():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)
            self.bn = nn.BatchNorm1d(8)
            self.rnn = nn.GRU(8, 8, batch_first=True)

        def body(self, x):
            y = self.q(x) * self.k(x)
            y = self.bn(y.transpose(1, 2)).transpose(1, 2)
            return self.rnn(y)[0]

        def forward(self, x):
            return cp.checkpoint(self.body, x, use_reentrant=False)

    model = Mixed().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager"))
    x = torch.randn(2, 5, 8, dtype=torch.bfloat16)
    out, ref_out = fn(x), ref(x)
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2)
    proj_loss(out.float()).backward()
    proj_loss(ref_out.float()).backward()
    close_grads(model, ref, 3e-2)
    rep = wfpass.last_report()
    assert len(rep.find("linear", "rewritten")) == 1
    for pattern in ("rnn", "batchnorm"):
        (rec,) = rep.find(pattern, "skipped") if pattern == "rnn" else [r for r in rep.find(pattern, "skipped")]
        assert "inside a tag_activation_checkpoint region" in rec.reason, str(rep)
        assert rec.params, str(rep)
    assert model.bn.weight.dtype == torch.bfloat16  # not converted: nothing moved behind the report's back


# -- HF models with gradient checkpointing ------------------------------------------


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   # A training run has no cache; with use_cache=True transformers 5.25
                                   # logs a warning inside the forward, a graph break Dynamo cannot resume
                                   # from inside the checkpointed layers, which then run eagerly.
                                   use_cache=False)
    return transformers.LlamaForCausalLM(cfg), "logits", 4  # 2 layers x (Q/K/V, gate/up)


def _bert():
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertModel(cfg), "last_hidden_state", 2  # 2 layers x Q/K/V


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("build", [_llama, _bert], ids=["llama", "bert"])
def test_hf_gradient_checkpointing_fuses_and_trains_like_eager(build, reentrant):
    torch.manual_seed(0)
    model, key, groups = build()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    ref = copy.deepcopy(model)
    cap = Capture()
    # The fused path (one GEMM over the block) at these 16 rows, so that the
    # graph reads the block and the check below can find it.
    fn = torch.compile(model, backend=wfpass.backend(inner=cap.backend(), linear_path="fused"))
    lr = 1e-3
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    top_grad = {}
    # transformers 5.25's layers set and reset a context variable (the
    # ``kernels`` package's CompileableContextVar) inside the checkpointed
    # forward; Dynamo refuses such a side effect in a checkpoint region unless
    # told it need not be replayed in the backward (it need not: the value is
    # restored before the layer returns). Without it stock torch.compile, any
    # backend, gets no graph for the layers (docs/guide/limits.md).
    no_replay = torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
    for step in range(5):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        with no_replay:
            out = getattr(fn(input_ids=ids), key)
        ref_out = getattr(ref(input_ids=ids), key)
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5, msg=lambda m: f"step {step}: {m}")
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        proj_loss(out, step).backward()
        proj_loss(ref_out, step).backward()
        close_grads(model, ref, 1e-4)
        for n, q in ref.named_parameters():
            if q.grad is not None:
                top_grad[n] = max(top_grad.get(n, 0.0), q.grad.abs().max().item())
        opt.step()
        ref_opt.step()
    largest = max(top_grad.values())
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        # A gradient that is zero in exact arithmetic (BERT's key bias: softmax
        # ignores a shift of the scores) is rounding noise, and Adam's update
        # normalises noise to a full step of lr, in eager as much as here: such
        # a parameter is only checked to have moved at most 5 steps of lr.
        atol = 5 * lr if top_grad.get(n, 0.0) < 1e-5 * largest else 1e-6
        torch.testing.assert_close(p, q, rtol=1e-4, atol=atol, msg=lambda m: f"{n} after 5 AdamW steps: {m}")
    rep = wfpass.report(model)
    fused = [r for r in rep.find("linear", "rewritten")]
    assert len(fused) == groups, str(rep)
    assert all(r.detail.get("region") == "tag_activation_checkpoint" for r in fused)
    assert all(r.stats["fused_calls"] == 5 and r.stats["fallback_calls"] == 0 for r in fused), str(rep)
    # Names are the model's own (state_dict) names.
    names = {p for r in fused for p in r.params}
    assert names <= set(model.state_dict()), names - set(model.state_dict())
    # Q/K/V (and gate/up) of every layer are views of one block each.
    attn = [m for m in model.modules() if hasattr(m, "q_proj") or hasattr(m, "query")]
    for a in attn:
        ws = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight] if hasattr(a, "q_proj") else [
            a.query.weight, a.key.weight, a.value.weight]
        assert len({w.untyped_storage().data_ptr() for w in ws}) == 1
    # The backward recomputes each layer's Q/K/V GEMM over its block.
    d, kv = 32, (16 if build is _llama else 32)
    assert len(recomputed_block_gemms(cap.bw, d + 2 * kv, d)) == 2, cap.bw.code


def test_wrap_region_fused():
    """``torch._higher_order_ops.wrap`` (what Dynamo emits for some wrapped
    regions): the same rewrite inside its body."""
    from torch._higher_order_ops.wrap import wrap

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)

        def body(self, x):
            return self.q(x) * self.k(x)

        def forward(self, x):
            return wrap(self.body, x)

    model = Wrapped()
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager"))
    x = torch.randn(2, 16)
    out, ref_out = fn(x), ref(x)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    proj_loss(out).backward()
    proj_loss(ref_out).backward()
    close_grads(model, ref, 1e-5)
    (rec,) = wfpass.last_report().find("linear", "rewritten")
    assert rec.detail["region"] == "wrap" and rec.stats["fused_calls"] == 1
    assert model.q.weight.untyped_storage().data_ptr() == model.k.weight.untyped_storage().data_ptr()


def test_body_shared_by_two_calls_is_left_with_a_reason():
    """One body run for two parameter sets (what ``invoke_subgraph`` does)
    would need one rewrite to hold for both: wfpass leaves it and says so."""
    from wfpass.core.bodies import hop_bodies

    body = torch.fx.symbolic_trace(lambda x, w1, w2: torch.nn.functional.linear(x, w1) * torch.nn.functional.linear(x, w2))
    g = torch.fx.Graph()
    x, a, b = g.placeholder("x"), g.placeholder("a"), g.placeholder("b")
    calls = []
    for _ in range(2):
        attr = g.get_attr("body")
        calls.append(g.call_function(torch.ops.higher_order.wrap, (attr, x, a, b)))
    g.output(calls)
    root = nn.Module()
    root.body = body
    gm = torch.fx.GraphModule(root, g)
    found = hop_bodies(gm)
    assert len(found) == 2 and all(h.callers == 2 and "shared by 2 calls" in h.problem for h in found)
