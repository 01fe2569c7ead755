"""The RNN format's rewrite: one group (record, flat block) per weight set,
and the graph's call replaced by one that reads the weights as graph values.

Dynamo flavour: ``torch.lstm(...)`` becomes ``RnnForward(spec, path)(x, hx,
*weights)`` (``paths.py``), its path chosen here from the static length;
a zero initial state is left to the op. ``symbolic_trace`` flavour:
``call_module`` becomes ``RnnModuleCall(x, hx, *weights)`` (``eager.py``),
which picks the path per call. The weights move into the block after the
inner compiler has run (``ctx.defer``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from .._torch import dynamo as _dynamo, kernels as _kernels
from ..config import default_seq_threshold
from ..core.graph import PassContext, meta_value, same_size, static_int
from ..core.groups import find_layout, group_record, open_site
from ..core.records import Record
from ..core.runtime import GroupSite
from ..core.storage import first_sharing_problem
from .auto import measure_threshold
from .eager import RnnModuleCall
from .match import RnnCall
from .varlen.sequence import PackedRnnForward
from .cpu import lstm_prepack as _lstm_prepack
from .paths import RnnForward
from .plan import RnnPlan, choose_path, plan_call
from .spec import RnnSpec, zero_state

__all__ = ["rewrite_call", "new_group", "call_plan", "note_kernel", "planned_kernels", "trains"]


def rewrite_call(ctx: PassContext, s: RnnCall) -> None:
    """Replace the call ``s`` (its guards passed: ``s.spec`` is set) with the
    format's call, in the group of its weight set."""
    site = _group_of(ctx, s)
    if s.batch_sizes is not None:  # a packed batch (rnn/packed/sequence.py)
        new = _packed_call(ctx, s, site)
    elif s.module is None:  # Dynamo flavour: weights are graph inputs
        new = _dynamo_call(ctx, s, site)
    else:
        new = _module_call(ctx, s, site)
    g, node = ctx.gm.graph, s.node
    new.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")})
    node.replace_all_uses_with(new)
    g.erase_node(node)
    # A weight written in place inside the graph (a hook, ``clamp_`` in
    # forward) needs no guard: the new call reads every weight as a graph
    # value, after the write, never the block. The record says so.
    written = s.run.written
    w = next((r for r in s.weights if r.node is not None and r.node in written), None)
    if w is not None:
        site.record.detail["written_in_graph"] = f"{w.name} by {written[w.node]}: the kernels read it after the write"


def _group_of(ctx: PassContext, s: RnnCall) -> GroupSite:
    """The group of the call's weight set: the one this graph made for it
    already (the same RNN called twice: one group, one block), or a new
    one."""
    spec, claimed = s.spec, s.run.claimed
    ws = [r.tensor for r in s.weights]
    names = [r.name for r in s.weights]
    ids = tuple(id(w) for w in ws)
    prior = claimed.get(ids[0])
    if prior is not None and prior[0] == ids:
        site = prior[1]
        if spec.name not in site.record.reason:  # e.g. a cell loop over an nn.LSTM's own weights
            site.record.reason += f"; also called as {spec.name}"
        return site
    site = new_group(ctx, spec, ws, names, s.plan, s.detail, overlap=any(i in claimed for i in ids))
    for i in ids:
        claimed[i] = (ids, site)
    return site


