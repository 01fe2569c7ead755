"""oneDNN's LSTM layer from plain weights against from a copy in its own
layout: what ``rnn/cpu/lstm_pack.py`` keeps for inference graphs.

    python benchmarks/lstm_pack_kernel.py [--threads 1] [--rounds 9] [--out FILE]

For each size (one layer, one direction, float32, inference), the kernel
``aten.mkldnn_rnn_layer`` as wfpass's op calls it, once with the plain
parameters (oneDNN reorders them into its layout on every call) and once
with the copy ``mkldnn::_reorder_mkldnn_rnn_layer_weight`` made; the copy is
made for the first size of its weights (T 16, batch 1 for the LM's sizes),
as the op makes it from the first call, and read at every other length and
batch too. Interleaved rounds, the median of per-round medians; x = plain /
copy (above 1: the copy is faster). Also printed: the largest difference of
the outputs (the same kernel and arithmetic: 0).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from _out import emit  # benchmarks/_out.py, beside this script

# (input, hidden, [(T, batch), ...]): the first (T, batch) makes the copy.
SIZES = [
    (32, 64, [(4, 4), (1, 1), (16, 1), (64, 4)]),
    (128, 128, [(16, 1), (1, 1), (16, 8), (64, 4)]),
    (256, 256, [(16, 1), (1, 1), (32, 8)]),
    (512, 512, [(16, 1), (1, 1), (32, 16)]),
]


def layer(x, w_ih, w_hh, b, h0):
    return torch.ops.aten.mkldnn_rnn_layer.default(x, w_ih, w_hh, b, b, h0, h0, False, [], 2, h0.shape[2], 1, True,
                                                   False, False, False)[0]


def per_call_us(fn, budget_s: float) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < budget_s:
        fn()
        n += 1
    return (time.perf_counter() - t0) / max(n, 1) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--sample-s", type=float, default=0.05)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lines = [f"Command: `python benchmarks/lstm_pack_kernel.py --threads {args.threads}`  ",
             f"torch {torch.__version__}, {platform.machine()}, {args.threads} thread(s), {args.rounds} interleaved "
             "rounds; us per layer call (median over rounds); x = plain weights / copy in oneDNN's layout", "",
             "| input | hidden | T | batch | plain weights | copy | x | max abs diff |", "|---|---|---|---|---|---|---|---|"]
    with torch.no_grad():
        for inp, hid, shapes in SIZES:
            w_ih, w_hh, b = torch.randn(4 * hid, inp) * 0.1, torch.randn(4 * hid, hid) * 0.1, torch.randn(4 * hid) * 0.1
            t0, b0 = shapes[0]
            p_ih, p_hh = torch.ops.mkldnn._reorder_mkldnn_rnn_layer_weight(w_ih, w_hh, hid, False, True, False, [t0, b0, inp])
            for T, B in shapes:
                x, h0 = torch.randn(T, B, inp), torch.zeros(1, B, hid)
                diff = (layer(x, w_ih, w_hh, b, h0) - layer(x, p_ih, p_hh, b, h0)).abs().max().item()
                plain, packed, ratios = [], [], []
                for _ in range(args.rounds):
                    a = per_call_us(lambda: layer(x, w_ih, w_hh, b, h0), args.sample_s)
                    c = per_call_us(lambda: layer(x, p_ih, p_hh, b, h0), args.sample_s)
                    plain.append(a)
                    packed.append(c)
                    ratios.append(a / c)
                lines.append(f"| {inp} | {hid} | {T} | {B} | {statistics.median(plain):.1f} | "
                             f"{statistics.median(packed):.1f} | {statistics.median(ratios):.2f} | {diff:.1e} |")
    emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
