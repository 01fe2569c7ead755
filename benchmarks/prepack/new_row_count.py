"""What a row count new to a compiled graph costs its first calls: the
bench's LLaMA-like decoder compiled with ``backend="wformat"``, called at
1 token (a static graph), 8 (Dynamo recompiles with the length symbolic),
then three times at each of a few new lengths; prints each call's
milliseconds. A new length is decided (the candidates timed unless the
decision file holds them, the library's kernels compiled) on its second
call; its first runs the plain GEMM.

    python benchmarks/prepack/new_row_count.py [--cold] [--threads N]

``--cold`` gives the process an empty decision file of its own (as on a
machine that never ran wfpass), so every decision is timed.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cold", action="store_true", help="an empty decision file of its own")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lengths", default="5,12,17,30")
    args = ap.parse_args()
    if args.cold:
        os.environ["WFPASS_CACHE_DIR"] = tempfile.mkdtemp(prefix="wfpass-choices-")
    import torch

    torch.set_num_threads(args.threads)
    from wfpass.tools.bench_models import Decoder

    torch.manual_seed(0)
    model = Decoder().eval()
    fn = torch.compile(model, backend="wformat")
    out = []
    with torch.no_grad():
        for n in [1, 8] + [n for n in map(int, args.lengths.split(",")) for _ in range(3)]:
            x = torch.randn(1, n, 256)
            t0 = time.perf_counter()
            fn(x)
            out.append((n, round((time.perf_counter() - t0) * 1e3, 1)))
    print(json.dumps({"cold": args.cold, "threads": args.threads, "torch": torch.__version__,
                      "calls_ms": out}))


if __name__ == "__main__":
    main()
