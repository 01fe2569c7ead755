"""``python -m wfpass demo``: a small transformer encoder, compiled with
``backend="wformat"``, checked against eager, its report, and eager /
Inductor / wformat timings side by side."""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["main", "EncoderLayer"]


class EncoderLayer(nn.Module):
    """Pre-norm attention with separate Q/K/V (grouped K/V) and a SwiGLU MLP:
    parameters declared the readable way, as users write them."""

    def __init__(self, d=256, heads=8, kv_heads=2, ffn=512):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, kv_heads * self.hd)
        self.v = nn.Linear(d, kv_heads * self.hd)
        self.o = nn.Linear(d, d)
        self.gate = nn.Linear(d, ffn, bias=False)
        self.up = nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _median_ms(fn, x, reps):
    with torch.no_grad():
        for _ in range(3):
            fn(x)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(x)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def demo(layers: int = 2, reps: int = 50) -> int:
    import wfpass
    from tabulate import tabulate

    torch.manual_seed(0)
    model = nn.Sequential(*[EncoderLayer() for _ in range(layers)]).eval()
    eager = copy.deepcopy(model)
    inductor = torch.compile(copy.deepcopy(model))
    wformat = torch.compile(model, backend="wformat")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {layers} encoder layers, d=256, GQA 8/2 heads, SwiGLU 512\n")

    rows, ok = [], True
    for shape in [(1, 1, 256), (8, 128, 256)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            ref, out = eager(x), wformat(x)
        err = (out - ref).abs().max().item()
        ok &= err < 1e-4
        report = wfpass.last_report()
        print(f"input {tuple(shape)}: max |wformat - eager| = {err:.2e}  ({'OK' if err < 1e-4 else 'MISMATCH'})")
        print(report, "\n")
        t_e, t_i, t_w = (_median_ms(f, x, reps) for f in (eager, inductor, wformat))
        rows.append([str(tuple(shape)), f"{t_e:.3f}", f"{t_i:.3f}", f"{t_w:.3f}", f"{t_i / t_w:.2f}x"])
    print(f"forward time, median of {reps} calls (ms); this machine is shared, so read the ratio:")
    print(tabulate(rows, headers=["input", "eager", "inductor", "wformat", "wformat vs inductor"], tablefmt="github"))
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wfpass", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="compile a small transformer encoder with backend='wformat'")
    d.add_argument("--layers", type=int, default=2)
    d.add_argument("--reps", type=int, default=50)
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        return demo(args.layers, args.reps)
    return 2


if __name__ == "__main__":
    sys.exit(main())