def _dynamo_call(ctx: PassContext, s: RnnCall, site: GroupSite) -> fx.Node:
    """Dynamo flavour: ``RnnForward(spec, path)`` over the weights as graph
    inputs, before the call; its path from the call's plan (``_take_plan``), a zero
    initial state left to the op."""
    spec, record, g = s.spec, site.record, ctx.gm.graph
    w_nodes = [r.node for r in s.weights]
    v = meta_value(s.x)
    if _must_specialize(s, spec, v):
        # Training through oneDNN's / cuDNN's kernel needs its workspace
        # saved for the backward, whose size only the kernel knows: at
        # a symbolic T or batch, a size the shape environment must let
        # the op make at run time. Dynamo's does not (unless
        # capture_dynamic_output_shape_ops is on), so the sizes are
        # specialized here, knowingly: Dynamo recompiles per size, as it
        # would for a static model, and the row says so.
        for d in v.shape:
            int(d)  # a guard on purpose (see static_int)
        record.detail["specialized"] = ("training graph with a symbolic length or batch: sizes specialized "
                                        "(the kernel's workspace has no size formula; "
                                        "Dynamo's config capture_dynamic_output_shape_ops=True keeps "
                                        "them symbolic); the kernel is then chosen as for those static sizes")
    if s.cast is not None:
        compute = s.cast[-1]  # float32 where the half dtype is emulated (guards.autocast_cast)
        if compute != v.dtype:
            with v.fake_mode:  # the kernels are chosen for the dtype the call computes in
                v = v.to(compute)
        if compute == s.cast[0]:
            words = (f"under autocast runs in {s.cast[0]} (input, states and weights cast per call; "
                     f"gradients reach the {s.weights[0].tensor.dtype} Parameters), returns {s.cast[1]}")
        else:
            words = (f"under autocast input, states and weights are rounded to {s.cast[0]} per call and computed in "
                     f"float32 (this CPU has no {s.cast[0]} instructions, where {s.cast[0]} kernels are slower than "
                     f"float32 ones; gradients reach the {s.weights[0].tensor.dtype} Parameters), returns {s.cast[1]}")
        if record.detail.get("autocast") != words:
            record.detail["autocast"] = words
            record.reason += f"; {words}"
    path = _take_plan(ctx, s, site, v, w_nodes).path
    hx = [None if _is_zero_state(h, spec, v, i) else h for i, h in enumerate(s.hx)]
    if hx != list(s.hx):
        record.detail["zero_state"] = "made inside the RNN op (no zeros kernel in the compiled graph)"
    with g.inserting_before(s.node):
        return g.call_function(RnnForward(spec, path, bool(s.consts[3]), s.cast), (s.x, hx, *w_nodes))


def _packed_call(ctx: PassContext, s: RnnCall, site: GroupSite) -> fx.Node:
    """A packed batch: ``PackedRnnForward`` over the weights as graph
    inputs. One kernel at every length (the lengths are data, so there is
    no threshold to take): the C++ loop that steps each layer's shrinking
    batch on the CPU, cuDNN's packed mode on CUDA."""
    spec, record, g = s.spec, site.record, ctx.gm.graph
    w_nodes = [r.node for r in s.weights]
    plan = s.kernel_plan = s.kernel_plan or call_plan(ctx, s, None)  # the guard's, where it made one
    path = plan.path
    record.detail["variable_lengths"] = ("a variable-length batch (pack_padded_sequence): each sequence's valid steps only; "
                                         "no threshold (the lengths are data)")
    _count_at_site(ctx, site, w_nodes, "fused_calls", plan)
    if path == "packed_onednn":  # no grad: oneDNN's layer per run, from the layer's copy as the padded path reads it
        _allow_packed_weights(ctx, s, record)
    with g.inserting_before(s.node):
        return g.call_function(PackedRnnForward(spec, path, bool(s.consts[3])), (s.x, s.batch_sizes, s.hx, *w_nodes))


def call_plan(ctx: PassContext, s: RnnCall, v: Any, record=None) -> RnnPlan:
    """The call's :class:`RnnPlan` (``plan.plan_call``) from its traced
    input ``v`` (in the dtype it computes in): the one place its kernel is
    decided; the rewrite, the row and ``wfpass.explain`` read it. With a
    ``record`` (a real compile), a ``seq_threshold="auto"`` is measured now
    and noted there; a dry run leaves it unmeasured."""
    spec = s.spec
    if s.batch_sizes is not None:
        return plan_call(spec, s.weights[0].tensor, None, spec.threshold, trains(s), varlen=True, cast=s.cast)
    ref = v if isinstance(v, torch.Tensor) else s.weights[0].tensor
    n = _compile_threshold(ctx, s, spec, record) if record is not None else spec.threshold
    return plan_call(spec, ref, _static_steps(s), n, trains(s), cast=s.cast)


