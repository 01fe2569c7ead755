"""Host cost per call and per training step of small RNNs on the CPU: eager
PyTorch, ``torch.compile``'s default (Inductor) and ``backend="wformat"``,
and where the time beyond eager goes, part by part.

    python benchmarks/overall/host_cost.py --threads 1,2 --json docs/results/data/host_cost.json
    python benchmarks/overall/host_cost.py --from-json docs/results/data/host_cost.json   # the tables of docs/results/host_cost.md again
    python benchmarks/overall/host_cost.py --from-json docs/results/data/host_cost.json --compare docs/results/data/host_cost_before.json
    python benchmarks/overall/host_cost.py --guards --cases lstm2,gru1,lm1   # Dynamo's guard evaluation per call
    python benchmarks/overall/host_cost.py --quick            # a smoke run: two cases, a few seconds of timing

Cases: ``nn.LSTM`` / ``nn.GRU`` (input 32, hidden 64; 1 and 2 layers,
bidirectional; T 4 and 16; batch 1-4) returning their output, the LSTM
language model of ``python -m wfpass bench`` (Embedding 500 -> 2-layer
LSTM 128 -> Linear 500) at T 16, batch 1 and 8, and a Python loop of
``nn.LSTMCell(64, 128)`` over T 64, batch 4, which wformat folds into one
LSTM call (compared with the same weights in one eager ``nn.LSTM``).
Steps: inference (forward under ``no_grad``) and a training step (forward,
``sum().backward()``, ``SGD.step()``, ``zero_grad``).

Every case runs in a process of its own; in it, every variant is its own
deep copy of the model with its own ``forward`` code object
(``wfpass.tools.bench.own_code``: Dynamo's cache and its recompile limit
are per code object, whatever the backend). The variants are timed in
interleaved rounds (the order rotated each round, each sample at least
``--min-s`` of calls); a cell is the median over rounds, a ratio the median
of the per-round ratios (baseline time / wformat time) with its spread
(half the interquartile range over rounds).

The parts come from ``torch.profiler`` (self time per step, summed by
event name after the timing rounds; the profiler inflates them, so they
compare parts, they are not timings):

* Dynamo's guard check: ``TorchDynamo Cache Lookup``;
* Dynamo's frame: ``Torch-Compiled Region`` and ``Pregraph bytecode``
  (the frame's own Python, which includes wfpass's per-call layout check,
  ``wfpass/core/runtime.py`` ``guarded_call``);
* AOTAutograd's forward wrapper: ``CompiledFunction`` and the runtime
  wrapper's prologue/epilogue events;
* AOTAutograd's backward wrapper: ``CompiledFunctionBackward`` and the
  autograd engine's event around it;
* Inductor's wrapper: ``## Call CompiledFxGraph ... ##`` (the generated
  Python that calls the kernels);
* wfpass's op bodies: ``wfpass::*`` ops (their own time, without the ATen
  kernels they call);
* kernels and the rest: ATen ops, the autograd engine, the optimizer.

Beside them, wfpass's per-call layout check is timed directly: the checks
of the compiled graphs wfpass returned, rebuilt around a compiled graph
that does nothing (``guarded_call(noop, sites, ...)``), called with the
graphs' own parameters.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.dirname(HERE)  # its _out.py

#: id -> (label, kind, spec). kinds: "rnn" (mode, layers, bidirectional, T, batch), "lm" (T, batch),
#: "cells" (T, batch).
CASES: Dict[str, tuple] = {
    "lstm1": ("LSTM 1 layer, T 4, batch 4", "rnn", ("LSTM", 1, False, 4, 4)),
    "lstm2": ("LSTM 2 layers, T 4, batch 4", "rnn", ("LSTM", 2, False, 4, 4)),
    "lstm2bi": ("LSTM 2 layers bidirectional, T 4, batch 4", "rnn", ("LSTM", 2, True, 4, 4)),
    "lstm2t16": ("LSTM 2 layers, T 16, batch 1", "rnn", ("LSTM", 2, False, 16, 1)),
    "gru1": ("GRU 1 layer, T 4, batch 4", "rnn", ("GRU", 1, False, 4, 4)),
    "gru2": ("GRU 2 layers, T 4, batch 4", "rnn", ("GRU", 2, False, 4, 4)),
    "gru2bi": ("GRU 2 layers bidirectional, T 4, batch 4", "rnn", ("GRU", 2, True, 4, 4)),
    "gru2t16": ("GRU 2 layers, T 16, batch 1", "rnn", ("GRU", 2, False, 16, 1)),
    "lm1": ("LSTM LM, T 16, batch 1", "lm", (16, 1)),
    "lm8": ("LSTM LM, T 16, batch 8", "lm", (16, 8)),
    "cells": ("LSTMCell loop, T 64, batch 4", "cells", (64, 4)),
}
QUICK_CASES = ("lstm2", "gru1")
STEPS = ("inference", "training step")

#: Profiler event -> part. Matched in order: exact names, then prefixes.
PARTS = ("Dynamo guard check", "Dynamo frame (incl. wfpass check)", "AOTAutograd forward wrapper",
         "AOTAutograd backward wrapper", "Inductor wrapper", "wfpass op bodies", "kernels and the rest")
_EXACT = {
    "TorchDynamo Cache Lookup": PARTS[0],
    "Pregraph bytecode": PARTS[1],
    "CompiledFunction": PARTS[2],
    "CompiledFunctionBackward": PARTS[3],
    "autograd::engine::evaluate_function: CompiledFunctionBackward": PARTS[3],
}
_PREFIX = (("Torch-Compiled Region", PARTS[1]), ("AOTDispatcher Runtime Wrapper", PARTS[2]),
           ("## Call CompiledFxGraph", PARTS[4]), ("wfpass::", PARTS[5]))


def part_of(name: str) -> str:
    part = _EXACT.get(name)
    if part is not None:
        return part
    for prefix, p in _PREFIX:
        if name.startswith(prefix):
            return p
    return PARTS[-1]


# -- the worker: one case, every variant, one process ------------------------------


def _variants(kind: str, cpp_wrapper: bool) -> List[str]:
    names = ["eager nn.LSTM", "eager", "wformat"] if kind == "cells" else ["eager", "inductor", "wformat"]
    if cpp_wrapper:
        names.append("wformat cpp_wrapper")
    return names + list(FLOOR)


#: The compiled-call floor, timed beside every case: one Linear(32, 64) on a
#: batch of 4, eager and under ``torch.compile``'s default, a compiled call
#: with nothing to gain in it (as docs/results/cell_floor.md measures it).
FLOOR = ("floor: Linear, eager", "floor: Linear, default")


def _build(kind: str, spec: tuple):
    """The base model (seeded) and its input."""
    import torch
    import torch.nn as nn

    from wfpass.tools.bench_models import CellLoop, RnnLM

    torch.manual_seed(0)
    if kind == "rnn":
        mode, layers, bidir, T, B = spec

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.rnn = getattr(nn, mode)(32, 64, num_layers=layers, bidirectional=bidir)

            def forward(self, x):
                return self.rnn(x)[0]

        return Net(), torch.randn(T, B, 32)
    if kind == "lm":
        T, B = spec
        return RnnLM(vocab=500, hidden=128, layers=2), torch.randint(0, 500, (T, B))
    T, B = spec
    return CellLoop(64, 128), torch.randn(T, B, 64)


class _Recorder:
    """While active, every call wfpass's backend returns (``guarded_call``'s
    result) is kept, for the direct timing of its layout checks; the calls
    themselves are the backend's, unchanged."""

    def __init__(self) -> None:
        self.calls: list = []

    def __enter__(self):
        import wfpass.compiler

        self._original = original = wfpass.compiler.guarded_call

        def recording(*args, **kwargs):
            call = original(*args, **kwargs)
            self.calls.append(call)
            return call

        wfpass.compiler.guarded_call = recording
        return self

    def __exit__(self, *exc) -> None:
        import wfpass.compiler

        wfpass.compiler.guarded_call = self._original


