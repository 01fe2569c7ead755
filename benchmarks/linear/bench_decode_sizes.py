"""Decode at real sizes: HF LLaMA ``generate()`` from 22 MB to 2.1 GB of
weights in float32, bfloat16 and float16, eager / Inductor / Inductor
``freezing=True`` / wformat, one process per (model, dtype, backend, threads)
run, and how far each is from the memory-bandwidth floor.

Decoding one token reads every weight once, so its floor is the weights'
bytes over the read bandwidth, measured in the same process after the
timing (``torch.dot`` and ``torch.mv`` over 1 GiB, larger than any
last-level cache here; the best of 5). ms/token is the decode step alone:
(time of ``generate()`` of 24 new tokens - time of 4) / 20, both after the
same 16-token prompt, greedy, batch 1; the median of ``--rounds`` rounds.
RSS growth: from before ``torch.compile`` to after two warm-up
``generate()`` calls (compiles, recompiles for the growing cache, kernel
decisions and copies), after ``malloc_trim(0)``; peak: the process's
high-water mark then. Runs go one after another (a compile beside a timed
run would disturb it), ``--passes`` times through the whole list, so each
figure's passes are apart in time.

    python benchmarks/linear/bench_decode_sizes.py --out docs/results/decode_sizes.md --json docs/results/data/decode_sizes.json
    python benchmarks/linear/bench_decode_sizes.py --linears   # per linear shape: direct vs the plain GEMM, GB/s

``--linears``: the share of the floor each linear shape of the 1 GB
model reaches at one row in bf16 (its weight cycling through copies that
fill 512 MiB, as a model's calls find it), direct kernel against the plain
GEMM (oneDNN), and the prompt's 16 rows on the direct kernel against
oneDNN's packed copy.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

MODELS = {
    # name: LlamaConfig fields (untied embedding and head, vocab 8000)
    "20MB": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=6,
                 num_key_value_heads=2),
    "40MB": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2),
    "1GB": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=11, num_attention_heads=16,
                  num_key_value_heads=4),
}
DTYPES = ("bfloat16", "float16", "float32")
BACKENDS = ("eager", "inductor", "freezing", "wformat")
#: Beside them on request: wformat with no prepacked copies (prepack.max_bytes=0),
#: and wformat without the direct kernel's AMX body (WFPASS_DIRECT_AMX=0; the
#: body is on by default where the CPU has AMX).
EXTRA = ("wformat_nocopy", "wformat_noamx")
PROMPT, SHORT, LONG = 16, 4, 24


def _rss() -> tuple:
    got = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                got[k] = int(v.split()[0]) * 1024
    return got["VmRSS"], got["VmHWM"]


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _model(name: str, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**MODELS[name], vocab_size=8000, max_position_embeddings=256, attn_implementation="sdpa",
                      tie_word_embeddings=False)
    with torch.device("meta"):
        m = LlamaForCausalLM(cfg)
    m = m.to_empty(device="cpu").to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        m.model.rotary_emb.__init__(cfg)  # its inv_freq buffer, not a parameter: computed, not left empty
    return m.eval()


def bandwidth() -> float:
    """GB/s reading 1 GiB, the best of 5 tries of a dot product and a
    matrix-vector product over it."""
    import torch

    b = torch.ones(1 << 28)
    m = b.view(1 << 14, 1 << 14)
    best = 0.0
    for f in (lambda: torch.dot(b[:1 << 27], b[1 << 27:]), lambda: torch.mv(m, m[0])):
        for _ in range(5):
            t = time.perf_counter()
            f()
            best = max(best, b.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


def compile_forward(model, backend: str) -> None:
    """``model.forward`` compiled for ``backend`` (BACKENDS + EXTRA; eager:
    left as it is). ``freezing`` turns Inductor's freezing on for the
    process: a worker runs one backend."""
    import torch

    import wfpass

    if backend == "freezing":
        import torch._inductor.config as ic

        ic.freezing = True
    if backend == "wformat_nocopy":
        model.forward = torch.compile(model.forward, backend=wfpass.backend(prepack={"max_bytes": 0}))
    elif backend == "wformat_noamx":  # the worker's environment turns the AMX body off (main)
        model.forward = torch.compile(model.forward, backend="wformat")
    elif backend != "eager":
        model.forward = torch.compile(model.forward, backend="inductor" if backend == "freezing" else backend)


def generate_timer(model):
    """``gen(n)``: seconds of a greedy ``generate()`` of exactly ``n`` new
    tokens after the fixed PROMPT-token prompt."""
    import torch

    prompt = torch.randint(0, 8000, (1, PROMPT), generator=torch.Generator().manual_seed(1))

    def gen(n):
        with torch.no_grad():
            t = time.perf_counter()
            model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            return time.perf_counter() - t

    return gen


def worker(name: str, dtype_name: str, backend: str, threads: int, rounds: int) -> dict:
    import torch

    import wfpass
    from wfpass._torch.aot import disable_compile_caches, stop_compile_workers

    torch.set_num_threads(threads)
    disable_compile_caches()
    torch._dynamo.config.recompile_limit = 64
    dtype = getattr(torch, dtype_name)
    model = _model(name, dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    _trim()
    rss0, _ = _rss()
    compile_forward(model, backend)
    gen = generate_timer(model)
    t = time.perf_counter()
    gen(LONG)
    first = time.perf_counter() - t
    gen(LONG)
    stop_compile_workers()
    _trim()
    rss1, peak = _rss()
    per_token = []
    for _ in range(rounds):
        short, long_ = gen(SHORT), gen(LONG)
        per_token.append((long_ - short) / (LONG - SHORT) * 1e3)
    out = {"model": name, "dtype": dtype_name, "backend": backend, "threads": threads, "weights": weights,
           "first_s": first, "ms": per_token, "rss_growth": rss1 - rss0, "peak": peak}
    if backend.startswith("wformat"):
        rows = wfpass.report(model).find("prepack")
        calls = {k: sum(r.stats.get(k, 0) for r in rows) for k in ("direct_calls", "packed_calls", "plain_calls")}
        out["wformat"] = {**calls, "packed_bytes": sum(r.stats.get("packed_bytes", 0) for r in rows),
                          "over_bound_calls": sum(r.stats.get("over_bound_calls", 0) for r in rows)}
    del model
    _trim()
    out["bandwidth"] = bandwidth()
    return out


def linears(threads: int) -> list:
    """Per linear shape of the 1 GB model in bf16, the weight cycling through
    512 MiB of copies: one row (a decode step) on the direct kernel and the
    plain GEMM, and the prompt's 16 rows on the direct kernel and on
    oneDNN's packed copy (the copy the decision rule weighs it against),
    all interleaved round by round in one process."""
    import torch

    from wfpass import native
    from wfpass._torch import kernels as _k
    from wfpass.native import ops as _nops

    native.load()
    torch.set_num_threads(threads)
    cfg = MODELS["1GB"]
    d, ff, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg["num_attention_heads"] * \
        cfg["num_key_value_heads"]
    shapes = {"q / o": (d, d), "q+k+v block": (d + 2 * kv, d), "gate+up block": (2 * ff, d), "down": (d, ff),
              "head": (8000, d)}
    bw = bandwidth()
    rows = []
    for label, (n, k) in shapes.items():
        nbytes = n * k * 2
        ws = [torch.randn(n, k).to(torch.bfloat16) for _ in range(max(2, (512 << 20) // nbytes))]
        packs = [_k.onednn_pack(w) for w in ws] if _k.onednn_packs(torch.bfloat16) else []
        x1, x16 = torch.randn(1, k).to(torch.bfloat16), torch.randn(16, k).to(torch.bfloat16)
        kernels = {"direct": (ws, lambda w: _nops.direct_linear(x1, w, None)),
                   "plain": (ws, lambda w: torch.nn.functional.linear(x1, w)),
                   "direct16": (ws, lambda w: _nops.direct_linear(x16, w, None))}
        if packs:
            kernels["onednn16"] = (packs, lambda p: _k.onednn_linear(x16, p, None))
        ts: dict = {kk: [] for kk in kernels}
        for _ in range(7):
            for kk, (args, f) in kernels.items():
                f(args[0])
                t = time.perf_counter()
                for w in args:
                    f(w)
                ts[kk].append((time.perf_counter() - t) / len(args))
        res = {kk: statistics.median(v) for kk, v in ts.items()}
        row = {"linear": label, "shape": [n, k], "bytes": nbytes, "bandwidth": bw,
               **{f"{kk}_us": v * 1e6 for kk, v in res.items()},
               **{f"{kk}_share": nbytes / res[kk] / 1e9 / bw for kk in ("direct", "plain")}}
        if packs:  # the median over rounds of oneDNN's time over the direct kernel's, round by round
            row["onednn16_over_direct16"] = statistics.median(o / d for o, d in zip(ts["onednn16"], ts["direct16"]))
        rows.append(row)
        del ws, packs
    return rows


def _cpu() -> str:
    from wfpass.tools.doctor import cpu_words

    return cpu_words()


def _md(runs: list, lin: list, command: str) -> str:
    import torch

    lines = ["# Decode at real sizes: distance to the memory-bandwidth floor", "",
             f"Machine: {_cpu()}; torch {torch.__version__}. Command: `{command}`.", "",
             "HF `LlamaForCausalLM` built from a config (untied head, vocab 8000): 20MB is hidden 384, FF 1024, "
             "3 layers (6 heads, 2 KV heads); 40MB is hidden 512, FF 1408, "
             "4 layers (8 heads, 2 KV heads); 1GB is hidden 2048, FF 5632, 11 layers (16 heads, 4 KV heads); the "
             "name is its size in bf16. `generate()` greedy, batch 1, 16-token prompt; ms/token is the decode "
             "step alone ((24 new tokens - 4 new tokens) / 20), median of the rounds of every pass. The floor is "
             "the weights' bytes over the read bandwidth measured in the same process (1 GiB, `torch.dot` / "
             "`torch.mv`, best of 5). Each run in its own process, one after another.", "",
             "| model | dtype | threads | weights | floor ms | backend | ms/token | x floor | x freezing | x own floor "
             "| x freezing, own floors | RSS growth | peak RSS | wformat's linears |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    key = lambda r: (r["model"], r["dtype"], r["threads"])  # noqa: E731
    groups: dict = {}
    for r in runs:
        groups.setdefault(key(r), {}).setdefault(r["backend"], []).append(r)
    for (model, dtype, threads), by in groups.items():
        med = {b: statistics.median([m for r in rs for m in r["ms"]]) for b, rs in by.items()}
        # Each process against the floor its own bandwidth gives: a machine's read bandwidth can move between
        # processes (up to 2x within an hour on the AMD EPYC of docs/results/decode_prompt_amd.md), which a
        # ratio of two processes' ms/token carries along.
        own = {b: statistics.median([statistics.median(r["ms"]) / (r["weights"] / r["bandwidth"] / 1e6) for r in rs])
               for b, rs in by.items()}
        bw = statistics.median([r["bandwidth"] for rs in by.values() for r in rs])
        w = next(iter(by.values()))[0]["weights"]
        floor = w / bw / 1e6
        for b in BACKENDS + EXTRA:
            if b not in by:
                continue
            r = by[b][-1]
            vs = f"{med['freezing'] / med[b]:.2f}x" if "freezing" in med else "-"
            vs_own = f"{own['freezing'] / own[b]:.2f}x" if "freezing" in own else "-"
            extra = ""
            if b.startswith("wformat") and "wformat" in r:
                k = r["wformat"]
                extra = (f"direct {k['direct_calls']}, packed {k['packed_calls']}, plain {k['plain_calls']} calls; "
                         f"copies {k['packed_bytes'] / 2**20:.0f} MiB")
            lines.append(f"| {model} | {dtype} | {threads} | {w / 1e9:.3f} GB | {floor:.1f} | {b} | {med[b]:.1f} | "
                         f"{med[b] / floor:.2f} | {vs} | {own[b]:.2f} | {vs_own} | {r['rss_growth'] / 1e9:+.2f} GB | "
                         f"{r['peak'] / 1e9:.2f} GB | {extra} |")
    lines += ["", "x freezing: `freezing=True`'s ms/token over this backend's (above 1: faster than freezing). "
              "x own floor: the median over this backend's processes of its ms/token over the floor its own "
              "process measured; x freezing, own floors: `freezing=True`'s x own floor over this backend's (the "
              "comparison with each process's bandwidth taken out). "
              "wformat's linears: the calls of its linear kernels during the last `generate()` pair and the "
              "bytes of the packed copies it holds. wformat_nocopy: wformat with `prepack={\"max_bytes\": 0}` "
              "(no prepacked copy; the direct kernel or the plain GEMM). wformat_noamx: wformat with "
              "`WFPASS_DIRECT_AMX=0` (the direct kernel without its AMX body for bf16 prompt rows, which is on by "
              "default where the CPU has AMX)."]
    if lin:
        lines += ["", "## Per linear, bf16, 1 thread", "",
                  "Each weight of the 1GB model's shapes cycling through copies that fill 512 MiB, the kernels "
                  "interleaved round by round in one process (median of 7 rounds); share: bytes read per second "
                  "over the read bandwidth. 16 rows: the prompt's calls, on the direct kernel and on oneDNN's "
                  "packed copy of the weight; oneDNN / direct: the median of the rounds' ratios (below 0.85 the "
                  "decision rule would keep the copy).", "",
                  "| linear | shape | 1 row: direct us | share | plain GEMM us | share | 16 rows: direct us "
                  "| oneDNN packed us | oneDNN / direct |", "|---|---|---|---|---|---|---|---|---|"]
        for r in lin:
            pk = (f"{r['onednn16_us']:.0f} | {r['onednn16_over_direct16']:.2f}" if "onednn16_us" in r else "- | -")
            lines.append(f"| {r['linear']} | {r['shape'][0]}x{r['shape'][1]} | {r['direct_us']:.0f} | "
                         f"{r['direct_share']:.2f} | {r['plain_us']:.0f} | {r['plain_share']:.2f} | "
                         f"{r['direct16_us']:.0f} | {pk} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", nargs=4, metavar=("MODEL", "DTYPE", "BACKEND", "THREADS"))
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS + EXTRA)
    ap.add_argument("--threads", nargs="+", type=int, default=[1])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--linears", action="store_true", help="only the per-linear table (printed)")
    ap.add_argument("--no-linears", action="store_true", help="without the per-linear table")
    ap.add_argument("--out")
    ap.add_argument("--json")
    ap.add_argument("--from-json", help="write --out from the JSON of an earlier run (its runs and command)")
    a = ap.parse_args(argv)
    if a.from_json:
        with open(a.from_json) as f:
            got = json.load(f)
        with open(a.out, "w") as f:
            f.write(_md(got["runs"], got["linears"], got["command"]))
        return 0
    if a.worker:
        m, d, b, t = a.worker
        print(json.dumps(worker(m, d, b, int(t), a.rounds)), flush=True)
        return 0
    if a.linears:
        print(json.dumps(linears(a.threads[0]), indent=1))
        return 0
    runs = []
    for _ in range(a.passes):
        for t in a.threads:
            for m in a.models:
                for d in a.dtypes:
                    for b in a.backends:
                        env = dict(os.environ, OMP_NUM_THREADS=str(t))
                        if b == "wformat_noamx":
                            env["WFPASS_DIRECT_AMX"] = "0"
                        p = subprocess.run([sys.executable, __file__, "--worker", m, d, b, str(t), "--rounds",
                                            str(a.rounds)], capture_output=True, text=True, env=env)
                        if p.returncode != 0:
                            print(f"{m} {d} {b} {t}: failed\n{p.stderr[-2000:]}", file=sys.stderr)
                            continue
                        r = json.loads(p.stdout.strip().splitlines()[-1])
                        runs.append(r)
                        print(f"{m} {d} t{t} {b}: {statistics.median(r['ms']):.1f} ms/token, floor "
                              f"{r['weights'] / r['bandwidth'] / 1e6:.1f}, RSS {r['rss_growth'] / 1e9:+.2f} GB "
                              f"{r.get('wformat', '')}", flush=True)
    lin = linears(1) if "1GB" in a.models and not a.no_linears else []
    command = "python benchmarks/linear/bench_decode_sizes.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": runs, "linears": lin, "command": command.strip()}, f, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(_md(runs, lin, command.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
