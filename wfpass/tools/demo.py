"""``python -m wfpass demo``: where ``backend="wformat"`` pays, measured on
this machine in under a minute, each result checked against eager PyTorch.

1. a Python loop of ``nn.LSTMCell`` steps, trained: folded into one LSTM
   call, against the eager loop;
2. BatchNorm statistics in a bf16 model: the running variance against an
   fp32 copy, eager bf16 against wformat;
3. decoding with packed weights: a small LLaMA-like decoder at one token,
   eager, Inductor and wformat;
4. what changed in the model: the report, the same Parameter objects, no
   extra bytes.

Timings run on one thread (the steadiest on a shared machine), the
variants interleaved inside each round; every ratio is "x faster" =
baseline time / wformat time, with the spread of both; where the spread is
as large as the effect the demo says so instead of quoting a ratio.
"""
from __future__ import annotations

import copy
import time
from typing import Dict, List

import torch
import torch.nn as nn

from .. import native

__all__ = ["demo"]


def _param_storage(model: nn.Module) -> Dict[int, int]:
    """Bytes of every distinct storage that holds a parameter, by address."""
    out: Dict[int, int] = {}
    for p in model.parameters():
        s = p.untyped_storage()
        out[s.data_ptr()] = s.nbytes()
    return out


def _ratio(base, wf, baseline: str) -> str:
    """The baseline's time over wformat's, or a sentence where the machine's
    noise (the two spreads) is as large as the difference."""
    r = base.median / wf.median
    noise = base.spread + wf.spread
    if abs(r - 1) <= noise:
        return f"level with {baseline}: the difference ({r:.2f}x) is within this run's noise (±{noise:.0%})"
    return f"{r:.2f}x faster than {baseline}" if r >= 1 else f"{r:.2f}x faster than {baseline}, i.e. slower"


def _grad_error(model: nn.Module, ref: nn.Module) -> float:
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())]
    scale = max(q.abs().max().item() for _, q in grads)
    return max((p - q).abs().max().item() for p, q in grads) / scale


def _cell_loop(rounds: int, progress) -> bool:
    from .bench_models import CellLoop
    from .bench_timing import interleaved

    print("1. A Python loop of nn.LSTMCell(64, 128) steps, T = 64, batch 4, training step")
    torch.manual_seed(0)
    loop = CellLoop()
    eager = copy.deepcopy(loop)
    compiled = torch.compile(loop, backend="wformat")
    x, R = torch.randn(64, 4, 64), torch.randn(64, 4, 128)
    with progress.working("compiling the loop with backend='wformat'"):
        t = time.perf_counter()
        (compiled(x) * R).sum().backward()
        first = time.perf_counter() - t
    progress.close()
    (eager(x) * R).sum().backward()
    err = _grad_error(loop, eager)
    ok = err <= 1e-4
    print(f"   compile + first step {first:.1f} s; checked against eager: max |grad difference| / max |grad| = {err:.1e} "
          "(tolerance 1e-4)")
    built = native.build_seconds()
    if built:
        print(f"   (of which {built:.1f} s built wfpass's C++ kernels: once per machine, then cached)")

    def step(m):
        def go():
            m.zero_grad(set_to_none=True)
            (m(x) * R).sum().backward()
        return go

    with progress.working(f"timing, {rounds} interleaved rounds"):
        t = interleaved({"eager loop": step(eager), "wformat": step(compiled)}, rounds, 0.05)
    progress.close()
    print(f"   eager loop {t['eager loop'].cell()} ms, wformat {t['wformat'].cell()} ms: "
          f"{_ratio(t['eager loop'], t['wformat'], 'the eager loop')}")
    print("   (the 64 steps became one oneDNN LSTM call; Inductor unrolls them instead, and its compile grows with "
          "T: docs/cells.md)\n")
    return ok


