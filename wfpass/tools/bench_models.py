"""The models ``python -m wfpass bench`` and ``python -m wfpass demo``
measure: a Llama-style decoder (separate and hand-fused Q/K/V and
gate/up), an LSTM language model and a BatchNorm CNN."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F



def built_in_dtype(dtype: torch.dtype, build):
    """``build()`` with ``dtype`` as torch's default dtype: a model built on
    fake tensors (``FakeTensorMode``, ``device="cuda"``) cannot be cast with
    ``.to(dtype)``, which would have to swap its fake parameters."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return build()
    finally:
        torch.set_default_dtype(prev)

class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class DecoderLayer(nn.Module):
    """LLaMA-like: RMSNorm, grouped-query causal attention, SwiGLU. With
    ``fused=True`` the layer is written by hand with one Q/K/V linear and one
    gate/up linear: the layout a weight-format rewrite aims at."""

    def __init__(self, d: int, heads: int, kv_heads: int, ffn: int, fused: bool = False) -> None:
        super().__init__()
        self.h, self.kv, self.hd = heads, kv_heads, d // heads
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.fused, self.ffn = fused, ffn
        qo, ko = heads * self.hd, kv_heads * self.hd
        self.sizes = (qo, ko, ko)
        if fused:
            self.qkv = nn.Linear(d, qo + 2 * ko, bias=False)
            self.gate_up = nn.Linear(d, 2 * ffn, bias=False)
        else:
            self.q, self.k, self.v = (nn.Linear(d, n, bias=False) for n in self.sizes)
            self.gate, self.up = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.o = nn.Linear(qo, d, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.n1(x)
        if self.fused:
            q, k, v = self.qkv(h).split(self.sizes, -1)
        else:
            q, k, v = self.q(h), self.k(h), self.v(h)
        q = q.view(b, t, self.h, self.hd).transpose(1, 2)
        k = k.view(b, t, self.kv, self.hd).transpose(1, 2).repeat_interleave(self.h // self.kv, 1)
        v = v.view(b, t, self.kv, self.hd).transpose(1, 2).repeat_interleave(self.h // self.kv, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        h = self.n2(x)
        if self.fused:
            g, u = self.gate_up(h).split(self.ffn, -1)
        else:
            g, u = self.gate(h), self.up(h)
        return x + self.down(F.silu(g) * u)


class Decoder(nn.Module):
    def __init__(self, d: int = 256, layers: int = 4, heads: int = 8, kv_heads: int = 2, ffn: int = 1376,
                 fused: bool = False) -> None:
        super().__init__()
        self.shape = dict(d=d, layers=layers, heads=heads, kv_heads=kv_heads, ffn=ffn)
        self.layers = nn.ModuleList(DecoderLayer(d, heads, kv_heads, ffn, fused) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def hand_fused_decoder(src: Decoder) -> Decoder:
    """``src`` written by hand with fused Q/K/V and gate/up weights."""
    out = Decoder(**src.shape, fused=True)
    with torch.no_grad():
        for a, b in zip(out.layers, src.layers):
            a.qkv.weight.copy_(torch.cat([b.q.weight, b.k.weight, b.v.weight]))
            a.gate_up.weight.copy_(torch.cat([b.gate.weight, b.up.weight]))
            for name in ("o", "down", "n1", "n2"):
                getattr(a, name).weight.copy_(getattr(b, name).weight)
    return out


class CellLoop(nn.Module):
    """``nn.LSTMCell`` (or ``nn.GRUCell``) stepped over the sequence ([T,
    batch, features]) in a Python loop, the outputs stacked."""

    def __init__(self, inp: int = 64, hidden: int = 128, cell: str = "LSTMCell"):
        super().__init__()
        self.cell = getattr(nn, cell)(inp, hidden)

    def forward(self, x):
        state = None
        outs = []
        for t in range(x.shape[0]):
            state = self.cell(x[t]) if state is None else self.cell(x[t], state)
            outs.append(state[0] if isinstance(state, tuple) else state)
        return torch.stack(outs)

    def as_rnn(self) -> nn.Module:
        """The same weights (copies) in one ``nn.LSTM`` / ``nn.GRU``, returning
        its output only: the loop as a user would rewrite it."""
        c = self.cell
        rnn = (nn.LSTM if isinstance(c, nn.LSTMCell) else nn.GRU)(c.input_size, c.hidden_size)
        with torch.no_grad():
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(rnn, name + "_l0").copy_(getattr(c, name))
        return _FirstOutput(rnn)


class _FirstOutput(nn.Module):
    def __init__(self, rnn: nn.Module):
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        return self.rnn(x)[0]


class RnnLM(nn.Module):
    """Embedding -> LSTM -> Linear over the vocabulary; input [T, batch]."""

    def __init__(self, vocab: int = 500, hidden: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, hidden)
        self.rnn = nn.LSTM(hidden, hidden, num_layers=layers)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        return self.out(self.rnn(self.emb(tokens))[0])


class SpeechEncoder(nn.Module):
    """Two 1-D convolutions over the mel bins, a 2-layer LSTM, LayerNorm and
    a projection; input [batch, mels, frames]."""

    def __init__(self, mels: int = 80, hidden: int = 256) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv1d(mels, hidden, 3, padding=1), nn.GELU(),
                                  nn.Conv1d(hidden, hidden, 3, padding=1), nn.GELU())
        self.rnn = nn.LSTM(hidden, hidden, num_layers=2, batch_first=True)
        self.norm = nn.LayerNorm(hidden)
        self.proj = nn.Linear(hidden, 32)

    def forward(self, x):
        h = self.conv(x).transpose(1, 2)
        return self.proj(self.norm(self.rnn(h)[0]))


class PackedSpeechEncoder(SpeechEncoder):
    """The speech encoder fed a variable-length batch, as speech models
    train: the convolutions over the padded batch, then
    pack_padded_sequence (unsorted lengths) -> LSTM -> pad_packed_sequence
    -> LayerNorm -> Linear; input [batch, mels, frames] and each
    utterance's frames."""

    def forward(self, x, lengths):
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

        h = self.conv(x).transpose(1, 2)
        packed = pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False)
        y = pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=h.shape[1])[0]
        return self.proj(self.norm(y))

    def padded(self) -> nn.Module:
        """The same weights on the padded batch, without packing."""
        return _PaddedSpeech(self)


class _PaddedSpeech(nn.Module):
    def __init__(self, enc: PackedSpeechEncoder) -> None:
        super().__init__()
        self.enc = enc

    def forward(self, x, lengths):
        return SpeechEncoder.forward(self.enc, x)


class PackedLSTM(nn.Module):
    """A variable-length batch through a bidirectional LSTM, as RNNs are
    trained: Linear -> pack_padded_sequence (unsorted lengths) -> LSTM ->
    pad_packed_sequence (back to the batch's length) -> Linear; input
    [T, batch, features] and each sequence's length."""

    def __init__(self, inp: int = 40, hidden: int = 128, layers: int = 2, out: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(inp, hidden)
        self.rnn = nn.LSTM(hidden, hidden, num_layers=layers, bidirectional=True)
        self.out = nn.Linear(2 * hidden, out)

    def forward(self, x, lengths):
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

        packed = pack_padded_sequence(self.inp(x), lengths, enforce_sorted=False)
        y, _ = self.rnn(packed)
        return self.out(pad_packed_sequence(y, total_length=x.shape[0])[0])

    def padded(self) -> nn.Module:
        """The same weights run on the padded batch, without packing (what
        users do to avoid packing's cost: every step of every sequence; the
        backward direction then starts in the padding)."""
        return _Padded(self)


class _Padded(nn.Module):
    def __init__(self, packed: PackedLSTM) -> None:
        super().__init__()
        self.inp, self.rnn, self.out = packed.inp, packed.rnn, packed.out

    def forward(self, x, lengths):
        return self.out(self.rnn(self.inp(x))[0])


class BnCNN(nn.Module):
    """Conv-BatchNorm-ReLU blocks with a residual, then pooling and a linear
    head: the BatchNorm pattern of a ResNet."""

    def __init__(self, width: int = 32, blocks: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                          nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width))
            for _ in range(blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = F.relu(x + block(x))
        return self.head(x.mean((2, 3)))


def bn_fp32_by_hand(model: nn.Module) -> nn.Module:
    """The reference for the batchnorm format: BatchNorms in fp32 in a half
    model; PyTorch's mixed-precision batch norm kernel then runs."""
    for m in model.modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
            m.float()
    return model
