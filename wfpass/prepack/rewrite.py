"""The packed-weight format's rewrite: the call becomes
``wfpass::packed_linear`` over the parameters themselves, with a site that
carries its record, its options and the kernel per row count.

One record per weight (set): the same parameters in another graph (a
recompile for another row count, the decode and prefill graphs of
``generate()``) add their row counts and calls to it, as they share its
packed copy.
"""
from __future__ import annotations

import operator
from typing import Any, Dict, List, Tuple

import torch
import torch.fx as fx

from .._torch import tensors as _tensors
from .. import native as _native
from ..core.graph import PassContext, node_arg
from ..linear.kernel import EagerBlock, EagerLayoutCheck
from ..core.records import Record
from .guards import choose_kernel, copy_free_kernel, describe_choice, graph_weight_bytes
from .kernel import PackSite, note_weights, register_site
from .match import PackMatch

__all__ = ["rewrite_call", "OP", "OP_TRAIN"]

OP = torch.ops.wfpass.packed_linear.default  # no gradient through the call (the guard made sure)
OP_TRAIN = torch.ops.wfpass.packed_linear_train.default  # with its gradient formula

# first weight -> its record, while the weight lives.
_RECORDS = _tensors.weak_id_key_dict()


def _reason(rec: Record) -> str:
    kind = rec.detail.get("what", "linear")
    words = rec.detail.get("choices") or {}
    # The choices per M seen, then (a graph with a symbolic M) what that graph was measured at.
    over = rec.detail.get("over_budget") or {}
    # A row count the budget refused for some weight set: the choice, then the refusal.
    parts = [words[m] + (f"; {over[m]}" if m in over else "") for m in sorted(words)] + [rec.detail.get("pending", "")]
    parts += [over[m] for m in sorted(over) if m not in words]
    # Which kernel runs the op matters to the choice (its per-call cost is
    # added to every packed candidate) and is invisible otherwise: a torch
    # whose headers the compiler rejects gives the Python kernel silently.
    op = "" if _native.is_loaded() else f"; the op runs on its {_native.status()}"
    return (f"{kind}: per row count the kernel measured fastest, on the parameter itself or on a packed copy "
            f"beside it; " + "; ".join(p for p in parts if p) + op)


def _record_for(ctx: PassContext, m: PackMatch) -> Record:
    """The weight (set)'s ``rewritten`` record, made on its first graph and
    shared by every later one, with this graph's choice noted in it."""
    w0 = m.weights[0].tensor
    dtype, k, n = w0.dtype, w0.shape[1], m.rows
    what = (f"{len(m.weights)} linears' block ({n}x{k} {str(dtype).replace('torch.', '')})" if m.block
            else f"linear {n}x{k} {str(dtype).replace('torch.', '')}")
    rec = _RECORDS.get(w0)
    if rec is None or rec.params != m.params:
        rec = ctx.report.add("prepack", "rewritten", "", m.params, what=what)
        _RECORDS[w0] = rec
    else:
        ctx.report.records.append(rec)
    choices: Dict[int, str] = rec.detail.setdefault("choices", {})
    if m.m is not None:
        choices[m.m] = m.why
    else:
        rec.detail["pending"] = m.why
    rec.reason = _reason(rec)
    return rec


def _open_site(ctx: PassContext, m: PackMatch, rec: Record) -> int:
    """The call's ``PackSite`` (its record, options and kernel per row
    count, each further M chosen and noted on its second call), registered
    and kept alive with the graph; its id."""
    opts = ctx.config.prepack
    w0 = m.weights[0].tensor
    dtype, k, n = w0.dtype, w0.shape[1], m.rows

    pool = graph_weight_bytes(ctx)

    def choose(rows: int, opts=opts, dtype=dtype, k=k, n=n, rec=rec, pool=pool) -> str:
        kernel = choose_kernel(opts, dtype, k, n, rows, pool)
        if rows not in rec.detail["choices"]:
            rec.detail["choices"][rows] = describe_choice(opts, dtype, k, n, rows, pool)
            rec.reason = _reason(rec)
        return kernel

    def fallback(rows: int, opts=opts, dtype=dtype, k=k, n=n, pool=pool) -> str:
        return copy_free_kernel(opts, dtype, k, n, rows, pool)

    site = PackSite(rec, choose, opts.max_bytes, fallback)
    site.on_budget = lambda rec=rec: setattr(rec, "reason", _reason(rec))
    # The "weights" budget counts every parameter of the graphs this format
    # rewrote, and every parameter set a graph runs with: under regional
    # compilation one graph runs every layer, and its compile saw the first.
    note_weights([r.tensor for r in ctx.state_tensors() if r.kind == "parameter"])
    if ctx.is_dynamo:
        ctx.on_new_params(note_weights)
    if m.m is not None:
        site.by_rows[m.m] = m.kernel
    elif m.hint is not None:
        # Measured at compile time: decided on its first call, not its second.
        site.seen_once.add(m.hint)
    site.names = [w.name for w in m.weights]
    sid = register_site(site)
    ctx.keep_alive(site)
    if not ctx.is_dynamo:
        # ``wfpass.apply`` graphs run eagerly: the op sees grad mode itself.
        site.eager_training = opts.training
    return sid


