"""The cases ``python -m wfpass bench`` times: for each, how to build one
variant (eager, Inductor, the hand-fused reference, wformat) of a model
and its timed step. ``bench.py`` builds every variant in a process of its
own from the same seed, so each variant compiles and runs as it would in a
user's program, with nothing of another variant in Dynamo's caches."""
from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .bench_models import (BnCNN, CellLoop, Decoder, PackedLSTM, PackedSpeechEncoder, RnnLM, SpeechEncoder,
                           bn_fp32_by_hand, hand_fused_decoder)
from .bench_report import VARIANTS

__all__ = ["Sizes", "QUICK", "FULL", "PARTS", "Case", "cases"]


@dataclasses.dataclass
class Sizes:
    decoder: dict
    decode_tokens: int
    prefill_tokens: int
    rnn: dict
    rnn_batch: int
    rnn_steps: int
    cnn: dict
    cnn_input: tuple
    bn_steps: int
    rounds: int
    min_s: float
    cells: dict = dataclasses.field(default_factory=lambda: dict(inp=64, hidden=128))
    cell_steps: int = 32
    cell_batch: int = 4
    train_tokens: int = 8
    regional_tokens: int = 8
    speech: dict = dataclasses.field(default_factory=lambda: dict(mels=40, hidden=128))
    speech_input: tuple = (4, 40, 64)  # batch, mel bins, frames
    prompt_tokens: int = 8
    new_tokens: int = 16
    vocab: int = 1000
    packed: dict = dataclasses.field(default_factory=lambda: dict(inp=40, hidden=128, layers=2))
    packed_input: tuple = (100, 16, 20)  # T, batch, shortest length (the longest is T)
    packed_speech_input: tuple = (16, 40, 160, 80)  # batch, mel bins, frames, shortest utterance


QUICK = Sizes(decoder=dict(d=64, layers=2, heads=4, kv_heads=2, ffn=172), decode_tokens=1, prefill_tokens=32,
              rnn=dict(vocab=100, hidden=32, layers=2), rnn_batch=4, rnn_steps=16,
              cnn=dict(width=8, blocks=1), cnn_input=(4, 3, 16, 16), bn_steps=20, rounds=3, min_s=0.01,
              cells=dict(inp=16, hidden=32), cell_steps=8, cell_batch=2, train_tokens=8,
              speech=dict(mels=16, hidden=32), speech_input=(2, 16, 16), new_tokens=4, vocab=100,
              packed=dict(inp=8, hidden=16, layers=2), packed_input=(12, 4, 3),
              packed_speech_input=(4, 16, 16, 8))
FULL = Sizes(decoder=dict(d=256, layers=4, heads=8, kv_heads=2, ffn=1376), decode_tokens=1, prefill_tokens=256,
             rnn=dict(vocab=500, hidden=128, layers=2), rnn_batch=8, rnn_steps=64,
             cnn=dict(width=32, blocks=3), cnn_input=(8, 3, 32, 32), bn_steps=100, rounds=7, min_s=0.05)

PARTS = ("decoder", "generate", "rnn", "speech", "packed", "cnn", "cells")

#: Per variant: the compiler, and whether the model is the hand-fused one.
_BACKENDS = {"inductor": "inductor", "hand-fused": "inductor", "wformat": "wformat"}


@dataclasses.dataclass
class Case:
    """One row. ``build(variant)`` returns (the model, its timed step, an
    optional extra measurement run after the first call, returning a dict
    for the statistics table)."""

    model: str
    step: str
    size: str
    build: Callable[[str], tuple]
    tol: float  # max |out - eager| relative to max |eager|
    note: str = ""
    variants: Tuple[str, ...] = VARIANTS
    #: variants timed but not compared with eager (they compute something else by design)
    unchecked: Tuple[str, ...] = ()


def _step(model: nn.Module, x: torch.Tensor, train: bool, sgd: bool = False) -> Callable[[], torch.Tensor]:
    """One timed call: a training step (forward, ``sum().backward()`` in
    fp32; with ``sgd``, an SGD step and ``zero_grad`` too, as a training
    loop runs) or a forward without grad; returns the output, detached."""
    if train:
        opt = torch.optim.SGD(model.parameters(), lr=1e-6) if sgd else None

        def run():
            out = model(*x) if isinstance(x, tuple) else model(x)
            out.float().sum().backward()
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            return out.detach()
    else:
        def run():
            with torch.no_grad():
                return model(*x) if isinstance(x, tuple) else model(x)
    return run


