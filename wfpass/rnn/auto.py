"""``seq_threshold="auto"``: the unfused and fused paths timed once per
shape, with the model's weights on random input, at the lengths
``RnnOptions.auto_lengths``; the largest length at which the unfused path
was not slower is the shape's N, cached by shape."""
from __future__ import annotations

import statistics
import time
from typing import Dict, Optional

import torch

from .paths import fused_path, unfused_path
from .plan import paths_differ
from .spec import RnnSpec

__all__ = ["auto_threshold_cache", "measure_threshold"]

_AUTO: Dict[tuple, int] = {}


def auto_threshold_cache() -> Dict[tuple, int]:
    """The thresholds ``seq_threshold="auto"`` measured, by shape key."""
    return _AUTO


def _auto_key(spec: RnnSpec, x: torch.Tensor, need_grad: bool, train: bool, p: float) -> tuple:
    """What a measured N depends on: the shape, the mode, grad and dropout, the options."""
    batch = x.shape[0] if spec.batch_first else x.shape[1]
    return (x.device.type, x.dtype, int(batch), spec.hidden_size, spec.num_layers, spec.mode, spec.input_size,
            spec.proj_size, spec.bidirectional, need_grad, bool(train and p > 0), spec.options)


def _median_time(fn, reps: int = 3, device: Optional[torch.device] = None) -> float:
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    fn()  # warm-up: oneDNN / cuDNN build their plan for the shape on the first call
    ts = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _measure_threshold(spec: RnnSpec, x, hx, ws, has_b: bool, train: bool, p: float, need_grad: bool) -> int:
    """Largest length at which the unfused path was at least as fast as the
    fused kernel, measured on random data with this call's weights."""
    batch = x.shape[0] if spec.batch_first else x.shape[1]
    n, fused_wins = 0, 0
    with torch.random.fork_rng(devices=[]):  # leave the caller's dropout stream alone
        for T in spec.options.auto_lengths:
            shape = (batch, T, spec.input_size) if spec.batch_first else (T, batch, spec.input_size)
            xt = torch.randn(shape, dtype=x.dtype, device=x.device)
            if need_grad:
                wt = [w.detach().requires_grad_() for w in ws]

                def run(path):
                    out = path(spec, xt, hx, wt, has_b, train, p)[0]
                    torch.autograd.grad(out, [w for w in wt if w.requires_grad], torch.ones_like(out))
            else:
                wt = list(ws)

                def run(path):
                    with torch.no_grad():
                        path(spec, xt, hx, wt, has_b, train, p)

            t_unfused = _median_time(lambda: run(unfused_path), device=x.device)
            t_fused = _median_time(lambda: run(fused_path), device=x.device)
            if t_unfused <= t_fused:
                n, fused_wins = T, 0
            else:
                fused_wins += 1
                if fused_wins == 2:
                    break
    return n


def measure_threshold(spec: RnnSpec, record, x, hx, ws, has_b: bool, train: bool, p: float, need_grad: bool) -> int:
    """``seq_threshold="auto"``: the measured N for this shape, cached by shape."""
    if spec.threshold != "auto":
        return spec.threshold
    if not paths_differ(spec, x):
        return 0  # one kernel either way: nothing to measure
    key = _auto_key(spec, x, need_grad, train, p)
    n = _AUTO.get(key)
    if n is None:
        with torch.enable_grad() if need_grad else torch.no_grad():
            n = _AUTO[key] = _measure_threshold(spec, x, hx, ws, has_b, train, p, need_grad)
        if record is not None:
            record.detail.setdefault("auto_thresholds", {})[f"batch={key[2]} {key[1]} grad={need_grad}"] = n
            record.bump("auto_measurements")
    return n
