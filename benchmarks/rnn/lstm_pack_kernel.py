"""oneDNN's LSTM layer from plain weights against from a copy in its own
layout: what ``rnn/cpu/lstm_prepack.py`` keeps for inference graphs.

    python benchmarks/rnn/lstm_pack_kernel.py [--threads 1] [--rounds 9] [--out FILE]
    python benchmarks/rnn/lstm_pack_kernel.py --against-loop [--threads 1]
    python benchmarks/rnn/lstm_pack_kernel.py --dtype bfloat16 [--threads 1]
    python benchmarks/rnn/lstm_pack_kernel.py --packed [--dtype bfloat16] [--threads 1]

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
import os
import statistics
import sys
import time

import torch
from wfpass.tools.doctor import cpu_words  # the page names its CPU: figures differ by vendor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _out.py
from _out import emit  # noqa: E402

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


def _rounds(calls: dict, rounds: int, sample_s: float, rec, where) -> tuple:
    """Every call timed in each of ``rounds`` interleaved rounds, without
    grad: (per-round times, medians) in us; stops if the copy allowed on
    ``rec`` was never read (the figures would be the plain weights')."""
    times = {k: [] for k in calls}
    with torch.no_grad():
        for _ in range(rounds):
            for k, f in calls.items():
                times[k].append(per_call_us(f, sample_s))
    rec.stats._sync()
    if not rec.stats.get("packed_calls"):
        raise SystemExit(f"the copy was not read at {where}: {dict(rec.stats)}")
    return times, {k: statistics.median(v) for k, v in times.items()}


LOOP_SIZES = [(4, 4, 32, 64), (16, 1, 32, 64), (8, 16, 64, 64), (32, 4, 64, 64), (4, 32, 64, 64),
              (16, 1, 128, 128), (64, 4, 64, 128), (16, 8, 128, 128)]


def against_loop(rounds: int, sample_s: float) -> list:
    """``--against-loop``: wfpass's ops as a compiled inference graph calls
    them, at the sizes of docs/results/rnn_onednn_layout.md's table: the C++ loop
    (``packed_layer_fw``), oneDNN's layer from the plain weights and from
    the copy (``lstm_layer_fw`` with the pair allowed a copy)."""
    import wfpass  # noqa: F401  (registers the ops)
    from wfpass import native
    from wfpass.core.records import Record
    from wfpass.rnn.cpu import lstm_layer, lstm_prepack, varlen_layer  # noqa: F401

    if not native.loaded():
        raise SystemExit("--against-loop needs wfpass's C++ kernels (python -m wfpass doctor)")
    ops = torch.ops.wfpass
    lines = ["| T | batch | input | hidden | C++ loop | oneDNN, plain weights | oneDNN, copy | loop / copy |",
             "|---|---|---|---|---|---|---|---|"]
    for T, B, I, H in LOOP_SIZES:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(T, B, I, generator=g)
        w = [torch.randn(4 * H, I, generator=g) * 0.1, torch.randn(4 * H, H, generator=g) * 0.1,
             torch.randn(4 * H, generator=g) * 0.1, torch.randn(4 * H, generator=g) * 0.1]
        wc = [t.clone() for t in w]
        rec = Record("rnn", "rewritten", "lstm_pack_kernel.py", ["w_ih", "w_hh"])
        lstm_prepack.allow(rec, [(wc[0], wc[1])], None)
        none = torch.empty(0, dtype=torch.int64)
        calls = {"loop": lambda: ops.packed_layer_fw(x, none, *w, None, None, None, "LSTM", False, False),
                 "plain": lambda: ops.lstm_layer_fw(x, *w, None, None, False, H, True, False),
                 "copy": lambda: ops.lstm_layer_fw(x, *wc, None, None, False, H, True, False)}
        times, m = _rounds(calls, rounds, sample_s, rec, (T, B, I, H))
        r = statistics.median([a / b for a, b in zip(times["loop"], times["copy"])])
        lines.append(f"| {T} | {B} | {I} | {H} | {m['loop']:.1f} | {m['plain']:.1f} | {m['copy']:.1f} | {r:.2f} |")
    return lines


# (input, hidden, batch, lengths): packed batches, longest first.
PACKED_SIZES = [(32, 64, 8, [16, 14, 12, 10, 8, 6, 4, 2]), (128, 128, 4, [16, 9, 5, 1]),
                (128, 128, 16, [100 - 5 * k for k in range(16)]), (256, 256, 8, [40, 35, 30, 25, 20, 15, 10, 5])]


def packed_runs(rounds: int, sample_s: float, dt: torch.dtype) -> list:
    """``--packed``: ``wfpass::packed_lstm_runs`` (a packed batch's layer
    without grad, oneDNN's layer over each run of equal batch size, what
    runs in bf16 or where the C++ loop has no fast path), reading the plain
    weights (a reorder per run) against the layer direction's copy."""
    import wfpass  # noqa: F401  (registers the ops)
    from wfpass.core.records import Record
    from wfpass.rnn.cpu import lstm_prepack, varlen_lstm_runs  # noqa: F401

    op = torch.ops.wfpass.packed_lstm_runs_fw
    lines = ["| input | hidden | batch | lengths | runs | plain weights | copy | x | max abs diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    for I, H, B, lengths in PACKED_SIZES:
        g = torch.Generator().manual_seed(0)
        L = torch.tensor(lengths)
        padded = torch.randn(int(L.max()), B, I, generator=g).to(dt)
        packed = torch.nn.utils.rnn.pack_padded_sequence(padded, L)
        w = [(torch.randn(4 * H, I, generator=g) * 0.1).to(dt), (torch.randn(4 * H, H, generator=g) * 0.1).to(dt),
             (torch.randn(4 * H, generator=g) * 0.1).to(dt), (torch.randn(4 * H, generator=g) * 0.1).to(dt)]
        wc = [t.clone() for t in w]
        rec = Record("rnn", "rewritten", "lstm_pack_kernel.py", ["w_ih", "w_hh"])
        lstm_prepack.allow(rec, [(wc[0], wc[1])], None)
        calls = {"plain": lambda: op(packed.data, packed.batch_sizes, *w, None, None, False, False),
                 "copy": lambda: op(packed.data, packed.batch_sizes, *wc, None, None, False, False)}
        with torch.no_grad():
            diff = (calls["plain"]()[0].float() - calls["copy"]()[0].float()).abs().max().item()
        times, m = _rounds(calls, rounds, sample_s, rec, (I, H, B))
        r = statistics.median([a / b for a, b in zip(times["plain"], times["copy"])])
        n_runs = len(set(packed.batch_sizes.tolist()))
        lines.append(f"| {I} | {H} | {B} | {min(lengths)}-{max(lengths)} | {n_runs} | {m['plain']:.1f} | "
                     f"{m['copy']:.1f} | {r:.2f} | {diff:.1e} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--sample-s", type=float, default=0.05)
    ap.add_argument("--out", default=None)
    ap.add_argument("--against-loop", action="store_true", help="the copy against wfpass's C++ loop")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--packed", action="store_true", help="a packed batch's layer run by run (packed_lstm_runs)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.packed:
        head = [f"Command: `python benchmarks/rnn/lstm_pack_kernel.py --packed --threads {args.threads}"
                + (f" --dtype {args.dtype}" if args.dtype != "float32" else "") + "`  ",
                f"torch {torch.__version__}, {cpu_words()}, {args.dtype}, {args.threads} thread(s), "
                f"{args.rounds} interleaved rounds; us per layer call over a packed batch, inference (median over "
                "rounds); runs: runs of equal batch size (one oneDNN call each); x = plain / copy, the median of "
                "per-round ratios (above 1: the copy is faster)", ""]
        emit("\n".join(head + packed_runs(args.rounds, args.sample_s, getattr(torch, args.dtype))), args.out)
        return 0
    if args.against_loop:
        head = [f"Command: `python benchmarks/rnn/lstm_pack_kernel.py --against-loop --threads {args.threads}`  ",
                f"torch {torch.__version__}, {cpu_words()}, {args.threads} thread(s), {args.rounds} interleaved "
                "rounds; us per layer call, inference (median over rounds); loop / copy: the median of per-round "
                "ratios (above 1: oneDNN from the copy is faster)", ""]
        emit("\n".join(head + against_loop(args.rounds, args.sample_s)), args.out)
        return 0
    dt = getattr(torch, args.dtype)
    lines = [f"Command: `python benchmarks/rnn/lstm_pack_kernel.py --threads {args.threads}"
             + (f" --dtype {args.dtype}" if args.dtype != "float32" else "") + "`  ",
             f"torch {torch.__version__}, {cpu_words()}, {args.dtype}, {args.threads} thread(s), {args.rounds} interleaved "
             "rounds; us per layer call (median over rounds); x = plain weights / copy in oneDNN's layout", "",
             "| input | hidden | T | batch | plain weights | copy | x | max abs diff |", "|---|---|---|---|---|---|---|---|"]
    with torch.no_grad():
        for inp, hid, shapes in SIZES:
            w_ih, w_hh, b = (torch.randn(4 * hid, inp) * 0.1).to(dt), (torch.randn(4 * hid, hid) * 0.1).to(dt), \
                (torch.randn(4 * hid) * 0.1).to(dt)
            t0, b0 = shapes[0]
            p_ih, p_hh = torch.ops.mkldnn._reorder_mkldnn_rnn_layer_weight(w_ih, w_hh, hid, False, True, False, [t0, b0, inp])
            for T, B in shapes:
                x, h0 = torch.randn(T, B, inp, dtype=dt), torch.zeros(1, B, hid, dtype=dt)
                diff = (layer(x, w_ih, w_hh, b, h0).float() - layer(x, p_ih, p_hh, b, h0).float()).abs().max().item()
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