def _take_plan(ctx: PassContext, s: RnnCall, site: GroupSite, v: Any, w_nodes) -> RnnPlan:
    """The Dynamo call's plan, noted in the record (per length, why oneDNN's
    kernel is not used); the site, checked per call by the backend, counts
    the call."""
    record = site.record
    plan = s.kernel_plan = call_plan(ctx, s, v, record)
    if plan.why_not_onednn:
        record.detail["kernel"] = plan.why_not_onednn
    if plan.thread_bound and record.detail.get("thread_bound") != plan.thread_bound:
        record.detail["thread_bound"] = plan.thread_bound
        record.reason += f"; {plan.thread_bound}"
    # Counted by length, as the report's threshold reads: GRUs and plain
    # RNNs run the same kernels on both sides of N on the CPU.
    _count_at_site(ctx, site, w_nodes, "unfused_calls" if plan.unfused else "fused_calls", plan)
    if plan.path == "mkldnn" and not plan.train:
        _allow_packed_weights(ctx, s, record)
    return plan


def _allow_packed_weights(ctx: PassContext, s: RnnCall, record) -> None:
    """An inference LSTM on oneDNN's layer op (a padded batch's ``mkldnn``
    path, or a packed batch's ``packed_onednn``, run by run): let each layer
    direction keep its weights in oneDNN's layout (``cpu/lstm_pack.py``),
    under the packed format's options (``prepack.mode="off"``: none) and budget."""
    if ctx.config.prepack.mode == "off" or ctx.config.dry_run:
        return
    ws = [r.tensor for r in s.weights]
    if not all(_copies_here(w) for w in ws):  # bf16: only where oneDNN's LSTM runs it on this CPU
        return
    per = s.spec.weights_per_layer
    pairs = [(ws[k], ws[k + 1]) for k in range(0, len(ws), per)]
    _lstm_prepack.allow(record, pairs, ctx.config.prepack.max_bytes)


def _count_at_site(ctx: PassContext, site: GroupSite, w_nodes, counter: str, plan: RnnPlan) -> None:
    """The row notes the plan's path and kernel for its length bucket; the
    site, checked per call by the backend, counts the call in ``counter``
    (which side of N, or ``fused_calls``) and in the kernel's own counter."""
    record = site.record
    record.stats.setdefault("fused_calls", 0)
    record.stats.setdefault("unfused_calls", 0)
    record.detail.setdefault("paths", {})[plan.bucket] = plan.path
    kernel = note_kernel(record, plan)
    if ctx.is_dynamo and all(w.op == "placeholder" for w in w_nodes):
        site.idx = tuple(ctx.placeholder_index(w) for w in w_nodes)
        site.counter = (counter, kernel)
        ctx.add_site(site)


def planned_kernels(ctx: PassContext, s: RnnCall, packs: bool = False) -> str:
    """What a dry run (``wfpass.explain``) says about the call's kernel, from
    the plan a compile would take: ``"; T=12: oneDNN LSTM; threshold N=2"``;
    ``packs`` (``prepack.mode`` is not ``"off"``): also that an inference call
    on oneDNN's kernel will read its weights from a copy in oneDNN's layout."""
    v = meta_value(s.x)
    ref = v if isinstance(v, torch.Tensor) else s.weights[0].tensor
    plan = s.kernel_plan = call_plan(ctx, s, v)
    copies = packs and not plan.train and plan.path in ("mkldnn", "packed_onednn") and _copies_here(ref)
    return plan.words() + (_COPY_PLANNED if copies and (plan.varlen or plan.threshold != "auto") else "")


_COPY_PLANNED = "; in inference oneDNN will read each layer's weights from a copy in its own layout (within prepack.max_bytes)"


