"""The RNN format: flat weights, one opaque op, a run-time choice of kernel.

Graph after ``fuse_rnn`` (Dynamo flavour, a 2-layer ``nn.LSTM``)::

    blk = rnn_weight_block("rnn0", w_ih_l0, w_hh_l0, b_ih_l0, b_hh_l0, w_ih_l1, ...)  # prologue
    out, h_n, c_n, tape = rnn_call(x, [h0, c0], [w_ih_l0, ...], blk, "rnn0", train, grad_mask)

``rnn_call`` is ``wfpass::rnn`` (a ``torch.library`` op with a fake
implementation) under its autograd formula (``_Rnn``, an
``autograd.Function``): AOTAutograd traces it into one ``wfpass.rnn`` node in
the forward graph and one ``wfpass.rnn_backward`` in the backward graph,
whatever the sequence length, and Inductor calls them as fallback kernels. At
run time it reads the length ``T`` of *this* call (static or symbolic alike)
and takes

* the unfused path when ``T <= N`` (``seq_threshold``): the input projection
  of all steps as one GEMM, then one recurrent GEMM per step. On the CPU that
  is exactly ATen's native kernel (``torch._VF.lstm`` with oneDNN switched
  off); elsewhere a Python loop over the same weights (``_loop``);
* the fused kernel when ``T > N``: ``torch._VF.<mode>`` as PyTorch dispatches
  it, i.e. oneDNN's LSTM on the CPU (GRU and RNN have no oneDNN kernel in
  PyTorch: both paths are ATen's native loop there) and cuDNN on CUDA, where
  the parameters already sit in cuDNN's flat buffer, so ATen's "weights are
  not part of single contiguous chunk of memory" copy never happens.

Autograd: the implementation runs the kernel with autograd recording (the
dispatcher and ``_Rnn.forward`` had switched it off, ``_compat.autograd_inside_op``) and
keeps that graph on a *tape* owned by the op's fourth output, a small uint8
tensor made with ``torch.frombuffer``. AOTAutograd saves the tape for the
backward like any other tensor; ``wfpass::rnn_backward`` replays the recorded
graph with ``torch.autograd.grad``. So gradients come from the very kernels
eager runs, dropout masks included, and the tape (with the activations) is
freed when AOTAutograd frees its saved tensors.

The flat block: every Parameter of the RNN is a view into one buffer (same
objects). On the CPU the kernels read each weight separately, so the order is
PyTorch's own (``_flat_weights``); the zero fake biases a ``bias=False`` RNN
passes to the CPU kernel (oneDNN takes bias tensors and would otherwise
allocate zeros on every call) live in a separate cached buffer, so saving a
parameter (``torch.save`` writes a view's whole storage) writes no zeros. On
CUDA the block is cuDNN's layout. ``rnn_weight_block`` (a
prologue, run before the compiled graph) checks the views are still in place,
re-fuses them if the layout was lost, and otherwise counts a fallback: the
kernels then read the separate tensors (and cuDNN copies them), with the same
results.
"""
from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
import weakref
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from .. import _compat
from ..report import Record
from ..storage import FusedStorage
from .runtime import Group, group, prologue

__all__ = [
    "RnnSpec", "RnnGroup", "GATES", "rnn_weight_block", "rnn_module_call", "paths_differ",
    "fused_path", "unfused_path", "auto_threshold_cache", "rnn_call",
]

#: Gates per mode: rows of ``weight_ih`` = GATES[mode] * hidden_size.
GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}
_CLASS = {"LSTM": "LSTM", "GRU": "GRU", "RNN_TANH": "RNN", "RNN_RELU": "RNN"}

#: Implementation of the unfused path: "auto" = ATen native on the CPU, the
#: Python loop elsewhere. Tests set "loop" to check the loop on the CPU.
UNFUSED_IMPL = "auto"


