"""RNN weight format: one flat buffer, and the RNN call lowered to ATen.

Before (Dynamo flavour; ``torch.compile`` normally graph-breaks here, see
``_compat.install_rnn_capture``)::

    h0 = zeros(2, B, 8); c0 = zeros(2, B, 8)
    lstm = torch.lstm(x, (h0, c0), [w_ih_l0, w_hh_l0, b_ih_l0, b_hh_l0, ...], True, 2, 0.0, True, False, False)
    out = lstm[0]; h_n = lstm[1]; c_n = lstm[2]

After (the parameters now views of one flat block)::

    lstm = rnn_mkldnn(x, [h0, c0], w_ih_l0, w_hh_l0, ...)   # ops/rnn.RnnForward, path chosen from T
    out = lstm[0]; h_n = lstm[1]; c_n = lstm[2]               # users unchanged

AOTAutograd traces ``rnn_mkldnn`` into ``aten.mkldnn_rnn_layer`` per layer
(forward) and ``mkldnn_rnn_layer_backward`` (backward): one op per layer,
whatever the length T; at T <= ``seq_threshold`` into the unfused per-step
ops (``rnn_loop``). Everything the backward needs is a traced value.

``symbolic_trace`` graphs: ``call_module`` of an ``nn.LSTM/GRU/RNN`` becomes
``rnn_module_call(x, hx, *weights)`` over ``get_attr`` weights, which picks the
path per call.

Guards, each a skip record when it fails (the node is left as it was): not a
PackedSequence call; every weight a Parameter/buffer of the model; one dtype
and device; the layer layout adds up; no autocast. (A weight written in
place inside the graph is fine: the call reads it as a graph value.) Weights that share storage with other tensors are
not moved (the kernels read them where they are), so ties stay tied.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from .. import _compat
from ..config import Config, default_seq_threshold
from ..graph import PassContext, TensorRef, meta_value, mutated_state
from ..pipeline import Format, Match
from ..ops.rnn import GATES, RnnForward, RnnModuleCall, RnnSpec, choose_path, measure_threshold
from ..runtime import GroupSite
from ..storage import fuse, layout_of_set, refuse, sharing_problem, unmovable

__all__ = ["FuseRnn", "call_problem", "RNN_FUNCTIONS", "name_errors", "unname_errors"]

# Let Dynamo put RNN modules into the graph for wformat backends only.
_compat.install_rnn_capture()

_aten = torch.ops.aten
#: Graph targets of a whole-sequence RNN call -> mode. ``torch.lstm`` is what
#: Dynamo records for ``nn.LSTM``; the aten overloads appear in aten graphs.
RNN_FUNCTIONS: Dict[Any, str] = {
    torch.lstm: "LSTM", torch.gru: "GRU", torch.rnn_tanh: "RNN_TANH", torch.rnn_relu: "RNN_RELU",
    _aten.lstm.input: "LSTM", _aten.gru.input: "GRU", _aten.rnn_tanh.input: "RNN_TANH", _aten.rnn_relu.input: "RNN_RELU",
}
_PACKED = {_aten.lstm.data, _aten.gru.data, _aten.rnn_tanh.data, _aten.rnn_relu.data}
_MODULES = {nn.LSTM: "LSTM", nn.GRU: "GRU"}
_CLASS = {"LSTM": "LSTM", "GRU": "GRU", "RNN_TANH": "RNN", "RNN_RELU": "RNN"}



@dataclasses.dataclass
class _Run:
    """What the sites of one run of the format share."""

    claimed: Dict[int, Tuple[Tuple[int, ...], GroupSite]]  # id(weight) -> (ids of its set, its group)
    written: Dict[fx.Node, str]  # weights written in place in the graph -> by what


class _Site(Match):
    """One RNN call, in either flavour, with what the rewrite needs."""

    def __init__(self, node: fx.Node, mode: str):
        super().__init__()
        self.node, self.mode = node, mode
        self.spec: Optional[RnnSpec] = None  # set by the guards when they pass
        self.run: Optional[_Run] = None
        self.problem: Optional[str] = None
        self.x: Optional[fx.Node] = None
        self.hx: Optional[List[fx.Node]] = None  # Dynamo flavour: the state nodes
        self.weights: List[TensorRef] = []
        self.module: Optional[nn.Module] = None  # call_module flavour
        self.consts: Tuple = ()
        self.dropout_node: Optional[fx.Node] = None  # dynamic=True: the dropout float is a graph input
        self.name = ""


def _module_mode(mod: nn.Module) -> Optional[str]:
    if type(mod) in _MODULES:
        return _MODULES[type(mod)]
    if type(mod) is nn.RNN:
        return mod.mode  # RNN_TANH | RNN_RELU
    return None


def _display(path: str, mode: str) -> str:
    return f"'{path}' (nn.{_CLASS[mode]})" if path else f"nn.{_CLASS[mode]}"


def _named_check_forward_args(module: nn.Module, name: str, input, hx, batch_sizes) -> None:
    """``nn.RNNBase.check_forward_args`` with the RNN's name in its errors:
    same exception type, message ``"'enc' (nn.LSTM): <eager's message>"``."""
    try:
        type(module).check_forward_args(module, input, hx, batch_sizes)
    except (RuntimeError, ValueError, TypeError) as e:
        raise type(e)(f"{name}: {e}") from None


def name_errors(module: nn.Module, path: str) -> None:
    """Make ``module``'s argument-check errors name it (wrong input size,
    hidden state shape, dtype).

    Why an instance attribute: under ``torch.compile`` a bad input makes the
    check raise while Dynamo traces ``nn.LSTM.forward``; Dynamo then runs the
    frame eagerly and eager's check raises, before any graph (or this pass)
    is involved. The ``forward`` of ``nn.LSTM/GRU/RNN`` looks the check up
    as ``self.check_forward_args``, so an instance attribute is the one
    place both Dynamo's trace and that eager run read. It is a
    ``functools.partial`` of a module-level function, so ``copy.deepcopy``
    and pickling keep working; ``wfpass.restore`` removes it.
    ``_compat`` calls this when Dynamo first wraps the RNN for a wformat
    backend, i.e. before the first call's checks run."""
    mode = _module_mode(module)
    if mode is None or "check_forward_args" in module.__dict__:
        return
    module.__dict__["check_forward_args"] = functools.partial(_named_check_forward_args, module, _display(path, mode))


