"""One RNN layer on the CPU: eager's kernels against wfpass's C++ loop.

Behind ``rnn={"cpu_kernel": "auto"}`` (docs/guide/rnn.md, "CPU kernels"; docs/results/rnn_cpu_kernels.md): for each
mode and size, one layer and one direction, float32, called as the compiled
graph calls it, with no autograd around it:

* eager's kernel: for an LSTM oneDNN's LSTM layer (``wfpass::lstm_layer``,
  i.e. ``aten.mkldnn_rnn_layer`` and its backward), for a GRU or plain RNN
  ``wfpass::rnn_layer`` (ATen's kernels); what ``cpu_kernel="eager"`` runs;
* the C++ loop: ``wfpass::packed_layer`` over the full batch ``[T, B, I]``
  (per step oneDNN's small-GEMM kernel and AVX-512 or AVX2 gate math);

each in inference (the forward, no workspace) and training (the forward
with its workspace, then the backward with a gradient for the output). The
four variants of a size are timed in interleaved rounds (``--rounds``, the
order rotated, each sample at least ``--sample-s`` of calls); a time is the
median over rounds, a ratio eager's time / the loop's (above 1: the loop is
faster). The last columns say what ``cpu_kernel="auto"`` takes at that size
(inference / training where they differ) and in which steps that kernel was
the faster one here.

    python benchmarks/rnn/cpu_rnn_kernels.py --threads 1
    python benchmarks/rnn/cpu_rnn_kernels.py --threads 2
    python benchmarks/rnn/cpu_rnn_kernels.py --lm --threads 1   # the LSTM LM's training step on both kernels
    python benchmarks/rnn/cpu_rnn_kernels.py --lm-recompiled --threads 1   # the same after a dynamic recompile
    python benchmarks/rnn/cpu_rnn_kernels.py --training-bound --threads 2  # the sizes around the LSTM's training bound
    python benchmarks/rnn/cpu_rnn_kernels.py --quick        # a smoke run (tests/test_benchmarks.py)
"""
from __future__ import annotations

import argparse
import functools
import sys
from typing import List, Optional

import torch
from wfpass.tools.doctor import cpu_words  # the page names its CPU: figures differ by vendor

#: (mode, T, B, I, H): the small sizes the rule takes the loop for, the
#: edges of its LSTM bound, larger ones where oneDNN's layer wins, and
#: hidden 256 and 512, where a GRU's and a plain RNN's bound lies with AVX2.
SIZES = [
    ("LSTM", 4, 4, 32, 64), ("LSTM", 16, 1, 32, 64), ("LSTM", 8, 16, 64, 64), ("LSTM", 32, 4, 64, 64),
    ("LSTM", 4, 32, 64, 64), ("LSTM", 16, 1, 128, 128), ("LSTM", 64, 4, 64, 128), ("LSTM", 16, 8, 128, 128),
    ("LSTM", 16, 16, 128, 128), ("LSTM", 32, 8, 256, 256), ("LSTM", 16, 4, 512, 512),
    ("GRU", 4, 4, 32, 64), ("GRU", 16, 1, 32, 64), ("GRU", 16, 8, 128, 128), ("GRU", 64, 4, 64, 128),
    ("GRU", 32, 16, 256, 256), ("GRU", 50, 64, 256, 512),
    ("RNN_TANH", 4, 4, 32, 64), ("RNN_TANH", 16, 8, 128, 128), ("RNN_TANH", 32, 16, 256, 256),
    ("RNN_TANH", 50, 64, 256, 512),
]
QUICK = [("LSTM", 4, 4, 32, 64), ("GRU", 4, 4, 32, 64)]
GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1}


#: ``--training-bound``: around the LSTM's training bound (hidden 128: batch 8 at 1 thread, 4 at more).
BOUND_SIZES = [("LSTM", T, B, 128, 128) for T in (16, 64) for B in (1, 4, 8)] + [
    ("LSTM", 16, 8, 64, 64), ("LSTM", 16, 32, 64, 64)]


def _calls(mode: str, T: int, B: int, I: int, H: int):
    """The four calls of one size: eager's and the loop's, inference and training."""
    ops = torch.ops.wfpass
    g = torch.Generator().manual_seed(0)
    G = GATES[mode]
    x = torch.randn(T, B, I, generator=g)
    w = [torch.randn(G * H, I, generator=g) * 0.1, torch.randn(G * H, H, generator=g) * 0.1,
         torch.randn(G * H, generator=g) * 0.1, torch.randn(G * H, generator=g) * 0.1]
    grad = torch.randn(T, B, H, generator=g)
    rows = grad.reshape(T * B, H)
    none = torch.empty(0, dtype=torch.int64)

    if mode == "LSTM":
        def eager_inf():
            ops.lstm_layer_fw(x, *w, None, None, False, H, True, False)

        def eager_train():
            y, hy, cy, ws = ops.lstm_layer_fw(x, *w, None, None, False, H, True, True)
            ops.lstm_layer_backward(x, *w, None, None, y, hy, cy, grad, None, None, False, H, True, ws)
    else:
        def eager_inf():
            ops.rnn_layer_fw(x, *w, None, mode, False)

        def eager_train():
            y, _ = ops.rnn_layer_fw(x, *w, None, mode, False)
            ops.rnn_layer_backward(x, *w, None, y, grad, None, mode, False)

    def loop_inf():
        ops.packed_layer_fw(x, none, *w, None, None, None, mode, False, False)

    def loop_train():
        r = ops.packed_layer_fw(x, none, *w, None, None, None, mode, False, True)
        ops.packed_layer_backward(x, none, *w, None, None, None, *r, rows, None, None, mode, False)

    return {"eager inference": eager_inf, "loop inference": loop_inf, "eager training": eager_train,
            "loop training": loop_train}