@dataclasses.dataclass(frozen=True)
class RnnSpec:
    """Static facts of one RNN, fixed when the pass rewrites it."""

    name: str  # for messages: "'enc.lstm' (nn.LSTM)"
    mode: str  # LSTM | GRU | RNN_TANH | RNN_RELU
    input_size: int
    hidden_size: int
    proj_size: int
    num_layers: int
    bidirectional: bool
    batch_first: bool
    has_biases: bool
    dropout: float
    threshold: Union[int, str]
    offsets: Tuple[int, ...]  # element offset of each weight in the block
    numel: int  # elements in the block
    fake_bias_offsets: Tuple[Tuple[int, int], ...]  # per (layer, direction): (b_ih, b_hh) offsets in the zero buffer

    @property
    def directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def gate_size(self) -> int:
        return GATES[self.mode] * self.hidden_size

    @property
    def out_hidden(self) -> int:
        return self.proj_size if self.proj_size > 0 else self.hidden_size

    @property
    def weights_per_layer(self) -> int:
        return (4 if self.has_biases else 2) + (1 if self.proj_size > 0 else 0)


class RnnGroup(Group):
    """A rewritten RNN at run time: spec, report record, fused storage."""

    def __init__(self, gid: str, record: Record, storage: Optional[FusedStorage], spec: RnnSpec, module=None):
        super().__init__(gid, record, storage, spec)
        self._module = weakref.ref(module) if module is not None else None
        self._zeros: Optional[torch.Tensor] = None
        self._fake: Optional[Tuple[int, List[torch.Tensor]]] = None

    @property
    def module(self):
        return self._module() if self._module is not None else None

    def zeros(self, like: torch.Tensor) -> torch.Tensor:
        """A zero block (fake biases) for calls whose weights are not in the block."""
        z = self._zeros
        if z is None or z.dtype != like.dtype or z.device != like.device:
            z = self._zeros = torch.zeros(self.spec.numel, dtype=like.dtype, device=like.device)
        return z

    def fake_biases(self, like: torch.Tensor) -> List[torch.Tensor]:
        """Zero (b_ih, b_hh) tensors per layer and direction, views of one
        cached zero buffer of ``like``'s dtype and device (kept apart from the
        parameters' block: see the module docstring)."""
        key = (like.dtype, like.device)
        cached = self._fake
        if cached is None or cached[0] != key:
            g = self.spec.gate_size
            zeros = torch.zeros(2 * g * len(self.spec.fake_bias_offsets), dtype=like.dtype, device=like.device)
            views = []
            for o_ih, o_hh in self.spec.fake_bias_offsets:
                views += [zeros[o_ih : o_ih + g], zeros[o_hh : o_hh + g]]
            cached = self._fake = (key, views)
        return cached[1]


# -- the prologue: find the block -------------------------------------------


def _block_base(g: RnnGroup, ws: Sequence[torch.Tensor]) -> Optional[int]:
    return None if g.storage is None else g.storage.block_offset(ws, g.spec.offsets)


def _block_example(gid: str, *ws: torch.Tensor) -> torch.Tensor:
    return torch.zeros(group(gid).spec.numel, dtype=ws[0].dtype, device=ws[0].device)


@prologue(example=_block_example)
def rnn_weight_block(gid: str, *ws: torch.Tensor) -> torch.Tensor:
    """The RNN's flat weight block (an alias of the parameters' storage), after
    re-fusing the parameters if their layout was lost; when that is unsafe (a
    parameter's storage is shared), a zero block of the same size, counted as
    ``fallback_calls``: the kernels then read the separate tensors."""
    g: RnnGroup = group(gid)
    base = _block_base(g, ws)
    if base is None and g.storage is not None and g.try_refuse(ws):
        base = _block_base(g, ws)
    if base is None:
        g.record.bump("fallback_calls")
        return g.zeros(ws[0])
    return torch.as_strided(ws[0].detach(), (g.spec.numel,), (1,), base)


# -- the two paths ----------------------------------------------------------


def _kernel_weights(g: RnnGroup, ws: Sequence[torch.Tensor], block: torch.Tensor) -> Tuple[Sequence[torch.Tensor], bool]:
    """The weight list the kernel takes, with zero biases from the block where
    the spec asks for fake biases."""
    spec = g.spec
    if spec.has_biases or not spec.fake_bias_offsets or block.dtype != ws[0].dtype:
        return ws, spec.has_biases
    fakes = g.fake_biases(ws[0])
    per = spec.weights_per_layer
    out: List[torch.Tensor] = []
    for k in range(len(spec.fake_bias_offsets)):
        chunk = ws[k * per : (k + 1) * per]
        out += [chunk[0], chunk[1], fakes[2 * k], fakes[2 * k + 1], *chunk[2:]]
    return out, True


