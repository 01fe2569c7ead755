"""RSS growth of the bench's LLaMA-like decoder (d 256, 4 layers, 8 heads /
2 KV heads, FF 1376) compiled with ``--backend``, called at 1, 8, 8, 5, 8, 8,
3 tokens (Dynamo recompiles with the length symbolic) and then at 1, 5 and 8
tokens under no_grad, one backend per process; prints the process's RSS
growth from before compiling, the weights' bytes and, for wformat, the bytes
of packed copies alive and the rows' ``packed_bytes``; and the seconds those
calls took (``calls_s``: mostly the compiles, shorter where AOTAutograd's
and Inductor's on-disk caches already hold the graphs).

    python benchmarks/prepack/decoder_memory.py --backend wformat [--max-bytes none|weights|N|off] [--warm]
    python benchmarks/prepack/decoder_memory.py --backend inductor [--warm]
    python benchmarks/prepack/decoder_memory.py --backend wformat|inductor --warm --sweep 200 [--repeat 2]

``--sweep N`` calls the decoder at every length from 1 to N instead (a
prefill of varied prompt lengths: after the call at 2 Dynamo recompiles
with the length symbolic), so what a kernel library keeps per row count
shows: oneDNN compiles and keeps a kernel per packed shape and row count.
``--repeat 2`` calls each length twice: wformat decides a row count its
graph was not compiled for on that count's second call (the first runs the
plain GEMM), so one call per length packs nothing new.

The growth is read from before the ``torch.compile`` call: with
``backend="inductor"`` that call already imports Inductor's compiler, which
a callable backend imports at its first compile.

``--warm`` first compiles and calls a small model of three linears with the
same backend, so what a process pays once (imports, wfpass's native library,
the compiler's own first-use costs) is out of the figure: what is left is
what this model's compile adds. The growth is read after ``malloc_trim(0)``
too (glibc keeps freed heap pages otherwise), where glibc has it.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import time

import torch


class Warm(torch.nn.Module):
    """Three linears: what ``--warm`` compiles first."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        return self.a(x) + self.b(x) * self.c(x)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def rss_parts_mb() -> dict[str, float]:
    """RSS split as the kernel counts it: anonymous pages (heap, mmap'd
    buffers) against file-backed ones (shared libraries' code and data
    touched for the first time, Inductor's compiled modules)."""
    parts = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                key, kb = line.split()[:2]
                parts[key[3:-1].lower()] = int(kb) / 1024
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("wformat", "inductor"), required=True)
    ap.add_argument("--max-bytes", default="weights", help="wformat's prepack.max_bytes: weights, none or a number; off: packing off")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warm", action="store_true", help="pay one-time costs on a small model first")
    ap.add_argument("--sweep", type=int, default=0, help="call at every length 1..N instead")
    ap.add_argument("--repeat", type=int, default=1, help="with --sweep: calls per length (wformat decides a new length on its second call)")
    ap.add_argument("--hand-fused", action="store_true", help="the decoder written by hand with fused Q/K/V and gate/up weights")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import wfpass
    from wfpass.prepack import kernel as pk
    from wfpass.tools.bench_models import Decoder, hand_fused_decoder

    torch.manual_seed(0)
    model = Decoder().eval()
    if args.hand_fused:
        model = hand_fused_decoder(model).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if args.backend == "wformat":
        mb = None if args.max_bytes in ("none", "off") else ("weights" if args.max_bytes == "weights" else int(args.max_bytes))
        pack = {"mode": "off"} if args.max_bytes == "off" else {"max_bytes": mb}
        backend = wfpass.backend(prepack=pack)
    else:
        backend = "inductor"
    if args.warm:
        small = Warm().eval()
        with torch.no_grad():
            for n in (1, 2, 3):
                torch.compile(small, backend=backend)(torch.randn(n, 8))
    # Read before torch.compile(...) itself: with backend="inductor" that
    # call imports Inductor's compiler (32 MB of RSS, measured in a fresh
    # process), where a callable backend such as wformat's imports it at the
    # first compile; read after the call, the fresh-process figures charged
    # that import to wformat alone.
    gc.collect()
    before = rss_mb()
    before_parts = rss_parts_mb()
    fn = torch.compile(model, backend=backend)
    t0 = time.perf_counter()
    with torch.no_grad():
        lengths = [n for n in range(1, args.sweep + 1) for _ in range(args.repeat)] if args.sweep else (1, 8, 8, 5, 8, 8, 3) + (1, 5, 8) * 5
        for n in lengths:
            fn(torch.randn(1, n, 256))
    calls_s = time.perf_counter() - t0
    gc.collect()
    grown = rss_mb() - before
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        trimmed = round(rss_mb() - before, 1)
    except (OSError, AttributeError):  # not glibc
        trimmed = None
    parts = {f"rss_{k}_growth_mb": round(v - before_parts.get(k, 0.0), 1) for k, v in rss_parts_mb().items()}
    out = {"backend": args.backend, "max_bytes": args.max_bytes, "warm": args.warm, "sweep": args.sweep, "repeat": args.repeat, "hand_fused": args.hand_fused, "rss_growth_mb": round(grown, 1),
           "rss_growth_after_trim_mb": trimmed, "weights_mb": round(weights / 2**20, 1),
           **parts, "calls_s": round(calls_s, 1)}
    if args.backend == "wformat":
        rows = wfpass.report(model).find("prepack", "rewritten")
        out["packed_alive_mb"] = round(pk.packed_bytes_alive() / 2**20, 1)
        out["rows_packed_bytes_mb"] = round(sum(r.stats.get("packed_bytes", 0) for r in rows) / 2**20, 1)
        out["over_bound_calls"] = sum(r.stats.get("over_bound_calls", 0) for r in rows)
        out["kernel_mb"] = round(sum(r.stats.get("kernel_bytes", 0) for r in rows) / 2**20, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