def unname_errors(module: nn.Module) -> bool:
    """Undo ``name_errors``; True if there was something to undo."""
    f = module.__dict__.get("check_forward_args")
    if isinstance(f, functools.partial) and f.func is _named_check_forward_args:
        del module.__dict__["check_forward_args"]
        return True
    return False


def _module_path(weight_name: str) -> str:
    path, _, _ = weight_name.rpartition(".")
    return path


def _site_of(ctx: PassContext, node: fx.Node) -> Optional[_Site]:
    if node.op == "call_function":
        if node.target in _PACKED:
            s = _Site(node, "LSTM")
            s.problem = "PackedSequence input: not supported yet (left to the inner compiler)"
            return s
        mode = RNN_FUNCTIONS.get(node.target)
        if mode is None:
            return None
        return _dynamo_site(ctx, node, mode)
    if node.op == "call_module":
        mod = ctx.module_of(node)
        mode = _module_mode(mod) if mod is not None else None
        if mode is None:
            if isinstance(mod, nn.RNNBase):
                s = _Site(node, getattr(mod, "mode", "LSTM"))
                s.name = _display(node.target, s.mode)
                s.problem = f"{type(mod).__name__} is a subclass of nn.RNNBase with its own forward: not rewritten"
                return s
            return None
        return _module_site(ctx, node, mod, mode)
    return None


