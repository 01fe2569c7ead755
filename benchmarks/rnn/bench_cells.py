"""Python loops of RNN cells: eager, Inductor, wformat and the eager RNN module, side by side.

    python benchmarks/rnn/bench_cells.py --skip-inductor --lengths 32 128 512 --rounds 7 --out docs/results/cells_lstm.md
    python benchmarks/rnn/bench_cells.py --cell GRU --skip-inductor --lengths 32 128 512 --rounds 7 --out docs/results/cells_gru.md

``--cell LSTM`` (default), ``GRU`` or ``RNN`` (tanh) picks the cell and the
module compared with it (``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``).

The model: ``nn.LSTMCell(64, 128)`` stepped over T steps in a Python loop,
batch 4 (and a 2-layer stack, ``LSTMCell(64, 128)`` then ``LSTMCell(128,
128)`` at every step), every step's h gathered with ``torch.stack``. Two
modes: a training step (forward, then backward of a fixed random projection
of the output) and inference (forward under ``no_grad``).

Variants, interleaved inside every round so machine noise hits them alike:
the eager loop; ``torch.compile`` default (Inductor, the loop unrolled);
``torch.compile(backend="wformat")`` (the loop folded into one RNN call);
eager ``nn.LSTM`` holding the same weights (the hand-written fused model).

Compile + first step: each configuration runs in a fresh process with
Inductor's caches off (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``), so the time
is a cold compile. An Inductor compile that takes longer than
``--compile-limit`` seconds is stopped and reported as such, and longer
lengths are then not tried for it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time

IN, HID, BATCH = 64, 128, 4


CELLS = {"LSTM": ("LSTMCell", "LSTM"), "GRU": ("GRUCell", "GRU"), "RNN": ("RNNCell", "RNN")}


def _models(layers: int, T: int, kind: str = "LSTM"):
    import torch
    import torch.nn as nn

    cell_cls, rnn_cls = (getattr(nn, n) for n in CELLS[kind])
    lstm = kind == "LSTM"

    class CellLoop(nn.Module):
        def __init__(self):
            super().__init__()
            self.cells = nn.ModuleList([cell_cls(IN if i == 0 else HID, HID) for i in range(layers)])

        def forward(self, x):
            sts = [None] * layers
            outs = []
            for t in range(x.shape[0]):
                inp = x[t]
                for k, cell in enumerate(self.cells):
                    sts[k] = cell(inp) if sts[k] is None else cell(inp, sts[k])
                    inp = sts[k][0] if lstm else sts[k]
                outs.append(inp)
            return torch.stack(outs)

    class Fused(nn.Module):
        def __init__(self, loop):
            super().__init__()
            self.lstm = rnn_cls(IN, HID, num_layers=layers)
            with torch.no_grad():
                for k, cell in enumerate(loop.cells):
                    for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                        getattr(self.lstm, f"{n}_l{k}").copy_(getattr(cell, n))

        def forward(self, x):
            return self.lstm(x)[0]

    torch.manual_seed(0)
    loop = CellLoop()
    return loop, Fused(loop)


class _Timeout(Exception):
    pass


_FIRED = []


def _alarm(signum, frame):
    # Inductor may wrap the exception (InductorError): the flag says it was ours.
    _FIRED.append(True)
    raise _Timeout()


def run_one(layers: int, T: int, mode: str, rounds: int, reps: int, limit: float, skip_inductor: bool,
            threads: int, kind: str = "LSTM") -> dict:
    import copy

    import torch

    import wfpass

    torch.set_num_threads(threads)
    loop, fused = _models(layers, T, kind)
    x = torch.randn(T, BATCH, IN)
    R = torch.randn(T, BATCH, HID)
    train = mode == "train"

    def step(fn):
        def go():
            if train:
                out = fn(x)
                (out * R).sum().backward()
            else:
                with torch.no_grad():
                    fn(x)
        return go

    variants = {"eager loop": step(loop), f"eager nn.{CELLS[kind][1]}": step(fused)}
    compile_s = {}
    for name, backend in (("wformat", "wformat"), ("inductor", "inductor"), ("wformat module", "wformat")):
        if name == "inductor" and skip_inductor:
            compile_s[name] = None
            continue
        # A model of its own: no torch._dynamo.reset(), which would recompile
        # the others. "wformat module": the RNN module itself (nn.LSTM /
        # nn.GRU with the same weights) under wformat.
        m = copy.deepcopy(fused if name == "wformat module" else loop)
        cm = torch.compile(m, backend=backend)
        fn = step(cm)
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(int(limit))
        t0 = time.perf_counter()
        try:
            fn()
            compile_s[name] = time.perf_counter() - t0
        except Exception:
            if not _FIRED:
                raise
            _FIRED.clear()
            compile_s[name] = None
            continue
        finally:
            signal.alarm(0)
        variants[name] = fn
        if name.startswith("wformat"):
            folded = [r for r in wfpass.report(m).records if r.pattern == "rnn" and r.action == "rewritten"]
            assert folded, f"{name}: wformat did not rewrite the RNN"
    # Dynamo alone (its trace grows with T whatever the backend does);
    # measured after the others, so without the process's one-time costs.
    t0 = time.perf_counter()
    step(torch.compile(copy.deepcopy(loop), backend="eager"))()
    compile_s["dynamo"] = time.perf_counter() - t0
    for fn in variants.values():  # warm-up
        fn()
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():  # interleaved
            per = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                per.append(time.perf_counter() - t0)
            times[k].append(statistics.median(per))
    return {"layers": layers, "T": T, "mode": mode, "compile_s": compile_s,
            "ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
            "spread": {k: (max(v) - min(v)) / statistics.median(v) for k, v in times.items()}}


def _fmt(v, unit=""):
    return "n/a" if v is None else f"{v:.2f}{unit}"


def main() -> None:
    from wfpass.tools.doctor import cpu_words  # the page names its CPU: figures differ by vendor
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="markdown file to write (default: print)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8, 32, 128, 512])
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--modes", nargs="+", default=["train", "infer"])
    ap.add_argument("--compile-limit", type=float, default=240.0)
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads (1: steadiest on a shared machine, where threads that wait for each "
                         "other turn any other load into 10x swings)")
    ap.add_argument("--cell", choices=list(CELLS), default="LSTM", help="the cell looped over (default LSTM)")
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--skip-inductor", action="store_true",
                    help="leave torch.compile's default (Inductor) out: its cold compile of an unrolled loop takes "
                         "minutes at long T")
    a = ap.parse_args()
    if a.one:
        layers, T, mode = int(a.one[0]), int(a.one[1]), a.one[2]
        print(json.dumps(run_one(layers, T, mode, a.rounds, a.reps, a.compile_limit, a.skip_inductor, a.threads, a.cell)))
        return
    env = dict(os.environ, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    rows = []
    # Every finished configuration is kept (JSON lines under data/ beside the
    # table, as the results pages keep their raw data), so a run that stops
    # part-way resumes where it stopped.
    cache_path = None
    if a.out:
        head, name = os.path.split(a.out)
        cache_path = os.path.join(head, "data", name.rsplit(".", 1)[0] + ".jsonl")
        os.makedirs(os.path.dirname(cache_path), exist_ok=True)
    # Only rows measured on this CPU with these threads resume: a row from
    # another machine (or one that did not record its machine) would be
    # printed under this machine's name.
    here = {"cpu": cpu_words(), "threads": a.threads}
    done = {}
    if cache_path and os.path.exists(cache_path):
        for line in open(cache_path):
            r = json.loads(line)
            if r.get("machine") == here:
                done[(r["layers"], r["T"], r["mode"])] = r
    for layers in a.layers:
        for mode in a.modes:
            too_slow = False
            for T in a.lengths:
                if (layers, T, mode) in done:
                    r = done[(layers, T, mode)]
                    too_slow = too_slow or r["compile_s"]["inductor"] is None
                    rows.append(r)
                    continue
                cmd = [sys.executable, __file__, "--one", str(layers), str(T), mode, "--rounds", str(a.rounds),
                       "--reps", str(a.reps), "--compile-limit", str(a.compile_limit), "--threads", str(a.threads), "--cell", a.cell]
                if too_slow or a.skip_inductor:
                    cmd.append("--skip-inductor")
                p = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if p.returncode != 0:
                    sys.stderr.write(p.stderr[-3000:])
                    raise SystemExit(f"configuration layers={layers} T={T} {mode} failed")
                r = json.loads(p.stdout.strip().splitlines()[-1])
                r["machine"] = here
                if cache_path:
                    with open(cache_path, "a") as f:
                        f.write(json.dumps(r) + "\n")
                too_slow = too_slow or r["compile_s"]["inductor"] is None
                rows.append(r)
                print(f"layers={layers} T={T:4d} {mode:5s} compile wformat {_fmt(r['compile_s']['wformat'], ' s')}, "
                      f"inductor {_fmt(r['compile_s']['inductor'], ' s')}; ms {r['ms']}", file=sys.stderr, flush=True)
    import torch

    mod = f"nn.{CELLS[a.cell][1]}"
    lines = [
        f"# {a.cell} cell loops: measured",
        "",
        f"Command: `python benchmarks/rnn/bench_cells.py {' '.join(sys.argv[1:])}`",
        "",
        f"Machine: {cpu_words()}, {os.cpu_count()} CPU cores ({a.threads} intra-op thread(s)), torch {torch.__version__}, "
        f"{platform.python_version()}; {a.rounds} interleaved rounds of {a.reps} calls, medians. "
        f"Model: `{CELLS[a.cell][0]}({IN}, {HID})` per layer looped over T steps, batch {BATCH}.",
        "",
        "Compile + first step: a fresh process, Inductor caches off. 'Dynamo alone': a separate compile of the "
        "same loop with `backend=\"eager\"` (Dynamo's trace of the Python loop, no backend work), measured after "
        "the others; it is not a part of the wformat column and can exceed it on a noisy machine. 'n/a' = stopped "
        f"after {a.compile_limit:.0f} s, or not run (`--skip-inductor`, or a shorter T already took longer). "
        f"**x faster = baseline time / wformat time.** 'wformat {mod}': the module itself compiled with wformat. "
        "Spread = (max - min) / median of wformat's round medians.",
        "",
        "| layers | mode | T | compile+1st: Inductor | compile+1st: wformat | Dynamo alone | eager loop ms | Inductor ms "
        f"| wformat ms | eager {mod} ms | wformat {mod} ms | x faster vs eager loop | vs eager {mod} | vs Inductor "
        f"| wformat {mod} vs eager {mod} | spread (wformat) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = r["ms"]
        w = ms.get("wformat")
        ind = ms.get("inductor")
        wm = ms.get("wformat module")
        base = ms["eager " + mod]
        lines.append(
            f"| {r['layers']} | {r['mode']} | {r['T']} | {_fmt(r['compile_s']['inductor'], ' s')} | "
            f"{_fmt(r['compile_s']['wformat'], ' s')} | {_fmt(r['compile_s']['dynamo'], ' s')} | {ms['eager loop']:.2f} | "
            f"{_fmt(ind)} | {_fmt(w)} | {base:.2f} | {_fmt(wm)} | {ms['eager loop'] / w:.2f}x | {base / w:.2f}x | "
            f"{'n/a' if ind is None else f'{ind / w:.2f}x'} | {'n/a' if wm is None else f'{base / wm:.2f}x'} | "
            f"{r['spread']['wformat']:.0%} |")
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
        _plot(rows, a.out.rsplit(".", 1)[0] + ".png")
    print(text)


def _plot(rows, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for layers, style in ((1, "-"), (2, "--")):
        sel = [r for r in rows if r["layers"] == layers and r["mode"] == "train"]
        if not sel:
            continue
        Ts = [r["T"] for r in sel]
        for name, color in (("inductor", "tab:red"), ("wformat", "tab:blue")):
            pts = [(t, r["compile_s"][name]) for t, r in zip(Ts, sel) if r["compile_s"][name] is not None]
            if pts:
                axes[0].plot(*zip(*pts), style, marker="o", color=color, label=f"{name}, {layers} layer(s)")
        for name, color in (("eager loop", "tab:gray"), ("inductor", "tab:red"), ("wformat", "tab:blue"),
                            (next(k for k in sel[0]["ms"] if k.startswith("eager nn.")), "tab:green")):
            pts = [(t, r["ms"][name]) for t, r in zip(Ts, sel) if name in r["ms"]]
            if pts:
                axes[1].plot(*zip(*pts), style, marker="o", color=color, label=f"{name}, {layers} layer(s)")
    axes[0].set(xscale="log", yscale="log", xlabel="T (steps)", ylabel="compile + first step (s)",
                title="Cold compile, training step")
    axes[1].set(xscale="log", yscale="log", xlabel="T (steps)", ylabel="ms per training step",
                title="Steady state, training step")
    from matplotlib.ticker import NullFormatter, NullLocator

    lengths = sorted({r["T"] for r in rows})
    for ax in axes:
        # The measured lengths as plain ticks (log axes' default minor
        # labels overlap at these few points).
        ax.set_xticks(lengths, [str(t) for t in lengths])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
