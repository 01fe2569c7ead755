"""``python -m wfpass demo``: a short tour of what ``backend="wformat"`` does
to a small LLaMA-like decoder.

1. compile it and check it against eager PyTorch, forward and backward;
2. print the report: what was rewritten, what was skipped, which path ran;
3. show the parameters: the same objects, now views of fused blocks, no
   extra bytes;
4. time eager, Inductor and wformat, interleaved, at a decode and a prefill
   size.
"""
from __future__ import annotations

import copy
from typing import Dict, List

import torch

__all__ = ["demo"]


def _param_storage(model: torch.nn.Module) -> Dict[int, int]:
    """Bytes of every distinct storage that holds a parameter, by address."""
    out: Dict[int, int] = {}
    for p in model.parameters():
        s = p.untyped_storage()
        out[s.data_ptr()] = s.nbytes()
    return out


def demo(layers: int = 2, rounds: int = 5, threads=None) -> int:
    import wfpass
    from tabulate import tabulate

    from .bench import Decoder, Progress, interleaved

    wfpass._load_api()
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = Decoder(d=256, layers=layers, heads=8, kv_heads=2, ffn=688)
    eager = copy.deepcopy(model)
    print(f"wfpass {wfpass.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"model: LLaMA-like decoder, {layers} layers, d_model 256, 8 heads / 2 KV heads, SwiGLU 688, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters\n")

    params_before: List[torch.nn.Parameter] = list(model.parameters())
    storage_before = _param_storage(model)
    compiled = torch.compile(model, backend="wformat")
    progress = Progress(2 + 2 * (2 + rounds))

    print("1. compiled with backend='wformat', checked against eager (a deep copy)")
    ok = True
    decode = torch.randn(1, 1, 256)
    with progress.working("forward, 1 token (compiling)"), torch.no_grad():
        out, ref = compiled(decode), eager(decode)
    err = (out - ref).abs().max().item()
    ok &= err <= 1e-4
    progress.close()
    print(f"   forward, 1 token, no grad:     max |wformat - eager| = {err:.1e}  (tolerance 1e-4)")

    x = torch.randn(2, 8, 256)
    proj = torch.randn(2, 8, 256)  # loss = (out * proj).sum(): every output element matters
    with progress.working("forward + backward, 2 x 8 tokens (compiling)"):
        (compiled(x) * proj).sum().backward()
        (eager(x) * proj).sum().backward()
    progress.close()
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), eager.parameters())]
    scale = max(q.abs().max().item() for _, q in grads)
    gerr = max((p - q).abs().max().item() for p, q in grads) / scale
    ok &= gerr <= 1e-4
    print(f"   forward + backward, 2 x 8:     max |grad difference| / max |grad| = {gerr:.1e}  (tolerance 1e-4)")
    model.zero_grad(set_to_none=True)

    print("\n2. the report: wfpass.report(model)\n")
    print(wfpass.report(model))

    print("\n3. the parameters")
    same = len(params_before) == len(list(model.parameters())) and all(
        a is b for a, b in zip(params_before, model.parameters()))
    ok &= same
    storage_after = _param_storage(model)
    grown = sum(storage_after.values()) - sum(storage_before.values())
    ok &= grown == 0
    print(f"   the same nn.Parameter objects as before compiling: {'yes' if same else 'NO'}")
    print(f"   parameter memory: {sum(storage_before.values()):,} bytes before, {sum(storage_after.values()):,} after "
          f"({grown:+,} bytes)")
    print(f"   storages holding them: {len(storage_before)} before, {len(storage_after)} after "
          "(the fused linears are views of one block each)")
    first = model.layers[0]
    q, k, v = first.q.weight, first.k.weight, first.v.weight
    shared = q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    print(f"   layers.0.q/k/v.weight share one storage: {'yes' if shared else 'no'} "
          f"(offsets {q.storage_offset()}, {k.storage_offset()}, {v.storage_offset()}); "
          f"state_dict keys unchanged: {list(model.state_dict()) == list(eager.state_dict())}")

    print("\n4. forward time without grad, ms per call")
    inductor = torch.compile(copy.deepcopy(eager))
    rows = []
    for label, shape in (("decode, 1 token", (1, 1, 256)), ("prefill, 64 tokens", (1, 64, 256))):
        xx = torch.randn(*shape)
        steps = {"eager": eager, "inductor": inductor, "wformat": compiled}
        runs = {k: (lambda m=m: m(xx)) for k, m in steps.items()}
        with torch.no_grad():
            with progress.working(f"{label}: compiling Inductor and wformat for this size"):
                for fn in runs.values():
                    fn()
            progress.say(f"{label}: {rounds} interleaved rounds")
            t = interleaved(runs, rounds, 0.05, progress)
        progress.advance()
        rows.append([label] + [t[k].cell() for k in steps] + [f"{t['inductor'].median / t['wformat'].median:.2f}x"])
    progress.close()
    print(tabulate(rows, headers=["input", "eager", "Inductor", "wformat", "Inductor / wformat"], tablefmt="github"))
    print(f"\n   median over {rounds} interleaved rounds, ± half the interquartile range. The spread shows the "
          "machine's noise: read a ratio within it as equal.\n   More: python -m wfpass bench --quick")
    print(f"\n{'OK' if ok else 'FAILED'}: {'every check passed' if ok else 'a check above failed'}")
    return 0 if ok else 1
