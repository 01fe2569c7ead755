"""Exported RNN models: export time, AOTInductor compile time and the
package's run time, ``wfpass.export`` against stock ``torch.export`` (a
static T: it cannot export a dynamic one), stock with PyTorch's while-loop
LSTM decomposition where it runs, and eager.

Each variant runs in a process of its own (``--worker``): export, compile,
load the package, then the run times at T 1, 16 and 128 and batch 1 and 8
(median of ``--reps`` calls after 3 warm-up calls), each checked against
eager (relative error). A stock package holds one T: it is compiled at
T 16 and run only there.

    python benchmarks/rnn/bench_export.py --threads 1 --models lstm_lm gru_packed --passes 3 --out docs/results/export_1thread.md
    python benchmarks/rnn/bench_export.py --threads 1 --models decoder_block --reps 20 --out docs/results/export_decoder_1thread.md

The LLaMA-like decoder block (no RNN; d 512, 8 heads, FF 1376, 7 linears;
in float32 and in bfloat16) shows what a program holds of the linear
formats: its GEMM nodes (``wfpass::linear_group`` counted as one).

    python benchmarks/rnn/bench_export.py --threads 1 --models decoder_block decoder_block_bf16 --reps 20 --out docs/results/export_decoder_1thread.md
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODELS = ("lstm_lm", "gru_packed", "decoder_block", "decoder_block_bf16")
#: ``wfpass_cxx``: ``rnn={"cpu_kernel": "cxx"}``, the LSTM on wfpass's C++ loop
#: instead of oneDNN's layer (the GRU takes the loop by default).
#: ``stock_decomposed``: stock's static program after ``run_decompositions()``
#: (the core ATen opset that ExecuTorch, ONNX and other lowerings start
#: from), where the LSTM is unrolled over T.
VARIANTS = ("eager", "wfpass", "wfpass_cxx", "stock_static", "stock_decomposed", "stock_while_loop")
LENGTHS = (1, 16, 128)
BATCHES = (1, 8)


def _span(xs) -> str:
    """Seconds as a range, "7.3-7.7 s" ("-" for none)."""
    if not xs:
        return "-"
    lo, hi = f"{min(xs):.1f}", f"{max(xs):.1f}"
    return f"{lo} s" if lo == hi else f"{lo}-{hi} s"


def _gemms(gm, branch: int) -> int:
    """The program's GEMM nodes (``wfpass::linear_group`` counted as one),
    those of each ``torch.cond`` on the row count taken from its branch
    ``branch`` (1: the op, up to the direct kernel's rows; 2: the linears)."""
    import torch

    count = 0
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is torch.ops.higher_order.cond:
            count += _gemms(getattr(gm, n.args[branch].target), branch)
        elif str(n.target).split(".")[-2 if str(n.target).count(".") > 1 else -1] in (
                "linear", "mm", "addmm", "bmm", "linear_group"):
            count += 1
    return count


def build(name: str):
    import torch
    from torch import nn
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    torch.manual_seed(0)
    if name == "lstm_lm":
        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb, self.rnn, self.head = nn.Embedding(500, 128), nn.LSTM(128, 128, 2), nn.Linear(128, 500)

            def forward(self, tok):
                return self.head(self.rnn(self.emb(tok))[0])

        def inputs(t, b):
            return (torch.randint(0, 500, (t, b)),)

        return LM().eval(), inputs, lambda T, B: {"tok": {0: T, 1: B}}

    if name.startswith("decoder_block"):
        class Block(nn.Module):
            """LLaMA-like: RMSNorm, Q/K/V/O, causal SDPA, SiLU-gated MLP
            (gate/up/down): 7 linears, two sibling groups (Q/K/V, gate/up)."""

            def __init__(self, d=512, heads=8, ff=1376):
                super().__init__()
                self.heads = heads
                self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
                self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
                self.gate, self.up = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
                self.down = nn.Linear(ff, d, bias=False)

            def forward(self, x):
                b, t, d = x.shape
                h = self.n1(x)
                q, k, v = (f(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
                a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
                h = self.n2(x)
                return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))

        dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32

        def inputs(t, b):
            return (torch.randn(b, t, 512, generator=torch.Generator().manual_seed(t * 100 + b)).to(dtype),)

        return Block().to(dtype).eval(), inputs, lambda T, B: {"x": {0: B, 1: T}}

    class Enc(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(64, 128, 1, bidirectional=True, batch_first=True)
            self.head = nn.Linear(256, 64)

        def forward(self, x, lengths):
            y, h = self.rnn(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
            y, _ = pad_packed_sequence(y, batch_first=True, total_length=x.shape[1])
            return self.head(y), h

    def inputs(t, b):
        g = torch.Generator().manual_seed(t * 100 + b)
        lengths = torch.randint(1, t + 1, (b,), generator=g)
        lengths[0] = t
        return torch.randn(b, t, 64, generator=g), lengths

    return Enc().eval(), inputs, lambda T, B: {"x": {0: B, 1: T}, "lengths": {0: B}}


def _time(fn, args, reps):
    for _ in range(3):
        fn(*args)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def _err(got, want):
    import torch

    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    return max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want) if isinstance(w, torch.Tensor))


def worker(model_name: str, variant: str, reps: int) -> dict:
    import torch
    from torch.export import Dim

    import wfpass
    from wfpass._torch.aot import disable_compile_caches

    disable_compile_caches()
    model, inputs, dyn = build(model_name)
    out = {"model": model_name, "variant": variant, "runs": {}}
    if variant == "wfpass_cxx" and model_name != "lstm_lm":
        return {**out, "skipped": "for the LSTM: the GRU takes the C++ loop by default, the block has no RNN"}
    if variant != "eager":
        # Inductor finds the vector ISA its C++ compiler can build by
        # compiling a test program per ISA, once per process and cache folder
        # (7.3 s from a fresh cache here; torch 2.13's cpu_vec_isa.pick_vec_isa,
        # private). A user's later compiles read it from the cache, and a
        # worker that compiles two packages pays it once: paid before the
        # timed compiles, so they compare the models' own compiles.
        from torch._inductor import cpu_vec_isa

        t0 = time.perf_counter()
        cpu_vec_isa.pick_vec_isa()
        out["isa_s"] = time.perf_counter() - t0
    shapes = [(t, b) for t in LENGTHS for b in BATCHES]
    with torch.no_grad():
        if variant == "eager":
            for t, b in shapes:
                out["runs"][f"{t},{b}"] = [_time(model, inputs(t, b), reps), 0.0]
            return out
        ex = inputs(16, 2)
        t0 = time.perf_counter()
        if variant in ("wfpass", "wfpass_cxx"):
            opts = {"rnn": {"cpu_kernel": "cxx"}} if variant == "wfpass_cxx" else {}
            ep = wfpass.export(model, ex, dynamic_shapes=dyn(Dim("T", min=1, max=512), Dim("B", min=1, max=64)),
                               **opts)
            out["linear_ops"] = [f"{r.detail['members']} linear(s), direct kernel up to {r.detail['direct_rows']} rows"
                                 for r in wfpass.last_report().find("linear", "rewritten")]
        elif variant in ("stock_static", "stock_decomposed"):
            shapes = [(16, b) for b in BATCHES]

            def stock_program(b):  # one T and one B a program (stock's LSTM specializes both)
                e = torch.export.export(model, inputs(16, b))
                return e.run_decompositions() if variant == "stock_decomposed" else e

            try:
                ep = stock_program(1)  # compiled at each B below
            except Exception as e:  # noqa: BLE001 - what a user meets, in the table
                return {**out, "skipped": f"export failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"}
        else:
            from torch.export._patches import register_lstm_while_loop_decomposition

            if model_name != "lstm_lm":
                return {**out, "skipped": "the while-loop decomposition is for nn.LSTM over a padded batch"}
            try:
                with register_lstm_while_loop_decomposition():
                    ep = torch.export.export(model, ex, dynamic_shapes=dyn(Dim("T", min=1, max=512),
                                                                              Dim("B", min=1, max=64)))
            except Exception as e:  # noqa: BLE001 - what a user meets, in the table
                return {**out, "skipped": f"export failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"}
        out["export_s"] = time.perf_counter() - t0
        out["nodes"] = len(ep.graph.nodes)
        small, large = _gemms(ep.graph_module, 1), _gemms(ep.graph_module, 2)
        out["gemms"] = str(small) if small == large else f"{small} ({large} above the direct rows)"
        packages = {}
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            try:
                if variant in ("stock_static", "stock_decomposed"):
                    for b in BATCHES:  # stock's static program is for batch 1: export and compile one per batch too
                        e_b = stock_program(b) if b != 1 else ep
                        packages[b] = torch._inductor.aoti_compile_and_package(e_b, package_path=f"{d}/m{b}.pt2")
                    out["compile_s"] = (time.perf_counter() - t0) / len(BATCHES)
                else:
                    path = torch._inductor.aoti_compile_and_package(ep, package_path=f"{d}/m.pt2")
                    packages = {b: path for b in BATCHES}
                    out["compile_s"] = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001
                return {**out, "skipped": f"AOTInductor failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            loaded = {p: torch._inductor.aoti_load_package(p) for p in set(packages.values())}
            for t, b in shapes:
                args = inputs(t, b)
                run = loaded[packages[b]]
                out["runs"][f"{t},{b}"] = [_time(run, args, reps), _err(run(*args), model(*args))]
    return out


def _merge(rs: list) -> dict:
    """One variant's passes as one result: the median of each figure over
    the passes (its error: the largest), the first pass's otherwise."""
    ok = [r for r in rs if "skipped" not in r]
    if not ok:
        return rs[0]
    out = dict(ok[0])
    for k in ("export_s", "compile_s", "isa_s"):
        if k in out:
            out[k] = statistics.median(r[k] for r in ok)
    out["runs"] = {key: [statistics.median(r["runs"][key][0] for r in ok), max(r["runs"][key][1] for r in ok)]
                   for key in ok[0]["runs"]}
    return out


def _cell(r, key, eager):
    if "skipped" in r:
        return "-"
    if key not in r["runs"]:
        return "one T a package"
    ms, err = r["runs"][key]
    base = eager["runs"][key][0]
    return f"{ms:.3f} ({base / ms:.2f}x, err {err:.0e})" if r["variant"] != "eager" else f"{ms:.3f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--passes", type=int, default=1, help="times through every variant; figures: medians over them")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--out")
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        import torch

        torch.set_num_threads(a.threads)
        print(json.dumps(worker(a.worker[0], a.worker[1], a.reps)))
        return 0
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from _out import emit

    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "WFPASS_QUIET": "1"}
    passes: dict = {}
    for i in range(a.passes):  # each pass through every variant, so a slow spell of the machine hits them all
        for m in a.models:
            for v in VARIANTS:
                # A fresh Inductor cache per worker: compile times are cold for
                # every variant, whatever earlier runs left in the cache.
                with tempfile.TemporaryDirectory() as cache:
                    p = subprocess.run([sys.executable, __file__, "--worker", m, v, "--threads", str(a.threads),
                                        "--reps", str(a.reps)], capture_output=True, text=True,
                                       env={**env, "TORCHINDUCTOR_CACHE_DIR": cache})
                line = p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else None
                passes.setdefault((m, v), []).append(
                    json.loads(line) if line else {"model": m, "variant": v,
                                                   "skipped": f"worker failed: {p.stderr[-300:]}"})
                print(m, v, f"pass {i + 1} done", file=sys.stderr, flush=True)
    results = {k: _merge(rs) for k, rs in passes.items()}
    import torch

    import wfpass.tools.doctor as doctor

    lines = [f"# Exported models, {a.threads} thread(s): wfpass.export against stock torch.export", "",
             "`python benchmarks/rnn/bench_export.py " + " ".join(argv if argv is not None else sys.argv[1:]) + "`",
             "", f"Machine: {doctor.cpu_words()}; torch {torch.__version__}; {a.threads} thread(s); each variant "
             f"in its own process, {a.passes} pass(es) through all of them; run times: median of {a.reps} calls of the loaded "
             "AOTInductor package (eager: the model itself), in ms, the median over the passes, with the speed-up over "
             "eager and the relative error against it (the largest of the passes). AOTInductor compile s: one "
             "package, after Inductor's check of the vector ISA its compiler builds, which each worker paid first "
             "(once per process and cache folder; a user's later compiles read it from the cache): "
             + _span([r["isa_s"] for r in results.values() if "isa_s" in r]) + ".", ""]
    lines += ["| model | variant | export s | AOTInductor compile s | graph nodes | GEMM nodes | notes |",
              "|---|---|---|---|---|---|---|"]
    for (m, v), r in results.items():
        if v == "eager":
            continue
        note = r.get("skipped", "dynamic T and B" if v in ("wfpass", "wfpass_cxx", "stock_while_loop") else "T 16, one package per batch")
        if r.get("linear_ops"):
            note += "; wfpass::linear_group: " + ", ".join(r["linear_ops"])
        fmt = (lambda k: f"{r[k]:.1f}" if k in r else "-")
        lines.append(f"| {m} | {v} | {fmt('export_s')} | {fmt('compile_s')} | {r.get('nodes', '-')} | "
                     f"{r.get('gemms', '-')} | {note} |")
    lines += ["", "| model | T | batch | " + " | ".join(VARIANTS) + " |", "|---|---|---|" + "---|" * len(VARIANTS)]
    for m in a.models:
        eager = results[(m, "eager")]
        for t in LENGTHS:
            for b in BATCHES:
                key = f"{t},{b}"
                lines.append(f"| {m} | {t} | {b} | " + " | ".join(_cell(results[(m, v)], key, eager) for v in VARIANTS)
                             + " |")
    return emit(lines, a.out)


if __name__ == "__main__":
    sys.exit(main())