def _variant(base: nn.Module, variant: str, hand: Optional[Callable] = None, dynamic: Optional[bool] = False,
             regional: bool = False) -> nn.Module:
    """``base`` as ``variant`` runs it. dynamic=False (unless asked): every
    size gets its own static graph, as in a serving loop that pads to fixed
    sizes. ``regional``: each decoder layer compiled on its own
    (``nn.Module.compile``), as large models are compiled to cut compile time."""
    if variant == "eager":
        return base
    model = hand(base) if variant == "hand-fused" else base
    backend = _BACKENDS[variant]
    if regional:
        for layer in model.layers:
            layer.compile(backend=backend, dynamic=dynamic)
        return model
    return torch.compile(model, backend=backend, dynamic=dynamic)


def _decoder_shape(s: Sizes) -> str:
    d = s.decoder
    return (f"{d['layers']} layers, d_model {d['d']}, {d['heads']} heads / {d['kv_heads']} KV heads, "
            f"SwiGLU {d['ffn']}, batch 1")


def _decoder_case(s: Sizes, tokens: int, label: str, regional: bool = False) -> Case:
    def build(v):
        torch.manual_seed(0)
        base = Decoder(**s.decoder).eval()
        x = torch.randn(1, tokens, s.decoder["d"])
        m = _variant(base, v, hand_fused_decoder, regional=regional)
        return m, _step(m, x, train=False), None

    step = "forward, each layer compiled on its own" if regional else "forward"
    return Case("LLaMA-like decoder", step, f"{label}: {tokens} token{'s' if tokens > 1 else ''}", build, 1e-4,
                _decoder_shape(s))


def _decoder_dynamic_case(s: Sizes, tokens: int) -> Case:
    """The decoder after Dynamo's dynamic recompile: every compiled variant
    first runs two other lengths (the first compiles statically, the second
    makes Dynamo recompile with the length symbolic), then is timed at
    ``tokens`` on that symbolic graph, as a serving loop with varying
    prompt lengths runs."""
    def build(v):
        torch.manual_seed(0)
        base = Decoder(**s.decoder).eval()
        d = s.decoder["d"]
        # Drawn for every variant (eager too) before the hand-fused model
        # draws its own initial weights, so each variant gets the same x.
        # Two other lengths: the first compiles statically, the second
        # recompiles with the length symbolic (neither 1, which Dynamo
        # specializes).
        warm = [torch.randn(1, n, d) for n in (tokens + 2, tokens + 5)]
        x = torch.randn(1, tokens, d)
        m = _variant(base, v, hand_fused_decoder, dynamic=None)
        if v != "eager":
            with torch.no_grad():
                for w in warm:
                    m(w)
        return m, _step(m, x, train=False), None

    return Case("LLaMA-like decoder", "forward after a dynamic recompile", f"{tokens} token{'s' if tokens > 1 else ''}",
                build, 1e-4)


def _decoder_train_case(s: Sizes) -> Case:
    """A training step of the decoder (forward, backward, SGD step)."""
    def build(v):
        torch.manual_seed(0)
        base = Decoder(**s.decoder).train()
        x = torch.randn(1, s.train_tokens, s.decoder["d"])
        m = _variant(base, v, lambda b: hand_fused_decoder(b).train())
        return m, _step(m, x, True, sgd=True), None

    return Case("LLaMA-like decoder", "training step (SGD)", f"{s.train_tokens} tokens", build, 1e-4)


