"""The performance targets, side by side in one run: a LLaMA-like decoder and
an RNN language model under eager, torch.compile default (Inductor), the
hand-fused model (Inductor; the limit a weight-format rewrite can reach) and
``backend="wformat"``.

    python benchmarks/overall/bench_targets.py --rounds 7 --skip rnn --threads 1 --out docs/results/targets.md

Decoder: 4 layers, d_model 256 (and 512), 8 heads, 2 KV heads, SwiGLU 1376,
batch 1, forward without grad at 1, 8, 64 and 256 tokens; compiled four
ways: static shapes, ``dynamic=True`` (one graph for every length),
recompiled (static first, then the dynamic recompile Dynamo makes when a
second length comes), and regional (``layer.compile()`` per block, one graph
run for every layer).
RNN LM: Embedding(500) -> 2-layer LSTM(128) -> Linear(500), T in {1, 16, 64,
256}, batch 1 and 8, a training step (forward + backward) and inference.

Every cell is the median over rounds of a per-call median; the variants are
interleaved inside each round, so machine noise hits them alike; the tables
quote ratios to the faster baseline.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Callable, Dict

import torch
import torch.nn as nn

import wfpass
from wfpass.tools.bench import own_code
from wfpass.tools.bench_models import Decoder, RnnLM, hand_fused_decoder
from wfpass.tools.doctor import cpu_words  # the page names its CPU: figures differ by vendor

torch._dynamo.config.recompile_limit = 512
torch._dynamo.config.accumulated_recompile_limit = 8192


# -- the models: the ones ``python -m wfpass bench`` measures (wfpass/tools/bench_models.py) --


def compiled(model: nn.Module, backend, mode: str) -> Callable:
    if mode == "regional":
        for layer in model.layers:
            layer.compile(backend=backend)
        return model
    # "recompiled": default dynamic=None; the caller runs another length first.
    return torch.compile(model, backend=backend, dynamic=True if mode == "dynamic" else None)


# -- timing -----------------------------------------------------------------------------


def _per_call(fn: Callable[[], None], min_s: float = 0.02) -> float:
    fn()
    n, t = 1, 0.0
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t = time.perf_counter() - t0
        if t >= min_s:
            return t / n
        n *= 2


def interleaved(steps: Dict[str, Callable[[], None]], rounds: int) -> Dict[str, float]:
    for f in steps.values():  # compile and warm up
        f()
        f()
    times: Dict[str, list] = {k: [] for k in steps}
    for _ in range(rounds):
        for k, f in steps.items():
            times[k].append(_per_call(f))
    return {k: statistics.median(v) for k, v in times.items()}


def decoder_rows(d: int, modes, tokens, rounds: int, log) -> list:
    rows = []
    torch.manual_seed(0)
    base = Decoder(d).eval()
    for mode in modes:
        for T in tokens:
            torch._dynamo.reset()
            x = torch.randn(1, T, d)
            variants = {
                "eager": base,
                "inductor": compiled(copy.deepcopy(base), "inductor", mode),
                "hand-fused": compiled(hand_fused_decoder(base), "inductor", mode),
                "wformat": compiled(copy.deepcopy(base), "wformat", mode),
                # The same Inductor model again: its ratio to the first copy
                # is the noise floor of this cell.
                "inductor-again": compiled(copy.deepcopy(base), "inductor", mode),
            }
            steps = {k: (lambda m=m: m(x)) for k, m in variants.items()}
            with torch.no_grad():
                if mode == "recompiled":
                    # Another length first: Dynamo compiles it statically, then
                    # recompiles with a dynamic length for the timed one.
                    for k, m in variants.items():
                        if k != "eager":
                            m(torch.randn(1, T + 3, d))
                ref = base(x)
                for k, m in variants.items():
                    torch.testing.assert_close(m(x), ref, rtol=1e-4, atol=1e-4)
                t = interleaved(steps, rounds)
            best = min(t["inductor"], t["hand-fused"])
            rows.append((d, mode, T, t, t["wformat"] and best / t["wformat"]))
            log(f"decoder d={d} {mode} T={T}: " + " ".join(f"{k}={v * 1e3:.3f}ms" for k, v in t.items())
                + f"  wformat vs best {best / t['wformat']:.3f}x")
    return rows


def rnn_rows(lengths, batches, rounds: int, log) -> list:
    rows = []
    torch.manual_seed(0)
    base = RnnLM()
    for train in (True, False):
        for B in batches:
            for T in lengths:
                torch._dynamo.reset()
                tok = torch.randint(0, 500, (T, B))
                # Each compiled copy gets a forward code object of its own:
                # Dynamo marks a code object it failed to compile (torch.compile's
                # default gives up on the LSTM) and then runs it eagerly for
                # every backend, so a shared one made wformat run eagerly.
                variants = {"eager": base, "inductor": torch.compile(own_code(copy.deepcopy(base))),
                            "wformat": torch.compile(own_code(copy.deepcopy(base)), backend="wformat")}
                steps = {}
                for k, m in variants.items():
                    if train:
                        def step(m=m):
                            m(tok).sum().backward()
                    else:
                        def step(m=m):
                            with torch.no_grad():
                                m(tok)
                    steps[k] = step
                t = interleaved(steps, rounds)
                rec = [r for r in wfpass.report(variants["wformat"]).records if r.pattern == "rnn"]
                if not rec or not (rec[0].stats.get("fused_calls", 0) + rec[0].stats.get("unfused_calls", 0)):
                    raise RuntimeError(f"wformat's compiled LSTM did not run (T={T}, B={B}): the timing would be eager's")
                rows.append(("train" if train else "infer", B, T, t))
                log(f"rnn {'train' if train else 'infer'} B={B} T={T}: " + " ".join(f"{k}={v * 1e3:.3f}ms" for k, v in t.items())
                    + f"  wformat/eager {t['eager'] / t['wformat']:.2f}x, /inductor {t['inductor'] / t['wformat']:.2f}x")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per cell (median reported)")
    ap.add_argument("--tokens", default="1,8,64,256", help="decoder lengths")
    ap.add_argument("--modes", default="static,dynamic,recompiled,regional",
                    help="decoder compile modes (recompiled: a static compile, then Dynamo's dynamic recompile)")
    ap.add_argument("--d512-modes", default="static", help="compile modes also run at d_model 512 ('' for none)")
    ap.add_argument("--lengths", default="1,16,64,256", help="RNN LM lengths")
    ap.add_argument("--batches", default="1,8", help="RNN LM batch sizes")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: decoder, rnn")
    ap.add_argument("--out", default=None, help="write the markdown tables here")
    ap.add_argument("--threads", type=int, default=None,
                    help="intra-op threads (default: torch's); 1 is steadiest on a shared machine")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.time()
    lines = []

    def log(s):
        print(s, flush=True)

    skip = set(filter(None, a.skip.split(",")))
    tokens = [int(t) for t in a.tokens.split(",")]
    dec = []
    if "decoder" not in skip:
        dec += decoder_rows(256, a.modes.split(","), tokens, a.rounds, log)
        if a.d512_modes:
            dec += decoder_rows(512, a.d512_modes.split(","), tokens, a.rounds, log)
    rnn = []
    if "rnn" not in skip:
        rnn = rnn_rows([int(t) for t in a.lengths.split(",")], [int(b) for b in a.batches.split(",")], a.rounds, log)

    cmd = "python benchmarks/overall/bench_targets.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines.append(f"Command: `{cmd}`  \ntorch {torch.__version__}, {cpu_words()}, {torch.get_num_threads()} threads, "
                 f"{a.rounds} interleaved rounds per cell, {time.time() - t0:.0f} s in all. Times in ms per call.\n")
    if dec:
        lines.append("### LLaMA-like decoder (4 layers, batch 1, forward without grad)\n")
        lines.append(
            "Four ways to compile: *static* (`dynamic=False`, a graph per length), *dynamic* (`dynamic=True`, one "
            "graph for every length), *recompiled* (the default: a static graph first, then the graph with a "
            "symbolic length that Dynamo compiles when a second length comes, which is what is timed) and "
            "*regional* (`layer.compile()` per decoder block, one graph run for every block). "
            "**x faster = baseline time / wformat time**; the baseline here is the faster of Inductor and the "
            "hand-fused model (the decoder written with one Q/K/V and one gate/up linear), the best a user "
            "could pick instead. *Noise*: a second, identical Inductor model against the first; where it is far "
            "from 1.0 a cell's ratio means nothing.\n")
        lines.append("| d_model | compile | tokens | eager | Inductor | hand-fused | wformat | x faster than the faster baseline | noise: Inductor / Inductor again |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for d, mode, T, t, ratio in dec:
            lines.append(f"| {d} | {mode} | {T} | {t['eager'] * 1e3:.3f} | {t['inductor'] * 1e3:.3f} | {t['hand-fused'] * 1e3:.3f} | "
                         f"{t['wformat'] * 1e3:.3f} | {ratio:.3f} | {t['inductor'] / t['inductor-again']:.3f} |")
        lines.append("")
    if rnn:
        lines.append("### RNN language model (Embedding 500 -> 2-layer LSTM 128 -> Linear 500)\n")
        lines.append("**x faster = baseline time / wformat time.** `torch.compile`'s default puts no LSTM in its "
                     "graph: its column is the model run eagerly. docs/results/rnn_speed.md has the fuller comparison "
                     "(each variant in its own process, static and recompiled, 1 and 2 threads).\n")
        lines.append("| step | batch | T | eager | Inductor | wformat | x faster than eager | than Inductor |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for kind, B, T, t in rnn:
            re, ri = t["eager"] / t["wformat"], t["inductor"] / t["wformat"]
            lines.append(f"| {kind} | {B} | {T} | {t['eager'] * 1e3:.3f} | {t['inductor'] * 1e3:.3f} | {t['wformat'] * 1e3:.3f} | "
                         f"{re:.2f} | {ri:.2f} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
