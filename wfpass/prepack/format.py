"""Packed weights: a linear computed from the CPU kernel library's own
packed copy of its weight, kept beside the parameter and never stale.

Before (a single linear, and the one-GEMM call ``fuse_linears`` leaves for
a Q/K/V group at decode sizes)::

    y = linear(x, w, b)
    qkv = fused_linear(x, as_strided(q_w, ...), b_block, spec, q_w, k_w, v_w, ...)

After::

    y = wfpass.packed_linear(x, [w], [b], 512, site)
    qkv = wfpass.packed_linear(x, [q_w, k_w, v_w], [q_b, k_b, v_b], 768, site)

The op reads the parameters (the compiler sees the dependency) and, per
call, finds the packed copy made from them, checks it against them and
makes it again if they changed (``wfpass/prepack/kernel.py``); per row count
it runs the kernel measured fastest for the shape, the plain GEMM
included (``wfpass/prepack/choose.py``).

The steps ``pipeline.drive`` runs:

- ``matches``: every linear call, and every ``fused_linear`` block
  (``wfpass/prepack/match.py``); runs after ``fuse_linears``, whose blocks
  it packs as one weight.
- ``guard``: the weight is a Parameter or buffer on the CPU in a dtype a
  packed kernel takes on this CPU; input, weight and output of one dtype
  (no autocast); not written in the graph; no gradient through it unless
  ``prepack.training``; for a static row count, a packed kernel measured
  faster than the plain GEMM (``wfpass/prepack/guards.py``).
- ``apply``: the call becomes ``wfpass::packed_linear`` with its site
  (``wfpass/prepack/rewrite.py``). Nothing moves: the parameters stay where
  they are, and the first call makes the copy.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch.fx as fx

from ..core.graph import PassContext
from .guards import pack_problem
from .kernel import drop_copies
from .match import PackMatch, pack_candidates
from .rewrite import rewrite_call
from ..pipeline import Format
from ..core.runtime import note

__all__ = ["PackLinears"]


class PackLinears(Format):
    """The packed-weight format (see the module docstring)."""

    name, pattern = "prepack_linears", "prepack"

    def restore(self, module) -> None:
        # Packed copies are derived state: the next call makes them again.
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            drop_copies(t)

    def matches(self, gm: fx.GraphModule, ctx: PassContext) -> Iterator[PackMatch]:
        yield from pack_candidates(gm, ctx)

    def guard(self, m: PackMatch, ctx: PassContext) -> Optional[str]:
        return pack_problem(m, ctx)

    def skipped(self, m: PackMatch, record, ctx: PassContext) -> None:
        if ctx.config.dry_run:  # a dry run files nothing under the model's tensors
            return
        refs = [r for r in m.weights if r is not None]
        note(record, [r.name for r in refs], [r.tensor for r in refs])

    def apply(self, m: PackMatch, ctx: PassContext) -> None:
        rewrite_call(ctx, m)
