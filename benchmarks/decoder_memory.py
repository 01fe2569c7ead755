"""RSS growth of the bench's LLaMA-like decoder (d 256, 4 layers, 8 heads /
2 KV heads, FF 1376) compiled with ``--backend``, called at 1, 8, 8, 5, 8, 8,
3 tokens (Dynamo recompiles with the length symbolic) and then at 1, 5 and 8
tokens under no_grad, one backend per process; prints the process's RSS
growth from before compiling, the weights' bytes and, for wformat, the bytes
of packed copies alive and the rows' ``packed_bytes``.

    python benchmarks/decoder_memory.py --backend wformat [--max-bytes none|weights|N]
    python benchmarks/decoder_memory.py --backend inductor
"""
from __future__ import annotations

import argparse
import gc
import json

import torch


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("wformat", "inductor"), required=True)
    ap.add_argument("--max-bytes", default="weights", help="wformat's pack.max_bytes: weights, none or a number; off: packing off")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import wfpass
    from wfpass.pack import kernel as pk
    from wfpass.tools.bench_models import Decoder

    torch.manual_seed(0)
    model = Decoder().eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if args.backend == "wformat":
        mb = None if args.max_bytes in ("none", "off") else ("weights" if args.max_bytes == "weights" else int(args.max_bytes))
        pack = {"mode": "off"} if args.max_bytes == "off" else {"max_bytes": mb}
        fn = torch.compile(model, backend=wfpass.backend(pack=pack))
    else:
        fn = torch.compile(model)
    gc.collect()
    before = rss_mb()
    with torch.no_grad():
        for n in (1, 8, 8, 5, 8, 8, 3) + (1, 5, 8) * 5:
            fn(torch.randn(1, n, 256))
    gc.collect()
    out = {"backend": args.backend, "max_bytes": args.max_bytes, "rss_growth_mb": round(rss_mb() - before, 1),
           "weights_mb": round(weights / 2**20, 1)}
    if args.backend == "wformat":
        rows = wfpass.report(model).find("pack", "rewritten")
        out["packed_alive_mb"] = round(pk.packed_bytes_alive() / 2**20, 1)
        out["rows_packed_bytes_mb"] = round(sum(r.stats.get("packed_bytes", 0) for r in rows) / 2**20, 1)
        out["over_bound_calls"] = sum(r.stats.get("over_bound_calls", 0) for r in rows)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
