"""The packed-weight format's matcher: every linear call whose weight could
be packed, single or a block ``fuse_linears`` built.

* single linears: ``linear(x, w, b)`` (Dynamo graphs; ``F.linear``) or a
  ``call_module`` of an ``nn.Linear`` (``symbolic_trace`` graphs);
* blocks: ``fused_linear(x, w_block, b_block, spec, *weights, *biases)``,
  the one-GEMM call of a sibling group; its weights are the members, in
  block order, the first at the block's start;
* split groups: the linears of a sibling group ``fuse_linears`` left on
  the split path (one GEMM per member, above ``fused_max_rows``), whose
  weights are views of one block: packed as that block, one copy and one
  call, so a model's prefill and decode graphs share one packed copy
  instead of packing the block and each member.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ..core.graph import PassContext, TensorRef, meta_value, mutated_state
from ..linear.kernel import fused_linear
from ..linear.site import LinearSite, linear_sites, rows_of, weight_block_of
from ..pipeline import Match
from ..core.storage import layout_of

__all__ = ["PackMatch", "pack_candidates"]


class PackMatch(Match):
    """One linear call (or one block's call) whose weight may be packed."""

    def __init__(self, node: fx.Node, x: fx.Node, weights: List[Optional[TensorRef]], bias: Optional[fx.Node],
                 bias_ref: Optional[TensorRef], rows: int, block: bool, members: Sequence[fx.Node] = (),
                 bias_nodes: Sequence[fx.Node] = ()):
        names = [w.name if w is not None else node.name for w in weights]
        if bias_ref is not None and not block:
            names.append(bias_ref.name)
        super().__init__(names)
        self.node, self.x, self.weights, self.bias, self.bias_ref = node, x, weights, bias, bias_ref
        self.rows, self.block = rows, block
        # A split group: its linear calls in block order, and their biases.
        self.members, self.bias_nodes = list(members), list(bias_nodes)
        self.m: Optional[int] = rows_of(x)  # M, None where symbolic or unknown
        # Set by the guard of a taken match: the kernel for a static M and its row's words.
        self.kernel, self.why = "", ""
        # A symbolic M: the size the graph was compiled for, measured then.
        self.hint: Optional[int] = None
        # The graph's in-place writes to its inputs and attributes
        # (``graph.mutated_state``), found once per run by the matcher.
        self.written: Dict[fx.Node, str] = {}

    def needs_grad(self) -> Optional[bool]:
        """Does the graph compute a gradient through this call? None where the
        graph does not say (``symbolic_trace`` graphs carry no values). A
        block call ``fuse_linears`` made carries no value, but the flag it
        took from the members' values."""
        v = meta_value(self.node)
        if isinstance(v, torch.Tensor):
            return bool(v.requires_grad)
        flag = self.node.meta.get("wfpass_requires_grad")
        return bool(flag) if flag is not None else None


def _split_group(x: fx.Node, sites: List[Tuple[fx.Node, TensorRef, Optional[fx.Node]]]) -> Optional[PackMatch]:
    """Linears over one input ``x`` (``sites`` in graph order) whose weights
    are all the members of one intact sibling block: one block match, its
    members in block order (None otherwise)."""
    fs = layout_of(sites[0][1].tensor)
    members = fs.members
    order = {id(t): i for i, t in enumerate(members)}
    if len(sites) != len(members) or any(id(w.tensor) not in order for _, w, _ in sites):
        return None
    first = sites[0][0]  # the new call goes before the first of them in the graph
    sites = sorted(sites, key=lambda s: order[id(s[1].tensor)])
    biases = [b for _, _, b in sites]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None  # only some members have a bias: packed one by one
    rows = sum(w.tensor.shape[0] for _, w, _ in sites)
    return PackMatch(first, x, [w for _, w, _ in sites], None, None, rows, block=True,
                     members=[n for n, _, _ in sites], bias_nodes=[b for b in biases if b is not None])


def _single(ctx: PassContext, site: LinearSite) -> PackMatch:
    """One linear call, its weight packed on its own."""
    node, w = site.node, site.weight
    if node.op == "call_module":
        return PackMatch(node, site.x, [w], None, site.bias, ctx.module_of(node).out_features, block=False)
    rows = w.tensor.shape[0] if w is not None and w.tensor.dim() == 2 else 0
    return PackMatch(node, site.x, [w], site.bias_arg, site.bias, rows, block=False)


def _block_call(ctx: PassContext, node: fx.Node) -> PackMatch:
    """The one-GEMM call of a sibling block, its members' weights packed as the block."""
    x, _w_block, b_block, spec = node.args[:4]
    sizes = spec[0]
    weights = [ctx.resolve(a) for a in node.args[4:4 + len(sizes)]]
    return PackMatch(node, x, weights, b_block, None, sum(sizes), block=True)


def pack_candidates(gm: fx.GraphModule, ctx: PassContext) -> Iterator[PackMatch]:
    """Every linear call (``linear_sites``) and block call, in graph order;
    first, as one match each, the split groups whose members make up a
    whole intact block (their calls then not matched one by one)."""
    sites = {s.node: s for s in linear_sites(ctx)}
    singles: List[PackMatch] = []
    groups: Dict[tuple, List[Tuple[fx.Node, TensorRef, Optional[fx.Node]]]] = {}
    for node in list(gm.graph.nodes):
        site = sites.get(node)
        if site is not None:
            singles.append(_single(ctx, site))
            wr, b = site.weight, site.bias_arg
            # A module call's weight has no node: never a member of a split group.
            fs = weight_block_of(wr.tensor) if wr is not None and wr.node is not None else None
            if fs is not None:
                groups.setdefault((id(fs), site.x), []).append((node, wr, b if isinstance(b, fx.Node) else None))
        elif node.op == "call_function" and node.target is fused_linear:
            singles.append(_block_call(ctx, node))
    written = mutated_state(gm)
    taken = set()
    for (_, x), members in groups.items():
        g = _split_group(x, members)
        if g is not None:
            taken.update(g.members)
            g.written = written
            yield g
    for m in singles:
        if m.node not in taken:
            m.written = written
            yield m
