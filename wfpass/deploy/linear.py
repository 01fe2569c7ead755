"""Sibling linears (Q/K/V, gate/up) and the copy-free linear kernel in an
exported program.

Run on the program ``torch.export`` traced (``program.py``). Linears that
read the same input and whose weights are the program's own parameters,
read by nothing else, become one ``wfpass::linear_group`` (``linear/group.py``),
which gives each member its own output, as its linear did::

    before: q = aten.linear(x, q_w, q_b); k = aten.linear(x, k_w, k_b); v = aten.linear(x, v_w, v_b)
    after:  small = sym_size(x, 0) * sym_size(x, 1) <= 4
            qkv = cond(small, group, linears, (x, q_w, k_w, v_w, q_b, k_b, v_b))
            q, k, v = qkv[0], qkv[1], qkv[2]
      group:   wfpass.linear_group(x, [q_w, k_w, v_w, q_b, k_b, v_b], [True, True, True], 4)
      linears: aten.linear(x, q_w, q_b), aten.linear(x, k_w, k_b), aten.linear(x, v_w, v_b)

The op reads each weight where the program holds it: no block, no copy, no
concatenation. Up to ``direct_rows`` rows a call is one pass of wfpass's
copy-free direct kernel over all the members; ``direct_rows`` is what the
prepacked-linear format would choose among its copy-free kernels
(``prepack/rule.copy_free``) on the exporting machine for a weight of the
group's size, from the same timings and ``choices.json``. Above it the
program takes the members' own linears, as ``torch.export`` traced them,
through a ``torch.cond`` on the row count (AOTInductor compiles it into an
``if``): the op would run the same GEMMs behind its extern call, measured
13-20% slower for the bf16 decoder block at 16-128 rows. A program whose
row count is fixed takes one side at export. Where the direct kernel wins
at no row count (float32 on an Intel Xeon with MKL), the linears stay
``aten.linear``. A lone linear becomes the op where the direct kernel wins.
Prepacked copies are not made: a program holds each weight once.

Left as ``torch.export`` traced them, with the reason in the report: a
weight or bias that is not a parameter of the program, or that another node
also reads (tied, reused); a program not on the CPU (the op has only its
Python kernel elsewhere, unchecked in AOTInductor); members of mixed dtype.
"""
from __future__ import annotations

import contextlib
import operator
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from ..config import Config
from ..core.records import Report
from ..linear import group as _group  # noqa: F401 - defines wfpass::linear_group, the op the rewrite calls
from ..native import ops as _nops
from ..prepack import choose as _choose
from ..prepack.rule import copy_free as _copy_free

__all__ = ["into_program", "direct_rows"]

#: Row counts tried for the direct kernel, in order (the decisions' buckets:
#: exact up to ``choose.EXACT_ROWS``, then powers of two); ``direct_rows`` is
#: the last of the unbroken run the direct kernel wins from the first.
_ROWS = tuple(range(1, _choose.EXACT_ROWS + 1)) + (16, 32)


def direct_rows(dtype: torch.dtype, k: int, n: int, config: Config) -> Tuple[int, str]:
    """The largest row count up to which the direct kernel serves a weight
    of ``n`` x ``k`` (every count up to it measured faster than the plain
    GEMM by the prepack rule's margin), and the words saying why."""
    if not config.runs("prepack_linears") or config.prepack.mode == "off":
        return 0, "the prepacked-linear format is off (it chooses the direct kernel)"
    if not _nops.direct_runs(dtype):
        return 0, "the direct kernel does not run here (CPU, build or dtype)"
    rows = 0
    for m in _ROWS:
        if _copy_free(_choose.decide(dtype, k, n, m)) != "direct":
            break
        rows = m
    if rows == 0:
        return 0, f"the direct kernel was not faster than the plain GEMM at 1 row for {n}x{k} on this machine"
    return rows, f"direct kernel up to {rows} row(s) (measured faster on this machine for {n}x{k})"


def _param(node: fx.Node, params: Dict[str, str]) -> Optional[str]:
    return params.get(node.name) if isinstance(node, fx.Node) and node.op == "placeholder" else None


