"""Where a decode token's time goes beyond the memory-bandwidth floor: HF
``generate()`` of the 1 GB bf16 LLaMA (``bench_decode_sizes.py``'s model),
profiled with ``torch.profiler``, the time of each part per decode token.

A token's time is the profiled ``generate()`` of 24 new tokens minus that of
4, over 20 (the decode steps alone, as bench_decode_sizes times them); each
part is the same difference of the profiler's self times: the linears
(wfpass's op, or Inductor's linear calls under ``freezing=True``),
attention (ATen's flash attention for the CPU), Inductor's fused kernels
(``cpp.enable_kernel_profile``), Inductor's wrapper code (the Python that
calls them, ``## Call CompiledFxGraph``), Dynamo's guards (``TorchDynamo
Cache Lookup``), the other ATen ops (HF's and ``generate()``'s outside the
graph) and the Python no op accounts for (wall time minus every self
time). The profiler adds to the Python parts, so the unprofiled ms/token
is given beside. Each backend in its own process; the floor is measured
in that process after the timing (1 GiB read, as bench_decode_sizes).

    python benchmarks/linear/profile_decode.py --threads 1 --out docs/results/decode_profile_amd.md
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode_sizes as b  # noqa: E402  (its model, timing and floor; torch is imported inside)

#: The parts of a token, in the page's order: (name, test on a profiler event's key).
PARTS = (
    ("linears", lambda k: k in ("wfpass::packed_linear", "mkldnn::_linear_pointwise", "aten::mm", "aten::addmm",
                                "aten::linear", "mkl::_mkl_linear")),
    ("attention", lambda k: "scaled_dot_product" in k and not k.startswith("graph_")),
    ("Inductor's fused kernels", lambda k: k.startswith("graph_")),
    ("Inductor's wrapper code", lambda k: k.startswith("## Call CompiledFxGraph")),
    ("Dynamo's guards", lambda k: k == "TorchDynamo Cache Lookup"),
    ("compiled-region entry", lambda k: k.startswith(("Torch-Compiled Region", "Pregraph bytecode",
                                                       "AOTDispatcher Runtime Wrapper"))),
)
BACKENDS = ("freezing", "wformat")
SHORT, LONG = b.SHORT, b.LONG  # the decode steps bench_decode_sizes times


def _parts(events) -> dict:
    got = {name: 0.0 for name, _ in PARTS}
    got["other ATen ops"] = 0.0
    for e in events:
        for name, match in PARTS:
            if match(e.key):
                got[name] += e.self_cpu_time_total / 1e3
                break
        else:
            got["other ATen ops"] += e.self_cpu_time_total / 1e3
    return got


def worker(backend: str, threads: int, rounds: int) -> dict:
    import torch
    import torch._inductor.config as ic
    from torch.profiler import ProfilerActivity, profile

    from wfpass._torch.aot import disable_compile_caches

    torch.set_num_threads(threads)
    disable_compile_caches()
    torch._dynamo.config.recompile_limit = 64
    ic.cpp.enable_kernel_profile = True  # each fused kernel a profiler event
    model = b._model("1GB", torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    b.compile_forward(model, backend)
    gen = b.generate_timer(model)
    gen(LONG)
    gen(LONG)
    plain = []
    for _ in range(rounds):
        short, long_ = gen(SHORT), gen(LONG)
        plain.append((long_ - short) / (LONG - SHORT) * 1e3)
    profiled = []
    for _ in range(rounds):
        walls, parts = [], []
        for n in (SHORT, LONG):
            with profile(activities=[ProfilerActivity.CPU]) as p:
                walls.append(gen(n))
            parts.append(_parts(p.key_averages()))
        row = {k: (parts[1][k] - parts[0][k]) / (LONG - SHORT) for k in parts[0]}
        wall = (walls[1] - walls[0]) / (LONG - SHORT) * 1e3
        row["Python outside any op"] = wall - sum(row.values())
        row["total (profiled)"] = wall
        profiled.append(row)
    del model
    bw = b.bandwidth()
    return {"backend": backend, "threads": threads, "weights": weights, "ms": statistics.median(plain),
            "parts": {k: statistics.median(r[k] for r in profiled) for k in profiled[0]}, "bandwidth": bw,
            "floor_ms": weights / (bw * 1e9) * 1e3}


def _md(runs: list, command: str) -> str:
    import torch

    from wfpass.tools.doctor import cpu_words

    names = list(runs[0]["parts"])
    lines = ["# A decode token's time, part by part", "",
             f"Machine: {cpu_words()}; torch {torch.__version__}. Command: `{command}`.", "",
             "HF `LlamaForCausalLM`, 1.06 GB of bf16 weights (hidden 2048, FF 5632, 11 layers; "
             "bench_decode_sizes.py's 1GB model), `generate()` greedy, batch 1, 16-token prompt. Each part: "
             f"the profiler's self time in `generate()` of {LONG} new tokens minus {SHORT}, per token, its "
             "median over the rounds (so the parts need not add up to the total's median); \"Python outside "
             "any op\": the profiled wall time minus every self time. The "
             "profiler slows the Python parts; \"ms/token, not profiled\" is the same difference timed without "
             "it. Floor: the weights' bytes over the read bandwidth measured in the same process. Each backend "
             "in its own process.", ""]
    head = "| part (ms per token) | " + " | ".join(f"{r['backend']}, {r['threads']} thread(s)" for r in runs) + " |"
    lines += [head, "|---|" + "---|" * len(runs)]
    for k in names:
        lines.append(f"| {k} | " + " | ".join(f"{r['parts'][k]:.2f}" for r in runs) + " |")
    lines.append("| ms/token, not profiled | " + " | ".join(f"{r['ms']:.1f}" for r in runs) + " |")
    lines.append("| floor (same process) | " + " | ".join(f"{r['floor_ms']:.1f}" for r in runs) + " |")
    lines.append("| linears over the floor | " + " | ".join(f"{r['parts']['linears'] / r['floor_ms']:.2f}"
                                                          for r in runs) + " |")
    lines.append("| the rest over the floor | " + " | ".join(
        f"{(r['parts']['total (profiled)'] - r['parts']['linears']) / r['floor_ms']:.2f}" for r in runs) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", nargs=2, metavar=("BACKEND", "THREADS"))
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    ap.add_argument("--threads", nargs="+", type=int, default=[1])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.worker:
        print("RESULT " + json.dumps(worker(a.worker[0], int(a.worker[1]), a.rounds)))
        return 0
    runs = []
    for threads in a.threads:
        for backend in a.backends:
            out = subprocess.run([sys.executable, __file__, "--worker", backend, str(threads), "--rounds",
                                  str(a.rounds)], capture_output=True, text=True, check=True).stdout
            runs.append(json.loads(out.split("RESULT ", 1)[1]))
            print(backend, threads, f"{runs[-1]['ms']:.1f} ms/token", file=sys.stderr)
    command = "python benchmarks/linear/profile_decode.py " + " ".join(sys.argv[1:] if argv is None else argv)
    page = _md(runs, command)
    print(page)
    if a.out:
        with open(a.out, "w") as f:
            f.write(page)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": command, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
