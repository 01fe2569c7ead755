"""Where a training step's time goes on a GPU: eager PyTorch (cuDNN),
Inductor and wformat with each RNN one cuDNN call (``rnn={"cuda":
"cudnn"}``), for one model of ``bench_gpu.py`` at one point. For each
variant: wall time per step, GPU kernel time per step (the profiler's CUDA
total), kernel launches per step, and the kernels that take the most GPU
time. A step whose wall time is well above its GPU time is bound by the CPU
(launches, Python, AOTAutograd's wrappers), not by the kernels.

    python benchmarks/gpu/profile_cuda_train.py --model "LSTM LM" --T 16 --B 16 --steps 20   # docs/results/gpu_h100.md

``--device cpu`` runs the same code on the CPU (a dry run: the GPU columns
are then CPU time).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import wfpass
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _out.py
from _out import emit  # noqa: E402
from bench_gpu import CUDNN, _call, _inputs, _model, fresh_copy, own_code  # noqa: E402 - the same models and inputs
from wfpass.tools.tables import markdown_table


def _step(fn, x, params):
    opt = torch.optim.SGD(params, lr=1e-4)

    def run():
        _call(fn, x).float().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="LSTM LM")
    ap.add_argument("--T", type=int, default=16)
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    torch.manual_seed(0)
    base = _model(a.model).to(dev).train()
    x = _inputs(a.model, a.T, a.B, dev)
    variants = {"eager": fresh_copy(base)}
    variants["Inductor"] = torch.compile(own_code(fresh_copy(base)))
    m = own_code(fresh_copy(base))
    variants["wformat"] = torch.compile(m, backend=wfpass.backend(rnn=CUDNN))
    activity = torch.profiler.ProfilerActivity.CUDA if dev.type == "cuda" else torch.profiler.ProfilerActivity.CPU
    rows, tops = [], []
    for name, fn in variants.items():
        params = list((fn._orig_mod if hasattr(fn, "_orig_mod") else fn).parameters())
        run = _step(fn, x, params)
        for _ in range(5):
            run()
        _sync(dev)
        t = time.perf_counter()
        for _ in range(a.steps):
            run()
        _sync(dev)
        wall = (time.perf_counter() - t) / a.steps * 1e3
        with torch.profiler.profile(activities=[activity]) as prof:
            for _ in range(a.steps):
                run()
            _sync(dev)
        events = prof.key_averages()
        attr = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        kernels = [e for e in events if getattr(e, attr, 0) > 0 and (dev.type != "cuda" or e.device_type.name == "CUDA")]
        gpu = sum(getattr(e, attr) for e in kernels) / a.steps / 1e3
        launches = sum(e.count for e in kernels) / a.steps
        rows.append([name, f"{wall:.3f}", f"{gpu:.3f}", f"{launches:.0f}"])
        for e in sorted(kernels, key=lambda e: -getattr(e, attr))[:a.top]:
            tops.append([name, e.key[:70], f"{getattr(e, attr) / a.steps / 1e3:.3f}", f"{e.count / a.steps:.0f}"])
    where = torch.cuda.get_device_name(0) if dev.type == "cuda" else "CPU (dry run)"
    lines = [f"Command: `python benchmarks/gpu/profile_cuda_train.py --model \"{a.model}\" --T {a.T} --B {a.B} "
             f"--steps {a.steps}`  ", f"{where}, torch {torch.__version__}; one training step (forward, backward, "
             "SGD) per row, ms per step.", "",
             markdown_table(["variant", "wall", "kernel time", "kernels per step"], rows), "",
             markdown_table(["variant", "kernel", "ms per step", "calls per step"], tops)]
    return emit(lines, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