def _hx_arg(spec: RnnSpec, hx: Sequence[torch.Tensor]):
    return list(hx) if spec.mode == "LSTM" else hx[0]


def fused_path(spec: RnnSpec, x, hx, ws, has_b: bool, train: bool, p: float):
    """``torch._VF.<mode>`` as PyTorch dispatches it: oneDNN (CPU LSTM), cuDNN (CUDA)."""
    return _compat.rnn_kernel(spec.mode)(
        x, _hx_arg(spec, hx), ws, has_b, spec.num_layers, p, train, spec.bidirectional, spec.batch_first
    )


def unfused_path(spec: RnnSpec, x, hx, ws, has_b: bool, train: bool, p: float):
    """Input projection for all steps as one GEMM, then per-step recurrent GEMMs."""
    if x.device.type == "cpu" and UNFUSED_IMPL != "loop":
        # ATen's native CPU kernel is this algorithm (it precomputes
        # ``linear_ih`` over the whole sequence) without Python per step;
        # only the LSTM has a oneDNN kernel to switch off.
        if spec.mode != "LSTM" or not _compat.get_mkldnn_enabled():
            return fused_path(spec, x, hx, ws, has_b, train, p)
        _compat.set_mkldnn_enabled(False)
        try:
            return fused_path(spec, x, hx, ws, has_b, train, p)
        finally:
            _compat.set_mkldnn_enabled(True)
    return _loop(spec, x, hx, ws, has_b, train, p)


def _loop(spec: RnnSpec, x, hx, ws, has_b: bool, train: bool, p: float):
    """The unfused path in PyTorch ops (CUDA and other devices), with ATen's
    native cell formulas and dropout placement."""
    if spec.batch_first:
        x = x.transpose(0, 1)
    T = x.shape[0]
    D = spec.directions
    per = (4 if has_b else 2) + (1 if spec.proj_size > 0 else 0)
    lstm = spec.mode == "LSTM"
    h0 = hx[0]
    c0 = hx[1] if lstm else None
    layer_in = x
    hs, cs = [], []
    for layer in range(spec.num_layers):
        outs = []
        for d in range(D):
            k = layer * D + d
            w = ws[k * per : (k + 1) * per]
            w_ih, w_hh = w[0], w[1]
            b_ih, b_hh = (w[2], w[3]) if has_b else (None, None)
            w_hr = w[-1] if spec.proj_size > 0 else None
            xw = F.linear(layer_in, w_ih, b_ih)  # all steps: one GEMM
            h = h0[k]
            c = c0[k] if lstm else None
            ys: List[Optional[torch.Tensor]] = [None] * T
            for t in (range(T - 1, -1, -1) if d == 1 else range(T)):
                gates = F.linear(h, w_hh, b_hh).add(xw[t]) if not spec.mode == "GRU" else None
                if lstm:
                    i, f, g, o = gates.chunk(4, 1)
                    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                    h = torch.sigmoid(o) * torch.tanh(c)
                    if w_hr is not None:
                        h = F.linear(h, w_hr)
                elif spec.mode == "GRU":
                    gh = F.linear(h, w_hh, b_hh)
                    ir, iz, in_ = xw[t].chunk(3, 1)
                    hr, hz, hn = gh.chunk(3, 1)
                    r = torch.sigmoid(ir + hr)
                    z = torch.sigmoid(iz + hz)
                    n = torch.tanh(in_ + r * hn)
                    h = (h - n) * z + n
                elif spec.mode == "RNN_TANH":
                    h = torch.tanh(gates)
                else:
                    h = torch.relu(gates)
                ys[t] = h
            outs.append(torch.stack(ys, 0))
            hs.append(h)
            if lstm:
                cs.append(c)
        layer_out = outs[0] if D == 1 else torch.cat(outs, 2)
        if p > 0 and train and layer < spec.num_layers - 1:
            layer_out = F.dropout(layer_out, p, True)
        layer_in = layer_out
    out = layer_in.transpose(0, 1) if spec.batch_first else layer_in
    if lstm:
        return out, torch.stack(hs, 0), torch.stack(cs, 0)
    return out, torch.stack(hs, 0)