def _variant(name: str, base, x):
    """(model, input) of variant ``name``: its own deep copy, its own forward code object."""
    import torch

    from wfpass.tools.bench import own_code

    if name.startswith("floor"):
        torch.manual_seed(1)
        lin = own_code(torch.nn.Linear(32, 64))
        xl = torch.randn(4, 32)
        return (lin if name.endswith("eager") else torch.compile(lin, dynamic=False)), xl
    if name == "eager nn.LSTM":
        return own_code(base.as_rnn()), x
    model = own_code(copy.deepcopy(base))
    if name == "eager":
        return model, x
    if name == "inductor":
        return torch.compile(model, dynamic=False), x
    options = {"cpp_wrapper": True} if name == "wformat cpp_wrapper" else None
    return torch.compile(model, backend="wformat", dynamic=False, options=options), x


def _step(model, x, train: bool):
    import torch

    if train:
        opt = torch.optim.SGD(model.parameters(), lr=1e-6)

        def run():
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        def run():
            with torch.no_grad():
                model(x)
    return run


def _check_cost(calls: list, min_s: float, rounds: int) -> Optional[float]:
    """us per call of wfpass's layout checks of one compiled graph (the
    median over the graphs ``calls``), timed around a graph that does
    nothing, with the parameters each graph was made for. (Each probe call
    counts on the report's counters like a real call: this process's
    report is not read.)"""
    from wfpass.core.runtime import guarded_call
    from wfpass.tools.bench_timing import interleaved

    per_graph = []
    for call in calls:
        sites = getattr(call, "_wfpass_sites", None)
        if not sites:
            continue
        args: list = [None] * (1 + max(i for s in sites for i in s.idx))
        ok = True
        for s in sites:
            fs = s._last() if s._last is not None else None  # the layout the site served last
            members = fs.members if fs is not None else []
            if len(members) != len(s.idx) or any(m is None for m in members):
                ok = False
                break
            for i, m in zip(s.idx, members):
                args[i] = m
        if not ok:
            continue
        probe = guarded_call(lambda *a: None, sites, lambda *a: None, ())
        t = interleaved({"check": lambda: probe(*args)}, rounds=rounds, min_s=min_s)["check"]
        per_graph.append(t.median * 1e6)
    return statistics.median(per_graph) if per_graph else None


