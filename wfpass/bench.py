"""``python -m wfpass bench``: the headline comparisons in one run.

Three models, each step timed four ways, interleaved:

- a LLaMA-like decoder (RMSNorm, grouped-query attention, SwiGLU MLP),
  forward without grad, at a decode size (1 token) and a prefill size;
- an RNN language model (Embedding -> 2-layer LSTM -> Linear), a training
  step and inference;
- a bf16 CNN with BatchNorm (conv-BN-ReLU blocks), a training step and an
  eval forward, plus the BatchNorm running statistics after a number of
  training steps, against an fp32 copy.

The four ways: eager PyTorch, ``torch.compile`` default (Inductor), the
hand-fused reference compiled with Inductor (the decoder written with one
Q/K/V and one gate/up linear; the CNN with its BatchNorms moved to fp32 by
hand; the LSTM has none: eager already runs PyTorch's fused kernel), and
``backend="wformat"``. Each output is first checked against eager.

Timing: a round times every variant once (a sample: enough calls to last
``min_s``, per-call time), in an order that rotates from round to round, so
machine noise reaches all of them alike. The table gives the median over
rounds and the spread (half the interquartile range over rounds, in % of
the median).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import statistics
import time
import types
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from .bench_models import BnCNN, CellLoop, Decoder, RnnLM, _bn_fp32_by_hand, hand_fused_decoder
from .bench_report import VARIANTS, markdown, plot
from .bench_timing import Progress, Timing, interleaved

__all__ = ["Progress", "interleaved", "Timing", "Decoder", "hand_fused_decoder", "RnnLM", "BnCNN", "main", "run"]


# -- the cases -------------------------------------------------------------------------


@dataclasses.dataclass
class Sizes:
    decoder: dict
    decode_tokens: int
    prefill_tokens: int
    rnn: dict
    rnn_batch: int
    rnn_steps: int
    cnn: dict
    cnn_input: tuple
    bn_steps: int
    rounds: int
    min_s: float
    cells: dict = dataclasses.field(default_factory=lambda: dict(inp=64, hidden=128))
    cell_steps: int = 32
    cell_batch: int = 4
    train_tokens: int = 8


QUICK = Sizes(decoder=dict(d=64, layers=2, heads=4, kv_heads=2, ffn=172), decode_tokens=1, prefill_tokens=32,
              rnn=dict(vocab=100, hidden=32, layers=2), rnn_batch=4, rnn_steps=16,
              cnn=dict(width=8, blocks=1), cnn_input=(4, 3, 16, 16), bn_steps=20, rounds=3, min_s=0.01,
              cells=dict(inp=16, hidden=32), cell_steps=8, cell_batch=2, train_tokens=8)
FULL = Sizes(decoder=dict(d=256, layers=4, heads=8, kv_heads=2, ffn=1376), decode_tokens=1, prefill_tokens=256,
             rnn=dict(vocab=500, hidden=128, layers=2), rnn_batch=8, rnn_steps=64,
             cnn=dict(width=32, blocks=3), cnn_input=(8, 3, 32, 32), bn_steps=100, rounds=7, min_s=0.05)

PARTS = ("decoder", "rnn", "cnn", "cells")


@dataclasses.dataclass
class Case:
    model: str
    step: str
    size: str
    # -> (models by variant, steps by variant, an optional extra measurement
    # run after the first calls)
    build: Callable[[], tuple]
    tol: float  # max |out - eager| relative to max |eager|
    note: str = ""


@dataclasses.dataclass
class Result:
    case: Case
    times: Dict[str, Timing]
    first_call_s: Dict[str, float]
    errors: Dict[str, float]
    ok: bool
    rewrites: str = ""  # what wfpass.report says the wformat model got


def _own_code(model: nn.Module) -> nn.Module:
    """Give ``model`` a ``forward`` with a code object of its own (a subclass
    with a copy of the function). Dynamo keeps its state per code object:
    cached graphs, and a mark that makes every later call of a frame it
    failed to compile run eagerly, for every backend. Without this, the
    first variant compiled decides for the others: ``torch.compile``'s
    default gives up on a model with an LSTM, and from then on the wformat
    copy of the same class would run eagerly too. Each variant is measured
    as if it ran in a process of its own."""
    cls = type(model)
    fwd = cls.forward
    own = types.FunctionType(fwd.__code__.replace(), fwd.__globals__, fwd.__name__, fwd.__defaults__, fwd.__closure__)
    model.__class__ = type(cls.__name__, (cls,), {"forward": own, "__module__": cls.__module__,
                                                   "__qualname__": cls.__qualname__})
    return model


def _compile(model: nn.Module, backend: str, dynamic: Optional[bool] = False) -> nn.Module:
    # dynamic=False (unless asked): every size gets its own static graph, as
    # in a serving loop that pads to fixed sizes; no size is compiled twice.
    return torch.compile(_own_code(model), backend=backend, dynamic=dynamic)


def _step(model: nn.Module, x: torch.Tensor, train: bool, sgd: bool = False) -> Callable[[], torch.Tensor]:
    """One timed call: a training step (forward, ``sum().backward()`` in
    fp32; with ``sgd``, an SGD step and ``zero_grad`` too, as a training
    loop runs) or a forward without grad; returns the output, detached."""
    if train:
        opt = torch.optim.SGD(model.parameters(), lr=1e-6) if sgd else None

        def run():
            out = model(x)
            out.float().sum().backward()
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            return out.detach()
    else:
        def run():
            with torch.no_grad():
                return model(x)
    return run


def _decoder_case(s: Sizes, tokens: int, label: str) -> Case:
    def build():
        torch.manual_seed(0)
        base = Decoder(**s.decoder).eval()
        x = torch.randn(1, tokens, s.decoder["d"])
        models = {"eager": base, "inductor": _compile(copy.deepcopy(base), "inductor"),
                  "hand-fused": _compile(hand_fused_decoder(base), "inductor"),
                  "wformat": _compile(copy.deepcopy(base), "wformat")}

        return models, {k: _step(m, x, train=False) for k, m in models.items()}, None

    d = s.decoder
    return Case("LLaMA-like decoder", "forward", f"{label}: {tokens} token{'s' if tokens > 1 else ''}", build, 1e-4,
                f"{d['layers']} layers, d_model {d['d']}, {d['heads']} heads / {d['kv_heads']} KV heads, SwiGLU {d['ffn']}, batch 1")


def _decoder_dynamic_case(s: Sizes, tokens: int) -> Case:
    """The decoder after Dynamo's dynamic recompile: every compiled variant
    first runs two other lengths (the first compiles statically, the second
    makes Dynamo recompile with the length symbolic), then is timed at
    ``tokens`` on that symbolic graph, as a serving loop with varying
    prompt lengths runs."""
    def build():
        torch.manual_seed(0)
        base = Decoder(**s.decoder).eval()
        d = s.decoder["d"]
        models = {"eager": base, "inductor": _compile(copy.deepcopy(base), "inductor", dynamic=None),
                  "hand-fused": _compile(hand_fused_decoder(base), "inductor", dynamic=None),
                  "wformat": _compile(copy.deepcopy(base), "wformat", dynamic=None)}
        with torch.no_grad():
            for n in (tokens + 2, tokens + 5):
                for k, m in models.items():
                    if k != "eager":
                        m(torch.randn(1, n, d))
        x = torch.randn(1, tokens, d)
        return models, {k: _step(m, x, train=False) for k, m in models.items()}, None

    return Case("LLaMA-like decoder", "forward after a dynamic recompile", f"{tokens} tokens", build, 1e-4)


def _decoder_train_case(s: Sizes) -> Case:
    """A training step of the decoder (forward, backward, SGD step)."""
    def build():
        torch.manual_seed(0)
        base = Decoder(**s.decoder).train()
        x = torch.randn(1, s.train_tokens, s.decoder["d"])
        models = {"eager": base, "inductor": _compile(copy.deepcopy(base), "inductor"),
                  "hand-fused": _compile(hand_fused_decoder(base).train(), "inductor"),
                  "wformat": _compile(copy.deepcopy(base), "wformat")}
        return models, {k: _step(m, x, True, sgd=True) for k, m in models.items()}, None

    return Case("LLaMA-like decoder", "training step (SGD)", f"{s.train_tokens} tokens", build, 1e-4)


def _cell_case(s: Sizes, cell: str, train: bool) -> Case:
    """A Python loop of ``nn.LSTMCell`` / ``nn.GRUCell`` steps; the
    hand-fused reference is the same weights in one eager ``nn.LSTM`` /
    ``nn.GRU`` (what a user would rewrite the loop as)."""
    def build():
        torch.manual_seed(0)
        c = s.cells
        base = CellLoop(c["inp"], c["hidden"], cell=cell)
        x = torch.randn(s.cell_steps, s.cell_batch, c["inp"])
        models = {"eager": base, "inductor": _compile(copy.deepcopy(base), "inductor"),
                  "hand-fused": base.as_rnn(), "wformat": _compile(copy.deepcopy(base), "wformat")}
        return models, {k: _step(m, x, train) for k, m in models.items()}, None

    c = s.cells
    return Case(f"{cell} loop", "training step" if train else "inference", f"T={s.cell_steps}, batch {s.cell_batch}",
                build, 1e-4, f"nn.{cell}({c['inp']}, {c['hidden']}) stepped in a Python loop, outputs stacked; "
                f"hand-fused: the same weights in one eager nn.{cell[:-4]}")


def _rnn_case(s: Sizes, train: bool) -> Case:
    def build():
        torch.manual_seed(0)
        base = RnnLM(**s.rnn)
        tok = torch.randint(0, s.rnn["vocab"], (s.rnn_steps, s.rnn_batch))
        models = {"eager": base, "inductor": _compile(copy.deepcopy(base), "inductor"),
                  "wformat": _compile(copy.deepcopy(base), "wformat")}

        return models, {k: _step(m, tok, train) for k, m in models.items()}, None

    r = s.rnn
    return Case("RNN language model", "training step" if train else "inference", f"T={s.rnn_steps}, batch {s.rnn_batch}",
                build, 1e-4, f"Embedding {r['vocab']} -> {r['layers']}-layer LSTM {r['hidden']} -> Linear {r['vocab']}")


def _cnn_case(s: Sizes, train: bool, stats: Dict[str, float]) -> Case:
    def build():
        torch.manual_seed(0)
        base = BnCNN(**s.cnn).to(torch.bfloat16)
        ref32 = BnCNN(**s.cnn)
        ref32.load_state_dict({k: v.float() for k, v in base.state_dict().items()})
        x = torch.randn(*s.cnn_input, dtype=torch.bfloat16)
        models = {"eager": base, "inductor": _compile(copy.deepcopy(base), "inductor"),
                  "hand-fused": _compile(_bn_fp32_by_hand(copy.deepcopy(base)), "inductor"),
                  "wformat": _compile(copy.deepcopy(base), "wformat")}

        def bn_statistics() -> None:
            # Running statistics on a stream whose channel means and spread
            # drift (weights fixed, so only the statistics differ), against
            # an fp32 copy given the same bf16 inputs. Runs the compiled
            # training graphs, after their first call.
            ref32(x.float())  # the step every variant took on its first call
            g = torch.Generator().manual_seed(1)
            batches = [(torch.randn(*s.cnn_input, generator=g) * (1.0 + 0.01 * i) + 2.0 + 0.02 * i).to(torch.bfloat16)
                       for i in range(s.bn_steps)]
            for m in list(models.values()) + [ref32]:
                for xb in batches:
                    m(xb if m is not ref32 else xb.float())
            ref_bns = [m for m in ref32.modules() if isinstance(m, nn.BatchNorm2d)]
            stats.clear()
            for k, m in models.items():
                mod = getattr(m, "_orig_mod", m)
                bns = [b for b in mod.modules() if isinstance(b, nn.BatchNorm2d)]
                stats[k] = statistics.median(
                    ((b.running_var.float() - r.running_var).norm() / r.running_var.norm()).item() for b, r in zip(bns, ref_bns))
                stats[k + " dtype"] = str(bns[0].running_var.dtype).replace("torch.", "")

        for m in models.values():
            m.train(train)

        return models, {k: _step(m, x, train) for k, m in models.items()}, (bn_statistics if train else None)

    c = s.cnn
    n_bn = 1 + 2 * c["blocks"]
    return Case("bf16 CNN with BatchNorm", "training step" if train else "eval forward",
                "x".join(map(str, s.cnn_input)), build, 5e-2,
                f"{n_bn} conv-BatchNorm pairs, width {c['width']}, bf16")


def run(sizes: Sizes, parts: Sequence[str] = PARTS, progress: Optional[Progress] = None) -> tuple:
    """Run the cases of ``parts``; returns (results, BatchNorm statistics)."""
    stats: Dict[str, float] = {}
    cases: List[Case] = []
    if "decoder" in parts:
        cases += [_decoder_case(sizes, sizes.decode_tokens, "decode"), _decoder_case(sizes, sizes.prefill_tokens, "prefill"),
                  _decoder_dynamic_case(sizes, 8), _decoder_train_case(sizes)]
    if "rnn" in parts:
        cases += [_rnn_case(sizes, True), _rnn_case(sizes, False)]
    if "cnn" in parts:
        cases += [_cnn_case(sizes, True, stats), _cnn_case(sizes, False, stats)]
    if "cells" in parts:
        cases += [_cell_case(sizes, cell, train) for cell in ("LSTMCell", "GRUCell") for train in (True, False)]
    if progress is None:
        progress = Progress(0, enabled=False)
    # Per case: one unit for building, one per variant's first call, one per round.
    progress.total = sum(2 + len(VARIANTS) + sizes.rounds for _ in cases) + ("cnn" in parts)
    results = []
    for case in cases:
        torch.compiler.reset()  # each case starts from nothing compiled
        name = f"{case.model}, {case.step}, {case.size}"
        with progress.working(f"{name}: building"):
            models, steps, extra = case.build()
        first, errors, ok = {}, {}, True
        ref = None
        for k, fn in steps.items():
            what = "running eager" if k == "eager" else f"compiling {k}"
            with progress.working(f"{name}: {what}"):
                t0 = time.perf_counter()
                out = fn()
                first[k] = time.perf_counter() - t0
            out = out.float()
            if ref is None:
                ref = out
            err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
            errors[k] = err
            ok &= math.isfinite(err) and err <= case.tol
        progress.advance(len(VARIANTS) - len(steps))
        if extra is not None:
            with progress.working(f"{name}: BatchNorm statistics, {sizes.bn_steps} steps"):
                extra()
        progress.say(f"{name}: timing, {sizes.rounds} interleaved rounds")
        times = interleaved(steps, sizes.rounds, sizes.min_s, progress)
        results.append(Result(case, times, first, errors, ok, _rewrites(models["wformat"])))
        progress.advance()
        del steps, models
    torch.compiler.reset()
    progress.close()
    return results, stats


def _rewrites(model: nn.Module) -> str:
    """``"8 linear"``: the rewritten records of the model's report, by
    pattern, that served at least one call (so the timing ran them)."""
    import wfpass

    counts: Dict[str, int] = {}
    for r in wfpass.report(model).rewritten:
        if any(v for k, v in r.stats.items() if k.endswith("_calls")) or r.pattern == "batchnorm":
            counts[r.pattern] = counts.get(r.pattern, 0) + 1
    return ", ".join(f"{n} {p}" for p, n in counts.items()) or "none"


def main(quick: bool = False, out: str = "wfpass-bench", rounds: Optional[int] = None, parts: Sequence[str] = PARTS,
         threads: Optional[int] = None, plot_file: bool = True, command: str = "python -m wfpass bench") -> int:
    import wfpass

    wfpass._load_api()  # registers the backend's passes
    from ._torch.aot import disable_compile_caches

    # First calls are cold compiles, not reads of an earlier run's cache.
    disable_compile_caches()
    sizes = dataclasses.replace(QUICK if quick else FULL)
    if rounds is not None:
        sizes.rounds = rounds
    if threads is None and quick:
        # Tiny sizes gain nothing from threads, and on a busy machine a
        # second thread waiting for a descheduled first one costs more than
        # the whole call.
        threads = 1
    if threads is not None:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    progress = Progress(0)
    results, stats = run(sizes, parts, progress)
    text = markdown(results, stats, sizes, command, time.perf_counter() - t0)
    print(text)
    os.makedirs(out, exist_ok=True)
    table_path = os.path.join(out, "bench.md")
    with open(table_path, "w") as f:
        f.write(text)
    print(f"table written to {table_path}")
    # The same figures for programs (benchmarks/bench_versions.py compares
    # torch releases from them): medians in ms, ratios, checks.
    rows = [{"model": r.case.model, "step": r.case.step, "size": r.case.size, "ok": r.ok,
             "median_ms": {k: t.median * 1e3 for k, t in r.times.items()},
             "x_faster_than_inductor": r.times["inductor"].median / r.times["wformat"].median,
             "x_faster_than_eager": r.times["eager"].median / r.times["wformat"].median,
             "first_call_s": r.first_call_s, "rewrites": r.rewrites} for r in results]
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "command": command,
                   "rows": rows}, f, indent=1)
    if plot_file:
        png = os.path.join(out, "bench.png")
        msg = plot(results, png)
        print(msg if msg else f"plot written to {png}")
    return 0 if all(r.ok for r in results) else 1
