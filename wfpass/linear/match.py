"""The sibling-linear format's matcher: linears that read the same input.

``linear_sites`` finds every linear call (``site.py``, the matcher the
packed-weight format shares); ``groups`` groups them by their input: one
``LinearGroup`` per input read by two or more.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterator, List, Optional, Sequence

import networkx as nx
import torch.fx as fx

from ..core.graph import PassContext, mutated_state
from ..pipeline import Match
from .site import LinearSite, linear_sites, rows_of

__all__ = ["LinearSite", "linear_sites", "rows_of", "LinearGroup", "RunState", "groups", "dependency_graph",
           "site_params"]


def dependency_graph(gm: fx.GraphModule) -> nx.DiGraph:
    """The graph's data dependencies as a networkx graph (node -> its users)."""
    g = nx.DiGraph()
    for n in gm.graph.nodes:
        g.add_node(n)
        for u in n.users:
            g.add_edge(n, u)
    return g


def site_params(sites: Sequence[LinearSite]) -> List[str]:
    out = []
    for s in sites:
        out.append(s.weight.name if s.weight else s.node.name)
        if s.has_bias and s.bias is not None:
            out.append(s.bias.name)
    return out


class RunState:
    """What the groups of one run share: the state written in place in the
    graph, and the graph's dependencies (built when first needed, dropped
    when a rewrite changes the graph)."""

    def __init__(self, gm: fx.GraphModule):
        self.gm, self.written, self._dep = gm, mutated_state(gm), None

    @property
    def dep(self) -> nx.DiGraph:
        if self._dep is None:
            self._dep = dependency_graph(self.gm)
        return self._dep

    def changed(self) -> None:
        self._dep = None


class LinearGroup(Match):
    """Linears reading the same input ``x``: the members of one block."""

    def __init__(self, x: fx.Node, sites: Sequence[LinearSite], run: RunState, checked: str = "the checks"):
        super().__init__(site_params(sites))
        self.x, self.sites, self.run = x, list(sites), run
        # Which checks the members passed, for the min_group_size row.
        self.checked = checked
        # Set by the guard of a taken group (``guards.group_problem``):
        self.path, self.why = "", ""  # "fused" | "split" | "by_rows" (chosen per call), and the row's words
        self.fuse_biases = False  # every member has a bias: one bias block
        self.region = ""  # the row's words for a checkpointed region

    def part(self, sites: Sequence[LinearSite], checked: Optional[str] = None) -> "LinearGroup":
        return LinearGroup(self.x, sites, self.run, checked or self.checked)

    def refs(self) -> list:
        return [r for s in self.sites for r in ((s.weight, s.bias) if s.has_bias else (s.weight,)) if r is not None]




def groups(gm: fx.GraphModule, ctx: PassContext) -> Iterator[LinearGroup]:
    """One group per input that two or more linears read (a lone linear is
    not a pattern: nothing to report), in graph order."""
    by_input: Dict[fx.Node, List[LinearSite]] = defaultdict(list)
    for site in linear_sites(ctx):
        by_input[site.x].append(site)
    run = RunState(gm)
    for x, sites in by_input.items():
        if len(sites) >= 2:
            yield LinearGroup(x, sites, run)
