"""The built-in formats, in the order they run: the one place that order is written.

Each entry is a format object (``wfpass.pipeline.Format``): a name (what
``Config(passes=...)`` and the report use), a pattern (the report's column),
its steps, and the ordering constraints it declares, which the pipeline
checks when this list is installed. Users' formats run after these.
After every format that rewrote something the graph is cleaned up the same
way: dead code eliminated, linted, recompiled (``pipeline.cleanup``).
"""
from __future__ import annotations

from .pipeline import install_builtins, run_passes
from .batchnorm.fold_format import FoldBatchNorm
from .rnn.cells.format import FoldCells
from .batchnorm.fp32_format import Fp32BatchNorm
from .linear.format import FuseLinears
from .rnn.format import FuseRnn
from .prepack.format import PackLinears

__all__ = ["BUILTIN_FORMATS", "PASS_NAMES", "run_passes"]

BUILTIN_FORMATS: tuple = (
    FuseLinears(),
    # A folded cell loop is an RNN call that fuse_rnn then lowers.
    FoldCells(before=("fuse_rnn",)),
    FuseRnn(),
    Fp32BatchNorm(),
    # fold_batchnorm finds BatchNorms with the matcher it shares with
    # fp32_batchnorm (wfpass/batchnorm/match.py), which looks through the
    # wrapper fp32_batchnorm puts around the ones it rewrote.
    FoldBatchNorm(after=("fp32_batchnorm",)),
    # Last: it packs the blocks fuse_linears builds as one weight each, and
    # only linears whose weight no format rewrites after it (a folded
    # BatchNorm changes the weight its linear reads).
    PackLinears(after=("fuse_linears", "fold_batchnorm")),
)
install_builtins(BUILTIN_FORMATS)

#: The built-in formats' names, in pipeline order.
PASS_NAMES = tuple(f.name for f in BUILTIN_FORMATS)