def _dynamo_site(ctx: PassContext, node: fx.Node, mode: str) -> _Site:
    s = _Site(node, mode)
    args = node.args
    if node.kwargs or len(args) != 9:
        s.problem = f"unexpected call form of {node.target} ({len(args)} args, kwargs {list(node.kwargs)})"
        return s
    state_is_list = isinstance(args[1], (tuple, list)) if mode == "LSTM" else isinstance(args[2], (tuple, list))
    if not state_is_list:
        s.problem = "PackedSequence input (a batch_sizes argument): not supported yet (left to the inner compiler)"
        return s
    s.x = args[0]
    s.hx = list(args[1]) if mode == "LSTM" else [args[1]]
    consts = list(args[3:9])  # has_biases, num_layers, dropout, train, bidirectional, batch_first
    p = consts[2]
    if isinstance(p, fx.Node) and p.op == "call_method" and p.target == "item" and isinstance(p.args[0], fx.Node):
        # dynamic=True lifts float attributes (``self.dropout``) to 0-d tensor
        # inputs read with .item(): pass the tensor; the op reads it per call.
        ref = ctx.resolve(p.args[0])
        if ref is not None and ref.tensor.dim() == 0:
            s.dropout_node, consts[2] = p.args[0], float(ref.tensor)
    consts = tuple(consts)
    if any(isinstance(c, fx.Node) for c in consts) or not all(isinstance(h, fx.Node) for h in s.hx):
        s.problem = "RNN flags or state are not plain graph values"
        return s
    s.consts = consts
    refs = [ctx.resolve(p) for p in args[2]]
    names = [r.name if r is not None else str(p) for r, p in zip(refs, args[2])]
    s.name = _display(_module_path(names[0]) if refs[0] is not None else "", mode)
    if "wfpass_cells" in node.meta:  # a loop of cells that fold_cells folded into this call
        s.name = node.meta["wfpass_cells"]
    for r, p in zip(refs, args[2]):
        if r is None or not r.is_state:
            s.problem = f"weight {getattr(p, 'name', p)} is not a Parameter or buffer of the model (a functional call?)"
            return s
    s.weights = refs
    return s


def _module_site(ctx: PassContext, node: fx.Node, mod: nn.Module, mode: str) -> _Site:
    s = _Site(node, mode)
    s.module = mod
    s.name = _display(node.target, mode)
    args, kwargs = list(node.args), dict(node.kwargs)
    if len(args) > 2 or set(kwargs) - {"hx", "input"}:
        s.problem = "unexpected call form of the module"
        return s
    s.x = args[0] if args else kwargs.get("input")
    if not isinstance(s.x, fx.Node):
        s.problem = "input is not a graph value"
        return s
    s.consts = (mod.bias, mod.num_layers, float(mod.dropout), mod.training, mod.bidirectional, mod.batch_first)
    s.weights = [
        TensorRef(f"{node.target}.{n}", getattr(mod, n), "parameter", None) for n in mod._flat_weights_names
    ]
    if any(not isinstance(r.tensor, torch.Tensor) for r in s.weights):
        s.problem = "a weight of the module is not a tensor"
    return s


def _spec_problem(s: _Site) -> Optional[str]:
    ws = [r.tensor for r in s.weights]
    if len({(w.dtype, w.device) for w in ws}) != 1:
        return "weights differ in dtype or device"
    if not ws[0].is_floating_point():
        return f"weights are {ws[0].dtype}, not floating point"
    x_val = meta_value(s.x)
    if isinstance(x_val, torch.Tensor) and (x_val.dtype != ws[0].dtype or x_val.device != ws[0].device):
        return f"input is {x_val.dtype}/{x_val.device}, weights {ws[0].dtype}/{ws[0].device}"
    if torch.is_autocast_enabled(ws[0].device.type):
        return "autocast is enabled: left to the inner compiler"
    if len({id(w) for w in ws}) != len(ws):
        return "the same tensor appears twice among the weights"
    return None