def _batchnorm(progress) -> bool:
    from .bench_models import BnCNN

    print("2. BatchNorm statistics in a bf16 CNN (3 conv-BatchNorm pairs): running_var after 40 batches of a "
          "drifting stream,\n   relative error against an fp32 copy given the same inputs")
    torch.manual_seed(0)
    base = BnCNN(width=16, blocks=1).to(torch.bfloat16)
    ref32 = BnCNN(width=16, blocks=1)
    ref32.load_state_dict({k: v.float() for k, v in base.state_dict().items()})
    wf_model = copy.deepcopy(base)
    compiled = torch.compile(wf_model, backend="wformat")
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 3, 16, 16, generator=g) * (1.0 + 0.01 * i) + 2.0 + 0.02 * i) for i in range(40)]
    with progress.working("compiling the CNN and running the batches"), torch.no_grad():
        for xb in batches:
            base(xb.bfloat16())
            compiled(xb.bfloat16())
            ref32(xb)
    progress.close()

    def err(m):
        bns = [b for b in m.modules() if isinstance(b, nn.BatchNorm2d)]
        refs = [b for b in ref32.modules() if isinstance(b, nn.BatchNorm2d)]
        return max(((b.running_var.float() - r.running_var).norm() / r.running_var.norm()).item()
                   for b, r in zip(bns, refs))

    e_eager, e_wf = err(base), err(wf_model)
    dtype = str(next(b for b in wf_model.modules() if isinstance(b, nn.BatchNorm2d)).running_var.dtype)
    print(f"   eager bf16: {e_eager:.1e}   wformat: {e_wf:.1e} ({e_eager / e_wf:.0f}x smaller; its statistics are held "
          f"in {dtype.replace('torch.', '')} and the model still computes in bf16)\n")
    return e_wf < e_eager


def _decode(rounds: int, progress):
    from .bench_models import Decoder
    from .bench_timing import interleaved

    print("3. Decoding one token with packed weights: LLaMA-like decoder in bf16, 2 layers, d_model 512, no grad")
    torch.manual_seed(0)
    model = Decoder(d=512, layers=2, heads=8, kv_heads=2, ffn=1376).to(torch.bfloat16)
    eager = copy.deepcopy(model)
    params_before: List[nn.Parameter] = list(model.parameters())
    storage_before = _param_storage(model)
    compiled = torch.compile(model, backend="wformat")
    inductor = torch.compile(copy.deepcopy(eager))
    x = torch.randn(1, 1, 512, dtype=torch.bfloat16)
    with progress.working("compiling Inductor and wformat"), torch.no_grad():
        out, ref = compiled(x), eager(x)
        inductor(x)
    progress.close()
    # bf16 keeps 8 bits of mantissa: a different summation order moves the
    # last bit, so the check is relative to the output's size.
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    ok = err <= 2e-2
    print(f"   checked against eager: max |wformat - eager| / max |eager| = {err:.1e} (tolerance 2e-2, bf16)")
    runs = {k: (lambda m=m: m(x)) for k, m in (("eager", eager), ("inductor", inductor), ("wformat", compiled))}
    with progress.working(f"timing, {rounds} interleaved rounds"), torch.no_grad():
        t = interleaved(runs, rounds, 0.1)
    progress.close()
    print(f"   ms per token: eager {t['eager'].cell()}, Inductor {t['inductor'].cell()}, wformat {t['wformat'].cell()}")
    print(f"   wformat is {_ratio(t['inductor'], t['wformat'], 'Inductor')}; {_ratio(t['eager'], t['wformat'], 'eager')}")
    print("   (the report below says which linears run from a packed copy and why; HF LLaMA generate(): "
          "docs/pack_results.md)\n")
    return ok, model, eager, params_before, storage_before


def demo(rounds: int = 5, threads: int = 1) -> int:
    import wfpass

    from .bench import Progress

    wfpass.Config  # loads the API (lazy under `python -m wfpass`)
    torch.set_num_threads(threads)
    print(f"wfpass {wfpass.__version__}, torch {torch.__version__}, {torch.get_num_threads()} thread(s). Times: median "
          f"of {rounds} interleaved rounds ± half the interquartile range; x faster = baseline time / wformat time.\n")
    progress = Progress(5)
    ok = _cell_loop(rounds, progress)
    ok &= _batchnorm(progress)
    good, model, eager, params_before, storage_before = _decode(rounds, progress)
    ok &= good

    print("4. What changed in the decoder: wfpass.report(model)\n")
    print(wfpass.report(model))
    same = len(params_before) == len(list(model.parameters())) and all(
        a is b for a, b in zip(params_before, model.parameters()))
    storage_after = _param_storage(model)
    grown = sum(storage_after.values()) - sum(storage_before.values())
    ok &= same and grown == 0
    print(f"\n   the same nn.Parameter objects as before compiling: {'yes' if same else 'NO'}; parameter memory "
          f"{sum(storage_before.values()):,} bytes before, {sum(storage_after.values()):,} after ({grown:+,}); "
          f"state_dict keys unchanged: {list(model.state_dict()) == list(eager.state_dict())}")
    print("   (packed copies live beside the parameters and are counted in the report's packed_bytes)")
    print("\n   More: python -m wfpass bench --quick; docs/index.md")
    print(f"\n{'OK' if ok else 'FAILED'}: {'every check passed' if ok else 'a check above failed'}")
    return 0 if ok else 1
