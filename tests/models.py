"""Toy models shared by the tests."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class QKV(nn.Module):
    """Grouped-query attention projections: q wider than k/v; k has no bias."""

    def __init__(self, d=32, dq=32, dkv=16, k_bias=False):
        super().__init__()
        self.q = nn.Linear(d, dq)
        self.k = nn.Linear(d, dkv, bias=k_bias)
        self.v = nn.Linear(d, dkv)
        self.o = nn.Linear(dq, d)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        att = torch.softmax(q[..., : k.shape[-1]] @ k.transpose(-1, -2) / 4.0, -1)
        return self.o(torch.cat([att @ v, q[..., k.shape[-1] :]], -1))


class SwiGLU(nn.Module):
    def __init__(self, d=32, h=48):
        super().__init__()
        self.gate = nn.Linear(d, h, bias=False)
        self.up = nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Functional(nn.Module):
    """Siblings written with F.linear over bare Parameters."""

    def __init__(self, d=16):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, d) / 4)
        self.w2 = nn.Parameter(torch.randn(12, d) / 4)
        self.b2 = nn.Parameter(torch.randn(12))

    def forward(self, x):
        return F.linear(x, self.w1).sum(-1) + F.linear(x, self.w2, self.b2).pow(2).sum(-1)


class Chain(nn.Module):
    """k reads q's output: not siblings, nothing to fuse."""

    def __init__(self, d=16):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)

    def forward(self, x):
        return self.k(self.q(x))