def _generate_case(s: Sizes) -> Case:
    """HF ``LlamaForCausalLM.generate()``, greedy, with the decoder's shape;
    the compiled variants compile ``model.forward``, as HF's docs show.
    The output compared is the generated tokens."""
    def build(v):
        from transformers import LlamaConfig, LlamaForCausalLM

        d = s.decoder
        torch.manual_seed(0)
        cfg = LlamaConfig(hidden_size=d["d"], intermediate_size=d["ffn"], num_hidden_layers=d["layers"],
                          num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"], vocab_size=s.vocab,
                          max_position_embeddings=256, attn_implementation="sdpa")
        model = LlamaForCausalLM(cfg).eval()
        if v != "eager":
            model.forward = torch.compile(model.forward, backend=_BACKENDS[v])
        prompt = torch.randint(0, s.vocab, (1, s.prompt_tokens), generator=torch.Generator().manual_seed(1))

        def run():
            with torch.no_grad():
                out = model.generate(prompt, max_new_tokens=s.new_tokens, min_new_tokens=s.new_tokens,
                                     do_sample=False, pad_token_id=0)
            return out.float()

        return model, run, None

    return Case("HF LLaMA generate()", "greedy decoding", f"{s.prompt_tokens} + {s.new_tokens} tokens", build, 0.0,
                "transformers' LlamaForCausalLM with the decoder's shape, vocabulary " + str(s.vocab)
                + "; compiled: model.forward; checked: the generated tokens equal eager's",
                variants=("eager", "inductor", "wformat"))


def _cell_case(s: Sizes, cell: str, train: bool) -> Case:
    """A Python loop of ``nn.LSTMCell`` / ``nn.GRUCell`` steps; the
    hand-fused reference is the same weights in one eager ``nn.LSTM`` /
    ``nn.GRU`` (what a user would rewrite the loop as)."""
    def build(v):
        torch.manual_seed(0)
        c = s.cells
        base = CellLoop(c["inp"], c["hidden"], cell=cell)
        x = torch.randn(s.cell_steps, s.cell_batch, c["inp"])
        m = base.as_rnn() if v == "hand-fused" else _variant(base, v)
        return m, _step(m, x, train), None

    c = s.cells
    return Case(f"{cell} loop", "training step" if train else "inference", f"T={s.cell_steps}, batch {s.cell_batch}",
                build, 1e-4, f"nn.{cell}({c['inp']}, {c['hidden']}) stepped in a Python loop, outputs stacked; "
                f"hand-fused: the same weights in one eager nn.{cell[:-4]}")


def _rnn_case(s: Sizes, train: bool) -> Case:
    def build(v):
        torch.manual_seed(0)
        base = RnnLM(**s.rnn)
        tok = torch.randint(0, s.rnn["vocab"], (s.rnn_steps, s.rnn_batch))
        m = _variant(base, v)
        return m, _step(m, tok, train), None

    r = s.rnn
    return Case("RNN language model", "training step" if train else "inference", f"T={s.rnn_steps}, batch {s.rnn_batch}",
                build, 1e-4, f"Embedding {r['vocab']} -> {r['layers']}-layer LSTM {r['hidden']} -> Linear {r['vocab']}",
                variants=("eager", "inductor", "wformat"))


def _speech_case(s: Sizes, train: bool) -> Case:
    def build(v):
        torch.manual_seed(0)
        base = SpeechEncoder(**s.speech)
        x = torch.randn(*s.speech_input)
        m = _variant(base, v)
        return m, _step(m, x, train), None

    b, mels, frames = s.speech_input
    return Case("speech encoder", "training step" if train else "inference", f"{frames} frames, batch {b}", build,
                1e-4, f"two Conv1d over {mels} mel bins -> 2-layer LSTM {s.speech['hidden']} -> LayerNorm -> Linear",
                variants=("eager", "inductor", "wformat"))


def _packed_build(base: nn.Module, inputs: tuple, train: bool, v: str):
    """A variable-length model as ``v`` runs it; ``hand-fused`` is eager on
    the padded batch (the same weights, no packing)."""
    m = base.padded() if v == "hand-fused" else _variant(base, v)
    return m, _step(m, inputs, train, sgd=train), None


def _packed_case(s: Sizes, train: bool) -> Case:
    def build(v):
        torch.manual_seed(0)
        base = PackedLSTM(**s.packed)
        T, B, shortest = s.packed_input
        lengths = torch.randint(shortest, T + 1, (B,))
        lengths[0] = T
        return _packed_build(base, (torch.randn(T, B, s.packed["inp"]), lengths), train, v)

    T, B, shortest = s.packed_input
    p = s.packed
    return Case("packed LSTM (variable lengths)", "training step" if train else "inference",
                f"T={T}, batch {B}, lengths {shortest}-{T}", build, 1e-4,
                f"Linear -> pack_padded_sequence -> {p['layers']}-layer bidirectional LSTM {p['hidden']} -> "
                "pad_packed_sequence -> Linear; hand-fused: eager on the padded batch (no packing)",
                unchecked=("hand-fused",))