def paths_differ(spec: RnnSpec, x: torch.Tensor) -> bool:
    """Do the two paths run different kernels for this input? On the CPU only
    an LSTM without projections in a dtype oneDNN takes has a fused kernel."""
    if x.device.type != "cpu" or UNFUSED_IMPL == "loop":
        return True
    return spec.mode == "LSTM" and spec.proj_size == 0 and _compat.mkldnn_rnn_dtype(x.dtype)


# -- seq_threshold="auto" -----------------------------------------------------

_AUTO: Dict[tuple, int] = {}
#: Lengths "auto" measures, in order; it stops after the fused kernel wins twice in a row.
AUTO_LENGTHS = (1, 2, 4, 8, 16, 32, 64, 128)


def auto_threshold_cache() -> Dict[tuple, int]:
    """The thresholds ``seq_threshold="auto"`` measured, by shape key."""
    return _AUTO


def _auto_key(spec: RnnSpec, x: torch.Tensor, need_grad: bool, train: bool, p: float) -> tuple:
    batch = x.shape[0] if spec.batch_first else x.shape[1]
    return (x.device.type, x.dtype, int(batch), spec.hidden_size, spec.num_layers, spec.mode, spec.input_size,
            spec.proj_size, spec.bidirectional, need_grad, bool(train and p > 0))


def _median_time(fn, reps: int = 3, device: Optional[torch.device] = None) -> float:
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    fn()  # warm-up: oneDNN / cuDNN build their plan for the shape on the first call
    ts = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _measure_threshold(spec: RnnSpec, x, hx, ws, has_b: bool, train: bool, p: float, need_grad: bool) -> int:
    """Largest length at which the unfused path was at least as fast as the
    fused kernel, measured on random data with this call's weights."""
    batch = x.shape[0] if spec.batch_first else x.shape[1]
    n, fused_wins = 0, 0
    with torch.random.fork_rng(devices=[]):  # leave the caller's dropout stream alone
        for T in AUTO_LENGTHS:
            shape = (batch, T, spec.input_size) if spec.batch_first else (T, batch, spec.input_size)
            xt = torch.randn(shape, dtype=x.dtype, device=x.device)
            if need_grad:
                wt = [w.detach().requires_grad_() for w in ws]

                def run(path):
                    out = path(spec, xt, hx, wt, has_b, train, p)[0]
                    torch.autograd.grad(out, [w for w in wt if w.requires_grad], torch.ones_like(out))
            else:
                wt = list(ws)

                def run(path):
                    with torch.no_grad():
                        path(spec, xt, hx, wt, has_b, train, p)

            t_unfused = _median_time(lambda: run(unfused_path), device=x.device)
            t_fused = _median_time(lambda: run(fused_path), device=x.device)
            if t_unfused <= t_fused:
                n, fused_wins = T, 0
            else:
                fused_wins += 1
                if fused_wins == 2:
                    break
    return n


def _threshold(g: RnnGroup, x, hx, ws, has_b: bool, train: bool, p: float, need_grad: bool) -> int:
    spec = g.spec
    if spec.threshold != "auto":
        return spec.threshold
    if not paths_differ(spec, x):
        return 0  # one kernel either way: nothing to measure
    key = _auto_key(spec, x, need_grad, train, p)
    n = _AUTO.get(key)
    if n is None:
        with _compat.autograd_inside_op() if need_grad else torch.no_grad():
            n = _AUTO[key] = _measure_threshold(spec, x, hx, ws, has_b, train, p, need_grad)
        g.record.detail.setdefault("auto_thresholds", {})[f"batch={key[2]} {key[1]} grad={need_grad}"] = n
        g.record.bump("auto_measurements")
    return n


# -- the custom ops -----------------------------------------------------------


class _Tape(bytearray):
    """Owns the autograd graph one forward recorded; lives as long as the
    uint8 tensor ``torch.frombuffer`` made from it (the op's 4th output)."""


_TAPES: "weakref.WeakValueDictionary[int, _Tape]" = weakref.WeakValueDictionary()
_tape_ids = itertools.count(1)


