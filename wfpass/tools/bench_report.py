"""The output of ``python -m wfpass bench``: the markdown table (times,
first calls, BatchNorm statistics) and the plot, from ``bench.run``'s
results."""
from __future__ import annotations

import os
import platform
from typing import Dict, Optional, Sequence

import torch

from .tables import markdown_table

__all__ = ["VARIANTS", "markdown", "plot", "worst_cells"]

#: The four ways every model runs, in the table's column order.
VARIANTS = ("eager", "inductor", "hand-fused", "wformat")


def _machine() -> str:
    from .doctor import cpu_words  # the CPU's model, vendor and instruction sets: figures differ by vendor

    n = torch.get_num_threads()
    return (f"torch {torch.__version__}, Python {platform.python_version()}, {cpu_words()}, {os.cpu_count()} CPUs visible, "
            f"{n} torch thread{'s' if n != 1 else ''}; every model on the CPU")


def worst_cells(results: Sequence) -> str:
    """The line above the table: the lowest "x faster" against Inductor's
    default and against eager over every row, and the row it came from."""
    def worst(base: str):
        rows = [(r.times[base].median / r.times["wformat"].median, r) for r in results if base in r.times]
        return min(rows, key=lambda p: p[0]) if rows else None

    parts = []
    for base, name in (("inductor", "torch.compile's default (Inductor)"), ("eager", "eager PyTorch")):
        w = worst(base)
        if w is not None:
            x, r = w
            parts.append(f"**{x:.2f}x** of {name} ({r.case.model}, {r.case.step}, {r.case.size})")
    return "Worst row: wformat at " + "; at ".join(parts) + " (x faster as in the table; below 1: slower)."


def markdown(results: Sequence, stats: Dict[str, float], sizes, command: str, seconds: float) -> str:
    """The table: ``results`` are ``bench.Result``s, ``sizes`` the ``bench.Sizes`` they ran at."""
    lines = [f"Command: `{command}`  ",
             f"{_machine()}; {sizes.rounds} interleaved rounds per row, {seconds:.0f} s in all.",
             "", worst_cells(results), "",
             "Times in ms per call: median over rounds, ± half the interquartile range over rounds. "
             "**x faster = baseline time / wformat time** (above 1: wformat is faster). "
             "Every variant runs in a process of its own (its compile cold, its caches and heap its own). "
             "*hand-fused*: the decoder written with one Q/K/V and one gate/up linear, or the CNN with its "
             "BatchNorms in fp32 by hand, compiled with Inductor; a cell loop written as one eager nn.LSTM/nn.GRU; "
             "the packed LSTM run eagerly on the padded batch instead (no packing: every step of every "
             "sequence, on PyTorch's fused kernel; what users do to avoid packing's cost; its outputs differ "
             "by design and are not checked); the other LSTM models have none (eager already runs PyTorch's "
             "fused kernel). `torch.compile`'s "
             "default puts no LSTM in its graph: for the RNN models its Inductor column runs the LSTM eagerly "
             "between compiled pieces.",
             ""]
    rows = []
    for r in results:
        t = r.times
        cells = [t[k].cell() if k in t else "-" for k in VARIANTS]
        vs_i = t["inductor"].median / t["wformat"].median
        vs_e = t["eager"].median / t["wformat"].median
        worst = max(v for k, v in r.errors.items() if k != "eager" and k not in r.case.unchecked)
        check = f"{'ok' if r.ok else 'MISMATCH'} ({worst:.0e})"
        rows.append([r.case.model, r.case.step, r.case.size, *cells, f"{vs_i:.2f}", f"{vs_e:.2f}", check, r.rewrites])
    lines.append(markdown_table(["model", "step", "size", "eager", "Inductor", "hand-fused", "wformat",
                                 "x faster than Inductor", "x faster than eager", "output checked", "wformat rewrote"],
                                rows))
    lines += ["", "*output checked*: largest |variant - eager| over largest |eager|, all compiled variants "
              "(bf16 CNN: tolerance 5e-2; the rest 1e-4). *wformat rewrote*: the rewrites in `wfpass.report` "
              "of the wformat model (linear groups, RNNs, BatchNorms) that ran.", ""]
    lines += ["First call (compile included), seconds; variants compiled one after the other, in the order "
              "Inductor, hand-fused, wformat. Inductor's graph caches are off, but C++ kernels an earlier "
              "process compiled are read from Inductor's disk cache, which can shorten a later variant's first call:", ""]
    lines.append(markdown_table(["model", "step", "size", "Inductor", "hand-fused", "wformat"],
                                ([r.case.model, r.case.step, r.case.size,
                                  *(f"{r.first_call_s[k]:.1f}" if k in r.first_call_s else "-" for k in VARIANTS[1:])]
                                 for r in results)))
    lines.append("")
    models = {}
    for r in results:
        models.setdefault(r.case.model, r.case.note)
    lines += ["Models: " + "; ".join(f"{k}: {v}" for k, v in models.items()) + ".", ""]
    if stats:
        lines += [f"BatchNorm running_var after {sizes.bn_steps} training steps on a drifting bf16 stream "
                  "(weights fixed), relative error against an fp32 copy given the same inputs, median over the "
                  "BatchNorms:", ""]
        lines.append(markdown_table(["variant", "statistics dtype", "running_var error"],
                                    ([k, stats[k + " dtype"], f"{stats[k]:.2e}"] for k in VARIANTS if k in stats)))
        lines.append("")
    return "\n".join(lines)


def plot(results: Sequence, path: str) -> Optional[str]:
    """A bar chart of every variant's time relative to Inductor's, with the
    spread as error bars. Returns a message instead when matplotlib is
    missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return "matplotlib is not installed, so no plot was written (pip install matplotlib)"
    labels = [f"{r.case.model}\n{r.case.step}, {r.case.size}" for r in results]
    fig, ax = plt.subplots(figsize=(9, 0.9 * len(results) + 1.5))
    h = 0.8 / len(VARIANTS)
    for i, k in enumerate(VARIANTS):
        ys, xs, lo, hi = [], [], [], []
        for j, r in enumerate(results):
            if k in r.times:
                # Speed relative to Inductor: Inductor's time / this variant's
                # (right of 1: faster), the convention of every table.
                t, base = r.times[k], r.times["inductor"].median
                q1, q3 = t.quartiles
                x = base / t.median
                ys.append(j + (i - (len(VARIANTS) - 1) / 2) * h)
                xs.append(x)
                lo.append(x - base / q3)
                hi.append(base / q1 - x)
        ax.errorbar(xs, ys, xerr=[lo, hi], fmt="o", label=k, capsize=3)
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ticks = [t for t in (0.25, 0.33, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0)
             if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FixedFormatter([f"{t:g}x" for t in ticks]))
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_yticks(range(len(results)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("x faster than Inductor (Inductor's time / the variant's; log scale, bars: IQR)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(VARIANTS), frameon=False)
    ax.set_title(f"wfpass bench, torch {torch.__version__}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
