"""Higher-order ops' bodies (activation checkpointing, ``wrap``,
``invoke_subgraph``): which bodies wfpass rewrites inside (``hop_bodies``),
and the pass context of one body (``BodyContext``), which resolves the
body's placeholders to the outer graph's operands."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.fx as fx

from .._torch.kernels import HigherOrderOperator
from .graph import PassContext, TensorRef, getattr_path, mutated_state
from ..pipeline import registered, run_format

__all__ = ["BODY_HOPS", "BodyContext", "HopBody", "hop_bodies", "run_in_bodies"]


# -- higher-order-op bodies (activation checkpointing, wrap, invoke_subgraph) ----

#: Higher-order ops whose body wfpass looks into. Dynamo traces the body into
#: its own GraphModule (a ``get_attr`` of the outer graph) and lifts what the
#: body reads, parameters included, to operands of the call: the parameters
#: stay placeholders of the outer graph, so the per-call layout check sees
#: them as for any other group. ``tag_activation_checkpoint`` is
#: ``torch.utils.checkpoint`` (reentrant or not) and HF's
#: ``gradient_checkpointing_enable()``; its body runs again in the backward
#: (recomputation), reading the same inputs.
BODY_HOPS = ("tag_activation_checkpoint", "wrap", "wrap_with_set_grad_enabled", "invoke_subgraph")


@dataclasses.dataclass
class HopBody:
    """One call of a higher-order op with a body wfpass may rewrite."""

    node: fx.Node  # the call in the outer graph
    op: str  # the op's name, e.g. "tag_activation_checkpoint"
    attr: str  # the body's attribute name in the outer GraphModule
    body: Optional[fx.GraphModule]
    operands: List[Any]  # outer-graph values, in the order of the body's placeholders
    callers: int  # how many calls in the outer graph run this body
    problem: Optional[str] = None  # why wfpass does not rewrite inside it


def _hop_name(node: fx.Node) -> Optional[str]:
    if node.op != "call_function" or not isinstance(node.target, HigherOrderOperator):
        return None
    return node.target.name()


def hop_bodies(gm: fx.GraphModule) -> List[HopBody]:
    """Every higher-order-op call of ``gm`` that has a GraphModule body, with
    its operands mapped to the body's placeholders; ``problem`` says why wfpass
    leaves a body alone (an op it does not know, a body shared by several
    calls, operands that do not line up)."""
    found: List[HopBody] = []
    for node in gm.graph.nodes:
        op = _hop_name(node)
        if op is None:
            continue
        pos = next((i for i, a in enumerate(node.args) if isinstance(a, fx.Node) and a.op == "get_attr"
                    and isinstance(getattr_path(gm, a.target), fx.GraphModule)), None)
        if pos is None:
            continue
        attr = node.args[pos].target
        body = getattr_path(gm, attr)
        operands = list(node.args[pos + 1:])
        if op == "invoke_subgraph" and operands and not isinstance(operands[0], fx.Node):
            operands = operands[1:]  # (subgraph, identifier, *operands)
        found.append(HopBody(node, op, attr, body, operands, 0))
    for h in found:
        h.callers = sum(1 for o in found if o.attr == h.attr)
        placeholders = [n for n in h.body.graph.nodes if n.op == "placeholder"]
        if h.op not in BODY_HOPS:
            h.problem = f"inside a {h.op} region, which wfpass does not rewrite (it looks into {', '.join(BODY_HOPS)})"
        elif h.callers > 1:
            # One body run for several parameter sets: a rewrite would have to
            # hold for every caller's parameters at once.
            h.problem = f"inside a {h.op} body shared by {h.callers} calls of the graph, which wfpass does not rewrite"
        elif len(placeholders) != len(h.operands) or h.node.kwargs.get("context_fn") is not None:
            h.problem = f"inside a {h.op} region whose operands wfpass cannot map to its body"
    return found


class BodyContext(PassContext):
    """A pass's view of a higher-order op's body: the body is the graph it
    rewrites; a body placeholder resolves to the outer graph's operand (a
    parameter is a placeholder there, a graph input of the compiled call), so
    the sites, examples and deferred moves a pass registers land on the outer
    graph, whose compiled call checks them. Nested bodies chain."""

    def __init__(self, parent: PassContext, hop: HopBody):
        self.parent, self.hop = parent, hop
        self.gm = hop.body
        self.config, self.report = parent.config, parent.report
        self.example_inputs = parent.example_inputs
        self._placeholders = [n for n in hop.body.graph.nodes if n.op == "placeholder"]
        self._outer = dict(zip(self._placeholders, hop.operands))
        self._state_cache = None
        self.sites = parent.sites

    @property
    def region(self) -> str:
        return self.hop.op

    def outer(self, node: fx.Node) -> Any:
        return self._outer.get(node)

    def resolve(self, arg: Any) -> Optional[TensorRef]:
        if isinstance(arg, fx.Node) and arg.op == "placeholder" and arg in self._outer:
            r = self.parent.resolve(self._outer[arg])
            return TensorRef(r.name, r.tensor, r.kind, arg) if r is not None else None
        return None  # computed in the body, or a body attribute: not a tensor of the model

    def placeholder_index(self, node: fx.Node) -> int:
        return self.parent.placeholder_index(self._outer[node])

    def compile_example(self, placeholder: fx.Node, value: Any, same_layout: bool = True) -> None:
        self.parent.compile_example(self._outer[placeholder], value, same_layout)

    def refakify(self, placeholder: fx.Node) -> None:
        self.parent.refakify(self._outer[placeholder])

    def defer(self, move: Callable[[], None], at_first_call: bool = False) -> None:
        self.parent.defer(move, at_first_call)

    def add_site(self, site: Any) -> None:
        self.parent.add_site(site)

    def state_tensors(self) -> List[TensorRef]:
        return self.parent.state_tensors()

    def tensor_inputs(self) -> List[tuple]:
        return self.parent.tensor_inputs()

    def module_of(self, node: fx.Node) -> Optional[torch.nn.Module]:
        return None  # Dynamo bodies hold no call_module nodes

    def written_state(self) -> Dict[fx.Node, str]:
        """Writes inside the body, and writes in the outer graph (a hook
        before the region) to the tensors the body receives."""
        out = dict(mutated_state(self.gm))
        outer = self.parent.written_state()
        for ph, o in self._outer.items():
            if isinstance(o, fx.Node) and o in outer:
                out.setdefault(ph, outer[o])
        return out


# -- the formats in bodies ------------------------------------------------------


def run_in_bodies(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Run the formats that rewrite inside higher-order-op bodies
    (``Format.in_bodies``: activation checkpointing, ``wrap``) in every body
    of ``gm``, nested bodies too, and write a skip record, with the reason,
    for each pattern the other formats find there."""
    formats = [f for f in registered() if ctx.config.runs(f.name)]
    inside = [f for f in formats if f.in_bodies]
    for hop in hop_bodies(gm):
        sub = BodyContext(ctx, hop)
        if hop.problem is not None:
            _report_body_patterns(sub, formats, hop.problem)
            continue
        for fmt in inside:
            run_format(fmt, hop.body, sub)
        names = ", ".join(f.name for f in inside) or "no format"
        _report_body_patterns(sub, [f for f in formats if not f.in_bodies],
                              f"inside a {hop.op} region: wfpass runs only {names} there (this format is not "
                              f"applied inside it)")
        run_in_bodies(hop.body, sub)


def _report_body_patterns(ctx: BodyContext, formats, why: str) -> None:
    """A skip record per match of ``formats`` in ``ctx``'s body (and the
    bodies nested in it), so that nothing inside a region wfpass does not
    rewrite goes unmentioned. The matchers only find: nothing is decided or
    applied. Two formats of one pattern finding the same tensors (the
    BatchNorm formats) give one row."""
    seen = set()
    for fmt in formats:
        pattern = fmt.pattern or fmt.name
        for m in fmt.matches(ctx.gm, ctx):
            key = (pattern, tuple(m.params))
            if key not in seen:
                seen.add(key)
                ctx.report.add(pattern, "skipped", why, m.params, region=ctx.region)
    for hop in hop_bodies(ctx.gm):
        _report_body_patterns(BodyContext(ctx, hop), formats, why)
