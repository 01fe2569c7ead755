"""One RNN layer on wfpass's C++ loop (``wfpass::packed_layer_fw``, no grad):
the weights read as they are by the direct linear kernel, against the
per-call transposes oneDNN's small-GEMM ukernel reads, and what the rule
(``reads_weights_as_is`` in ``wfpass/native/rnn/varlen_rnn.cpp``) takes.

    python benchmarks/rnn/bench_rnn_as_is.py --threads 1 2 --rounds 3 --out docs/results/rnn_as_is.md
    python benchmarks/rnn/bench_rnn_as_is.py --lstm-layer --threads 1 2 --rounds 3 --out docs/results/rnn_short_calls.md

``--lstm-layer``: ``wfpass::lstm_layer_fw`` (the LSTM's oneDNN path, which
gives calls of at most 16 rows, T x batch, to the C++ loop) with
``WFPASS_RNN_AS_IS=0`` (oneDNN's layer for every call) against the default,
at T x batch up to 32 and, for the table's other side, above.

Each setting of ``WFPASS_RNN_AS_IS`` (``0``: every call transposes;
``all``: every call reads the weights as they are) runs in a process of its
own (the switch is read once), the two alternating round by round; each
process times every shape (median of its calls) and the table gives the
median over the rounds. LSTM and GRU layers with input size = hidden size,
a dense batch (every sequence of length T).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _out.py
from _out import emit  # noqa: E402
from wfpass.tools.doctor import cpu_words  # the page names its CPU: figures differ by vendor

HIDDEN = (64, 128, 256, 512)
STEPS = (1, 4, 16, 64)
BATCH = (1, 4, 16)
CELLS = ("LSTM", "GRU")


def takes_as_is(T: int, B: int, H: int) -> bool:
    """The rule in varlen_rnn.cpp: T <= H / 16 and T x batch <= H^2 / 512,
    or H >= 512 and batch <= 16."""
    return (H >= 512 and B <= 16) or (T * 16 <= H and T * B * 512 <= H * H)


def _median_us(fn, calls: int) -> float:
    for _ in range(max(3, calls // 10)):
        fn()
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


#: (T, batch) of the --lstm-layer table: up to 16 rows and a few above.
SHORT = ((1, 1), (1, 4), (1, 16), (4, 1), (4, 4), (16, 1), (2, 8), (1, 32), (4, 8), (32, 1), (64, 1))


def lstm_layer_worker(threads: int) -> dict:
    """wfpass::lstm_layer_fw's time per call, us, in this process's setting."""
    torch.set_num_threads(threads)
    from wfpass import native

    native.load()
    op = torch.ops.wfpass.lstm_layer_fw.default
    out = {}
    torch.manual_seed(0)
    with torch.no_grad():
        for H in HIDDEN:
            m = torch.nn.LSTM(H, H)
            for T, B in SHORT:
                x = torch.randn(T, B, H)
                args = (x, m.weight_ih_l0, m.weight_hh_l0, m.bias_ih_l0, m.bias_hh_l0, None, None, False, H, True, False)
                calls = max(15, min(400, int(2e5 / (T * B * H ** 1.3 / 64))))
                out[f"LSTM {H} {T} {B}"] = _median_us(lambda: op(*args), calls)
    return out


def worker(threads: int) -> dict:
    """Every shape's time per call, us, in this process's setting."""
    torch.set_num_threads(threads)
    from wfpass import native

    native.load()
    if not (native.loaded() and native.fast_loop()):
        raise SystemExit(f"wfpass's C++ loop is not in use here: {native.status()}")
    op = torch.ops.wfpass.packed_layer_fw.default
    none = torch.empty(0, dtype=torch.int64)  # no batch_sizes: a dense batch
    out = {}
    torch.manual_seed(0)
    with torch.no_grad():
        for H in HIDDEN:
            mods = {"LSTM": torch.nn.LSTM(H, H), "GRU": torch.nn.GRU(H, H)}
            for T in STEPS:
                for B in BATCH:
                    x = torch.randn(T, B, H)
                    for cell, m in mods.items():
                        args = (x, none, m.weight_ih_l0, m.weight_hh_l0, m.bias_ih_l0, m.bias_hh_l0, None, None,
                                None, cell, False, False)
                        # About 0.1-0.3 s a shape: more calls for the short ones.
                        calls = max(15, min(400, int(2e5 / (T * B * H ** 1.3 / 64))))
                        out[f"{cell} {H} {T} {B}"] = _median_us(lambda: op(*args), calls)
    return out


def run(setting: str, threads: int, layer: bool = False) -> dict:
    env = dict(os.environ, WFPASS_RNN_AS_IS=setting)
    r = subprocess.run([sys.executable, __file__, "--worker", str(threads)] + (["--lstm-layer"] if layer else []),
                       env=env, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def _medians(settings: tuple, threads: int, rounds: int, layer: bool = False) -> dict:
    """Each WFPASS_RNN_AS_IS setting's per-shape median over the rounds, the
    two settings alternating which runs first, each in processes of its own."""
    a, b = settings
    got = {a: [], b: []}
    for i in range(rounds):
        for setting in ((a, b) if i % 2 == 0 else (b, a)):
            got[setting].append(run(setting, threads, layer))
            print(f"threads {threads}, round {i + 1}, WFPASS_RNN_AS_IS={setting}: done", file=sys.stderr, flush=True)
    return {s: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for s, runs in got.items()}


def table(threads: int, rounds: int) -> list:
    med = _medians(("0", "all"), threads, rounds)
    lines = [f"### {threads} thread(s)", "",
             "| cell | hidden | T | batch | transposes, us | as they are, us | as they are: x faster | the rule takes |",
             "|---|---|---|---|---|---|---|---|"]
    inside, outside = [], []
    for key in med["0"]:
        cell, H, T, B = key.split()
        H, T, B = int(H), int(T), int(B)
        t0, t1 = med["0"][key], med["all"][key]
        rule = takes_as_is(T, B, H)
        (inside if rule else outside).append(t0 / t1)
        lines.append(f"| {cell} | {H} | {T} | {B} | {t0:.1f} | {t1:.1f} | {t0 / t1:.2f} | "
                     f"{'as they are' if rule else 'transposes'} |")
    lines += ["", f"Inside the rule's bound ({len(inside)} shapes) reading the weights as they are ran "
              f"{min(inside):.2f}-{max(inside):.2f}x the transposes' speed; outside it ({len(outside)} shapes) "
              f"{min(outside):.2f}-{max(outside):.2f}x.", ""]
    return lines


def layer_table(threads: int, rounds: int) -> list:
    med = _medians(("0", ""), threads, rounds, layer=True)
    lines = [f"### {threads} thread(s)", "",
             "| hidden | T | batch | rows | oneDNN's layer, us | the op by default, us | x faster | kernel by default |",
             "|---|---|---|---|---|---|---|---|"]
    short, long_ = [], []
    for key in med["0"]:
        _, H, T, B = key.split()
        rows = int(T) * int(B)
        t0, t1 = med["0"][key], med[""][key]
        (short if rows <= 16 else long_).append(t0 / t1)
        lines.append(f"| {H} | {T} | {B} | {rows} | {t0:.1f} | {t1:.1f} | {t0 / t1:.2f} | "
                     f"{'the C++ loop' if rows <= 16 else 'oneDNN'} |")
    lines += ["", f"At most 16 rows ({len(short)} shapes) the op ran {min(short):.2f}-{max(short):.2f}x as fast as "
              f"oneDNN's layer; above ({len(long_)} shapes, both oneDNN) {min(long_):.2f}-{max(long_):.2f}x "
              "(both processes run oneDNN's layer there: that spread is between processes, not kernels; at 2 threads oneDNN's layer ran slower in the processes with the short path off, not explained here).", ""]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--lstm-layer", action="store_true",
                    help="wfpass::lstm_layer_fw by default against oneDNN's layer for every call")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker is not None:
        print(json.dumps(lstm_layer_worker(a.worker) if a.lstm_layer else worker(a.worker)))
        return 0
    if a.lstm_layer:
        cmd = "python benchmarks/rnn/bench_rnn_as_is.py --lstm-layer --threads " + " ".join(map(str, a.threads)) + \
            f" --rounds {a.rounds}" + (f" --out {a.out}" if a.out else "")
        lines = ["# Short LSTM calls: wfpass's C++ loop inside the oneDNN path's op", "", f"`{cmd}`", "",
                 f"Machine: {cpu_words()}; torch {torch.__version__}. `wfpass::lstm_layer_fw`, the op an LSTM "
                 "takes for a symbolic T (under `torch.compile` and in `wfpass.export` programs): one layer, input "
                 "size = hidden size, no grad, a dense batch. *oneDNN's layer*: `WFPASS_RNN_AS_IS=0`, every call "
                 "on oneDNN's LSTM layer; *the op by default*: calls of at most 16 rows (T x batch) on wfpass's "
                 "C++ loop, reading the weights as they are. us per call: in each process the median of its "
                 f"calls, then the median over {a.rounds} rounds, the two settings alternating in processes of "
                 "their own.", ""]
        for threads in a.threads:
            lines += layer_table(threads, a.rounds)
        return emit(lines, a.out)
    cmd = "python benchmarks/rnn/bench_rnn_as_is.py --threads " + " ".join(map(str, a.threads)) + \
        f" --rounds {a.rounds}" + (f" --out {a.out}" if a.out else "")
    lines = ["# The C++ RNN loop: weights read as they are, or transposed on every call", "",
             f"`{cmd}`", "",
             f"Machine: {cpu_words()}; torch {torch.__version__}. One layer, input size = hidden size, no grad, "
             "a dense batch; us per call: in each process the median of its calls, then the median over "
             f"{a.rounds} rounds, the two settings in processes of their own, alternating. *transposes*: "
             "`WFPASS_RNN_AS_IS=0`, W_ih and W_hh transposed on every call for oneDNN's small-GEMM ukernel; "
             "*as they are*: `WFPASS_RNN_AS_IS=all`, both read by the direct linear kernel in their own "
             "layout. *the rule takes*: what a call takes by default (as they are where T <= hidden / 16 "
             "and T x batch <= hidden^2 / 512, or hidden >= 512 and batch <= 16).", ""]
    for threads in a.threads:
        lines += table(threads, a.rounds)
    return emit(lines, a.out)


if __name__ == "__main__":
    sys.exit(main())