def _profile(fns: Dict[str, object], steps: int, rounds: int) -> Dict[str, Dict[str, float]]:
    """us per step by part (``PARTS``), profiler self times: ``rounds``
    rounds of ``steps`` profiled steps of every variant in turn, the median
    per part over rounds."""
    from torch.profiler import ProfilerActivity, profile

    samples: Dict[str, Dict[str, list]] = {n: {p: [] for p in PARTS} for n in fns}
    for _ in range(rounds):
        for n, fn in fns.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    fn()
            out = {p: 0.0 for p in PARTS}
            for ev in prof.key_averages():
                out[part_of(ev.key)] += ev.self_cpu_time_total / steps
            for p in PARTS:
                samples[n][p].append(out[p])
    return {n: {p: statistics.median(v) for p, v in d.items()} for n, d in samples.items()}


def worker(case: str, threads: int, rounds: int, min_s: float, profile_steps: int, cpp_wrapper: bool) -> dict:
    import torch

    torch.set_num_threads(threads)
    import wfpass
    from wfpass.tools.bench_timing import interleaved

    label, kind, spec = CASES[case]
    base, x = _build(kind, spec)
    names = _variants(kind, cpp_wrapper)
    models, recorded = {}, {}
    for n in names:
        with _Recorder() as rec:
            m, xv = _variant(n, base, x)
            for train in (False, True):  # compiled for both steps, past Dynamo's first calls
                f = _step(m, xv, train)
                for _ in range(3):
                    f()
        models[n], recorded[n] = (m, xv), rec.calls
    result = {"case": label, "threads": torch.get_num_threads(), "variants": names, "steps": {}}
    for train in (False, True):
        fns = {n: _step(m, xv, train) for n, (m, xv) in models.items()}
        t = interleaved(fns, rounds=rounds, min_s=min_s)
        prof = _profile({n: f for n, f in fns.items() if not n.startswith("floor")}, profile_steps,
                        max(1, min(rounds, 5)))
        result["steps"][STEPS[train]] = {"samples_us": {n: [s * 1e6 for s in v.samples] for n, v in t.items()},
                                         "parts_us": prof}
    result["check_us"] = {n: _check_cost(c, min_s, rounds) for n, c in recorded.items() if c}
    result["rewritten"] = {n: sorted({r.pattern for r in wfpass.report(models[n][0]).rewritten})
                           for n in names if n.startswith("wformat")}
    from wfpass import native

    result["loop_isa"] = native.fast_isa_words() or "none"
    return result