def _copies_here(ref: torch.Tensor) -> bool:
    """Would an inference call on oneDNN's LSTM layer keep a copy of
    weights like ``ref`` (``_allow_packed_weights``'s dtype and device test)?"""
    return ref.device.type == "cpu" and ref.dtype in _lstm_prepack.DTYPES and _kernels.mkldnn_rnn_dtype(ref.dtype)


def note_kernel(record, plan: RnnPlan) -> str:
    """Write into the row, once per length bucket, the plan's kernel in
    words (``T=12: oneDNN LSTM (onednn_lstm_calls)``) and, once, the
    threshold N; returns the counter of that kernel's calls."""
    record.stats.setdefault(plan.counter, 0)
    kernels = record.detail.setdefault("kernels", {})
    if kernels.get(plan.bucket) != plan.kernel:
        kernels[plan.bucket] = plan.kernel
        record.reason += f"; {plan.bucket}: {plan.kernel} ({plan.counter})"
    if not plan.varlen and "threshold N=" not in record.reason:
        record.reason += f"; threshold N={plan.threshold} (T <= N takes the per-step path)"
    return plan.counter


def _module_call(ctx: PassContext, s: RnnCall, site: GroupSite) -> fx.Node:
    """``symbolic_trace`` flavour: ``RnnModuleCall`` over the weights as
    ``get_attr`` nodes, before the call; it picks the path per call."""
    g, node = ctx.gm.graph, s.node
    with g.inserting_before(node):
        w_nodes = [g.get_attr(r.name) for r in s.weights]
        hx = node.args[1] if len(node.args) > 1 else node.kwargs.get("hx")
        return g.call_function(RnnModuleCall(s.spec, site, s.module), (s.x, hx, *w_nodes))


def new_group(ctx: PassContext, spec: RnnSpec, ws, names, how, detail, overlap: bool) -> GroupSite:
    """The group of one weight set: its record (``how``: the record's
    reason; one record per parameter set, shared with other graphs that
    rewrote it) and its flat block, moved after the inner compile; weights
    tied to other tensors (or to another RNN of this graph: ``overlap``)
    stay where they are, and the record says why."""
    key = ("rnn", spec.offsets, tuple(tuple(w.shape) for w in ws))
    if overlap:
        why = "a weight also belongs to another RNN of this graph"
    else:
        # The RNN's own weights may already share one buffer (CUDA:
        # PyTorch's flatten_parameters): that is not a tie.
        why = first_sharing_problem(zip(names, ws), ctx.named_state(), allowed=ws)
    # Intact (a recompile, an idempotent re-run) or lost (a cast and back:
    # re-fused after the inner compile, which sees the storage offsets
    # Dynamo traced).
    existing = find_layout(ws, key, defer=ctx.defer) if why is None else None

    def new() -> Record:
        if why:
            note = f"weights left where they are ({why}); the kernels read them as they are"
        elif existing is not None:
            note = "weights already in one flat block (idempotent re-run)"
        else:
            note = f"weights moved into one flat block of {spec.numel} elements"
        return ctx.report.add("rnn", "rewritten", f"{how}; {note}", names, **detail)

    record = group_record(ctx, existing, "rnn", new)  # the same parameters in another graph: one record
    kind = "rnn.cudnn" if ws[0].device.type == "cuda" else "rnn"
    site = GroupSite(kind, key, (), names, spec.offsets, spec.numel, record, (), reads_block=False)
    # The graph reads each weight by itself, never the block: a move waits
    # until the inner compiler has run on the examples Dynamo fakified
    # (their storage offsets are those of before).
    return open_site(ctx, site, existing, ws, move="later" if why is None else "never")


def trains(s: RnnCall) -> bool:
    """Whether the call's output takes a gradient in this graph (a training
    graph). A call the cell-loop fold made has no traced value: its steps'
    answer, noted on it (``cells/rewrite.py``)."""
    out = meta_value(s.node)
    if out is None and "wfpass_trains" in s.node.meta:
        return bool(s.node.meta["wfpass_trains"])
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    return isinstance(first, torch.Tensor) and first.requires_grad