def _operands(ctx: PassContext, m: PackMatch) -> Tuple[fx.Node, List[Any], List[Any]]:
    """The op's input, weights and biases as the graph has them, for each
    kind of match; called at the new call's insertion point (a module
    call's tensors are fetched there, a block's layout check kept there)."""
    node, g = m.node, m.node.graph
    if m.members:
        # A split group: one call over the block, its columns split among the members.
        return m.x, [w.node for w in m.weights], list(m.bias_nodes)
    if node.op == "call_module":
        w_nodes = [ctx.get_attr_node(m.weights[0].name, node)]
        biases = [ctx.get_attr_node(m.bias_ref.name, node)] if m.bias_ref is not None else []
        return m.x, w_nodes, biases
    if m.block:
        x, w_block, b_block = node.args[0], node.args[1], node.args[2]
        w_nodes = list(node.args[4:4 + len(m.weights)])
        b_nodes = list(node.args[4 + len(m.weights):])
        # Every member has a bias: the members' biases, which the op
        # reads as their block (gradients reach each); only some: the
        # graph's bias vector (inference only, the guard made sure).
        biases = b_nodes if len(b_nodes) == len(w_nodes) else ([b_block] if b_block is not None else [])
        if isinstance(getattr(w_block, "target", None), EagerBlock):
            # ``wfpass.apply`` graphs: the block's layout check (and
            # re-fuse) that EagerBlock made, kept for its effect.
            g.call_function(EagerLayoutCheck(w_block.target.site, "linear_layout_check"), tuple(w_nodes))
        return x, w_nodes, biases
    return m.x, [m.weights[0].node], [m.bias] if isinstance(m.bias, fx.Node) else []


def _replace_members(m: PackMatch, new: fx.Node) -> None:
    """A split group: the op's output split among the members, each
    member's uses moved to its part, the members erased."""
    g = m.node.graph
    with g.inserting_before(m.node):
        sizes = [w.tensor.shape[0] for w in m.weights]
        parts = g.call_function(torch.split, (new, sizes, -1))
        outs = [g.call_function(operator.getitem, (parts, i)) for i in range(len(sizes))]
    for member, out in zip(m.members, outs):
        out.meta.update({key: v for key, v in member.meta.items() if key in ("nn_module_stack", "stack_trace")})
        member.replace_all_uses_with(out)
        g.erase_node(member)


def rewrite_call(ctx: PassContext, m: PackMatch) -> None:
    """The call (or split group) becomes ``wfpass::packed_linear`` over the
    parameters themselves, with its site; the record notes this graph."""
    sid = _open_site(ctx, m, _record_for(ctx, m))
    g = m.node.graph
    node = m.node
    # The input as the graph reads it now: an earlier rewrite may have
    # replaced the node the matcher saw (a linear feeding this one).
    m.x = node_arg(m.members[0] if m.members else node, 0, "input")
    with g.inserting_before(node):
        x, w_nodes, biases = _operands(ctx, m)
        op = OP if ctx.is_dynamo and m.needs_grad() is False else OP_TRAIN  # unknown: the op with a gradient
        new = g.call_function(op, (x, w_nodes, biases, m.rows, sid))
    if m.members:
        _replace_members(m, new)
        return
    new.meta.update({key: v for key, v in node.meta.items() if key in ("nn_module_stack", "stack_trace", "val", "example_value")})
    node.replace_all_uses_with(new)
    g.erase_node(node)
