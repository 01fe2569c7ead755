"""Eval-time folding of BatchNorm into the conv/linear in front of it (opt-in:
``fold_batchnorm=True``; inference only).

Before (Dynamo flavour, eval mode, no grad)::

    c = conv2d(x, conv_w, conv_b, stride, padding, dilation, groups)
    y = batch_norm(c, rm, rv, gamma, beta, False, 0.1, eps)

After::

    wf, bf = folded_params(eps, conv_w, conv_b, rm, rv, gamma, beta)   # in the graph
    y = conv2d(x, wf, bf, stride, padding, dilation, groups)

(a conv without bias gets one).

``wf = conv_w * s`` and ``bf = (conv_b - rm) * s + beta`` with
``s = gamma / sqrt(rv + eps)``, computed in fp32 and cast to the conv's dtype.
The model's own Parameters are untouched. Under ``torch.compile`` the fold is
part of the compiled graph: a few elementwise ops the compiler fuses, on the
live statistics of every call, nothing cached outside it. ``wfpass.apply``
graphs run eagerly and cache the folded tensors on their call target
(``fold_weight`` / ``fold_bias``), recomputed when a source tensor changes.

``call_module`` flavour (``wfpass.apply``)::

    y = bn(conv(x))   ->   y = fold_module_call(x)

which checks train/eval on every call (the module can be switched after the
pass) and runs ``bn(conv(x))`` unchanged in training mode.

The steps (``FoldBatchNorm``), side by side in ``wfpass/batchnorm/``:
``matches`` yields every batch norm (``batchnorm_sites`` of ``match.py``,
the matcher ``fp32_batchnorm`` uses too) with the kind of node in front of
it (``fold.fold_sites``, a ``FoldSite`` each; none unless
``config.fold_batchnorm``), ``guard`` decides (``fold.refusal``) and
``apply`` folds (``fold.fold``, with the kernels of ``kernels.py``).

Guards, each a skip record: the batch norm is in
eval mode (Dynamo: the traced ``training`` argument; call_module: the module
now); grad disabled (Dynamo graphs, where grad mode is guarded); running
statistics present; the conv/linear output has no other user; conv weight and
bias are model Parameters not shared with another tensor (tied weights), and
the BatchNorm's tensors likewise; a linear's output is 2-D (BatchNorm1d then
normalizes its features).
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch.fx as fx

from .fold import FoldSite, fold, fold_sites, refusal
from ..core.graph import PassContext
from ..pipeline import Format

__all__ = ["FoldBatchNorm", "FoldSite"]


class FoldBatchNorm(Format):
    """Fold eval-mode BatchNorm into the conv/linear before it. Finds nothing
    unless ``config.fold_batchnorm``."""

    name, pattern = "fold_batchnorm", "batchnorm"

    def matches(self, gm: fx.GraphModule, ctx: PassContext) -> Iterator[FoldSite]:
        if not ctx.config.fold_batchnorm:
            return
        yield from fold_sites(ctx)

    def guard(self, m: FoldSite, ctx: PassContext) -> Optional[str]:
        why = refusal(m, ctx)
        return None if why is None else f"not folded: {why}"

    def apply(self, m: FoldSite, ctx: PassContext) -> None:
        fold(m, ctx)