def _new_tape(leaves, outs) -> torch.Tensor:
    tid = next(_tape_ids)
    tape = _Tape(tid.to_bytes(8, "little"))
    tape.graph = (leaves, outs)
    _TAPES[tid] = tape
    return torch.frombuffer(tape, dtype=torch.uint8)


def _no_tape() -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _outputs(spec: RnnSpec, outs) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, hy = outs[0], outs[1]
    cy = outs[2] if spec.mode == "LSTM" else out.new_empty(0)
    return out.detach().contiguous(), hy.detach().contiguous(), cy.detach().contiguous()


# The ops are declared with ``torch.library.Library`` (schema + kernel + fake)
# and their autograd formula lives in ``_Rnn`` (an ``autograd.Function`` that
# the graph calls, as ``fused_linear`` does), not in ``custom_op``'s
# ``register_autograd``: in the compiled forward the op is then reached by the
# dispatcher's C++ autograd fallthrough instead of three Python layers and two
# more Python <-> C++ argument conversions. Measured on this CPU (LSTM(64, 64),
# batch 1, T = 1, no grad): the op call costs about 35 us less (microbenchmark
# in docs/rnn.md, "Per-call cost"). AOTAutograd traces through ``_Rnn`` like
# any Function, so its graphs still hold one ``wfpass.rnn`` forward and one
# ``wfpass.rnn_backward``.
_LIB = torch.library.Library("wfpass", "FRAGMENT")
_LIB.define(
    "rnn(Tensor input, Tensor[] hx, Tensor[] weights, Tensor block, str gid, bool train, bool[] grad_mask, "
    "Tensor? dropout) -> (Tensor, Tensor, Tensor, Tensor)",
    tags=(torch.Tag.nondeterministic_seeded,),
)
_LIB.define(
    "rnn_backward(Tensor tape, Tensor? grad_out, Tensor? grad_hy, Tensor? grad_cy, Tensor[] inputs, "
    "bool[] needs, str gid) -> Tensor[]"
)


