"""One GRU layer's forward on the CPU: wfpass's op (``wfpass::rnn_layer_fw``,
its C++ loop for float32/float64) against eager ``nn.GRU`` (ATen's loop)
and the op's Python kernel (``torch.gru``), without grad, same weights.

    python benchmarks/rnn/profile_gru_kernel.py --out docs/results/gru_kernel.md

1 thread; the bench's ``interleaved`` timing (9 rounds, order rotated, a
sample of at least 0.1 s), medians; outputs checked
equal to ``nn.GRU``'s (to 1e-5).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _out.py
from _out import emit  # noqa: E402
from wfpass.tools.doctor import cpu_words  # the page names its CPU: figures differ by vendor


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    import wfpass  # noqa: F401  (registers the op)
    from wfpass import native
    from wfpass.rnn.cpu import native_layer
    from wfpass.tools.bench_timing import interleaved

    if not native.loaded():
        print(native.status())
        return 1
    rows = []
    for T, B, I, H in ((32, 4, 64, 128), (128, 4, 64, 128), (32, 16, 128, 256), (64, 1, 64, 64)):
        torch.manual_seed(0)
        gru = torch.nn.GRU(I, H)
        ws = [p.detach() for p in gru._flat_weights]
        x = torch.randn(T, B, I)
        with torch.no_grad():
            ref = gru(x)[0]
            ours = torch.ops.wfpass.rnn_layer_fw(x, *ws, None, "GRU", False)[0]
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        fns = {"nn.GRU (eager)": lambda: gru(x),
               "wfpass op, C++ loop": lambda: torch.ops.wfpass.rnn_layer_fw(x, *ws, None, "GRU", False),
               "wfpass op, Python kernel (torch.gru)": lambda: native_layer._rnn_layer(x, *ws, None, "GRU", False)}
        with torch.no_grad():
            med = {k: t.median * 1e6 for k, t in interleaved(fns, rounds=9, min_s=0.1).items()}
        rows.append(((T, B, I, H), med))
        print((T, B, I, H), {k: round(v) for k, v in med.items()}, flush=True)
    names = list(rows[0][1])
    lines = ["Command: `python benchmarks/rnn/profile_gru_kernel.py" + (f" --out {a.out}`" if a.out else "`"), "",
             f"torch {torch.__version__}, {cpu_words()}, 1 thread, no grad; us per call (median of 9 interleaved rounds, a sample "
             "of at least 0.1 s each); x faster = nn.GRU's time / the C++ loop's.", "",
             "| T, batch, input, hidden | " + " | ".join(names) + " | x faster than nn.GRU |",
             "|---|" + "---|" * (len(names) + 1)]
    for shape, med in rows:
        lines.append(f"| {', '.join(map(str, shape))} | " + " | ".join(f"{med[k]:.0f}" for k in names)
                     + f" | {med['nn.GRU (eager)'] / med['wfpass op, C++ loop']:.2f} |")
    return emit(lines, a.out)


if __name__ == "__main__":
    sys.exit(main())
