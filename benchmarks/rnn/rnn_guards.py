"""What Dynamo's guards cost a compiled RNN call, and which of them are the
RNN's: the LSTM language model of the bench (Embedding 500 -> 2-layer LSTM
128 -> Linear 500, T 16, batch 1, inference) compiled with
``backend="wformat"``, timed per call with guards and with
``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` (interleaved
rounds, medians), one variant per process:

* ``as-is``: the model as users write it;
* ``no-flat-weight-check``: ``nn.LSTM._update_flat_weights`` replaced by a
  no-op before compiling, so Dynamo does not trace eager's check that the
  weights were not swapped (a weak reference per weight, read per call),
  which installs about 20 guards: what those guards cost;
* ``relational-aliasing``: Dynamo's object-aliasing guards (a weight reached
  through ``_parameters`` and through ``_flat_weights``) as C++ relational
  guards instead of one Python lambda
  (``torch._dynamo.config.use_lamba_guard_for_object_aliasing = False``).

Also the guard tree's own check, called directly (``check`` on the cache
entry's guard manager, the frame's locals as a dict), and the number of
guards. The variants other than ``as-is`` are measurements, not settings
wfpass makes.

    python benchmarks/rnn/rnn_guards.py [--rounds 7]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

VARIANTS = ("as-is", "no-flat-weight-check", "relational-aliasing")


def one(variant: str, rounds: int) -> dict:
    import torch
    import torch._dynamo.config as dynamo_config

    torch.set_num_threads(1)
    if variant == "no-flat-weight-check":
        torch.nn.LSTM._update_flat_weights = lambda self: None
    elif variant == "relational-aliasing":
        dynamo_config.use_lamba_guard_for_object_aliasing = False
    from wfpass.tools.bench_models import RnnLM

    torch.manual_seed(0)
    model = RnnLM().eval()
    x = torch.randint(0, 500, (16, 1))
    fn = torch.compile(model, backend="wformat")
    torch.set_grad_enabled(False)
    for _ in range(3):
        fn(x)

    def per_call(f, n=1000):
        t0 = time.perf_counter()
        for _ in range(n):
            f(x)
        return (time.perf_counter() - t0) / n * 1e6

    with_g, without_g = [], []
    for _ in range(rounds):
        with_g.append(per_call(fn))
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            without_g.append(per_call(fn))
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entry = _debug_get_cache_entry_list(type(model).forward.__code__)[0]
    gm = entry.guard_manager
    frame = {"self": model, "tokens": x}
    assert gm.check(frame)
    t0 = time.perf_counter()
    for _ in range(20000):
        gm.check(frame)
    check_us = (time.perf_counter() - t0) / 20000 * 1e6
    return {"variant": variant, "with_guards_us": round(statistics.median(with_g), 1),
            "without_us": round(statistics.median(without_g), 1),
            "guards_us": round(statistics.median(a - b for a, b in zip(with_g, without_g)), 1),
            "check_direct_us": round(check_us, 2), "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.variant:
        print(json.dumps(one(a.variant, a.rounds)))
        return
    print("| variant | per call, guards on (us) | guards skipped (us) | guards (us) | the guard tree's check alone (us) |")
    print("|---|---|---|---|---|")
    for v in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--variant", v, "--rounds", str(a.rounds)],
                             capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"| {v} | {r['with_guards_us']} | {r['without_us']} | {r['guards_us']} | {r['check_direct_us']} |")


if __name__ == "__main__":
    main()