def guard_cost(case: str, threads: int, rounds: int, min_s: float) -> dict:
    """us per inference call spent in Dynamo's guard evaluation, for the
    case's wformat variant and the floor's compiled Linear: each timed with
    guards and with ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``,
    interleaved, the difference of the medians."""
    import torch

    torch.set_num_threads(threads)
    import wfpass  # noqa: F401
    from wfpass.tools.bench_timing import interleaved

    label, kind, spec = CASES[case]
    base, x = _build(kind, spec)
    fns = {}
    for n in ("wformat", FLOOR[1]):
        m, xv = _variant(n, base, x)
        fns[n] = (lambda m=m, xv=xv: m(xv))
    out = {}
    with torch.no_grad():
        for f in fns.values():
            f(), f()
        with_guards = interleaved(fns, rounds=rounds, min_s=min_s)
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            without = interleaved(fns, rounds=rounds, min_s=min_s)
    for n in fns:
        out[n] = (with_guards[n].median * 1e6, without[n].median * 1e6)
    return {"case": label, "threads": threads, "us": out}


# -- the coordinator ------------------------------------------------------------------


def _run_case(case: str, threads: int, a) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", case, "--threads", str(threads),
           "--rounds", str(a.rounds), "--min-s", str(a.min_s), "--profile-steps", str(a.profile_steps)]
    if a.cpp_wrapper:
        cmd.append("--cpp-wrapper")
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(BENCHMARKS))
    if res.returncode != 0:
        raise SystemExit(f"host_cost: case {case!r} failed:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _ratio(num: List[float], den: List[float]) -> tuple:
    """Median and spread (half the interquartile range, relative) of the per-round ratios num/den."""
    return _median_spread([a / b for a, b in zip(num, den)])


def _median_spread(r: List[float]) -> tuple:
    med = statistics.median(r)
    if len(r) < 2 or not med:
        return med, 0.0
    q1, _, q3 = statistics.quantiles(r, n=4, method="inclusive")
    return med, abs((q3 - q1) / 2 / med)


def _baseline(variants) -> str:
    return "eager nn.LSTM" if "eager nn.LSTM" in variants else "eager"


def row_figures(r: dict, step: str) -> dict:
    """The figures of one case and step: medians (us), ratios (median of
    per-round ratios, spread), wformat's time beyond eager and beyond
    eager plus the compiled-call floor (per round, then the median)."""
    s = r["steps"][step]["samples_us"]
    base = _baseline(s)
    med = {k: statistics.median(v) for k, v in s.items()}
    out = {"median": med, "baseline": base, "vs_eager": _ratio(s[base], s["wformat"])}
    if "inductor" in s:
        out["vs_default"] = _ratio(s["inductor"], s["wformat"])
    floor = [c - e for c, e in zip(s[FLOOR[1]], s[FLOOR[0]])]
    beyond = [w - b for w, b in zip(s["wformat"], s[base])]
    out["floor"] = statistics.median(floor)
    out["beyond_eager"] = statistics.median(beyond)
    out["beyond_floor"] = statistics.median([b - f for b, f in zip(beyond, floor)])
    if "wformat cpp_wrapper" in s:
        out["cpp_wrapper"] = _ratio(s["wformat"], s["wformat cpp_wrapper"])
    return out


def tables(results: List[dict], command: str) -> List[str]:
    from wfpass.tools.doctor import cpu_words  # the page names its CPU: figures differ by vendor
    import torch

    lines = [f"Command: `{command}`", "",
             f"torch {torch.__version__}, {cpu_words()}, {os.cpu_count()} CPUs visible, a shared machine "
             "(other processes ran beside these), Python " + platform.python_version() + ". Times: us per step, the "
             "median over interleaved rounds. x = baseline time / wformat time, the median of the per-round "
             "ratios, ± its spread (half the interquartile range over rounds). *floor*: one Linear(32, 64) on a "
             "batch of 4 under torch.compile's default minus the same eagerly, timed in the same rounds (the "
             "cost of a compiled call with nothing to gain in it); *beyond floor*: wformat - eager - floor, per "
             "round. *check*: wfpass's per-call layout check of one compiled graph, timed directly.", ""]
    isas = sorted({r.get("loop_isa", "not recorded") for r in results})
    lines[-1:-1] = [f"wfpass's C++ loop's gate math in these runs: {', '.join(isas)} (`python -m wfpass doctor`).", ""]
    by_threads: Dict[int, List[dict]] = {}
    for r in results:
        by_threads.setdefault(r["threads"], []).append(r)
    cpp = any("wformat cpp_wrapper" in r["variants"] for r in results)
    for threads, rs in sorted(by_threads.items()):
        t = f"{threads} thread{'s' if threads > 1 else ''}"
        lines += [f"### {t}: time per step", "",
                  "| case | step | eager | torch.compile default | wformat | wformat vs default | wformat vs eager "
                  "| wformat - eager | floor | beyond floor | check |" + (" cpp_wrapper vs wformat |" if cpp else ""),
                  "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if cpp else "")]
        for r in rs:
            for step in STEPS:
                f = row_figures(r, step)
                med, base = f["median"], f["baseline"]
                cells = [r["case"], step, f"{med[base]:.0f}" + (" (nn.LSTM)" if base != "eager" else ""),
                         f"{med['inductor']:.0f}" if "inductor" in med else "-", f"{med['wformat']:.0f}"]
                cells.append(f"{f['vs_default'][0]:.2f}x ±{f['vs_default'][1] * 100:.0f}%" if "vs_default" in f else "-")
                cells.append(f"{f['vs_eager'][0]:.2f}x ±{f['vs_eager'][1] * 100:.0f}%")
                cells += [f"{f['beyond_eager']:+.0f}", f"{f['floor']:.0f}", f"{f['beyond_floor']:+.0f}"]
                chk = r.get("check_us", {}).get("wformat")
                cells.append(f"{chk:.1f}" if chk is not None else "-")
                if cpp:
                    c = f.get("cpp_wrapper")
                    cells.append(f"{c[0]:.2f}x ±{c[1] * 100:.0f}%" if c else "-")
                lines.append("| " + " | ".join(cells) + " |")
        lines += ["", f"### {t}: host time beyond eager, by part", "",
                  "Profiler self time, us per step, the variant's minus eager's (the cell loop: minus eager "
                  "nn.LSTM's); the median over profiled rounds.", "",
                  "| case | step | variant | " + " | ".join(PARTS) + " | total |",
                  "|---|---|---|" + "---|" * (len(PARTS) + 1)]
        for r in rs:
            for step in STEPS:
                parts = r["steps"][step]["parts_us"]
                base = _baseline(parts)
                for v in parts:
                    if v.startswith("eager") and v != "eager" or v == base:
                        continue
                    d = [parts[v][p] - parts[base][p] for p in PARTS]
                    lines.append(f"| {r['case']} | {step} | {v} | " + " | ".join(f"{x:+.0f}" for x in d)
                                 + f" | {sum(d):+.0f} |")
        lines.append("")
    lines += targets(results)
    return lines


def compare(before: List[dict], after: List[dict]) -> List[str]:
    """Before / after: wformat against the default and against eager, per
    case, step and thread count present in both runs (each run's own
    interleaved rounds: compare ratios, not times)."""
    old = {(r["case"], r["threads"]): r for r in before}
    lines = ["| threads | case | step | wformat vs default, before | after | wformat vs eager, before | after |",
             "|---|---|---|---|---|---|---|"]
    for r in after:
        b = old.get((r["case"], r["threads"]))
        if b is None:
            continue
        for step in STEPS:
            fb, fa = row_figures(b, step), row_figures(r, step)
            vd = [f"{f['vs_default'][0]:.2f}x" if "vs_default" in f else "-" for f in (fb, fa)]
            ve = [f"{f['vs_eager'][0]:.2f}x" for f in (fb, fa)]
            lines.append(f"| {r['threads']} | {r['case']} | {step} | {vd[0]} | {vd[1]} | {ve[0]} | {ve[1]} |")
    return lines


def targets(results: List[dict]) -> List[str]:
    """The targets, each against every case and step it concerns: how many
    meet it, and the worst."""
    rows = []
    for threads in sorted({r["threads"] for r in results}):
        figs = [(r, step, row_figures(r, step)) for r in results if r["threads"] == threads for step in STEPS]
        small = [(r, s, f) for r, s, f in figs if "vs_default" in f]
        cells = [(r, s, f) for r, s, f in figs if "vs_default" not in f]
        checks = (
            ("wformat / torch.compile default >= 1.0 (RNNs, LM)", small, lambda f: f["vs_default"][0], 1.0, "{:.2f}x"),
            ("wformat / eager >= 0.95 (RNNs, LM)", small, lambda f: f["vs_eager"][0], 0.95, "{:.2f}x"),
            ("beyond the floor <= 20 us, inference", [x for x in figs if x[1] == STEPS[0]],
             lambda f: -f["beyond_floor"], -20.0, "{:+.0f} us"),
            ("beyond the floor <= 40 us, training step", [x for x in figs if x[1] == STEPS[1]],
             lambda f: -f["beyond_floor"], -40.0, "{:+.0f} us"),
            ("LSTMCell loop / eager nn.LSTM >= 0.95", cells, lambda f: f["vs_eager"][0], 0.95, "{:.2f}x"),
        )
        for name, group, key, limit, fmt in checks:
            if not group:
                continue
            met = sum(key(f) >= limit for _, _, f in group)
            r, s, f = min(group, key=lambda x: key(x[2]))
            worst = key(f) if limit > 0 else -key(f)
            rows.append(f"| {threads} | {name} | {met} of {len(group)} | {fmt.format(worst)} ({r['case']}, {s}) |")
    return ["### Targets", "", "| threads | target | met | worst (case, step) |", "|---|---|---|---|", *rows, ""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two cases, 2 rounds, short samples: a smoke run")
    ap.add_argument("--cases", default=None, help="comma list of case ids (default: all, or two with --quick): " + ", ".join(CASES))
    ap.add_argument("--threads", default="1", help="comma list of torch thread counts (default: 1)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default: 9, 2 with --quick)")
    ap.add_argument("--min-s", type=float, default=None, help="seconds per sample (default: 0.1, 0.005 with --quick)")
    ap.add_argument("--profile-steps", type=int, default=None, help="profiled steps per variant and round (default: 50, 3 with --quick)")
    ap.add_argument("--cpp-wrapper", action="store_true",
                    help="also time wformat with Inductor's C++ wrapper (options={'cpp_wrapper': True})")
    ap.add_argument("--out", default=None, help="write the markdown tables here")
    ap.add_argument("--json", default=None, help="write the raw samples here")
    ap.add_argument("--from-json", default=None, help="make the tables from a --json file of an earlier run")
    ap.add_argument("--compare", default=None,
                    help="with --from-json: a before / after table against this earlier --json file")
    ap.add_argument("--guards", action="store_true",
                    help="instead: Dynamo's guard evaluation per inference call, wformat and the floor's Linear "
                         "(with and without skip_guard_eval_unsafe), for --cases (default: lstm2)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.rounds is None:
        a.rounds = 2 if a.quick else 9
    if a.min_s is None:
        a.min_s = 0.005 if a.quick else 0.1
    if a.profile_steps is None:
        a.profile_steps = 3 if a.quick else 50
    if a.worker is not None:
        print(json.dumps(worker(a.worker, int(a.threads), a.rounds, a.min_s, a.profile_steps, a.cpp_wrapper)))
        return 0
    sys.path.insert(0, BENCHMARKS)
    from _out import emit

    if a.guards:
        lines = ["| case | threads | variant | with guards (us) | without (us) | guards (us) |", "|---|---|---|---|---|---|"]
        for threads in (int(t) for t in a.threads.split(",")):
            for n in (a.cases.split(",") if a.cases else ("lstm2",)):
                g = guard_cost(n, threads, a.rounds, a.min_s)
                for v, (w, wo) in g["us"].items():
                    lines.append(f"| {g['case']} | {threads} | {v} | {w:.1f} | {wo:.1f} | {w - wo:.1f} |")
        return emit(lines, a.out)
    if a.from_json:
        with open(a.from_json) as f:
            saved = json.load(f)
        if a.compare:
            with open(a.compare) as f:
                return emit(compare(json.load(f)["results"], saved["results"]), a.out)
        return emit(tables(saved["results"], saved["command"]), a.out)
    names = a.cases.split(",") if a.cases else (QUICK_CASES if a.quick else tuple(CASES))
    bad = [n for n in names if n not in CASES]
    if bad:
        raise SystemExit(f"host_cost: unknown cases {bad}; known: {list(CASES)}")
    results = []
    t0 = time.perf_counter()
    command = "python benchmarks/overall/host_cost.py " + " ".join(argv if argv is not None else sys.argv[1:])
    for threads in (int(t) for t in a.threads.split(",")):
        for n in names:
            print(f"[{time.perf_counter() - t0:6.0f} s] {CASES[n][0]}, {threads} thread(s)", file=sys.stderr, flush=True)
            results.append(_run_case(n, threads, a))
            if a.json:  # after every case: a run cut short keeps what it measured
                with open(a.json, "w") as f:
                    json.dump({"command": command.strip(), "results": results}, f, indent=1)
    return emit(tables(results, command.strip()), a.out)


if __name__ == "__main__":
    sys.exit(main())