def _rule(mode: str, T: int, B: int, I: int, H: int, train: bool = False) -> bool:
    """Does ``cpu_kernel="auto"`` take the loop at this size (in a training graph: ``train``)?"""
    from wfpass.config import RnnOptions
    from wfpass.rnn.plan import cxx_serves
    from wfpass.rnn.spec import RnnSpec

    spec = RnnSpec(name="rnn", mode=mode, input_size=I, hidden_size=H, proj_size=0, num_layers=1,
                   bidirectional=False, batch_first=False, has_biases=True, dropout=0.0, threshold=2, offsets=(),
                   numel=0, options=RnnOptions())
    return cxx_serves(spec, torch.empty(T, B, I), T, train)


def run(sizes, rounds: int, sample_s: float) -> List[str]:
    import wfpass  # noqa: F401
    from wfpass import native
    from wfpass.rnn.cpu import lstm_layer, native_layer, varlen_layer  # noqa: F401  (the ops)
    from wfpass.tools.bench_timing import interleaved

    if not native.fast_loop():
        why = "neither AVX-512 nor AVX2 with FMA" if native.load() is None else native.status()
        raise SystemExit(f"the C++ loop's fast steps do not run here ({why}): "
                         "cpu_kernel='auto' keeps eager's kernels, nothing to compare")
    lines = [f"torch {torch.__version__}, {cpu_words()} ({native.fast_isa_words()} gate math), "
             f"{torch.get_num_threads()} thread(s), {rounds} interleaved rounds, median us per layer call; "
             "x = eager's time / the loop's",
             "",
             "| mode | T | batch | input | hidden | eager inference | loop inference | x | eager training | "
             "loop training | x | auto takes | faster in |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    wrong = 0
    for size in sizes:
        t = interleaved(_calls(*size), rounds=rounds, min_s=sample_s)
        us = {k: v.median * 1e6 for k, v in t.items()}
        xi = us["eager inference"] / us["loop inference"]
        xt = us["eager training"] / us["loop training"]
        loop = {"inference": _rule(*size), "training": _rule(*size, train=True)}
        # Was the kernel auto takes the faster one, per step?
        won = [step for step, x in (("inference", xi), ("training", xt)) if (x >= 1) == loop[step]]
        verdict = "both" if len(won) == 2 else (f"{won[0]} only" if won else "neither")
        wrong += len(won) < 2
        takes = {k: "loop" if v else "eager" for k, v in loop.items()}
        takes = takes["inference"] if takes["inference"] == takes["training"] else " / ".join(takes.values())
        lines.append(f"| {size[0]} | {' | '.join(str(v) for v in size[1:])} | {us['eager inference']:.1f} | "
                     f"{us['loop inference']:.1f} | {xi:.2f} | {us['eager training']:.1f} | "
                     f"{us['loop training']:.1f} | {xt:.2f} | {takes} | {verdict} |")
        print(lines[-1], flush=True)
    lines.append("")
    lines.append(f"auto took the faster kernel in both steps at {len(sizes) - wrong} of {len(sizes)} sizes")
    return lines


def lm_steps(shapes, rounds: int, sample_s: float) -> List[str]:
    """The LSTM language model of ``python -m wfpass bench`` (Embedding 500
    -> 2-layer LSTM 128 -> Linear 500), a training step (forward,
    ``sum().backward()``, SGD, zero_grad) at each ``(T, batch)``: eager,
    ``torch.compile``'s default, and wformat with ``cpu_kernel="eager"``
    and ``"cxx"``, each its own copy and forward code object, interleaved
    rounds, medians (ms). Where the per-layer tables tie, the whole step
    decides."""
    import copy

    import wfpass
    from wfpass.tools.bench import own_code
    from wfpass.tools.bench_models import RnnLM
    from wfpass.tools.bench_timing import interleaved

    lines = [f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {rounds} interleaved rounds, "
             "median ms per training step",
             "", "| T | batch | eager | default | wformat, cpu_kernel='eager' | wformat, 'cxx' | eager's kernel / the loop |",
             "|---|---|---|---|---|---|---|"]
    for T, B in shapes:
        torch.manual_seed(0)
        base = RnnLM(vocab=500, hidden=128, layers=2)
        x = torch.randint(0, 500, (T, B))
        models = {"eager": own_code(copy.deepcopy(base)),
                  "default": torch.compile(own_code(copy.deepcopy(base)), dynamic=False)}
        for k in ("eager", "cxx"):
            models["wf " + k] = torch.compile(own_code(copy.deepcopy(base)), dynamic=False,
                                              backend=wfpass.backend(rnn={"cpu_kernel": k}))

        def step(m):
            opt = torch.optim.SGD(m.parameters(), lr=1e-6)

            def run():
                m(x).sum().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return run

        fns = {k: step(m) for k, m in models.items()}
        for f in fns.values():
            for _ in range(3):
                f()
        ms = {k: v.median * 1e3 for k, v in interleaved(fns, rounds=rounds, min_s=sample_s).items()}
        lines.append(f"| {T} | {B} | {ms['eager']:.3f} | {ms['default']:.3f} | {ms['wf eager']:.3f} | "
                     f"{ms['wf cxx']:.3f} | {ms['wf eager'] / ms['wf cxx']:.2f} |")
        print(lines[-1], flush=True)
    return lines


def lm_recompiled_steps(shapes, rounds: int, sample_s: float) -> List[str]:
    """``--lm-recompiled``: the LSTM language model's training step (loss:
    a fixed random projection of the logits, SGD) after Dynamo recompiled
    it with a symbolic length and batch, whose sizes wfpass's training graph
    specializes: Inductor (the default), wformat with ``cpu_kernel="eager"``
    (oneDNN's layer, what such a graph ran whatever its sizes until the rule
    was applied to specialized sizes) and wformat (``auto``'s kernel for
    those sizes), each its own copy and forward code object, interleaved
    rounds per shape, medians (ms)."""
    import copy

    import wfpass
    from wfpass.tools.bench import own_code
    from wfpass.tools.bench_models import RnnLM
    from wfpass.tools.bench_timing import interleaved

    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    torch.manual_seed(0)
    base = RnnLM(vocab=500, hidden=128, layers=2)
    warm = [(1, 1), (4, 2)]  # the second shape makes Dynamo recompile with symbolic sizes
    g = torch.Generator().manual_seed(1)
    xs = {s: torch.randint(0, 500, s, generator=g) for s in warm + shapes}
    Rs = {s: torch.randn(*s, 500, generator=g) for s in warm + shapes}
    variants = {"inductor": "inductor", "onednn": wfpass.backend(rnn={"cpu_kernel": "eager"}), "auto": "wformat"}
    steps = {}
    for name, backend in variants.items():
        m = own_code(copy.deepcopy(base))
        f = torch.compile(m, backend=backend)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)

        def step(s, f=f, opt=opt):
            opt.zero_grad(set_to_none=True)
            (f(xs[s]) * Rs[s]).sum().backward()
            opt.step()
        for s in warm + shapes:
            step(s)
        for s in shapes:
            steps[(s, name)] = functools.partial(step, s)
    lines = [f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {rounds} interleaved rounds, "
             "median ms per training step after a dynamic recompile; x = the other's time / wformat's",
             "", "| T | batch | Inductor | wformat, cpu_kernel='eager' | wformat | vs Inductor | vs cpu_kernel='eager' |",
             "|---|---|---|---|---|---|---|"]
    for s in shapes:
        ms = {k: v.median * 1e3 for k, v in interleaved({n: steps[(s, n)] for n in variants}, rounds=rounds,
                                                         min_s=sample_s).items()}
        lines.append(f"| {s[0]} | {s[1]} | {ms['inductor']:.3f} | {ms['onednn']:.3f} | {ms['auto']:.3f} | "
                     f"{ms['inductor'] / ms['auto']:.2f} | {ms['onednn'] / ms['auto']:.2f} |")
        print(lines[-1], flush=True)
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--sample-s", type=float, default=0.1)
    ap.add_argument("--quick", action="store_true", help="two sizes, one round: a smoke run")
    ap.add_argument("--lm", action="store_true",
                    help="instead: the LSTM language model's training step at T 16 and 64, batch 8, both kernels")
    ap.add_argument("--training-bound", action="store_true",
                    help="instead: the sizes around auto's training bound for LSTMs (hidden 128, batch 1-8; hidden 64, "
                         "batch 8 and 32)")
    ap.add_argument("--lm-recompiled", action="store_true",
                    help="instead: its training step after a dynamic recompile, T 16-256, batch 1 and 8")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.training_bound:
        lines = run(BOUND_SIZES, a.rounds, a.sample_s)
    elif a.lm_recompiled:
        lines = lm_recompiled_steps([(16, 1), (16, 8), (64, 1), (64, 8), (256, 1), (256, 8)], a.rounds,
                                    max(a.sample_s, 0.15))
    elif a.lm:
        lines = lm_steps([(16, 8), (64, 8)], a.rounds, max(a.sample_s, 0.2))
    elif a.quick:
        lines = run(QUICK, 1, 0.002)
    else:
        lines = run(SIZES, a.rounds, a.sample_s)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