def _rnn_op(
    input: torch.Tensor, hx: List[torch.Tensor], weights: List[torch.Tensor], block: torch.Tensor,
    gid: str, train: bool, grad_mask: List[bool], dropout: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``wfpass::rnn``: outputs, final states, and the tape (see module
    docstring). An empty ``hx`` means a zero initial state, built here."""
    g: RnnGroup = group(gid)
    spec = g.spec
    p = spec.dropout if dropout is None else float(dropout)
    need_grad = any(grad_mask)
    state = hx if hx else _zero_state(spec, input)
    kw, has_b = _kernel_weights(g, weights, block)
    n = spec.threshold
    if n.__class__ is not int:
        n = _threshold(g, input, state, kw, has_b, train, p, need_grad)
    if input.shape[1 if spec.batch_first else 0] <= n:
        path = unfused_path
        g.record.bump("unfused_calls")
    else:
        path = fused_path
        g.record.bump("fused_calls")
    if not need_grad:
        outs = path(spec, input, state, kw, has_b, train, p)
        cy = outs[2].contiguous() if spec.mode == "LSTM" else input.new_empty(0)
        return outs[0].contiguous(), outs[1].contiguous(), cy, torch.empty(0, dtype=torch.uint8)
    with _compat.autograd_inside_op():
        leaves = [t.detach().requires_grad_(bool(m)) for t, m in zip([input, *hx, *weights], grad_mask)]
        x_, hx_ = leaves[0], (leaves[1 : 1 + len(hx)] if hx else state)
        kw, has_b = _kernel_weights(g, leaves[1 + len(hx) :], block)
        outs = path(spec, x_, hx_, kw, has_b, train, p)
    return (*_outputs(spec, outs), _new_tape(leaves, tuple(outs)))


def _zero_state(spec: RnnSpec, x: torch.Tensor) -> List[torch.Tensor]:
    """The zero initial state ``nn.LSTM/GRU/RNN.forward`` builds when no
    ``hx`` is given. Built inside the op rather than in the graph: Inductor
    would launch a kernel for each zeros tensor (about 20 us of host time
    apiece on CUDA, measured on an H100), ``torch.zeros`` here is one fill."""
    batch = x.shape[0 if spec.batch_first else 1]
    ld = spec.num_layers * spec.directions
    h0 = x.new_zeros((ld, batch, spec.out_hidden))
    return [h0, x.new_zeros((ld, batch, spec.hidden_size))] if spec.mode == "LSTM" else [h0]


def _rnn_fake(input, hx, weights, block, gid, train, grad_mask, dropout):
    spec: RnnSpec = group(gid).spec
    if spec.batch_first:
        batch, steps = input.shape[0], input.shape[1]
        out = input.new_empty((batch, steps, spec.directions * spec.out_hidden))
    else:
        steps, batch = input.shape[0], input.shape[1]
        out = input.new_empty((steps, batch, spec.directions * spec.out_hidden))
    hy, *cy = _zero_state(spec, input)  # the final states have the initial states' shapes
    cy = cy[0] if cy else input.new_empty(0)
    tape = torch.empty(8 if any(grad_mask) else 0, dtype=torch.uint8)
    return out, hy, cy, tape


def _rnn_backward_op(
    tape: torch.Tensor, grad_out: Optional[torch.Tensor], grad_hy: Optional[torch.Tensor],
    grad_cy: Optional[torch.Tensor], inputs: List[torch.Tensor], needs: List[bool], gid: str,
) -> List[torch.Tensor]:
    t = _TAPES.get(int(tape.view(torch.int64).item())) if tape.numel() == 8 else None
    if t is None:
        raise RuntimeError(
            f"wfpass: the backward of RNN {group(gid).spec.name} found no recorded forward "
            "(was it already run and freed, or did the forward run without grad?)"
        )
    leaves, outs = t.graph
    pairs = [(o, g) for o, g in zip(outs, (grad_out, grad_hy, grad_cy)) if g is not None and o.requires_grad and g.numel()]
    want = [i for i, m in enumerate(needs) if m]
    result = [x.new_empty(0) for x in inputs]
    if not want:
        return result
    with _compat.autograd_inside_op():
        grads = torch.autograd.grad(
            [o for o, _ in pairs], [leaves[i] for i in want], [g for _, g in pairs],
            retain_graph=True, allow_unused=True,
        )
    # An op whose schema declares no aliasing may not return views of its inputs or of each other. cuDNN's
    # backward returns the weight gradients as views of one flat buffer
    # (seen on an H100), so a gradient whose storage is already taken is copied.
    taken = {t.untyped_storage().data_ptr() for t in (tape, grad_out, grad_hy, grad_cy, *inputs)
             if t is not None and t.numel()}
    for i, gr in zip(want, grads):
        if gr is None:
            result[i] = torch.zeros_like(inputs[i])
        elif gr.stride() != inputs[i].stride() or gr.untyped_storage().data_ptr() in taken:
            # The fake promises empty_like(input) strides and Inductor asserts
            # them; the kernel's own backward may answer time-major (a
            # batch_first input's grad came back with strides (16, 64, 1)).
            result[i] = torch.empty_like(inputs[i]).copy_(gr)
        else:
            result[i] = gr
        if result[i].numel():
            taken.add(result[i].untyped_storage().data_ptr())
    return result


def _rnn_backward_fake(tape, grad_out, grad_hy, grad_cy, inputs, needs, gid):
    return [torch.empty_like(x) if m else x.new_empty(0) for x, m in zip(inputs, needs)]


_LIB.impl("rnn", _rnn_op, "CompositeExplicitAutograd")
_LIB.impl("rnn_backward", _rnn_backward_op, "CompositeExplicitAutograd")
torch.library.register_fake("wfpass::rnn", _rnn_fake, lib=_LIB)
torch.library.register_fake("wfpass::rnn_backward", _rnn_backward_fake, lib=_LIB)


class _Rnn(torch.autograd.Function):
    """The autograd formula of ``wfpass::rnn``: the backward replays the tape
    through ``wfpass::rnn_backward``. ``hx`` and the weights come flattened
    after ``n_hx`` because a Function only differentiates top-level tensors."""

    @staticmethod
    def forward(x, block, gid, train, grad_mask, dropout, n_hx, *tensors):
        return torch.ops.wfpass.rnn.default(
            x, list(tensors[:n_hx]), list(tensors[n_hx:]), block, gid, train, grad_mask, dropout
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, _block, gid, _train, grad_mask, _dropout, _n_hx, *tensors = inputs
        ctx.save_for_backward(output[3], x, *tensors)
        ctx.gid, ctx.mask = gid, list(grad_mask)
        ctx.mark_non_differentiable(output[3])
        ctx.set_materialize_grads(False)  # an unused h_n / c_n costs no backward work

    @staticmethod
    def backward(ctx, grad_out, grad_hy, grad_cy, _grad_tape):
        if torch.is_grad_enabled():
            # create_graph=True: the tape's graph hangs off detached leaves, so
            # a second derivative through it would be silently zero (the
            # dispatcher's fallback only warns). Say so instead.
            raise RuntimeError(
                f"wfpass: double backward (create_graph=True) through RNN {group(ctx.gid).spec.name} is not "
                "supported by the rnn format; compile with wfpass.backend(passes=...) without 'fuse_rnn' "
                "(or wfpass.restore the model) for higher-order gradients"
            )
        tape, *ins = ctx.saved_tensors
        grads = torch.ops.wfpass.rnn_backward.default(tape, grad_out, grad_hy, grad_cy, ins, ctx.mask, ctx.gid)
        grads = [gr if m else None for gr, m in zip(grads, ctx.mask)]
        return (grads[0], None, None, None, None, None, None, *grads[1:])


def rnn_call(input, hx, weights, block, gid: str, train: bool, grad_mask, dropout=None):
    """Graph-level entry point of the RNN format (FX cannot name
    ``_Rnn.apply`` in code): ``wfpass::rnn`` with its autograd formula.
    Returns ``(output, h_n, c_n, tape)``; ``c_n`` is empty unless LSTM; an
    empty ``hx`` is a zero initial state. Call this, not the op: the op
    alone has no autograd kernel (its schema and fake implementation pass
    ``torch.library.opcheck``, tested)."""
    return _Rnn.apply(input, block, gid, train, list(grad_mask), dropout, len(hx), *hx, *weights)


# -- symbolic_trace graphs: the module call -----------------------------------


def rnn_module_call(gid: str, input, hx, block: torch.Tensor, *weights: torch.Tensor):
    """``nn.LSTM/GRU/RNN.forward`` for ``wfpass.apply`` graphs: the module's
    own argument checks (their errors name the RNN), unbatched input, zero
    initial state, then ``wfpass::rnn``."""
    g: RnnGroup = group(gid)
    spec = g.spec
    mod = g.module
    if isinstance(input, torch.nn.utils.rnn.PackedSequence):
        g.record.bump("packed_fallback_calls")
        return type(mod).forward(mod, input, hx)
    lstm = spec.mode == "LSTM"
    if input.dim() not in (2, 3):
        raise ValueError(f"{spec.name}: {_CLASS[spec.mode]}: Expected input to be 2D or 3D, got {input.dim()}D instead")
    batched = input.dim() == 3
    batch_dim = 0 if spec.batch_first else 1
    if not batched:
        input = input.unsqueeze(batch_dim)
        if hx is not None:
            parts = hx if lstm else (hx,)
            if any(h.dim() != 2 for h in parts):
                raise RuntimeError(f"{spec.name}: for unbatched 2-D input, the hidden state should also be 2-D, got "
                                   f"{', '.join(f'{h.dim()}-D' for h in parts)}")
            hx = tuple(h.unsqueeze(1) for h in parts) if lstm else hx.unsqueeze(1)
    if hx is None:
        zeros = _zero_state(spec, input)
        hx = tuple(zeros) if lstm else zeros[0]
    try:
        mod.check_forward_args(input, hx, None)
    except (RuntimeError, ValueError, TypeError) as e:
        raise type(e)(f"{spec.name}: {e}") from None
    hx_list = list(hx) if lstm else [hx]
    train = mod.training
    tensors = [input, *hx_list, *weights]
    if torch.is_grad_enabled():
        mask = [t.requires_grad for t in tensors]
    else:
        mask = [False] * len(tensors)
    out, hy, cy, _tape = rnn_call(input, hx_list, list(weights), block, gid, train, mask, None)
    if not batched:
        out, hy, cy = out.squeeze(batch_dim), hy.squeeze(1), cy.squeeze(1) if lstm else cy
    return (out, (hy, cy)) if lstm else (out, hy)