def _packed_speech_case(s: Sizes, train: bool) -> Case:
    def build(v):
        torch.manual_seed(0)
        base = PackedSpeechEncoder(**s.speech)
        B, mels, frames, shortest = s.packed_speech_input
        lengths = torch.randint(shortest, frames + 1, (B,))
        lengths[0] = frames
        return _packed_build(base, (torch.randn(B, mels, frames), lengths), train, v)

    B, mels, frames, shortest = s.packed_speech_input
    return Case("speech encoder (variable lengths)", "training step" if train else "inference",
                f"{shortest}-{frames} frames, batch {B}", build, 1e-4,
                f"two Conv1d over {mels} mel bins -> pack_padded_sequence -> 2-layer LSTM {s.speech['hidden']} -> "
                "pad_packed_sequence -> LayerNorm -> Linear; hand-fused: eager on the padded batch (no packing)",
                unchecked=("hand-fused",))


def _cnn_case(s: Sizes, train: bool) -> Case:
    def build(v):
        torch.manual_seed(0)
        base = BnCNN(**s.cnn).to(torch.bfloat16)
        x = torch.randn(*s.cnn_input, dtype=torch.bfloat16)
        ref32 = BnCNN(**s.cnn)
        ref32.load_state_dict({k: val.float() for k, val in base.state_dict().items()})
        m = _variant(base, v, bn_fp32_by_hand)
        m.train(train)

        def bn_statistics() -> Dict[str, object]:
            # Running statistics on a stream whose channel means and spread
            # drift (weights fixed, so only the statistics differ), against
            # an fp32 copy given the same bf16 inputs; run after the first
            # call (a training step), which the fp32 copy takes too.
            ref32(x.float())
            g = torch.Generator().manual_seed(1)
            for i in range(s.bn_steps):
                xb = (torch.randn(*s.cnn_input, generator=g) * (1.0 + 0.01 * i) + 2.0 + 0.02 * i).to(torch.bfloat16)
                m(xb)
                ref32(xb.float())
            mine = [b for b in getattr(m, "_orig_mod", m).modules() if isinstance(b, nn.BatchNorm2d)]
            ref = [b for b in ref32.modules() if isinstance(b, nn.BatchNorm2d)]
            err = statistics.median(((b.running_var.float() - r.running_var).norm() / r.running_var.norm()).item()
                                    for b, r in zip(mine, ref))
            return {v: err, v + " dtype": str(mine[0].running_var.dtype).replace("torch.", "")}

        return m, _step(m, x, train), (bn_statistics if train else None)

    c = s.cnn
    return Case("bf16 CNN with BatchNorm", "training step" if train else "eval forward",
                "x".join(map(str, s.cnn_input)), build, 5e-2,
                f"{1 + 2 * c['blocks']} conv-BatchNorm pairs, width {c['width']}, bf16")


def cases(sizes: Sizes, parts: Sequence[str] = PARTS) -> List[Case]:
    """The rows of ``parts``, in table order."""
    out: List[Case] = []
    if "decoder" in parts:
        out += [_decoder_case(sizes, sizes.decode_tokens, "decode"), _decoder_case(sizes, sizes.prefill_tokens, "prefill"),
                _decoder_case(sizes, sizes.regional_tokens, "regional", regional=True),
                *(_decoder_dynamic_case(sizes, n) for n in (1, 5, 8)), _decoder_train_case(sizes)]
    if "generate" in parts:
        out.append(_generate_case(sizes))
    if "rnn" in parts:
        out += [_rnn_case(sizes, True), _rnn_case(sizes, False)]
    if "speech" in parts:
        out += [_speech_case(sizes, True), _speech_case(sizes, False)]
    if "packed" in parts:
        out += [_packed_case(sizes, True), _packed_case(sizes, False), _packed_speech_case(sizes, True),
                _packed_speech_case(sizes, False)]
    if "cnn" in parts:
        out += [_cnn_case(sizes, True), _cnn_case(sizes, False)]
    if "cells" in parts:
        out += [_cell_case(sizes, cell, train) for cell in ("LSTMCell", "GRUCell") for train in (True, False)]
    return out