def _build_spec(s: _Site, config: Config) -> Tuple[Optional[RnnSpec], Optional[str]]:
    has_biases, num_layers, dropout, train, bidirectional, batch_first = s.consts
    ws = [r.tensor for r in s.weights]
    D = 2 if bidirectional else 1
    if num_layers < 1 or len(ws) % (num_layers * D):
        return None, f"{len(ws)} weights do not split into {num_layers} layer(s) x {D} direction(s)"
    per = len(ws) // (num_layers * D)
    proj = per - (4 if has_biases else 2)
    if proj not in (0, 1) or (proj and s.mode != "LSTM"):
        return None, f"{per} weights per layer do not match mode {s.mode} (bias={has_biases})"
    gates = GATES[s.mode]
    g = ws[0].shape[0]
    if ws[0].dim() != 2 or g % gates:
        return None, "weight_ih_l0 is not [gates * hidden, input]"
    hidden = g // gates
    proj_size = ws[per - 1].shape[0] if proj else 0
    spec = dict(
        name=s.name, mode=s.mode, input_size=ws[0].shape[1], hidden_size=hidden, proj_size=proj_size,
        num_layers=int(num_layers), bidirectional=bool(bidirectional), batch_first=bool(batch_first),
        has_biases=bool(has_biases), dropout=float(dropout),
        threshold=default_seq_threshold(ws[0].device.type) if config.seq_threshold is None else config.seq_threshold,
        options=config.rnn,
    )
    offsets, acc = [], 0
    layout = None
    if ws[0].device.type == "cuda":
        layout = _compat.cudnn_flat_layout(ws, per, spec["input_size"], s.mode, hidden, proj_size, num_layers,
                                           bool(batch_first), bool(bidirectional))
    if layout is not None:
        offsets, acc = layout
    else:
        for k in range(num_layers * D):
            chunk = ws[k * per : (k + 1) * per]
            for w in chunk:
                offsets.append(acc)
                acc += w.numel()
    return RnnSpec(offsets=tuple(offsets), numel=acc, **spec), None


class FuseRnn(Format):
    """The RNN format: match every RNN call, guard it, rewrite it."""

    name, pattern = "fuse_rnn", "rnn"

    def matches(self, gm: fx.GraphModule, ctx: PassContext) -> Iterator[_Site]:
        # What this run's sites share: the weight sets already grouped (the
        # same RNN called twice is one group), the weights written in place.
        run = _Run(claimed={}, written=mutated_state(gm))
        for node in list(gm.graph.nodes):
            s = _site_of(ctx, node)
            if s is not None:
                s.params, s.run = [r.name for r in s.weights], run
                yield s

    def guard(self, s: _Site, ctx: PassContext) -> Optional[str]:
        why = call_problem(s, ctx)
        if why is not None:
            return f"{s.name or s.node.name}: {why}"
        spec = s.spec
        s.plan = f"{spec.name}: {_describe(spec)}"
        s.detail = dict(threshold=spec.threshold, mode=spec.mode, layers=spec.num_layers,
                        bidirectional=spec.bidirectional, block_elements=spec.numel)
        return None

    def apply(self, s: _Site, ctx: PassContext) -> None:
        _rewrite(ctx.gm, ctx, s)
        # A weight written in place inside the graph (a hook, ``clamp_`` in
        # forward) needs no guard: the rewritten call reads every weight as
        # a graph value, after the write, never the block. The record says so.
        written = s.run.written
        w = next((r for r in s.weights if r.node is not None and r.node in written), None)
        if w is not None:
            rec = s.run.claimed[id(s.weights[0].tensor)][1].record
            rec.detail["written_in_graph"] = f"{w.name} by {written[w.node]}: the kernels read it after the write"


