"""RNN models on the CPU: eager, ``torch.compile`` default and wformat, each
variant in its own process, rounds interleaved.

    python benchmarks/rnn/bench_rnn_speed.py --out docs/results/rnn_speed.md --json docs/results/data/rnn_speed.json [--rounds 5] [--threads 1 2]

Two models:

* ``lm``: the LSTM language model of ``python -m wfpass bench``
  (Embedding 500 -> 2-layer LSTM 128 -> Linear 500), T in {1, 16, 64, 256},
  batch 1 and 8, a training step (forward, backward of ``(logits * R).sum()``,
  SGD step) and inference (forward under ``no_grad``). Two ways to
  compile: ``static`` (``dynamic=False``: a graph per shape) and
  ``recompiled`` (the default ``dynamic=None``, all shapes visited once in
  a mixed order first, so Dynamo recompiles with a symbolic length and
  batch, as a training loop with varying batches makes it do).
* ``encoder``: a small speech encoder, where the LSTM sits between layers
  Inductor fuses: two strided ``Conv1d`` + GELU (80 features -> 128), a
  2-layer LSTM 128, LayerNorm, Linear 128 -> 64; batch 8, 400 frames (100
  LSTM steps); training step and inference, compiled statically.

One worker process per (variant, compile way): Dynamo's cache is per code
object, so variants sharing a process would share it, and a code object
``torch.compile``'s default gave up on runs eagerly for every backend after
it. Each worker compiles, visits its shapes, then answers the
coordinator, which interleaves the variants inside every round. A cell:
the median over rounds of a per-call median (at least 30 ms of calls).
Ratios: "x faster" = baseline time / wformat time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _worker.py
import _worker  # noqa: E402

LENGTHS, BATCHES = (1, 16, 64, 256), (1, 8)
LM_VARIANTS = ("eager", "inductor-static", "inductor-recompiled", "wformat-static", "wformat-recompiled")
#: wformatonednn: wformat with ``rnn={"cpu_kernel": "eager"}``, oneDNN's LSTM layer where ``auto`` gives this
#: encoder's training the C++ loop (hidden 128, batch 8): the rule's two kernels on one model.
ENC_VARIANTS = ("eager", "inductor-static", "wformat-static", "wformatonednn-static")
ENC_BATCH, ENC_FRAMES = 8, 400


# -- the worker: one variant, one process -------------------------------------------


def _lm():
    import torch

    from wfpass.tools.bench_models import RnnLM

    torch.manual_seed(0)
    return RnnLM()


def _encoder():
    import torch
    import torch.nn as nn

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.front = nn.Sequential(nn.Conv1d(80, 128, 5, stride=2, padding=2), nn.GELU(),
                                       nn.Conv1d(128, 128, 5, stride=2, padding=2), nn.GELU())
            self.lstm = nn.LSTM(128, 128, num_layers=2)
            self.norm = nn.LayerNorm(128)
            self.proj = nn.Linear(128, 64)

        def forward(self, feats):  # [B, 80, frames]
            x = self.front(feats).permute(2, 0, 1)  # [T, B, 128]
            y, _ = self.lstm(x)
            return self.proj(self.norm(y))

    torch.manual_seed(0)
    return Encoder()


def _cells(model_name: str):
    """(key, make_inputs) for every shape the model is timed at."""
    import torch

    if model_name == "encoder":
        return [((ENC_FRAMES, ENC_BATCH), lambda: torch.randn(ENC_BATCH, 80, ENC_FRAMES))]
    return [((T, B), (lambda T=T, B=B: torch.randint(0, 500, (T, B)))) for T in LENGTHS for B in BATCHES]


def worker(model_name: str, variant: str, threads: int) -> None:
    import torch

    from wfpass._torch.aot import disable_compile_caches

    torch.set_num_threads(threads)
    disable_compile_caches()
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    model = _lm() if model_name == "lm" else _encoder()
    fwd = model
    if variant != "eager":
        backend, how = variant.split("-")
        if backend == "wformatonednn":
            import wfpass

            backend = wfpass.backend(rnn={"cpu_kernel": "eager"})
        fwd = torch.compile(model, backend=backend, dynamic=False if how == "static" else None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    steps = {}
    for (T, B), make in _cells(model_name):
        x = make()
        with torch.no_grad():
            R = torch.randn(fwd(x).shape, generator=g)

        def train(x=x, R=R):
            opt.zero_grad(set_to_none=True)
            (fwd(x) * R).sum().backward()
            opt.step()

        def infer(x=x):
            with torch.no_grad():
                fwd(x)

        steps[("train", T, B)] = train
        steps[("infer", T, B)] = infer
    # Visit every shape in a mixed order (long and short, small and large
    # batch alternating): with dynamic=None, the second shape makes Dynamo
    # recompile with symbolic sizes, and that graph then serves the rest.
    order = sorted(steps, key=lambda k: (k[0], (k[1] * 7 + k[2] * 3) % 11))
    t0 = time.perf_counter()
    for k in order:
        steps[k]()
    first = time.perf_counter() - t0
    for k in order:
        steps[k]()
    info = {"ready": True, "first_s": first}
    if variant.startswith("wformat"):
        import wfpass

        recs = [r for r in wfpass.report(model).records if r.pattern == "rnn"]
        info["rnn_paths"] = {k: v for r in recs for k, v in r.detail.get("paths", {}).items()}
        info["rnn_calls"] = sum(r.stats.get("fused_calls", 0) + r.stats.get("unfused_calls", 0) for r in recs)
        if not info["rnn_calls"]:
            raise SystemExit("wformat's compiled LSTM never ran: the timings would be eager's")
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "time":
            fn = steps[(cmd[1], int(cmd[2]), int(cmd[3]))]
            fn()
            per, t_all = [], time.perf_counter()
            while time.perf_counter() - t_all < 0.03 or len(per) < 3:
                t = time.perf_counter()
                fn()
                per.append(time.perf_counter() - t)
            print(json.dumps({"ms": statistics.median(per) * 1e3}), flush=True)
        elif cmd[0] == "quit":
            break


# -- the coordinator ----------------------------------------------------------------


def Worker(model_name: str, variant: str, threads: int) -> _worker.Worker:
    return _worker.Worker(__file__, ["--worker", variant, "--model", model_name, "--threads", str(threads)], variant,
                          threads)


def run(model_name: str, threads: int, rounds: int, log) -> dict:
    variants = LM_VARIANTS if model_name == "lm" else ENC_VARIANTS
    res = {"model": model_name, "threads": threads, "first_s": {}, "info": {}, "ms": {}}
    workers = []
    for v in variants:  # one at a time: a compile would disturb another's timing
        w = Worker(model_name, v, threads)
        info = w.ask()
        res["first_s"][v] = info.pop("first_s")
        res["info"][v] = info
        workers.append(w)
        log(f"{model_name} {threads}t {v}: ready ({res['first_s'][v]:.1f} s)")
    keys = [(s, T, B) for s in ("train", "infer") for (T, B), _ in _cells(model_name)]
    ms = {f"{s} {T} {B}": {v: [] for v in variants} for s, T, B in keys}
    for _ in range(rounds):
        for s, T, B in keys:
            for w in workers:
                ms[f"{s} {T} {B}"][w.variant].append(w.ask(f"time {s} {T} {B}")["ms"])
    for w in workers:
        w.close()
    res["ms"] = ms
    return res


def _med(xs):
    return statistics.median(xs)


def _md(results, command: str) -> str:
    from wfpass.tools.doctor import cpu_words  # the page names its CPU: figures differ by vendor
    import torch

    out = [
        "# RNN models on the CPU: measured",
        "",
        f"Command: `{command}`  ",
        f"torch {torch.__version__}, {cpu_words()}, {os.cpu_count()} cores. Each variant in its own process, "
        "rounds interleaved; a cell is the median over rounds of a per-call median, in ms. "
        "**x faster = baseline time / wformat time** (above 1: wformat is faster).",
        "",
        "`torch.compile` default (Inductor) does not put `nn.LSTM` in its graph (Dynamo breaks the graph on RNN "
        "modules); for these models its first calls compiled little or nothing (see *First calls*) and its "
        "times are eager's within noise: read its columns as a second eager run, a gauge of this machine's "
        "noise. wformat compiles the LSTM into the graph as one oneDNN LSTM call per layer.",
        "",
    ]
    for r in results:
        th = r["threads"]
        if r["model"] == "lm":
            out += [f"## LSTM language model, {th} thread(s)", "",
                    "Embedding 500 -> 2-layer LSTM 128 -> Linear 500. *static*: `dynamic=False`, a graph per shape. "
                    "*recompiled*: default `dynamic=None`, every shape visited once in a mixed order first, so the "
                    "timed graph has a symbolic length and batch.", "",
                    "| step | T | batch | eager | Inductor static | wformat static | x faster vs eager | vs Inductor "
                    "| Inductor recompiled | wformat recompiled | x faster vs eager | vs Inductor |",
                    "|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for key, v in r["ms"].items():
                s, T, B = key.split()
                e, i_s, w_s, i_r, w_r = (_med(v[k]) for k in LM_VARIANTS)
                out.append(f"| {s} | {T} | {B} | {e:.3f} | {i_s:.3f} | {w_s:.3f} | {e / w_s:.2f} | {i_s / w_s:.2f} "
                           f"| {i_r:.3f} | {w_r:.3f} | {e / w_r:.2f} | {i_r / w_r:.2f} |")
            paths = r["info"]["wformat-recompiled"].get("rnn_paths", {})
            out += ["", f"Paths wformat took (recompiled worker): {paths}.", ""]
        else:
            out += [f"## Speech encoder, {th} thread(s)", "",
                    f"Conv1d(80, 128, 5, stride 2) + GELU, Conv1d(128, 128, 5, stride 2) + GELU, 2-layer LSTM 128, "
                    f"LayerNorm, Linear 128 -> 64; batch {ENC_BATCH}, {ENC_FRAMES} frames ({ENC_FRAMES // 4} LSTM "
                    "steps); static compile.", "",
                    "| step | eager | Inductor | wformat | x faster vs eager | vs Inductor | wformat, "
                    "cpu_kernel='eager' | auto's kernel vs the other |",
                    "|---|---|---|---|---|---|---|---|"]
            for key, v in r["ms"].items():
                s = key.split()[0]
                e, i_s, w_s, w_o = (_med(v[k]) for k in ENC_VARIANTS)
                out.append(f"| {s} | {e:.3f} | {i_s:.3f} | {w_s:.3f} | {e / w_s:.2f} | {i_s / w_s:.2f} | {w_o:.3f} "
                           f"| {w_o / w_s:.2f} |")
            out.append("")
        out += ["First calls (compile of every shape in the worker, and one run of each), s: "
                + ", ".join(f"{k} {v:.1f}" for k, v in r["first_s"].items()), ""]
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--models", nargs="+", default=["lm", "encoder"], choices=["lm", "encoder"])
    ap.add_argument("--out", help="markdown file to write (default: print)")
    ap.add_argument("--json", help="raw results (every round) as JSON")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.model, a.worker, a.threads[0])
        return
    results = []
    for th in a.threads:
        for m in a.models:
            results.append(run(m, th, a.rounds, lambda s: print(s, file=sys.stderr, flush=True)))
    command = "python benchmarks/rnn/bench_rnn_speed.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = _md(results, command)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
