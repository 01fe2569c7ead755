"""The pass pipeline: the built-in formats, in the order written once, here.

Each pass is ``(gm, ctx) -> int`` (the number of patterns it rewrote) and
writes its decisions into ``ctx.report``. After every pass the graph is
cleaned up the same way: dead code eliminated, linted, recompiled.
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, List, Tuple

import torch.fx as fx

from ..formats import PassFormat, register_format, registered_formats
from ..graph import PassContext
from .fold_batchnorm import fold_batchnorm
from .fold_cells import fold_cells
from .fp32_batchnorm import fp32_batchnorm
from .fuse_linears import fuse_linears
from .fuse_rnn import fuse_rnn

__all__ = ["PIPELINE", "run_passes"]

log = logging.getLogger("wfpass")

PassFn = Callable[[fx.GraphModule, PassContext], int]

#: The built-in formats, in the order they run; registered below, so the
#: pipeline is simply "every registered format", users' ones after these.
PIPELINE: List[Tuple[str, str, PassFn]] = [
    ("fuse_linears", "linear", fuse_linears),
    # Before fuse_rnn: a folded cell loop is an RNN call fuse_rnn then lowers.
    ("fold_cells", "rnn", fold_cells),
    ("fuse_rnn", "rnn", fuse_rnn),
    ("fp32_batchnorm", "batchnorm", fp32_batchnorm),
    ("fold_batchnorm", "batchnorm", fold_batchnorm),
]
for _name, _pattern, _fn in PIPELINE:
    register_format(PassFormat(_name, _pattern, _fn))


def _keep(node: fx.Node) -> bool:
    # FX counts every call_method as pure, so DCE would drop Dynamo's
    # ``num_batches_tracked.add_(1)`` (no users): keep in-place methods.
    # A layout check in a ``wfpass.apply`` graph returns nothing and runs for its effect.
    return node.is_impure() or (node.op == "call_method" and str(node.target).endswith("_")) or getattr(
        node.target, "_wfpass_keep", False)


def _cleanup(gm: fx.GraphModule) -> None:
    gm.graph.eliminate_dead_code(is_impure_node=_keep)
    gm.graph.lint()
    gm.recompile()


def run_passes(gm: fx.GraphModule, ctx: PassContext) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    wanted = ctx.config.passes
    for fmt in registered_formats():
        if wanted is not None and fmt.name not in wanted:
            continue
        counts[fmt.name] = fmt.run(gm, ctx)
        if counts[fmt.name] and not ctx.config.dry_run:
            _cleanup(gm)
        log.debug("format %s rewrote %d pattern(s)", fmt.name, counts[fmt.name])
    return counts
