"""What wfpass adds to a compile: the time of the wformat backend itself.

For each model, Dynamo captures the forward and hands the graph to
``wfpass.backend(inner="eager")`` (the eager inner compiler returns the
graph as it is, so what is timed is wfpass: its formats' matchers, guards
and rewrites, the report, and moving the parameters into their blocks).
Every sample compiles a fresh copy of the model after ``torch._dynamo.reset()``.

Several source trees of wfpass can be compared (``--trees A B``: each a
folder holding the ``wfpass`` package, put first on ``PYTHONPATH``): a round
runs every model under every tree, each in its own process, in an order
that rotates from round to round; the table gives the medians over rounds
and the ratio to the first tree.

    python benchmarks/overall/bench_pass_time.py --trees /tmp/before . --rounds 7 --out docs/results/pass_time.md
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

MODELS = ("decoder", "rnn_lm", "cell_loop", "bf16_cnn", "hf_llama", "hf_bert")


def _model(name: str):
    """``(model, inputs)``, built the same way in every tree (``_note`` says what it is)."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    if name == "decoder":
        from wfpass.tools.bench_models import Decoder

        return Decoder(d=256, layers=4, heads=8, kv_heads=2, ffn=1376).eval(), (torch.randn(1, 16, 256),)
    if name == "rnn_lm":
        from wfpass.tools.bench_models import RnnLM

        return RnnLM(vocab=500, hidden=128, layers=2), (torch.randint(0, 500, (64, 8)),)
    if name == "cell_loop":
        class Loop(nn.Module):
            def __init__(self):
                super().__init__()
                self.cell = nn.LSTMCell(64, 128)

            def forward(self, x):
                h = c = torch.zeros(x.shape[1], 128)
                outs = []
                for t in range(x.shape[0]):
                    h, c = self.cell(x[t], (h, c))
                    outs.append(h)
                return torch.stack(outs)

        return Loop(), (torch.randn(32, 4, 64),)
    if name == "bf16_cnn":
        from wfpass.tools.bench_models import BnCNN

        return BnCNN(width=32, blocks=3).to(torch.bfloat16), (torch.randn(8, 3, 32, 32, dtype=torch.bfloat16),)
    import transformers

    if name == "hf_llama":
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        return transformers.LlamaForCausalLM(cfg).eval(), (torch.randint(0, 256, (1, 16)),)
    if name == "hf_bert":
        cfg = transformers.BertConfig(vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                      intermediate_size=256, max_position_embeddings=64)
        return transformers.BertModel(cfg).eval(), (torch.randint(0, 256, (1, 16)),)
    raise ValueError(f"unknown model {name!r}; one of {MODELS}")


def _worker(name: str, reps: int) -> None:
    """Print the backend's time per compile (seconds) for ``reps`` compiles."""
    import torch

    import wfpass

    torch.set_num_threads(1)
    base, inputs = _model(name)
    inner = wfpass.backend(inner="eager")
    times, rewritten = [], 0

    def timed(gm, example_inputs):
        t0 = time.perf_counter()
        out = inner(gm, example_inputs)
        times.append(time.perf_counter() - t0)
        return out

    for _ in range(reps + 1):  # the first compile warms imports and caches; dropped
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        torch.compile(model, backend=timed)(*inputs)
        rewritten = len(wfpass.last_report().rewritten)
    print(json.dumps({"per_compile": _per_compile(times, reps), "rewritten": rewritten,
                      "wfpass": os.path.dirname(os.path.dirname(os.path.abspath(wfpass.__file__)))}))


def _per_compile(times, reps):
    # A model may compile to several graphs; a compile's cost is their sum.
    per = len(times) // (reps + 1)
    sums = [sum(times[i * per:(i + 1) * per]) for i in range(reps + 1)]
    return statistics.median(sums[1:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", nargs="+", default=[None], help="folders holding the wfpass package to compare")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is reported")
    ap.add_argument("--reps", type=int, default=3, help="compiles per process (their median is one sample)")
    ap.add_argument("--out", default=None, help="write a markdown table here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        _worker(a.worker, a.reps)
        return 0
    samples = {(t, m): [] for t in a.trees for m in a.models}
    rewrites = {}
    jobs = [(t, m) for m in a.models for t in a.trees]
    t0 = time.perf_counter()
    for r in range(a.rounds):
        for t, m in jobs[r % len(jobs):] + jobs[:r % len(jobs)]:
            env = dict(os.environ, OMP_NUM_THREADS="1")
            if t is not None:
                env["PYTHONPATH"] = os.path.abspath(t) + os.pathsep + env.get("PYTHONPATH", "")
            out = subprocess.run([sys.executable, __file__, "--worker", m, "--reps", str(a.reps)], env=env,
                                 capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            res = json.loads(out)
            if t is not None and os.path.realpath(res["wfpass"]) != os.path.realpath(t):
                raise SystemExit(f"{t}: the worker imported wfpass from {res['wfpass']}")
            samples[(t, m)].append(res["per_compile"])
            rewrites[(t, m)] = res["rewritten"]
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    from wfpass.tools.doctor import cpu_words  # the page names its CPU: figures differ by vendor
    lines = [f"Command: `python benchmarks/overall/bench_pass_time.py {' '.join(argv if argv is not None else sys.argv[1:])}`  ",
             f"{a.rounds} interleaved rounds, each sample the median of {a.reps} compiles in one process; "
             f"{cpu_words()}, 1 torch thread; {time.perf_counter() - t0:.0f} s in all.", "",
             "Milliseconds of the wformat backend per compile (inner compiler `eager`), median over rounds "
             "± half the interquartile range; *rows rewritten*: the report's rewritten rows.", "",
             _table(a.trees, a.models, samples, rewrites), ""]
    lines.append("Models: " + "; ".join(f"{m}: {_note(m)}" for m in a.models) + ".")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


def _table(trees, models, samples, rewrites) -> str:
    """Per model: the median ms ± half the IQR under every tree, the ratios to the first tree (with more than
    one), and the rows rewritten under each tree."""
    # imported here, not at the top: workers run this file with another tree's wfpass first on the path
    from wfpass.tools.tables import markdown_table

    names = [t or "installed" for t in trees]
    body = []
    for m in models:
        meds = []
        cells = []
        for t in trees:
            xs = sorted(samples[(t, m)])
            med = statistics.median(xs)
            q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [med, med, med]
            meds.append(med)
            cells.append(f"{med * 1e3:.0f} ± {(q[2] - q[0]) / 2 * 1e3:.0f}")
        ratio = [" / ".join(f"{x / meds[0]:.2f}" for x in meds[1:])] if len(names) > 1 else []
        rw = " / ".join(str(rewrites[(t, m)]) for t in trees)
        body.append([m, *cells, *ratio, rw])
    return markdown_table(["model", *names, *(["ratio to the first"] if len(names) > 1 else []), "rows rewritten"], body)


def _note(name: str) -> str:
    return {"decoder": "LLaMA-like decoder, 4 layers, d 256 (wfpass.tools.bench_models), forward",
            "rnn_lm": "Embedding -> 2-layer LSTM 128 -> Linear, training graph",
            "cell_loop": "a loop of 32 LSTMCell(64, 128) steps, training graph",
            "bf16_cnn": "bf16 conv-BatchNorm-ReLU x 3, training graph",
            "hf_llama": "HF LlamaForCausalLM from a config, 4 layers, d 128, forward",
            "hf_bert": "HF BertModel from a config, 4 layers, d 128, forward"}[name]


if __name__ == "__main__":
    sys.exit(main())