def call_problem(s: _Site, ctx: PassContext) -> Optional[str]:
    """The RNN format's guards, in order, on one matched call: what the
    matcher found, a distributed weight, the weights' dtype and device, the
    layer layout. None when the call can be rewritten (``s.spec`` is then
    its spec). ``fold_cells`` asks the same of the call a loop would become."""
    if s.problem is None:
        # A DTensor/FSDP2 weight: not even the fallback op may run on it.
        s.problem = next((w for w in (unmovable(r.tensor, r.name) for r in s.weights) if w), None)
    if s.problem is None:
        s.problem = _spec_problem(s)
    if s.problem is None:
        s.spec, s.problem = _build_spec(s, ctx.config)
    return s.problem


def _describe(spec: RnnSpec) -> str:
    bits = [f"{spec.num_layers} layer(s)"]
    if spec.bidirectional:
        bits.append("bidirectional")
    if spec.proj_size:
        bits.append(f"proj_size={spec.proj_size}")
    if not spec.has_biases:
        bits.append("bias=False")
    if spec.dropout:
        bits.append(f"dropout={spec.dropout}")
    return ", ".join(bits)


def _steps(s: _Site) -> Optional[int]:
    """The static length T of this call, or None when it is symbolic."""
    v = meta_value(s.x)
    if not isinstance(v, torch.Tensor):
        return None
    batch_first = bool(s.consts[5])
    t = v.shape[1 if batch_first else 0] if v.dim() == 3 else v.shape[0]
    try:
        return int(t)
    except (TypeError, ValueError, RuntimeError):
        return None


def _threshold(ctx: PassContext, s: _Site, spec: RnnSpec, record) -> int:
    """N for this graph: the configured one, or ``"auto"`` measured now with
    the model's weights on a random input of this call's shape."""
    if spec.threshold != "auto":
        return spec.threshold
    v = meta_value(s.x)
    if not isinstance(v, torch.Tensor) or any(not isinstance(d, int) for d in v.shape) or v.dim() != 3:
        return default_seq_threshold(v.device.type if isinstance(v, torch.Tensor) else "cpu")
    x = torch.empty(tuple(v.shape), dtype=v.dtype, device=v.device)
    ws = [r.tensor.detach() for r in s.weights]
    from ..ops.rnn import _zero_state

    hx = _zero_state(spec, x)
    need_grad = torch.is_grad_enabled() and any(r.tensor.requires_grad for r in s.weights)
    return measure_threshold(spec, record, x, hx, ws, spec.has_biases, bool(s.consts[3]), spec.dropout, need_grad)


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
    try:
        return batch is not None and v.dim() == 3 and tuple(int(d) for d in v.shape) == tuple(int(d) for d in want)
    except (TypeError, ValueError, RuntimeError):
        return False


