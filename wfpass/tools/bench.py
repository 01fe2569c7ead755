"""``python -m wfpass bench``: the headline comparisons in one run.

The rows (``bench_cases.py``): a LLaMA-like decoder (RMSNorm, grouped-query
attention, SwiGLU MLP) at a decode and a prefill size, compiled per layer
(regional compilation), after a dynamic recompile and in a training step;
HF ``generate()`` with the same shape; an RNN language model and a conv +
LSTM speech encoder, training step and inference; a bf16 CNN with
BatchNorm (training step, eval forward, and the running statistics against
an fp32 copy); Python loops of ``nn.LSTMCell`` / ``nn.GRUCell``.

Each row runs up to four ways: eager PyTorch, ``torch.compile`` default
(Inductor), the hand-fused reference compiled with Inductor (the decoder
written with one Q/K/V and one gate/up linear; the CNN with its BatchNorms
moved to fp32 by hand; a cell loop as one eager ``nn.LSTM``/``nn.GRU``),
and ``backend="wformat"``; each in a process of its own, built from the
same seed, its output checked against eager's.

Timing: a round takes one sample of every variant (enough calls to last
``min_s``, per-call time), one process working at a time, in an order that
rotates from round to round, so machine noise reaches all of them alike.
The table gives the median over rounds and the spread (half the
interquartile range over rounds, in % of the median).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import traceback
import types
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from .bench_cases import FULL, PARTS, QUICK, Case, Sizes, cases
from .bench_models import BnCNN, Decoder, RnnLM, hand_fused_decoder
from .bench_report import VARIANTS, markdown, plot
from .bench_timing import Progress, Timing, calls_per_sample, interleaved, interleaved_samples

__all__ = ["Progress", "interleaved", "Timing", "Case", "Sizes", "own_code", "Decoder", "hand_fused_decoder", "RnnLM", "BnCNN",
           "main", "run"]


@dataclasses.dataclass
class Result:
    case: Case
    times: Dict[str, Timing]
    first_call_s: Dict[str, float]
    errors: Dict[str, float]
    ok: bool
    rewrites: str = ""  # what wfpass.report says the wformat model got


def own_code(model: nn.Module) -> nn.Module:
    """Give ``model`` a ``forward`` with a code object of its own (a subclass
    with a copy of the function), for benchmarks that compare variants in
    one process. Dynamo keeps its state per code object: cached graphs, and
    a mark that makes every later call of a frame it failed to compile run
    eagerly, for every backend. Without this, the first variant compiled
    decides for the others. (``bench`` itself runs each variant in a
    process of its own.)"""
    cls = type(model)
    fwd = cls.forward
    own = types.FunctionType(fwd.__code__.replace(), fwd.__globals__, fwd.__name__, fwd.__defaults__, fwd.__closure__)
    model.__class__ = type(cls.__name__, (cls,), {"forward": own, "__module__": cls.__module__,
                                                   "__qualname__": cls.__qualname__})
    return model


# -- one variant, one process ----------------------------------------------------------


def _worker(conn, sizes: Sizes, parts: tuple, index: int, variant: str, threads: int) -> None:
    """Build one variant of case ``index`` and answer the coordinator:
    ``first`` (the first call, timed, and its output), ``extra``, ``sample``
    (per-call seconds over enough calls to last ``sizes.min_s``),
    ``rewrites``, ``quit``. A fresh process: Dynamo's caches, Inductor's
    compiled kernels and the allocator's state are this variant's own."""
    try:
        torch.set_num_threads(threads)
        import wfpass

        wfpass.Config  # loads the API (lazy under `python -m wfpass`), which registers the formats
        from .._torch.aot import disable_compile_caches, stop_compile_workers

        disable_compile_caches()  # first calls are cold compiles
        model, step, extra = cases(sizes, parts)[index].build(variant)
        conn.send(("ready", None))
        calls = 0
        while True:
            cmd = conn.recv()
            if cmd == "first":
                t0 = time.perf_counter()
                out = step()
                took = time.perf_counter() - t0
                stop_compile_workers()  # no idle compile pool beside the timed calls
                conn.send(("ok", (took, out.detach().float().numpy())))
            elif cmd == "extra":
                conn.send(("ok", extra() if extra is not None else {}))
            elif cmd == "sample":
                if not calls:
                    calls = calls_per_sample(step, sizes.min_s)
                t0 = time.perf_counter()
                for _ in range(calls):
                    step()
                conn.send(("ok", (time.perf_counter() - t0) / calls))
            elif cmd == "rewrites":
                conn.send(("ok", _rewrites(model) if variant == "wformat" else ""))
            else:
                break
    except Exception:  # the coordinator raises it, with this traceback
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class _Variant:
    """The coordinator's handle on one worker process."""

    def __init__(self, ctx, sizes: Sizes, parts: tuple, index: int, variant: str, threads: int) -> None:
        self.name = variant
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, sizes, parts, index, variant, threads), daemon=True)
        self.proc.start()
        child.close()

    def answer(self):
        try:
            kind, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"bench: the {self.name} process died (exit code {self.proc.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"bench: the {self.name} variant failed:\n{value}")
        return value

    def ask(self, cmd: str):
        self.conn.send(cmd)
        return self.answer()

    def close(self) -> None:
        try:
            self.conn.send("quit")
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.kill()


