"""wformat graphs go through AOTAutograd's and Inductor's on-disk caches as
Inductor's own do: a second process compiling the same model reads the
compiled graphs instead of tracing them again (compile time, and about
12 MB of memory a trace leaves in the process), and still computes what
eager does. The graphs call wfpass's ``fused_linear``, a Python function
whose trace the caches cannot see, so its entries are keyed by a hash of
wfpass's source: a changed wfpass never reads an old entry.

Each case runs in fresh processes sharing one cache folder of its own.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(r"""
    import copy, json, sys
    import torch
    from torch._dynamo.utils import counters
    import wfpass
    import wfpass.compiler as compiler
    from wfpass.tools.bench_models import Decoder

    if sys.argv[1] != "-":  # another wfpass: the key of its functions differs
        key = sys.argv[1]
        compiler._cacheable_functions.cache_clear()
        marked = {name: key for name in compiler._cacheable_functions()}
        compiler._cacheable_functions = lambda: marked
    torch.manual_seed(0)
    model = Decoder(d=64, layers=2, heads=4, kv_heads=2, ffn=96)
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend="wformat")
    err = 0.0
    with torch.no_grad():
        for n in (1, 8, 8, 5, 8, 8, 3):
            x = torch.randn(1, n, 64)
            err = max(err, (fn(x) - ref(x)).abs().max().item())
    # A training step: the backward graph comes from the cache too.
    x = torch.randn(1, 6, 64)
    R = torch.randn(1, 6, 64)
    (fn(x) * R).sum().backward()
    (ref(x) * R).sum().backward()
    gmax = max(p.grad.abs().max().item() for p in ref.parameters())
    gerr = max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())) / gmax
    rows = wfpass.report(model).find("linear", "rewritten")
    print(json.dumps({"counters": dict(counters["aot_autograd"]), "err": err, "grad_err": gerr,
                      "fused_rows": len(rows)}))
""")


def _run(cache_dir: str, key: str = "-") -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", CHILD, key], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check_values(r: dict) -> None:
    assert r["fused_rows"] == 4, r  # Q/K/V and gate/up in both layers: the fused graphs are the ones cached
    assert r["err"] < 1e-4, r
    assert r["grad_err"] < 1e-4, r


def test_a_second_process_reads_the_compiled_graphs_from_the_cache_and_another_wfpass_does_not(tmp_path):
    # One cache folder, three processes: the first fills it, the second (the
    # same wfpass) reads every graph from it, the third (another wfpass
    # source, so another key) reads none of them.
    first = _run(str(tmp_path))
    _check_values(first)
    c = first["counters"]
    # Nothing in the graphs makes AOTAutograd's cache refuse them.
    assert c.get("autograd_cache_bypass", 0) == 0, c
    assert c.get("autograd_cache_saved", 0) >= 3, c  # static, symbolic, training graphs
    second = _run(str(tmp_path))
    _check_values(second)
    c = second["counters"]
    assert c.get("autograd_cache_bypass", 0) == 0 and c.get("autograd_cache_miss", 0) == 0, c
    assert c.get("autograd_cache_hit", 0) >= 3, c
    other = _run(str(tmp_path), key="wfpass-another-source")
    _check_values(other)
    c = other["counters"]
    assert c.get("autograd_cache_hit", 0) == 0, c
    assert c.get("autograd_cache_miss", 0) >= 3, c
