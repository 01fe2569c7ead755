"""RNN weight format: time per call against the sequence length, side by side.

For each (batch, hidden) shape, a one-layer ``nn.LSTM(hidden, hidden)`` on
input ``[T, batch, hidden]``, forward (no grad) and training step (forward,
backward, SGD step), T = 1 .. 512:

  eager       nn.LSTM as is (oneDNN on this CPU)
  inductor    torch.compile default with torch._dynamo.config.allow_rnn = True
              (static shapes; training only at small T: its compile time grows with T)
  unfused     wformat, seq_threshold forced above every T (ATen's native kernel)
  fused       wformat, seq_threshold=0 (oneDNN's fused LSTM kernel)
  default     wformat with the default seq_threshold
  auto        wformat with seq_threshold="auto"

The wformat variants compile once with ``dynamic=True`` (one graph for every
T > 1; Dynamo specialises T = 1); compile time against T is measured
separately with static shapes and the on-disk compile caches off. Each
variant runs its own copy of the model under its own forward code object, and
the variants are timed interleaved (round-robin, shuffled) so they share the
machine's load; medians over the rounds. Single-threaded by default
(``--threads``) because the machine is shared and multi-threaded timings spike. Writes a markdown table and a PNG plot::

    python benchmarks/rnn/bench_rnn.py --out FILE.md --plot FILE.png
    python benchmarks/rnn/bench_rnn.py --crossover docs/results/rnn_crossover.md   # the fused/unfused crossover alone
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import math
import random
import statistics
import sys
import time
import types
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn

import wfpass
from wfpass.config import Config, default_seq_threshold
from wfpass.rnn.auto import auto_threshold_cache
from wfpass.rnn.paths import fused_path, unfused_path
from wfpass.rnn.spec import RnnSpec
from wfpass.tools.tables import markdown_table
from wfpass.tools.doctor import cpu_words  # the page names its CPU: figures differ by vendor

LENGTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
VARIANTS = ("eager", "inductor", "unfused", "fused", "default", "auto")


def _wrapper_class(name: str):
    """A module class whose forward is a code object of its own: Dynamo keeps
    its compiled entries per code object, so variants compiled from one
    shared forward would queue behind each other's guards and distort timings."""

    def forward(self, x):
        return self.lstm(x)

    fn = types.FunctionType(forward.__code__.replace(co_name=name), globals(), name)
    return type(name, (nn.Module,), {"forward": fn})


class Case:
    """One (shape, mode): a fresh model per variant with the same weights."""

    def __init__(self, batch: int, hidden: int, train: bool):
        self.batch, self.hidden, self.train = batch, hidden, train
        torch.manual_seed(0)
        self.template = nn.LSTM(hidden, hidden)
        self._n = 0

    def model(self, tag: str) -> nn.Module:
        self._n += 1
        m = _wrapper_class(f"{tag}_{self._n}")()
        m.lstm = nn.LSTM(self.hidden, self.hidden)
        m.lstm.load_state_dict(self.template.state_dict())
        return m

    def inputs(self, T: int) -> torch.Tensor:
        return torch.randn(T, self.batch, self.hidden)

    def step(self, fn, model, x) -> Callable[[], None]:
        if not self.train:
            def fwd():
                with torch.no_grad():
                    fn(x)
            return fwd
        opt = torch.optim.SGD(model.parameters(), lr=1e-6)

        def train():
            out = fn(x)[0]
            out.sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return train


def _interleaved(steps: Dict[str, Callable[[], None]], rounds: int, min_block_s: float = 8e-3) -> Dict[str, float]:
    """Median seconds per call of each step. Every round times one block of
    each step in turn (shuffled), so all variants see the same machine load."""
    n = {}
    for k, f in steps.items():
        t0 = time.perf_counter()
        f()
        n[k] = max(1, int(min_block_s / max(time.perf_counter() - t0, 1e-7)))
    ts: Dict[str, List[float]] = {k: [] for k in steps}
    rng = random.Random(0)
    for _ in range(rounds):
        order = list(steps)
        rng.shuffle(order)
        for k in order:
            f = steps[k]
            t0 = time.perf_counter()
            for _ in range(n[k]):
                f()
            ts[k].append((time.perf_counter() - t0) / n[k])
    return {k: statistics.median(v) for k, v in ts.items()}