def _must_specialize(s: RnnCall, spec: RnnSpec, v: Any) -> bool:
    """A training call whose sizes are symbolic, on a path that saves a
    kernel workspace (a CPU LSTM on oneDNN, cuDNN), in a shape environment
    that refuses sizes known only at run time."""
    if not isinstance(v, torch.Tensor) or all(static_int(d) is not None for d in v.shape):
        return False
    if not trains(s):
        return False
    if choose_path(spec, v, None, 0) not in ("mkldnn", "cudnn"):
        return False
    return not _dynamo.unbacked_sizes_allowed(v)


def _static_steps(s: RnnCall) -> Optional[int]:
    """The static length T of this call, or None when it is symbolic."""
    v = meta_value(s.x)
    if not isinstance(v, torch.Tensor):
        return None
    batch_first = bool(s.consts[5])
    return static_int(v.shape[1 if batch_first else 0] if v.dim() == 3 else v.shape[0])


def _compile_threshold(ctx: PassContext, s: RnnCall, spec: RnnSpec, record) -> int:
    """N for this graph: the configured one, or ``"auto"`` measured now with
    the model's weights on a random input of this call's shape."""
    if spec.threshold != "auto":
        return spec.threshold
    v = meta_value(s.x)
    # static_int: a size the rewrite specialized (a recompiled training graph) counts as static.
    if not isinstance(v, torch.Tensor) or any(static_int(d) is None for d in v.shape) or v.dim() != 3:
        return default_seq_threshold(v.device.type if isinstance(v, torch.Tensor) else "cpu")
    x = torch.empty(tuple(static_int(d) for d in v.shape), dtype=v.dtype, device=v.device)
    ws = [r.tensor.detach() for r in s.weights]
    hx = zero_state(spec, x)
    need_grad = torch.is_grad_enabled() and any(r.tensor.requires_grad for r in s.weights)
    return measure_threshold(spec, record, x, hx, ws, spec.has_biases, bool(s.consts[3]), spec.dropout, need_grad)


# A zero initial state made in the graph (``torch.zeros`` and what only
# reshapes or stacks it) is left to the RNN op, which fills its own.
_ZEROS = {torch.zeros, torch.zeros_like, torch.ops.aten.zeros.default}
_SHAPE_OPS = {torch.stack, torch.cat, torch.unsqueeze, "unsqueeze", "expand", "contiguous", "view", "reshape"}


def _zeros_node(n: Any) -> bool:
    """Is ``n`` all zeros by construction (``torch.zeros``, ``zeros_like``,
    ``new_zeros``, or stacked / reshaped from such)?"""
    if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method"):
        return False
    if n.target in _ZEROS or n.target == "new_zeros":
        return True
    if n.target in _SHAPE_OPS and n.args:
        first = n.args[0]
        parts = first if isinstance(first, (list, tuple)) else [first]
        return bool(parts) and all(_zeros_node(p) for p in parts)
    return False


def _is_zero_state(h: fx.Node, spec: RnnSpec, x_val: Any, which: int) -> bool:
    """A state argument the RNN op can make itself: zeros of exactly the
    shape and dtype ``nn.LSTM/GRU/RNN`` would build (only the oneDNN op
    and the loops read ``None`` as that)."""
    v = meta_value(h)
    if not (_zeros_node(h) and isinstance(v, torch.Tensor) and isinstance(x_val, torch.Tensor)):
        return False
    if v.dtype != x_val.dtype or v.device != x_val.device or v.requires_grad:
        return False
    batch = x_val.shape[0 if spec.batch_first else 1] if x_val.dim() == 3 else None
    want = (spec.num_layers * spec.directions, batch, spec.out_hidden if which == 0 else spec.hidden_size)
    return batch is not None and v.dim() == 3 and all(same_size(a, b) for a, b in zip(v.shape, want))