def _rewrite(gm: fx.GraphModule, ctx: PassContext, s: _Site) -> None:
    spec, claimed = s.spec, s.run.claimed
    ws = [r.tensor for r in s.weights]
    names = [r.name for r in s.weights]
    ids = tuple(id(w) for w in ws)

    # The same RNN called twice in this graph: one group, one block.
    prior = claimed.get(ids[0])
    if prior is not None and prior[0] == ids:
        site = prior[1]
        if spec.name not in site.record.reason:  # e.g. a cell loop over an nn.LSTM's own weights
            site.record.reason += f"; also called as {spec.name}"
    else:
        site = _new_group(ctx, spec, ws, names, s.plan, s.detail, overlap=any(i in claimed for i in ids))
        for i in ids:
            claimed[i] = (ids, site)
    record = site.record

    g = gm.graph
    node = s.node
    if s.module is None:  # Dynamo flavour: weights are graph inputs
        w_nodes = [r.node for r in s.weights]
        steps = _steps(s)
        v = meta_value(s.x)
        n = _threshold(ctx, s, spec, record)
        need_grad = torch.is_grad_enabled() and (
            any(w.requires_grad for w in ws) or (isinstance(v, torch.Tensor) and v.requires_grad))
        static_batch = isinstance(v, torch.Tensor) and all(isinstance(d, int) for d in v.shape)
        path = choose_path(spec, v if isinstance(v, torch.Tensor) else ws[0], steps, n, need_grad, static_batch)
        # Counted by length, as the report's threshold reads: GRUs and plain
        # RNNs run the same kernels on both sides of N on the CPU.
        counter = "unfused_calls" if steps is not None and steps <= n else "fused_calls"
        record.stats.setdefault("fused_calls", 0)
        record.stats.setdefault("unfused_calls", 0)
        record.detail.setdefault("paths", {})[f"T={steps if steps is not None else 'symbolic'}"] = path
        if ctx.is_dynamo and all(w.op == "placeholder" for w in w_nodes):
            site.idx = tuple(ctx.placeholder_index(w) for w in w_nodes)
            site.counter = (counter,)
            ctx.add_site(site)
        hx = [None if _is_zero_state(h, spec, v, i) else h for i, h in enumerate(s.hx)]
        if hx != list(s.hx):
            record.detail["zero_state"] = "made inside the RNN op (no zeros kernel in the compiled graph)"
        with g.inserting_before(node):
            new = g.call_function(RnnForward(spec, path, bool(s.consts[3])), (s.x, hx, *w_nodes))
    else:
        with g.inserting_before(node):
            w_nodes = [g.get_attr(n) for n in names]
            hx = node.args[1] if len(node.args) > 1 else node.kwargs.get("hx")
            new = g.call_function(RnnModuleCall(spec, site, s.module), (s.x, hx, *w_nodes))
    new.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")})
    node.replace_all_uses_with(new)
    g.erase_node(node)


def _new_group(ctx: PassContext, spec: RnnSpec, ws, names, how, detail, overlap: bool) -> GroupSite:
    key = ("rnn", spec.offsets, tuple(tuple(w.shape) for w in ws))
    # Intact (a recompile, an idempotent re-run) or lost (a cast and back:
    # re-fused below, on its record).
    existing = layout_of_set(ws, key)
    why = None
    if overlap:
        why = "a weight also belongs to another RNN of this graph"
    else:
        others = [(r.name, r.tensor) for r in ctx.state_tensors()]
        for n, w in zip(names, ws):
            # The RNN's own weights may already share one buffer (CUDA:
            # PyTorch's flatten_parameters): that is not a tie.
            why = sharing_problem(w, n, others, allowed=ws)
            if why:
                break
    if existing is not None and existing.record is not None and why is None:
        record = existing.record  # the same parameters in another graph: one record
        ctx.report.records.append(record)
        if not existing.holds(ws):
            # Lost (a cast and back): re-fused after the inner compile, which
            # sees the storage offsets Dynamo traced.
            def refuse_later(fs=existing) -> None:
                if refuse(fs, ws):
                    fs.record.bump("refused")

            ctx.defer(refuse_later)
    else:
        if why:
            note = f"weights left where they are ({why}); the kernels read them as they are"
        elif existing is not None:
            note = "weights already in one flat block (idempotent re-run)"
        else:
            note = f"weights moved into one flat block of {spec.numel} elements"
        record = ctx.report.add("rnn", "rewritten", f"{how}; {note}", names, **detail)
    for k in ("fallback_calls", "refused"):
        record.stats.setdefault(k, 0)
    kind = "rnn.cudnn" if ws[0].device.type == "cuda" else "rnn"
    site = GroupSite(kind, key, (), names, spec.offsets, spec.numel, record, (), reads_block=False)
    if why is None:
        if existing is not None:
            existing.record = record
            site.adopt(existing, ws)
        else:
            # The graph reads each weight by itself, never the block: the
            # move waits until the inner compiler has run on the examples
            # Dynamo fakified (their storage offsets are those of before).
            def move() -> None:
                fs = fuse(kind, names, ws, spec.offsets, spec.numel, key=key, record=record)
                site.adopt(fs, ws)

            ctx.defer(move)
    else:
        from ..runtime import note as file_note

        file_note(record, names, ws)
    return site