def _rounds_for(T: int, batch: int, hidden: int, base: int) -> int:
    # Long, wide runs take a second each: fewer rounds keep the run short.
    work = T * batch * hidden * hidden
    return base if work < 2e8 else max(3, base // 2)


def run_case(case: Case, lengths, reps: int, inductor_train_max_t: int, log) -> Dict[str, Dict[int, Optional[float]]]:
    res: Dict[str, Dict[int, Optional[float]]] = {v: {} for v in VARIANTS}
    notes: Dict[str, str] = {}
    thresholds = {"unfused": 10**9, "fused": 0, "default": Config().rnn.seq_threshold, "auto": "auto"}
    models, fns = {}, {}
    for v in ("eager", "unfused", "fused", "default", "auto"):
        models[v] = case.model(v)
        # wformat: one compile with dynamic=True serves every T > 1.
        fns[v] = models[v] if v == "eager" else torch.compile(models[v], backend=wfpass.backend(rnn={"seq_threshold": thresholds[v]}), dynamic=True)
    inductor_crash = None
    for T in lengths:
        x = case.inputs(T)
        steps = {v: case.step(fns[v], models[v], x) for v in fns}
        for f in steps.values():
            f()  # compile / warm-up / "auto" measurement, untimed
        # torch.compile default (Inductor) with allow_rnn: static shapes, a fresh model per T.
        if (case.train and T > inductor_train_max_t) or inductor_crash:
            res["inductor"][T] = None
        else:
            with torch._dynamo.config.patch(allow_rnn=True):
                m = case.model("inductor")
                step = case.step(torch.compile(m), m, x)
                try:
                    step()
                    steps["inductor"] = step
                except Exception as e:  # report crashes honestly
                    res["inductor"][T] = None
                    notes[f"T={T}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    if case.train:
                        inductor_crash = notes[f"T={T}"]
        times = _interleaved(steps, _rounds_for(T, case.batch, case.hidden, reps))
        for v, t in times.items():
            res[v][T] = t
        log(f"  T={T}: " + " ".join(f"{v}={t * 1e6:.0f}" for v, t in times.items()))
        steps.pop("inductor", None)
        gc.collect()
    if inductor_crash:
        notes["training"] = f"crashed at the first T tried, not run at larger T: {inductor_crash}"
    res["_notes"] = notes  # type: ignore[assignment]
    return res


def compile_times(batch: int, hidden: int, lengths, train: bool, inductor_max_t: int, log) -> Dict[str, Dict[int, Optional[float]]]:
    """Seconds from the first call to its return (trace + passes + compile +
    one run), static shapes, fresh Dynamo state each time, Inductor's and
    AOTAutograd's on-disk caches off (a cache hit would hide the compile)."""
    out: Dict[str, Dict[int, Optional[float]]] = {"wformat": {}, "inductor": {}}
    case = Case(batch, hidden, train)
    crashed = False
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        for name in ("wformat", "inductor"):
            for T in lengths:
                if name == "inductor" and (T > inductor_max_t or crashed):
                    out[name][T] = None
                    continue
                torch._dynamo.reset()
                model = case.model(f"c{name}")
                x = case.inputs(T)
                if name == "wformat":
                    fn = torch.compile(model, backend="wformat")
                    ctx = contextlib.nullcontext()  # wformat captures RNNs by itself
                else:
                    fn = torch.compile(model)
                    ctx = torch._dynamo.config.patch(allow_rnn=True)
                with ctx:
                    step = case.step(fn, model, x)
                    t0 = time.perf_counter()
                    try:
                        step()
                        out[name][T] = time.perf_counter() - t0
                    except Exception:
                        out[name][T] = None
                        crashed = name == "inductor"
            log(f"  compile {name:8s} {'train' if train else 'fwd'}: " + " ".join(f"{T}:{v:.1f}s" if v else f"{T}:-" for T, v in out[name].items()))
    return out


def _fmt(v: Optional[float]) -> str:
    if v is None:
        return "-"
    us = v * 1e6
    return f"{us:.0f}" if us < 1e4 else f"{us / 1e3:.1f}k"


def markdown(results, compile_res, args, elapsed: float) -> str:
    lines = [
        "# RNN weight format: measured results",
        "",
        f"Generated by `benchmarks/rnn/bench_rnn.py` on {datetime.date.today()} ({elapsed / 60:.1f} min), "
        f"torch {torch.__version__}, {cpu_words()}, "
        f"{torch.get_num_threads()} thread(s), default seq_threshold = {Config().rnn.seq_threshold} "
        f"({default_seq_threshold('cpu')} on the CPU). Command:",
        "",
        "```",
        " ".join(["python"] + sys.argv),
        "```",
        "",
        "Time per call in microseconds (k = thousands), median of repeated runs; "
        "one-layer `nn.LSTM(hidden, hidden)`, input `[T, batch, hidden]`. "
        "`inductor` = `torch.compile` default with `allow_rnn=True` (static shapes; '-' = not run). "
        "`best/forced` = auto / min(unfused, fused); `default/eager`, `auto/eager` < 1 is faster than eager.",
        "",
    ]
    for (batch, hidden, train), res in results.items():
        mode = "training step (fwd + bwd + SGD)" if train else "forward (no grad)"
        lines += [f"## batch={batch}, hidden={hidden}: {mode}", ""]
        body = []
        for T in args.lengths:
            row = [str(T)] + [_fmt(res[v].get(T)) for v in VARIANTS]
            best = min(res["unfused"][T], res["fused"][T])
            row += [f"{res['auto'][T] / best:.2f}", f"{res['default'][T] / res['eager'][T]:.2f}", f"{res['auto'][T] / res['eager'][T]:.2f}"]
            body.append(row)
        lines.append(markdown_table(["T", *VARIANTS, "auto/best forced", "default/eager", "auto/eager"], body))
        notes = res.get("_notes") or {}
        for k, v in notes.items():
            lines.append(f"\ninductor at {k}: {v}")
        lines.append("")
        lines.append("")
    lines += ["## Compile time (seconds, first call incl. one run), static shapes", ""]
    for (batch, hidden, train), cres in compile_res.items():
        mode = "training step" if train else "forward"
        lines.append(f"batch={batch}, hidden={hidden}, {mode}:")
        lines.append("")
        lines.append(markdown_table(["T", *(str(T) for T in args.lengths)],
                                    [[name, *(f"{by_t[T]:.1f}" if by_t.get(T) else "-" for T in args.lengths)]
                                     for name, by_t in cres.items()]))
        lines.append("")
    lines += ["## Targets", ""] + targets(results, compile_res, args) + [""]
    lines += ["## seq_threshold=\"auto\": measured N per shape", ""]
    for key, n in auto_threshold_cache().items():
        lines.append(f"- batch={key[2]}, hidden={key[3]}, {key[1]}, grad={key[9]}: N = {n}")
    return "\n".join(lines) + "\n"


def targets(results, compile_res, args) -> List[str]:
    out = []
    for (batch, hidden, train), res in results.items():
        tag = f"batch={batch} hidden={hidden} {'train' if train else 'fwd'}"
        worst = max(res["auto"][T] / min(res["unfused"][T], res["fused"][T]) for T in args.lengths)
        miss = [T for T in args.lengths if res["auto"][T] > 1.05 * min(res["unfused"][T], res["fused"][T])]
        out.append(f"- {tag}: auto within 5% of the faster forced path at every T: "
                   f"{'met' if not miss else 'NOT met at T=' + ','.join(map(str, miss))} (worst ratio {worst:.2f})")
        if 1 in res["eager"]:
            r1 = res["default"][1] / res["eager"][1]
            ra = res["auto"][1] / res["eager"][1]
            out.append(f"- {tag}: T=1 faster than eager: default {r1:.2f}x, auto {ra:.2f}x of eager time -> "
                       f"{'met' if max(r1, ra) < 1 else 'NOT met'}")
        long = [T for T in args.lengths if T >= 128]
        if long:
            ratios = {T: res["auto"][T] / res["eager"][T] for T in long}
            out.append(f"- {tag}: T>=128 at least as fast as eager (auto/eager {', '.join(f'{T}:{r:.2f}' for T, r in ratios.items())}) -> "
                       f"{'met' if all(r <= 1.0 for r in ratios.values()) else 'NOT met (within noise if <= 1.05)' if all(r <= 1.05 for r in ratios.values()) else 'NOT met'}")
    for (batch, hidden, train), cres in compile_res.items():
        w = [v for v in cres["wformat"].values() if v]
        if w:
            out.append(f"- compile time, wformat {'train' if train else 'fwd'} (batch={batch}, hidden={hidden}): "
                       f"{min(w):.1f}-{max(w):.1f} s over T={min(args.lengths)}..{max(args.lengths)} "
                       f"(median {statistics.median(w):.1f} s)")
    return out


def plot(results, path: str, lengths) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results)
    cols = 2
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
    styles = {"eager": ("k", "-", "o"), "inductor": ("tab:gray", ":", "x"), "unfused": ("tab:blue", "--", "s"),
              "fused": ("tab:red", "--", "^"), "default": ("tab:green", "-", "d"), "auto": ("tab:purple", "-", ".")}
    for ax, key in zip(axes.flat, keys):
        res = results[key]
        for v in VARIANTS:
            ts = [T for T in lengths if res[v].get(T)]
            if not ts:
                continue
            c, ls, mk = styles[v]
            ax.plot(ts, [res[v][T] / res["eager"][T] for T in ts], color=c, linestyle=ls, marker=mk, label=v)
        batch, hidden, train = key
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="k", linewidth=0.5)
        ax.set_title(f"batch={batch} hidden={hidden} {'training step' if train else 'forward'}")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("time / eager nn.LSTM time")
        ax.set_ylim(0, 2.5)
        ax.grid(True, alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def kernel_crossover(shapes, lengths, log) -> str:
    """How many times faster the unfused path's kernels are than the fused
    one (the fused time / the unfused time; above 1: unfused faster),
    forward and forward+backward, called directly (no compile, no per-call
    overhead): the crossover the default seq_threshold comes from. Returns
    the markdown table, one row per shape and mode."""
    body = []
    for batch, hidden in shapes:
        torch.manual_seed(0)
        lstm = nn.LSTM(hidden, hidden)
        spec = None
        for train in (False, True):
            ws = [p.detach().requires_grad_(train) for p in lstm._flat_weights]
            ratios = []
            for T in lengths:
                x = torch.randn(T, batch, hidden)
                h = torch.zeros(1, batch, hidden)
                spec = RnnSpec("lstm", "LSTM", hidden, hidden, 0, 1, False, False, True, 0.0, 0, (), 0)

                def run(path):
                    if train:
                        out = path(spec, x, [h, h], ws, True, True, 0.0)[0]
                        torch.autograd.grad(out, ws, torch.ones_like(out))
                    else:
                        with torch.no_grad():
                            path(spec, x, [h, h], ws, True, False, 0.0)
                reps = 21 if batch * hidden * T < 2e5 else 7
                t_u, t_f = [], []
                run(unfused_path), run(fused_path)
                for _ in range(reps):  # interleaved: both see the same machine load
                    for path, acc in ((unfused_path, t_u), (fused_path, t_f)):
                        t0 = time.perf_counter()
                        run(path)
                        acc.append(time.perf_counter() - t0)
                ratios.append(statistics.median(t_f) / statistics.median(t_u))
            n = 0
            for T, r in zip(lengths, ratios):
                if r < 1.0:
                    break
                n = T
            row = [f"{batch} x {hidden}", "fwd+bwd" if train else "fwd", *(f"{r:.2f}" for r in ratios), str(n)]
            body.append(row)
            log(f"{row[0]} {row[1]}: " + " ".join(row[2:-1]) + f", crossover N {n}")
    return markdown_table(["batch x hidden", "mode", *(f"T={T}" for T in lengths), "crossover N"], body)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x64,16x256", help="comma-separated BATCHxHIDDEN")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--inductor-train-max-t", type=int, default=8,
                    help="largest T for the allow_rnn Inductor training step (its compile time grows with T)")
    ap.add_argument("--compile-shape", default="16x256", help="BATCHxHIDDEN for the compile-time table ('' to skip)")
    ap.add_argument("--out", default=None, help="markdown file to write")
    ap.add_argument("--plot", default=None, help="PNG file to write")
    ap.add_argument("--crossover", default=None, metavar="MD",
                    help="only measure the kernel crossover (how many times faster the unfused path is) for --crossover-shapes and write it to MD")
    ap.add_argument("--crossover-shapes", default="1x64,4x128,16x256,64x512")
    args = ap.parse_args(argv)
    args.lengths = [int(t) for t in args.lengths.split(",")]
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 4096
    start = time.perf_counter()
    log = lambda s: print(s, flush=True)  # noqa: E731
    if args.crossover:
        shapes = [tuple(map(int, s.split("x"))) for s in args.crossover_shapes.split(",")]
        lengths = [T for T in args.lengths if T <= 32]
        table = kernel_crossover(shapes, lengths, log)
        text = "\n".join([
            "# RNN kernels on the CPU: where the per-step path stops being faster", "",
            f"Machine: {cpu_words()}; {torch.get_num_threads()} torch thread(s); torch {torch.__version__}.", "",
            f"`benchmarks/rnn/bench_rnn.py --crossover` on {datetime.date.today()}. Command:", "", "```", " ".join(["python"] + sys.argv), "```", "",
            "One-layer LSTM(hidden, hidden), kernels called directly (no compile): ATen's native kernel "
            "(the unfused path) against oneDNN's fused kernel. **x faster** = the fused kernel's time / the unfused "
            "path's time: above 1, the unfused path is faster. Medians of interleaved runs. Crossover N = the largest "
            "T before the first value below 1.", "",
            table, ""])
        with open(args.crossover, "w") as f:
            f.write(text)
        print(text)
        return
    results = {}
    for shape in args.shapes.split(","):
        batch, hidden = map(int, shape.split("x"))
        for train in (False, True):
            log(f"batch={batch} hidden={hidden} {'train' if train else 'fwd'} (us per call)")
            results[(batch, hidden, train)] = run_case(Case(batch, hidden, train), args.lengths, args.reps, args.inductor_train_max_t, log)
    compile_res = {}
    if args.compile_shape:
        batch, hidden = map(int, args.compile_shape.split("x"))
        for train in (False, True):
            compile_res[(batch, hidden, train)] = compile_times(
                batch, hidden, args.lengths, train, args.inductor_train_max_t if train else max(args.lengths), log)
    elapsed = time.perf_counter() - start
    text = markdown(results, compile_res, args, elapsed)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.plot:
        plot(results, args.plot, args.lengths)
    log(f"done in {elapsed / 60:.1f} min")


if __name__ == "__main__":
    main()
