"""The command line: ``python -m wfpass demo``, ``bench`` and ``doctor``.

Nothing here imports torch at module level: ``--help`` and ``--version``
answer at once, and each command imports what it needs when it runs.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

__all__ = ["main", "build_parser"]

DESCRIPTION = """\
wfpass: weight formats inside the PyTorch compiler.

torch.compile(model, backend="wformat") moves your parameters once into the
layout a kernel wants (fused Q/K/V and gate/up blocks, one flat buffer per
RNN, fp32 BatchNorm statistics in bf16/fp16 models), keeps the same Parameter
objects and state_dict, and reports every decision (wfpass.report(model)).
"""

EPILOG = """\
examples:
  python -m wfpass demo               where wformat pays, measured here, in under a minute
  python -m wfpass bench --quick      the headline comparisons at tiny sizes, a few minutes
  python -m wfpass bench --out results
  python -m wfpass doctor             which torch, kernels and C++ build wfpass uses here
"""


def _version() -> str:
    from importlib import metadata

    from .. import __version__

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    return f"wfpass {__version__} (torch {torch_version}, Python {sys.version.split()[0]})"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def _parts(text: str) -> List[str]:
    from_text = [p.strip() for p in text.split(",") if p.strip()]
    from . import bench

    allowed = bench.PARTS
    bad = [p for p in from_text if p not in allowed]
    if bad or not from_text:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(allowed)}, got {text!r}")
    return from_text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m wfpass", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version(),
                        help="print the versions of wfpass, torch and Python, then exit")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND", title="commands")

    demo = sub.add_parser(
        "demo", help="where backend='wformat' pays, measured on this machine in under a minute",
        description="Three measured wins, each checked against eager PyTorch: a Python loop of LSTMCell steps "
                    "trained (folded into one LSTM call), BatchNorm statistics in a bf16 model (held in fp32), "
                    "and a small decoder decoding with packed weights; then what changed in the model (the "
                    "report, the same Parameter objects, no extra bytes). Timings interleaved, medians with "
                    "their spread; x faster = baseline time / wformat time.")
    demo.add_argument("--rounds", type=_positive, default=5,
                      help="interleaved timing rounds; the median and spread over them are shown (default: 5)")
    demo.add_argument("--threads", type=_positive, default=1,
                      help="torch threads (default: 1, the steadiest timings on a shared machine)")

    bench = sub.add_parser(
        "bench", help="time the headline models under eager, Inductor, a hand-fused reference and wformat",
        description="A LLaMA-like decoder (decode and prefill sizes, regional compilation, after a dynamic "
                    "recompile, a training step), HF generate(), an RNN language model and a speech encoder "
                    "(training step and inference), a bf16 CNN with BatchNorm (training step, eval forward, and "
                    "the BatchNorm statistics against fp32) and LSTMCell/GRUCell loops, each timed under eager "
                    "PyTorch, torch.compile's default (Inductor), a hand-fused reference and "
                    "backend='wformat', every variant in a process of its own, interleaved. Prints the worst "
                    "row against Inductor and against eager, and writes a markdown table (bench.md), the "
                    "figures (bench.json) and a plot (bench.png, needs matplotlib) into --out. The full run "
                    "takes about ten minutes on a 2-core machine; --quick about two.")
    bench.add_argument("--quick", action="store_true",
                       help="tiny sizes and 3 rounds: a few minutes, to see that everything runs")
    bench.add_argument("--out", default="wfpass-bench", metavar="DIR",
                       help="folder for bench.md and bench.png, created if needed (default: ./wfpass-bench)")
    bench.add_argument("--rounds", type=_positive, default=None,
                       help="interleaved timing rounds (default: 7, or 3 with --quick)")
    bench.add_argument("--only", type=_parts, default=None, metavar="PARTS",
                       help="comma list of the models to run: decoder, generate, rnn, speech, packed, cnn, cells (default: all)")
    bench.add_argument("--threads", type=_positive, default=None,
                       help="torch threads (default: torch's own choice; 1 with --quick)")
    bench.add_argument("--no-plot", action="store_true", help="write the table only, not bench.png")

    sub.add_parser(
        "doctor", help="which torch, kernels and C++ build wfpass uses on this machine",
        description="The torch release and whether wfpass was tested on it; for each dtype, whether oneDNN's LSTM "
                    "kernel and packed linears run on this CPU (probed with a tiny call); whether wfpass's C++ "
                    "kernels are built and in use, and if not, why (the compiler's first error); CUDA and cuDNN.")
    sub.add_parser(
        "libraries", help="the two libraries a C++ program loads to run a package wfpass.export made",
        description="Builds (once per machine and torch version) and prints, one per line, the libraries a C++ "
                    "program loads before torch::inductor::AOTIModelPackageLoader runs an AOTInductor package "
                    "of a wfpass.export program: wfpass's C++ kernels, then its ops' definitions "
                    "(docs/guide/export.md, examples/export_cpp/run_package.cpp).")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.print_help()
        return 2
    if args.cmd == "demo":
        from .demo import demo

        return demo(rounds=args.rounds, threads=args.threads)
    if args.cmd == "bench":
        from . import bench

        problem = bench.out_problem(args.out)
        if problem is not None:
            parser.error(problem)
        given = sys.argv[1:] if argv is None else list(argv)
        return bench.main(quick=args.quick, out=args.out, rounds=args.rounds,
                          parts=args.only or bench.PARTS, threads=args.threads, plot_file=not args.no_plot,
                          command="python -m wfpass " + " ".join(given))
    if args.cmd == "doctor":
        from .doctor import doctor

        return doctor()
    if args.cmd == "libraries":
        from ..native.program import cxx_libraries

        try:
            paths = cxx_libraries()
        except RuntimeError as e:
            print(f"wfpass: {e}", file=sys.stderr)
            return 1
        print("\n".join(str(p) for p in paths))
        return 0
    return 2  # pragma: no cover - argparse rejects unknown commands
