"""Sibling-linear fusion, side by side in one run.

    python benchmarks/linear/bench_linear.py [--rounds 7] [--calls 30] [--threads 1] [--out docs/results/linear.md]

Variants: eager; torch.compile default (Inductor); Inductor with freezing
(inference only); the same model written by hand with one fused Linear under
Inductor (the reference no weight-format rewrite can beat); wformat with
linear_path auto / fused / split. Forward (eval, no_grad) and one training
step (forward + backward). Each cell is the median over ``rounds`` rounds of
the per-call median of ``calls`` calls; variants are interleaved inside each
round so machine noise hits them alike. Also: parameter bytes before/after
wformat, and a small HF LLaMA forward at batch 1 x 1 token.
"""
from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import wfpass
from wfpass.tools.tables import markdown_table
from wfpass.tools.doctor import cpu_words  # the page names its CPU: figures differ by vendor

D = 768

# Every variant compiles the same forward code object (7 backends x 3 shapes x
# train/eval): above Dynamo's default limit of 8 entries the extra ones would
# silently run eagerly and be timed as if compiled.
torch._dynamo.config.recompile_limit = 256
torch._dynamo.config.accumulated_recompile_limit = 4096


class ThreeLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        return F.silu(self.q(x)) * self.k(x) + self.v(x)


class HandFused(nn.Module):
    def __init__(self, src: ThreeLinears):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([src.q.weight, src.k.weight, src.v.weight]))
            self.qkv.bias.copy_(torch.cat([src.q.bias, src.k.bias, src.v.bias]))

    def forward(self, x):
        q, k, v = self.qkv(x).split(D, -1)
        return F.silu(q) * k + v


def param_bytes(model):
    return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}.values())


def _call_ms(fn, x, calls, train):
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        if train:
            fn(x).sum().backward()
        else:
            fn(x)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench(variants, x, rounds, calls, train):
    ctx = torch.enable_grad() if train else torch.no_grad()
    with ctx:
        for fn in variants.values():  # compile + warm up
            for _ in range(3):
                _call_ms(fn, x, 1, train)
        per = {k: [] for k in variants}
        for _ in range(rounds):
            for k, fn in variants.items():
                per[k].append(_call_ms(fn, x, calls, train))
    return {k: statistics.median(v) for k, v in per.items()}


def build_variants(base, train):
    mode = (lambda m: m.train()) if train else (lambda m: m.eval())
    v = {
        "eager": mode(copy.deepcopy(base)),
        "inductor": torch.compile(mode(copy.deepcopy(base))),
    }
    if not train:
        v["inductor+freezing"] = torch.compile(mode(copy.deepcopy(base)), options={"freezing": True})
    v["hand-fused inductor"] = torch.compile(mode(HandFused(base)))
    for path in ("auto", "fused", "split"):
        v[f"wformat {path}"] = torch.compile(mode(copy.deepcopy(base)), backend=wfpass.backend(linear={"path": path}))
    return v


def llama_rows(rounds, calls):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 1000, (1, 1))
    variants = {
        "eager": copy.deepcopy(base),
        "inductor": torch.compile(copy.deepcopy(base)),
        "wformat": torch.compile(copy.deepcopy(base), backend="wformat"),
    }
    fns = {k: (lambda m: (lambda i: m(input_ids=i, use_cache=False).logits))(m) for k, m in variants.items()}
    return bench(fns, ids, rounds, calls, train=False)


def _variants_table(rows, names) -> str:
    """``rows[M][variant]`` (ms): per variant, the ms at every M, then the speed-up over Inductor and over the
    hand-fused Inductor model at every M."""
    head = (["variant"] + [f"M={m} ms" for m in rows] + [f"M={m} vs inductor" for m in rows]
            + [f"M={m} vs hand-fused" for m in rows])
    body = [[n] + [f"{rows[m][n]:.3f}" for m in rows] + [f"{rows[m]['inductor'] / rows[m][n]:.2f}x" for m in rows]
            + [f"{rows[m]['hand-fused inductor'] / rows[m][n]:.2f}x" for m in rows] for n in names]
    return markdown_table(head, body)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--out", default="docs/results/linear.md")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = ThreeLinears()
    shapes = {1: (1, D), 8: (8, D), 1024: (8, 128, D)}
    lines = [
        "# Sibling-linear fusion: measured results\n",
        f"Command: `python benchmarks/linear/bench_linear.py --rounds {args.rounds} --calls {args.calls}" + (f" --threads {args.threads}" if args.threads else "") + "`  ",
        f"torch {torch.__version__}, {cpu_words()}, {torch.get_num_threads()} threads, Python {platform.python_version()}. "
        "Model: three Linear(768, 768) with bias reading one input (Q/K/V-like). "
        f"Each cell: median over {args.rounds} interleaved rounds of the per-call median of {args.calls} calls, in ms. "
        "The machine is shared and noisy: read the ratios.\n",
    ]
    for train in (False, True):
        title = "Training step (forward + backward)" if train else "Forward (eval, no_grad)"
        rows = {}
        for m, shape in shapes.items():
            torch._dynamo.reset()
            x = torch.randn(*shape)
            variants = build_variants(base, train)
            rows[m] = bench(variants, x, args.rounds, args.calls, train)
            print(title, m, {k: round(v, 3) for k, v in rows[m].items()}, flush=True)
        names = list(next(iter(rows.values())))
        lines.append(f"\n## {title}\n")
        lines.append(_variants_table(rows, names))
        lines.append("\n(`vs` columns: speed-up, >1 means faster than the reference column.)")

    m = copy.deepcopy(base)
    before = param_bytes(m)
    torch.compile(m, backend="wformat")(torch.randn(1, D))
    after = param_bytes(m)
    lines.append(f"\n## Parameter memory\n\nwformat: {before} bytes of parameter storage before, {after} after: growth {after - before} bytes.")

    try:
        ll = llama_rows(args.rounds, args.calls)
        lines.append("\n## HF LLaMA forward, batch 1 x 1 token\n")
        lines.append("hidden 512, intermediate 1376, 4 layers, 8 heads / 2 KV heads, built from a config.\n")
        lines.append(markdown_table(["variant", "ms", "vs inductor"],
                                    [[k, f"{v:.3f}", f"{ll['inductor'] / v:.2f}x"] for k, v in ll.items()]))
        print("llama", ll, flush=True)
    except ImportError:
        lines.append("\n(transformers not installed: LLaMA row skipped)")
    text = "\n".join(lines) + "\n"
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
