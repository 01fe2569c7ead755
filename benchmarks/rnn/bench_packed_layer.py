"""One packed RNN layer on the CPU, forward + backward: eager PyTorch on the
PackedSequence, eager on the padded batch, ``wfpass::packed_layer`` (the
per-step loop) and, for the LSTM, ``wfpass::packed_lstm_runs`` (oneDNN's
LSTM layer over each run of equal batch size: what wformat runs for a
packed CPU LSTM without a projection and without grad where the loop has
no raw-pointer path for the dtype).

    python benchmarks/rnn/bench_packed_layer.py [--rounds 7] [--iters 5] [--threads 1] [--inference]

The shape: input 128, hidden 128, batch 16, lengths uniform in 20..100
(seeded; the padded batch is as long as the longest), one thread by
default. Per variant and round, ``--iters`` training steps (forward, then
the backward of a fixed random projection of ``out`` and ``h_n`` into the
input and every weight; with ``--inference``, the forward alone without
grad); the table gives the median over rounds of the
time per step, the variants interleaved inside every round so machine noise
hits them alike. Eager's padded LSTM is oneDNN's kernel; its padded GRU is
ATen's per-step loop. The op runs on its C++ kernel (``wfpass/native``)
when it builds, else on its Python kernel, and its fp32 steps on the
raw-pointer loop on an AVX-512 or AVX2 CPU (``WFPASS_FAST_LOOP=0``: ATen calls):
the first line says which.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

from wfpass import native
from wfpass.rnn.cpu import varlen_layer, varlen_lstm_runs  # noqa: F401 - register the ops

I, H, B, T = 128, 128, 16, 100


def _variants(kind: str, lengths: torch.Tensor, inference: bool = False):
    """name -> a function running one training step (or, ``inference``,
    one forward without grad)."""
    fns = _training_variants(kind, lengths)
    if not inference:
        return fns
    torch.manual_seed(0)
    rnn = (nn.LSTM if kind == "LSTM" else nn.GRU)(I, H)
    x = torch.randn(int(lengths[0]), B, I)
    packed = pack_padded_sequence(x, lengths)
    w = [p.detach() for p in rnn._flat_weights]
    ops = torch.ops.wfpass
    fns = {"eager, PackedSequence": lambda: rnn(packed), "eager, padded": lambda: rnn(x),
           "wfpass::packed_layer": lambda: ops.packed_layer_fw(packed.data, packed.batch_sizes, *w, None, None, None,
                                                                kind, False, False)}
    if kind == "LSTM":
        fns["wfpass::packed_lstm_runs"] = lambda: ops.packed_lstm_runs_fw(packed.data, packed.batch_sizes, *w, None,
                                                                           None, False, False)
    return fns


def _training_variants(kind: str, lengths: torch.Tensor):
    torch.manual_seed(0)
    rnn = (nn.LSTM if kind == "LSTM" else nn.GRU)(I, H)
    x = torch.randn(int(lengths[0]), B, I)  # padded to the longest sequence
    packed = pack_padded_sequence(x, lengths)
    R, Rh = torch.randn(packed.data.shape[0], H), torch.randn(1, B, H)
    Rp = torch.randn(x.shape[0], B, H)
    params = list(rnn.parameters())

    def eager_packed():
        data = packed.data.detach().requires_grad_()
        out, h = rnn(PackedSequence(data, packed.batch_sizes))
        h = h[0] if kind == "LSTM" else h
        torch.autograd.grad((out.data * R).sum() + (h * Rh).sum(), [data] + params)

    def eager_padded():
        xx = x.detach().requires_grad_()
        out, h = rnn(xx)
        h = h[0] if kind == "LSTM" else h
        torch.autograd.grad((out * Rp).sum() + (h * Rh).sum(), [xx] + params)

    def op():
        data = packed.data.detach().requires_grad_()
        out, h, _, _ = torch.ops.wfpass.packed_layer(data, packed.batch_sizes, rnn.weight_ih_l0, rnn.weight_hh_l0,
                                                     rnn.bias_ih_l0, rnn.bias_hh_l0, None, None, None, kind, False,
                                                     True)
        torch.autograd.grad((out * R).sum() + (h * Rh).sum(), [data] + params)

    def runs():
        data = packed.data.detach().requires_grad_()
        out, h, _, _ = torch.ops.wfpass.packed_lstm_runs(data, packed.batch_sizes, rnn.weight_ih_l0, rnn.weight_hh_l0,
                                                         rnn.bias_ih_l0, rnn.bias_hh_l0, None, None, False, True)
        torch.autograd.grad((out * R).sum() + (h * Rh).sum(), [data] + params)

    fns = {"eager, PackedSequence": eager_packed, "eager, padded": eager_padded, "wfpass::packed_layer": op}
    if kind == "LSTM":
        fns["wfpass::packed_lstm_runs"] = runs
    return fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--inference", action="store_true", help="time the forward alone, without grad")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, T + 1, (B,), generator=g).sort(descending=True).values
    loop = f"raw-pointer loop (fp32, {native.fast_isa_words()})" if native.fast_loop() else "ATen calls"
    print(f"torch {torch.__version__}, {args.threads} thread(s); op kernel: {native.status()}; the loop's steps: {loop}")
    print(f"I = {I}, H = {H}, B = {B}, T = {T}, lengths {lengths.tolist()} "
          f"({int(lengths.sum())} of {int(lengths[0]) * B} padded steps valid); "
          f"{'forward without grad, ms per call' if args.inference else 'forward + backward, ms per training step'}, "
          f"median of {args.rounds} rounds x {args.iters}\n")
    print("| layer | eager, PackedSequence | eager, padded | wfpass::packed_layer | wfpass::packed_lstm_runs | "
          "wformat's kernel vs eager packed | vs padded |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("LSTM", "GRU"):
        fns = _variants(kind, lengths, args.inference)
        if args.inference:
            torch.set_grad_enabled(False)
        for fn in fns.values():  # warm up (allocator, oneDNN primitives)
            fn()
        times = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    fn()
                times[name].append((time.perf_counter() - t0) / args.iters * 1e3)
        med = {name: statistics.median(v) for name, v in times.items()}
        a, b, c = med["eager, PackedSequence"], med["eager, padded"], med["wfpass::packed_layer"]
        r = med.get("wfpass::packed_lstm_runs")
        # The kernel wformat picks (varlen_lstm_runs.usable): oneDNN run by
        # run for an LSTM without grad where the loop has no raw-pointer
        # path for the dtype, else the loop.
        x = torch.empty(0)
        w = r if varlen_lstm_runs.usable(kind, 0, x, not args.inference) else c
        runs_cell = f"{r:.2f}" if r is not None else "-"
        print(f"| {kind} | {a:.2f} | {b:.2f} | {c:.2f} | {runs_cell} | {a / w:.2f}x | {b / w:.2f}x |")


if __name__ == "__main__":
    main()
