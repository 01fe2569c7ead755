"""Sibling-linear fusion (Q/K/V, gate/up): one GEMM over one weight block.

Before (three linears reading the same ``x``)::

    q = linear(x, q_w, q_b); k = linear(x, k_w, None); v = linear(x, v_w, v_b)

After, when the group computes on the fused path (see ``wfpass/linear/kernel.py``)::

    w = as_strided(q_w, (dq + dk + dv, d_in), (d_in, 1), 0)    # the block: a view of q_w's storage
    b = bias_vector([dq, dk, dv], [True, False, True], q_b, v_b)   # k has no bias
    y = fused_linear(x, w, b, spec, q_w, k_w, v_w, q_b, v_b)
    q, k, v = split(y, [dq, dk, dv], -1)

The parameters are moved into the block when the graph is compiled; another
parameter set meeting the same graph is moved on its first call
(``runtime.guarded_call``).

On the split path (large M, where one GEMM gains nothing here) a Dynamo
graph is left as it was (a ``symbolic_trace`` graph gets a layout check in
front of the linears: ``EagerLayoutCheck``); the storage is fused either way, which costs nothing and lets
each shape take the faster path.

A graph whose M is symbolic (Dynamo's recompile after a second length)
takes both, chosen per call at the same ``fused_max_rows`` (``by_rows``):
the fused path's graph, with the threshold in the spec::

    y = fused_linear(x, w, b, ([dq, dk, dv], [True, False, True], 4), q_w, k_w, v_w, q_b, v_b)

which AOTAutograd traces to one op, ``wfpass::linear_by_rows(x, w, b,
sizes, 4)``, that picks per call (``wfpass/linear/kernel.py``); each call
is counted on the path its M took.

The steps ``pipeline.drive`` runs:

- ``matches``: the linears reading one input (at least two), then the
  layers that already compute several projections with one weight
  (``wfpass/linear/already_fused.py``), which are reported and left alone.
- ``narrow``: the members left out of a group, each with its skip row: the
  weight resolves to a model Parameter/buffer; bias dtype equal to the
  weight's; not written in place inside the graph (a hook or ``clamp_`` in
  forward: ``graph.mutated_state``); not the same weight twice; same dtype,
  device and in_features as the largest part of the group; not depending on
  another member's output (networkx proves the fused node creates no cycle);
  no weight or bias shared with another tensor (ties stay tied).
- ``guard``: at least ``min_group_size`` left; the parameters are inputs of
  a Dynamo graph (not attributes baked in by ``freezing=True``); picks the
  path (one GEMM, one per member, or per call) from the row count.
- ``apply``: moves the weights into the block and rewrites the graph.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import torch.fx as fx

from ..core.graph import PassContext
from .already_fused import AlreadyFused, already_fused
from .guards import group_problem, narrow_group
from .match import LinearGroup, groups
from .rewrite import rewrite_group
from ..pipeline import Format, Match
from ..core.runtime import note

__all__ = ["FuseLinears"]


class FuseLinears(Format):
    """The sibling-linear format (see the module docstring)."""

    name, pattern = "fuse_linears", "linear"
    # In a checkpointed region the block is read in the body, so the
    # backward's recomputation reads it too; the layout check stays on the
    # outer graph, whose placeholders the body's operands are.
    in_bodies = True

    def matches(self, gm: fx.GraphModule, ctx: PassContext) -> Iterator[Match]:
        grouped = set()
        for group in groups(gm, ctx):
            grouped.add(group.x)
            yield group
        # Asked after the groups are rewritten: the graph as they left it.
        yield from already_fused(gm, ctx, grouped)

    def narrow(self, m: Match, ctx: PassContext) -> Tuple[Optional[Match], List[Tuple[Match, str]]]:
        return narrow_group(m, ctx) if isinstance(m, LinearGroup) else (m, [])

    def guard(self, m: Match, ctx: PassContext) -> Optional[str]:
        return m.reason if isinstance(m, AlreadyFused) else group_problem(m, ctx)

    def skipped(self, m: Match, record, ctx: PassContext) -> None:
        # Filed under the tensors too: ``wfpass.report(model)`` finds it by
        # identity; a dry run files nothing under the model's tensors.
        if ctx.config.dry_run:
            return
        refs = m.refs()
        note(record, [r.name for r in refs], [r.tensor for r in refs])

    def apply(self, m: Match, ctx: PassContext) -> None:
        rewrite_group(ctx, m)
        m.run.changed()