def run(sizes: Sizes, parts: Sequence[str] = PARTS, progress: Optional[Progress] = None) -> tuple:
    """Run the cases of ``parts``, every variant in a process of its own
    (started together, then compiled one at a time and timed in interleaved
    rounds, one process working at a time); returns (results, BatchNorm
    statistics)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    parts = tuple(parts)
    stats: Dict[str, object] = {}
    todo = cases(sizes, parts)
    if progress is None:
        progress = Progress(0, enabled=False)
    # Per case: one unit for starting, one per variant's first call, one per round.
    progress.total = sum(2 + len(VARIANTS) + sizes.rounds for _ in todo) + ("cnn" in parts)
    threads = torch.get_num_threads()
    results = []
    for index, case in enumerate(todo):
        name = f"{case.model}, {case.step}, {case.size}"
        workers: Dict[str, _Variant] = {}
        try:
            with progress.working(f"{name}: starting {len(case.variants)} processes"):
                for v in case.variants:
                    workers[v] = _Variant(ctx, sizes, parts, index, v, threads)
                for w in workers.values():
                    w.answer()
            first, errors, ok, ref = {}, {}, True, None
            for v, w in workers.items():
                what = "running eager" if v == "eager" else f"compiling {v}"
                with progress.working(f"{name}: {what}"):
                    first[v], out = w.ask("first")
                out = torch.from_numpy(out)
                ref = out if ref is None else ref
                errors[v] = err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
                if v not in case.unchecked:
                    ok &= math.isfinite(err) and err <= case.tol
            progress.advance(len(VARIANTS) - len(workers))
            extras = [w.ask("extra") for w in workers.values()]
            for e in extras:
                stats.update(e)
            if any(extras):
                progress.advance()
            progress.say(f"{name}: timing, {sizes.rounds} interleaved rounds")
            times = interleaved_samples({v: (lambda w=w: w.ask("sample")) for v, w in workers.items()},
                                        sizes.rounds, progress)
            results.append(Result(case, times, first, errors, ok, workers["wformat"].ask("rewrites")))
            progress.advance()
        finally:
            for w in workers.values():
                w.close()
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


def out_problem(out: str) -> Optional[str]:
    """Why ``out`` cannot take the bench's files, or None. Asked before the
    ten minutes of timing, not after them: a file where the folder should
    go would lose every figure."""
    if os.path.exists(out) and not os.path.isdir(out):
        return f"--out must name a folder (bench.md, bench.json and bench.png go into it); {out!r} is a file"
    return None


def main(quick: bool = False, out: str = "wfpass-bench", rounds: Optional[int] = None, parts: Sequence[str] = PARTS,
         threads: Optional[int] = None, plot_file: bool = True, command: str = "python -m wfpass bench") -> int:
    problem = out_problem(out)
    if problem is not None:
        raise ValueError(f"bench: {problem}")
    os.makedirs(out, exist_ok=True)
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
    table_path = os.path.join(out, "bench.md")
    with open(table_path, "w") as f:
        f.write(text)
    print(f"table written to {table_path}")
    # The same figures for programs (benchmarks/overall/bench_versions.py compares
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
