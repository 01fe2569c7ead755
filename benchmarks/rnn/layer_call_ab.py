"""One RNN layer on wfpass's C++ loop, one checkout of wfpass against another.

What a change to the loop's C++ kernels (``native/rnn/varlen_rnn.cpp``,
``fast_rnn.cpp``) did to one layer call, per call: each checkout builds its
own C++ library (the build is keyed by its sources), and each round runs
one process per checkout, alternating, so that a busy or a slow moment of a
shared machine reaches both alike. A process times, for each size, the op
as a compiled graph calls it (no autograd around it): inference is
``wfpass::packed_layer_fw`` with ``train=False`` (``packed_bilayer_fw`` for
the bidirectional row), *fw+bw* the forward with its workspace and then
``wfpass::packed_layer_backward`` with a gradient for the output. A time is
the median over a process's samples, then over rounds; x = the first
checkout's time / the second's (above 1: the second is faster).

    git worktree add /tmp/before <commit>
    python benchmarks/rnn/layer_call_ab.py --repos /tmp/before,. --rounds 3 [--threads 1]
    python benchmarks/rnn/layer_call_ab.py --quick          # a smoke run (tests/test_benchmarks.py)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

#: (mode, hidden, input, T, batch, fw+bw): small layers, where the call's
#: own cost shows, and hidden 128, where the weights' transposes did.
SIZES = [
    ("LSTM", 16, 8, 1, 1, False), ("LSTM", 64, 32, 4, 4, False), ("LSTM", 64, 32, 4, 4, True),
    ("LSTM", 128, 128, 16, 1, False), ("LSTM", 128, 128, 16, 8, True),
    ("GRU", 64, 32, 4, 4, False), ("GRU", 64, 32, 16, 1, True), ("GRU", 128, 128, 1, 1, False),
    ("RNN_TANH", 64, 32, 4, 4, False), ("BI-LSTM", 64, 32, 4, 4, False),
]
QUICK = [("LSTM", 16, 8, 1, 1, False), ("LSTM", 16, 8, 2, 2, True)]


def _name(size) -> str:
    mode, H, I, T, B, train = size
    return f"{mode} hidden {H}, input {I}, T {T}, batch {B}, {'fw+bw' if train else 'inference'}"


def worker(repo: str, sizes, sample_s: float) -> Dict[str, float]:
    """us per call of each size, with the wfpass found in ``repo``."""
    sys.path.insert(0, os.path.abspath(repo))
    import torch

    import wfpass
    from wfpass import native

    if not wfpass.__file__.startswith(os.path.abspath(repo)):
        raise SystemExit(f"imported wfpass from {wfpass.__file__}, not from {repo}")
    if not (native.loaded() and native.fast_loop()):
        raise SystemExit(f"the C++ loop does not run here: {native.status()}")
    fw = torch.ops.wfpass.packed_layer_fw.default
    bw = torch.ops.wfpass.packed_layer_backward.default
    bi = torch.ops.wfpass.packed_bilayer_fw.default
    empty = torch.empty(0, dtype=torch.int64)

    def timed(fn, n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e6

    out: Dict[str, float] = {}
    torch.manual_seed(0)
    with torch.no_grad():
        for size in sizes:
            mode, H, I, T, B, train = size
            m = mode.replace("BI-", "")
            G = {"LSTM": 4, "GRU": 3}.get(m, 1)

            def weights():  # views of one flat block, as the fused parameters are
                flat = torch.randn(G * H * I + G * H * H + 2 * G * H) * 0.1
                return [flat[:G * H * I].view(G * H, I), flat[G * H * I:G * H * (I + H)].view(G * H, H),
                        flat[-2 * G * H:-G * H], flat[-G * H:]]

            x = torch.randn(T, B, I)
            if mode.startswith("BI-"):
                w2 = weights() + weights()

                def fn():
                    return bi(x, empty, w2, None, None, m, True, False, False)
            elif train:
                w = weights()

                def fn():
                    o, hn, cn, ws = fw(x, empty, *w, None, None, None, m, False, True)
                    return bw(x, empty, *w, None, None, None, o, hn, cn, ws, o, None, None, m, False)
            else:
                w = weights()

                def fn():
                    return fw(x, empty, *w, None, None, None, m, False, False)

            for _ in range(20):
                fn()
            n = max(20, int(sample_s * 1e6 / max(1.0, timed(fn, 20))))
            out[_name(size)] = statistics.median(timed(fn, n) for _ in range(5))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repos", default=".", help="comma list of checkouts (the first is the baseline)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sample-s", type=float, default=0.02, help="seconds per sample (5 samples a size)")
    ap.add_argument("--quick", action="store_true", help="two sizes, this checkout twice, one round")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="all", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    sizes = QUICK if (a.quick or a.sizes == "quick") else SIZES
    if a.worker:
        import torch

        torch.set_num_threads(a.threads)
        print(json.dumps(worker(a.worker, sizes, a.sample_s)))
        return 0
    repos = [".", "."] if a.quick else a.repos.split(",")
    rounds = 1 if a.quick else a.rounds
    sample_s = 0.002 if a.quick else a.sample_s
    times: Dict[str, Dict[int, List[float]]] = {}
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    for _ in range(rounds):
        for i, repo in enumerate(repos):
            # From a neutral directory, so that ``import wfpass`` finds only the checkout on sys.path.
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", os.path.abspath(repo),
                                  "--threads", str(a.threads), "--sample-s", str(sample_s),
                                  "--sizes", "quick" if sizes is QUICK else "all"],
                                 capture_output=True, text=True, env=env, cwd="/")
            if res.returncode:
                sys.stderr.write(res.stderr)
                return res.returncode
            for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items():
                times.setdefault(k, {}).setdefault(i, []).append(v)
    import torch

    print(f"torch {torch.__version__}, {platform.machine()}, {a.threads} thread(s), {rounds} round(s) of one "
          f"process per checkout, alternating; us per layer call, medians; x = {repos[0]} / each other checkout")
    print()
    print("| layer call | " + " | ".join(repos) + " | " + " | ".join(f"x ({r})" for r in repos[1:]) + " |")
    print("|---|" + "---|" * (2 * len(repos) - 1))
    for k, by in times.items():
        med = [statistics.median(by[i]) for i in range(len(repos))]
        print(f"| {k} | " + " | ".join(f"{m:.1f}" for m in med) + " | "
              + " | ".join(f"{med[0] / m:.2f}" for m in med[1:]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
