"""The pass pipeline: the order is written once, here.

Each pass is ``(gm, ctx) -> int`` (the number of patterns it rewrote) and
writes its decisions into ``ctx.report``. After every pass the graph is
cleaned up the same way: dead code eliminated, linted, recompiled.
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, List, Tuple

import torch.fx as fx

from ..graph import PassContext
from .fold_batchnorm import fold_batchnorm
from .fp32_batchnorm import fp32_batchnorm
from .fuse_linears import fuse_linears
from .fuse_rnn import fuse_rnn

__all__ = ["PIPELINE", "run_passes"]

log = logging.getLogger("wfpass")

PassFn = Callable[[fx.GraphModule, PassContext], int]

#: (name, pass) in the order they run. Names match ``Config.passes``.
PIPELINE: List[Tuple[str, PassFn]] = [
    ("fuse_linears", fuse_linears),
    ("fuse_rnn", fuse_rnn),
    ("fp32_batchnorm", fp32_batchnorm),
    ("fold_batchnorm", fold_batchnorm),
]


def _keep(node: fx.Node) -> bool:
    # FX counts every call_method as pure, so DCE would drop Dynamo's
    # ``num_batches_tracked.add_(1)`` (no users): keep in-place methods.
    return node.is_impure() or (node.op == "call_method" and str(node.target).endswith("_"))


def _cleanup(gm: fx.GraphModule) -> None:
    gm.graph.eliminate_dead_code(is_impure_node=_keep)
    gm.graph.lint()
    gm.recompile()


def run_passes(gm: fx.GraphModule, ctx: PassContext) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for name, fn in PIPELINE:
        if name not in ctx.config.passes:
            continue
        counts[name] = fn(gm, ctx)
        if counts[name] and not ctx.config.dry_run:
            _cleanup(gm)
        log.debug("pass %s rewrote %d pattern(s)", name, counts[name])
    return counts