def into_program(program: "torch.export.ExportedProgram", config: Config, report: Report) -> None:
    """Rewrite the program's linears in place (see the module docstring)."""
    gm = program.graph_module
    params = dict(program.graph_signature.inputs_to_parameters)
    mutated = set(program.graph_signature.buffers_to_mutate.values()) | set(
        program.graph_signature.user_inputs_to_mutate.values())
    by_input: Dict[fx.Node, List[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.linear.default:
            by_input[node.args[0]].append(node)
    done = 0
    for nodes in by_input.values():
        # The input as the graph has it now: an earlier group's rewrite may
        # have replaced it (one linear reading another's output).
        x = nodes[0].args[0]
        members, left = [], []
        for node in nodes:
            why = _member_problem(node, params, mutated)
            (left.append((node, why)) if why else members.append(node))
        for node, why in left:
            fqns = [f for f in (_param(a, params) for a in node.args[1:3]) if f]
            report.add("linear", "skipped", f"linear {node.name}: {why}; left as torch.export traced it", fqns)
        if not members:
            continue
        dtypes = {m.args[1].meta["val"].dtype for m in members} | {x.meta["val"].dtype}
        if len(dtypes) > 1:
            report.add("linear", "skipped", f"linears reading {x.name} mix dtypes "
                       f"({', '.join(sorted(str(d) for d in dtypes))}): left as torch.export traced them",
                       [_param(m.args[1], params) for m in members])
            continue
        w = members[0].args[1].meta["val"]
        n = sum(int(m.args[1].meta["val"].shape[0]) for m in members)
        rows, words = direct_rows(w.dtype, int(w.shape[1]), n, config)
        fqns = [f for m in members for f in (_param(a, params) for a in m.args[1:3]) if f]
        if rows == 0:
            # The op's per-call cost in an AOTInductor package (its extern
            # call) is only repaid by the direct kernel: without it, the
            # members' own GEMMs, as stock traced them, are as fast or faster.
            if len(members) > 1:
                report.add("linear", "skipped", f"{len(members)} sibling linears reading {x.name}: {words}; left as "
                           "torch.export traced them (one GEMM each is what the op would run, at the cost of its "
                           "call)", fqns)
            continue
        static = _static_rows(x.meta["val"])
        if static is not None and static > rows:
            report.add("linear", "skipped", f"{len(members)} linear(s) reading {x.name}: the program's row count is "
                       f"{static}, above the {rows} the direct kernel serves; left as torch.export traced them", fqns)
            continue
        _outputs_renamed(program, _rewrite(gm, x, members, rows, branch=static is None))
        done += 1
        kind = f"{len(members)} sibling linears as one op" if len(members) > 1 else "a lone linear on the direct kernel"
        above = (f"; the program's {static} row(s) are within it" if static is not None else
                 "; above it the linears as traced (a torch.cond on the row count)")
        report.add("linear", "rewritten", f"exported program: {kind} over each weight where the program holds it (no "
                   f"block, no copy, no concatenation); {words}{above}", fqns, members=len(members), direct_rows=rows,
                   out_features=n)
    if done:
        gm.graph.lint()
        gm.recompile()


def _member_problem(node: fx.Node, params: Dict[str, str], mutated: set) -> str:
    args = list(node.args) + [None] * (3 - len(node.args))
    x, w, b = args[:3]
    if node.kwargs:
        return f"called with keywords {sorted(node.kwargs)}"
    if _param(w, params) is None:
        return "its weight is not a parameter of the program (computed, or a constant)"
    if b is not None and _param(b, params) is None:
        return "its bias is not a parameter of the program"
    for t in (w, b):
        if t is None:
            continue
        if len(t.users) != 1:
            others = sorted(u.name for u in t.users if u is not node)
            return f"{params[t.name]} is also read by {', '.join(others)} (tied or reused)"
        if params[t.name] in mutated:
            return f"{params[t.name]} is written in place by the program"
    vals = [a.meta.get("val") for a in (x, w, b) if a is not None]
    if any(not isinstance(v, torch.Tensor) for v in vals):
        return "a tensor without a traced value"
    if any(v.device.type != "cpu" for v in vals):
        return f"on {vals[1].device.type}: the exported linear op is checked on the CPU only"
    if vals[1].dim() != 2:
        return "its weight is not 2-D"
    return ""


def _rewrite(gm: fx.GraphModule, x: fx.Node, members: List[fx.Node], rows: int, branch: bool) -> Dict[str, str]:
    """Replace ``members`` by the op, behind a ``torch.cond`` on the row
    count where ``branch`` (the program's rows are symbolic:
    ``_rows_branch``); returns the new output names by the old ones."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first = min(members, key=order.__getitem__)
    weights = [m.args[1] for m in members]
    biases = [m.args[2] if len(m.args) > 2 else None for m in members]
    operands = [x] + weights + [b for b in biases if b is not None]
    has_bias = [b is not None for b in biases]
    xv = x.meta["val"]
    fake = getattr(xv, "fake_mode", None)
    vals = [a.meta["val"] for a in operands]
    with (fake if fake is not None else contextlib.nullcontext()):
        yv = list(torch.ops.wfpass.linear_group.default(vals[0], vals[1:], has_bias, rows))
    with gm.graph.inserting_before(first):
        if branch:
            y = _rows_branch(gm, operands, has_bias, rows, yv)
        else:
            y = gm.graph.call_function(torch.ops.wfpass.linear_group.default, (x, operands[1:], has_bias, rows))
        outs = [gm.graph.call_function(operator.getitem, (y, i)) for i in range(len(members))]
    for new in [y] + outs:
        new.meta.update({k: v for k, v in first.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack",
                                                                     "torch_fn")})
    # A higher-order op's outputs are a tuple (torch.export's serializer
    # reads no other for it); the op's schema says Tensor[].
    y.meta["val"] = tuple(yv) if y.target is torch.ops.higher_order.cond else yv
    for o, v in zip(outs, yv):
        o.meta["val"] = v
    for m, o in zip(members, outs):
        m.replace_all_uses_with(o)
        gm.graph.erase_node(m)
    return {m.name: o.name for m, o in zip(members, outs)}


def _static_rows(xv: torch.Tensor) -> Optional[int]:
    """The input's row count (every dimension but the last), or None where
    the program's shapes leave it symbolic."""
    m = 1
    for d in xv.shape[:-1]:
        if not isinstance(d, int):
            return None
        m *= d
    return m


def _rows_branch(gm: fx.GraphModule, operands: List[fx.Node], has_bias: List[bool], rows: int,
                 yv: List[torch.Tensor]) -> fx.Node:
    """``torch.cond(rows_of(x) <= rows, the op, the members' own linears)``.

    Above ``rows`` the op would run one GEMM per member behind its extern
    call; the linears as traced run the same GEMMs as AOTInductor's own
    calls, and that measured faster (the bf16 decoder block at 16 rows,
    ``deploy/linear.py``'s docstring). The program branches once per call
    on its row count, which AOTInductor compiles into an ``if``::

        pred = sym_size(x, 0) * sym_size(x, 1) <= 4
        qkv = cond(pred, group_op, linears, (x, q_w, k_w, v_w))
        q, k, v = qkv[0], qkv[1], qkv[2]
    """
    g = gm.graph
    x = operands[0]
    xv = x.meta["val"]
    m, mv = None, 1
    for i, d in enumerate(xv.shape[:-1]):
        if isinstance(d, int):
            node = d
        else:
            node = g.call_function(torch.ops.aten.sym_size.int, (x, i))
            node.meta["val"] = d
        mv = mv * d
        if m is None:
            m = node
        else:
            m = g.call_function(operator.mul, (m, node))
            m.meta["val"] = mv
    pred = g.call_function(operator.le, (m, rows))
    pred.meta["val"] = mv <= rows
    branches = []
    for kind in ("group", "linears"):
        name = _free_name(gm, f"wfpass_{kind}_{x.name}")
        gm.add_submodule(name, _branch(kind, operands, has_bias, rows, yv))
        branches.append(g.get_attr(name))
    return g.call_function(torch.ops.higher_order.cond, (pred, branches[0], branches[1], tuple(operands)))


def _branch(kind: str, operands: List[fx.Node], has_bias: List[bool], rows: int,
            yv: List[torch.Tensor]) -> fx.GraphModule:
    """One side of ``_rows_branch``: the op (``group``) or one
    ``aten.linear`` per member (``linears``), over ``(x, *weights,
    *biases)``. Both sides' outputs take the op's fake values ``yv`` (each
    member's ``(..., n_i)``, what its linear gives), not values from
    running ``aten.linear`` on the fakes: its decomposition would add shape
    guards to the program (torch 2.11 then guards T to the example's)."""
    g = fx.Graph()
    ins = []
    for a in operands:
        p = g.placeholder(a.name)
        p.meta["val"] = a.meta["val"]
        ins.append(p)
    x, params = ins[0], ins[1:]
    n = len(has_bias)
    if kind == "group":
        y = g.call_function(torch.ops.wfpass.linear_group.default, (x, params, has_bias, rows))
        y.meta["val"] = list(yv)
        outs = [g.call_function(operator.getitem, (y, i)) for i in range(n)]
    else:
        it = iter(params[n:])
        outs = [g.call_function(torch.ops.aten.linear.default, (x, w, next(it)) if has else (x, w))
                for w, has in zip(params[:n], has_bias)]
    for o, v in zip(outs, yv):
        o.meta["val"] = v
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g)


def _free_name(gm: fx.GraphModule, base: str) -> str:
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def _outputs_renamed(program: "torch.export.ExportedProgram", renamed: Dict[str, str]) -> None:
    """A member whose output is the program's output: the graph signature
    names that output by its node, which is now the op's ``getitem``
    (torch.export's verifier refuses a signature naming a node that is gone,
    torch 2.11-2.15)."""
    from torch.export.graph_signature import TensorArgument

    for spec in program.graph_signature.output_specs:
        if isinstance(spec.arg, TensorArgument) and spec.arg.name in renamed:
            spec.arg = TensorArgument(name=renamed[spec.arg.name])
