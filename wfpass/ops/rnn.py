"""The RNN format: flat weights, and an RNN call the compiler sees whole.

Graph after ``fuse_rnn`` (Dynamo flavour, a 2-layer ``nn.LSTM`` on the CPU,
T > ``seq_threshold``)::

    out, h_n, c_n = rnn_forward[mkldnn](x, [h0, c0], w_ih_l0, w_hh_l0, b_ih_l0, b_hh_l0, w_ih_l1, ...)

``rnn_forward`` is a callable object holding the RNN's spec and the path the
pass chose; AOTAutograd traces it like any Python function, into ATen ops
that carry their own derivative formulas:

* ``mkldnn``: ``aten.mkldnn_rnn_layer`` per layer and direction, the kernel
  eager PyTorch runs for a CPU LSTM (oneDNN), whose backward is
  ``mkldnn_rnn_layer_backward``. The graph holds one op per layer whatever
  the length T, so compile time does not grow with T.
* ``loop``: the unfused path, for T <= ``seq_threshold``: the input
  projection of all steps as one GEMM, then one recurrent GEMM and the gate
  math per step (T is small here, so the unrolled graph is too).
  GRUs, plain RNNs (no fused CPU kernel in PyTorch) and LSTMs oneDNN does
  not take (``proj_size``, some dtypes) take this path at every static T.
* ``aten``: the same ``torch.lstm`` / ``gru`` / ``rnn_tanh`` call as eager,
  which AOTAutograd decomposes into ATen ops as it would without wfpass;
  only for a symbolic T where the two paths above cannot run (training
  through oneDNN needs a static shape; the loop needs a static T).

No state is kept between the forward and the backward that AOTAutograd
does not see: what the backward needs, ``mkldnn_rnn_layer``'s workspace
included, are outputs of traced ops, saved and freed by AOTAutograd.

The path is chosen when the graph is compiled, from the static length T
(``T <= seq_threshold``: ``loop``). RNNs off the CPU are not captured at all
(``_compat``): they graph-break and run eagerly, as without wfpass. ``seq_threshold="auto"`` measures the two paths
once per shape at compile time (with the model's weights).

The flat block: every Parameter of the RNN is a view into one buffer (same
objects), in PyTorch's ``_flat_weights`` order. The CPU kernels read each
weight by itself, so the graph passes the parameters, not the block, and a
lost layout never changes a result (the backend re-fuses it, counted).
``wfpass.apply`` graphs call ``RnnModuleCall``, which runs the module's own
argument checks and picks the path per call from the real T.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
import weakref
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from .. import _compat
from ..config import RnnOptions

__all__ = [
    "RnnSpec", "GATES", "RnnForward", "RnnModuleCall", "paths_differ", "choose_path",
    "fused_path", "unfused_path", "auto_threshold_cache", "measure_threshold", "mkldnn_path",
]

#: Gates per mode: rows of ``weight_ih`` = GATES[mode] * hidden_size.
GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}
_CLASS = {"LSTM": "LSTM", "GRU": "GRU", "RNN_TANH": "RNN", "RNN_RELU": "RNN"}

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
    options: RnnOptions = RnnOptions()  # Config.rnn of the compile that made this spec

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


def _hx_arg(spec: RnnSpec, hx: Sequence[torch.Tensor]):
    return list(hx) if spec.mode == "LSTM" else hx[0]


def fused_path(spec: RnnSpec, x, hx, ws, has_b: bool, train: bool, p: float):
    """``torch._VF.<mode>`` as PyTorch dispatches it: oneDNN (CPU LSTM), cuDNN (CUDA)."""
    return _compat.rnn_kernel(spec.mode)(
        x, _hx_arg(spec, hx), ws, has_b, spec.num_layers, p, train, spec.bidirectional, spec.batch_first
    )


def unfused_path(spec: RnnSpec, x, hx, ws, has_b: bool, train: bool, p: float):
    """Input projection for all steps as one GEMM, then per-step recurrent GEMMs."""
    if x.device.type == "cpu" and spec.options.unfused_impl != "loop":
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


def _layers(spec: RnnSpec, x, train: bool, p: float, direction):
    """The layer and direction structure every path shares, as ``nn.LSTM``
    has it: ``direction(layer_in, k, reverse) -> (y, final_state)`` for
    each layer and direction ``k``, directions concatenated, dropout between
    layers in training, batch-first in and out. Returns the output and the
    final states in ``k`` order."""
    if spec.batch_first:
        x = x.transpose(0, 1)
    finals = []
    layer_in = x
    for layer in range(spec.num_layers):
        outs = []
        for d in range(spec.directions):
            y, final = direction(layer_in, layer * spec.directions + d, d == 1)
            outs.append(y)
            finals.append(final)
        layer_out = outs[0] if spec.directions == 1 else torch.cat(outs, 2)
        if p > 0 and train and layer < spec.num_layers - 1:
            layer_out = F.dropout(layer_out, p, True)
        layer_in = layer_out
    return (layer_in.transpose(0, 1) if spec.batch_first else layer_in), finals


def _loop(spec: RnnSpec, x, hx, ws, has_b: bool, train: bool, p: float):
    """The unfused path in PyTorch ops, with ATen's native cell formulas and
    dropout placement: the input projection of all steps as one GEMM, then
    one recurrent GEMM and the gate math per step."""
    per = (4 if has_b else 2) + (1 if spec.proj_size > 0 else 0)
    lstm = spec.mode == "LSTM"
    h0 = hx[0]
    c0 = hx[1] if lstm else None

    def direction(layer_in, k, reverse):
        T = layer_in.shape[0]
        w = ws[k * per : (k + 1) * per]
        w_ih, w_hh = w[0], w[1]
        b_ih, b_hh = (w[2], w[3]) if has_b else (None, None)
        w_hr = w[-1] if spec.proj_size > 0 else None
        xw = F.linear(layer_in, w_ih, b_ih)  # all steps: one GEMM
        h = h0[k]
        c = c0[k] if lstm else None
        ys: List[Optional[torch.Tensor]] = [None] * T
        for t in (range(T - 1, -1, -1) if reverse else range(T)):
            if lstm:
                gates = F.linear(h, w_hh, b_hh).add(xw[t])
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
                h = torch.tanh(F.linear(h, w_hh, b_hh).add(xw[t]))
            else:
                h = torch.relu(F.linear(h, w_hh, b_hh).add(xw[t]))
            ys[t] = h
        return torch.stack(ys, 0), (h, c)

    out, finals = _layers(spec, x, train, p, direction)
    hy = torch.stack([h for h, _ in finals], 0)
    if lstm:
        return out, hy, torch.stack([c for _, c in finals], 0)
    return out, hy


def mkldnn_path(spec: RnnSpec, x, hx, ws, has_b: bool, train: bool, p: float, need_grad: bool):
    """A CPU LSTM as oneDNN LSTM layer calls (``wfpass::lstm_layer``, i.e.
    ``aten.mkldnn_rnn_layer``), one per layer and direction, as ATen's own
    oneDNN LSTM runs it, with dropout between layers like ``nn.LSTM``.
    ``need_grad``: ask the kernel for the workspace its backward formula reads."""
    per = spec.weights_per_layer
    h0, c0 = hx[0], hx[1]

    def direction(layer_in, k, reverse):
        w = ws[k * per : (k + 1) * per]
        w0, w1 = w[0], w[1]
        w2, w3 = (w[2], w[3]) if has_b else (w0.new_zeros(w0.shape[0]),) * 2
        y, hy, cy, _ws = torch.ops.wfpass.lstm_layer.default(
            layer_in.contiguous(), w0, w1, w2, w3, None if h0 is None else h0[k : k + 1].contiguous(),
            None if c0 is None else c0[k : k + 1].contiguous(), reverse, spec.hidden_size, has_b, need_grad,
        )
        return y, (hy, cy)

    out, finals = _layers(spec, x, train, p, direction)
    return out, torch.cat([h for h, _ in finals], 0), torch.cat([c for _, c in finals], 0)


def choose_path(spec: RnnSpec, x: torch.Tensor, steps: Optional[int], threshold: int, need_grad: bool,
                static_batch: bool = True) -> str:
    """The path for a call of ``steps`` time steps (None: symbolic, unknown
    until run time): ``loop`` at or below the threshold, else the fused
    kernel where PyTorch has one for this RNN (``mkldnn``), else ``aten``.
    Training through oneDNN needs static shapes (its workspace size is
    measured per shape), so a symbolic shape with grad takes ``aten``."""
    if steps is not None and steps <= threshold and paths_differ(spec, x):
        return "loop"
    if (x.device.type == "cpu" and spec.mode == "LSTM" and spec.proj_size == 0
            and _compat.mkldnn_rnn_dtype(x.dtype) and (not need_grad or (steps is not None and static_batch))):
        return "mkldnn"
    if steps is not None:
        # No fused kernel for this RNN: the per-step ops, written out here.
        # Not ATen's decomposition of torch.gru/rnn_tanh, which drops the
        # dropout between layers (torch/_decomp/decompositions.py
        # ``_rnn_helper``, torch 2.13.0) and gave wrong h_n gradients for a
        # one-layer nn.RNN whose h_n is read (seen under Inductor).
        return "loop"
    return "aten"


class RnnForward:
    """The graph's call of one RNN (Dynamo flavour): ``(x, hx, *weights) ->
    (out, h_n, c_n)`` on the path chosen at compile time. A callable object,
    so the graph carries its spec without any global table."""

    def __init__(self, spec: RnnSpec, path: str, train: bool):
        self.spec, self.path, self.train = spec, path, train
        self.__name__ = self.__qualname__ = f"rnn_{path}"

    __module__ = __name__

    def __call__(self, x, hx, *weights):
        spec = self.spec
        p = spec.dropout
        ws, has_b = weights, spec.has_biases
        if self.path != "mkldnn" and any(h is None for h in hx):
            # A zero state (None): the oneDNN op fills its own; the others get it here.
            hx = [z if h is None else h for h, z in zip(hx, _zero_state(spec, x))]
        if self.path == "mkldnn":
            need_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *hx, *weights))
            out, hy, cy = mkldnn_path(spec, x, hx, ws, has_b, self.train, p, need_grad)
        elif self.path == "loop":
            outs = _loop(spec, x, hx, ws, has_b, self.train, p)
            out, hy, cy = outs[0], outs[1], (outs[2] if spec.mode == "LSTM" else None)
        elif spec.mode == "LSTM":
            # ATen's decomposition of torch.lstm (torch/_decomp/decompositions.py,
            # torch 2.13.0) picks aten.mkldnn_rnn_layer in inference mode
            # whenever oneDNN is on and the input needs no grad: without the
            # workspace its backward needs (weights that need grad), and in a
            # form Inductor's lowering fails on. Traced with oneDNN off it
            # unrolls the plain cell math, which AOTAutograd differentiates.
            with _compat.mkldnn_disabled():
                outs = fused_path(spec, x, hx, ws, has_b, self.train, p)
            out, hy, cy = outs[0], outs[1], outs[2]
        else:
            outs = fused_path(spec, x, hx, ws, has_b, self.train, p)
            out, hy, cy = outs[0], outs[1], None
        return (out, hy, cy) if spec.mode == "LSTM" else (out, hy)

    def __repr__(self) -> str:
        return f"RnnForward({self.spec.name}, path={self.path!r})"


def paths_differ(spec: RnnSpec, x: torch.Tensor) -> bool:
    """Do the two paths run different kernels for this input? On the CPU only
    an LSTM without projections in a dtype oneDNN takes has a fused kernel."""
    if x.device.type != "cpu" or spec.options.unfused_impl == "loop":
        return True
    return spec.mode == "LSTM" and spec.proj_size == 0 and _compat.mkldnn_rnn_dtype(x.dtype)


# -- seq_threshold="auto" -----------------------------------------------------

_AUTO: Dict[tuple, int] = {}


def auto_threshold_cache() -> Dict[tuple, int]:
    """The thresholds ``seq_threshold="auto"`` measured, by shape key."""
    return _AUTO


def _auto_key(spec: RnnSpec, x: torch.Tensor, need_grad: bool, train: bool, p: float) -> tuple:
    batch = x.shape[0] if spec.batch_first else x.shape[1]
    return (x.device.type, x.dtype, int(batch), spec.hidden_size, spec.num_layers, spec.mode, spec.input_size,
            spec.proj_size, spec.bidirectional, need_grad, bool(train and p > 0), spec.options)


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
        for T in spec.options.auto_lengths:
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


def measure_threshold(spec: RnnSpec, record, x, hx, ws, has_b: bool, train: bool, p: float, need_grad: bool) -> int:
    """``seq_threshold="auto"``: the measured N for this shape, cached by shape."""
    if spec.threshold != "auto":
        return spec.threshold
    if not paths_differ(spec, x):
        return 0  # one kernel either way: nothing to measure
    key = _auto_key(spec, x, need_grad, train, p)
    n = _AUTO.get(key)
    if n is None:
        with torch.enable_grad() if need_grad else torch.no_grad():
            n = _AUTO[key] = _measure_threshold(spec, x, hx, ws, has_b, train, p, need_grad)
        if record is not None:
            record.detail.setdefault("auto_thresholds", {})[f"batch={key[2]} {key[1]} grad={need_grad}"] = n
            record.bump("auto_measurements")
    return n


def _zero_state(spec: RnnSpec, x: torch.Tensor) -> List[torch.Tensor]:
    """The zero initial state ``nn.LSTM/GRU/RNN.forward`` builds when no
    ``hx`` is given. Built inside the op rather than in the graph: Inductor
    would launch a kernel for each zeros tensor (about 20 us of host time
    apiece on CUDA, measured on an H100), ``torch.zeros`` here is one fill."""
    batch = x.shape[0 if spec.batch_first else 1]
    ld = spec.num_layers * spec.directions
    h0 = x.new_zeros((ld, batch, spec.out_hidden))
    return [h0, x.new_zeros((ld, batch, spec.hidden_size))] if spec.mode == "LSTM" else [h0]


class RnnModuleCall:
    """``nn.LSTM/GRU/RNN.forward`` for ``wfpass.apply`` graphs, which run
    eagerly: the module's own argument checks (their errors name the RNN),
    unbatched input, zero initial state, the layout check, then the path for
    this call's T, under eager autograd."""

    __module__ = __name__

    def __init__(self, spec: RnnSpec, site, module):
        self.spec, self.site = spec, site
        self._module = weakref.ref(module)
        self.__name__ = self.__qualname__ = "rnn_module_call"

    def __call__(self, input, hx, *weights):
        spec, site = self.spec, self.site
        mod = self._module()
        if mod is None:
            raise RuntimeError(f"wfpass: {spec.name} was deleted")
        rec = site.record
        if isinstance(input, torch.nn.utils.rnn.PackedSequence):
            rec.bump("packed_fallback_calls")
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
        fs = site.find(weights)
        if fs is None:
            rec.bump("unfused_layout_calls")
        else:
            rec = fs.record
        hx_list = list(hx) if lstm else [hx]
        train = mod.training
        ws, has_b = weights, spec.has_biases
        need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (input, *hx_list, *weights))
        n = measure_threshold(spec, rec, input, hx_list, ws, has_b, train, spec.dropout, need_grad)
        if input.shape[1 if spec.batch_first else 0] <= n:
            rec.bump("unfused_calls")
            outs = unfused_path(spec, input, hx_list, ws, has_b, train, spec.dropout)
        else:
            rec.bump("fused_calls")
            outs = fused_path(spec, input, hx_list, ws, has_b, train, spec.dropout)
        out, hy = outs[0], outs[1]
        cy = outs[2] if lstm else None
        if not batched:
            out, hy = out.squeeze(batch_dim), hy.squeeze(1)
            cy = cy.squeeze(1) if lstm else None
        return (out, (hy, cy)) if lstm else (out, hy)


# -- the oneDNN LSTM layer as an op AOTAutograd can train through -----------------
#
# ``aten.mkldnn_rnn_layer`` returns the workspace its backward formula needs
# only while grad mode is on (checked on torch 2.13.0); AOTAutograd runs the
# compiled forward with grad mode off, so the traced op would hand its
# backward an undefined workspace. ``wfpass::lstm_layer`` is the same kernel
# with the workspace always produced when ``train`` asks for it: a functional
# op (fresh outputs, nothing hidden), whose autograd formula is ATen's own
# ``mkldnn_rnn_layer_backward`` over the op's saved inputs and outputs.
# The workspace's size is oneDNN's business, so the fake implementation
# declares it data-dependent.

_LIB = torch.library.Library("wfpass", "FRAGMENT")
_LIB.define(
    "lstm_layer(Tensor input, Tensor w_ih, Tensor w_hh, Tensor b_ih, Tensor b_hh, Tensor? hx, Tensor? cx, "
    "bool reverse, int hidden_size, bool has_biases, bool train) -> (Tensor, Tensor, Tensor, Tensor)"
)
_LIB.define(
    "lstm_layer_backward(Tensor input, Tensor w_ih, Tensor w_hh, Tensor b_ih, Tensor b_hh, Tensor? hx, Tensor? cx, "
    "Tensor output, Tensor hy, Tensor cy, Tensor? grad_output, Tensor? grad_hy, Tensor? grad_cy, bool reverse, "
    "int hidden_size, bool has_biases, Tensor workspace) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)


def _zero_hx(input, hx, hidden_size):
    """``None`` -> the zero state ``[1, B, H]``. Made here, inside the op,
    rather than in the graph: a zeros tensor in the graph is a kernel
    Inductor must generate and compile (seconds of C++ compile on a cold
    cache, measured), for a value the op can fill itself."""
    return input.new_zeros((1, input.shape[1], hidden_size)) if hx is None else hx


def _lstm_layer(input, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, hidden_size, has_biases, train):
    hx, cx = _zero_hx(input, hx, hidden_size), _zero_hx(input, cx, hidden_size)
    with torch.enable_grad() if train else torch.no_grad():
        y, hy, cy, ws = torch.ops.aten.mkldnn_rnn_layer.default(
            input, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, [], 2, hidden_size, 1, has_biases, False, False, train)
    if ws is None or not train:
        ws = input.new_empty(0, dtype=torch.uint8)
    return y, hy, cy, ws


_WORKSPACE: Dict[tuple, int] = {}


def workspace_numel(T: int, B: int, I: int, H: int, dtype: torch.dtype, has_biases: bool) -> int:
    """Bytes of oneDNN's training workspace for one LSTM layer of this shape.
    oneDNN rounds its parts to pages, so the size is no formula of T the
    compiler could carry: it is measured once per shape, on zeros, and cached
    (a few shapes per model)."""
    key = (T, B, I, H, dtype, has_biases)
    n = _WORKSPACE.get(key)
    if n is None:
        with _compat.outside_fake_mode(), torch.enable_grad():
            x = torch.zeros(T, B, I, dtype=dtype)
            w_ih, w_hh = torch.zeros(4 * H, I, dtype=dtype), torch.zeros(4 * H, H, dtype=dtype)
            b, h = torch.zeros(4 * H, dtype=dtype), torch.zeros(1, B, H, dtype=dtype)
            ws = torch.ops.aten.mkldnn_rnn_layer.default(x, w_ih, w_hh, b, b, h, h, False, [], 2, H, 1, has_biases,
                                                         False, False, True)[3]
        n = _WORKSPACE[key] = int(ws.numel()) if ws is not None else 0
    return n


def _lstm_layer_fake(input, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, hidden_size, has_biases, train):
    T, B = input.shape[0], input.shape[1]
    n = 0
    if train:
        # Static shapes only: the pass takes this op for a symbolic T only without grad.
        n = workspace_numel(int(T), int(B), int(input.shape[2]), hidden_size, input.dtype, has_biases)
    state = (1, B, hidden_size)
    return (input.new_empty((T, B, hidden_size)), input.new_empty(state), input.new_empty(state),
            input.new_empty((n,), dtype=torch.uint8))


def _lstm_layer_backward(input, w_ih, w_hh, b_ih, b_hh, hx, cx, output, hy, cy, grad_output, grad_hy, grad_cy,
                         reverse, hidden_size, has_biases, workspace):
    hx, cx = _zero_hx(input, hx, hidden_size), _zero_hx(input, cx, hidden_size)
    grads = torch.ops.aten.mkldnn_rnn_layer_backward.default(
        input, w_ih, w_hh, b_ih, b_hh, hx, cx, output, hy, cy, grad_output, grad_hy, grad_cy, reverse, 2,
        hidden_size, 1, has_biases, True, False, [], False, workspace)
    # An op may not return aliases of its inputs or of each other, and its
    # outputs must have the strides its fake promises (``empty_like``): copy
    # a gradient only where the kernel's answer breaks either rule.
    refs = (input, w_ih, w_hh, b_ih, b_hh, hx, cx)
    taken = {t.untyped_storage().data_ptr() for t in (input, w_ih, w_hh, b_ih, b_hh, hx, cx, output, hy, cy,
                                                       grad_output, grad_hy, grad_cy, workspace)
             if t is not None and t.numel()}
    out = []
    for g, ref in zip(grads, refs):
        if g is None:
            g = torch.zeros_like(ref)
        elif g.stride() != ref.stride() or (g.numel() and g.untyped_storage().data_ptr() in taken):
            g = torch.empty_like(ref).copy_(g)
        if g.numel():
            taken.add(g.untyped_storage().data_ptr())
        out.append(g)
    return tuple(out)


def _lstm_layer_backward_fake(input, w_ih, w_hh, b_ih, b_hh, hx, cx, output, hy, cy, grad_output, grad_hy, grad_cy,
                              reverse, hidden_size, has_biases, workspace):
    hx, cx = _zero_hx(input, hx, hidden_size), _zero_hx(input, cx, hidden_size)
    return tuple(torch.empty_like(t) for t in (input, w_ih, w_hh, b_ih, b_hh, hx, cx))


_LIB.impl("lstm_layer", _lstm_layer, "CompositeExplicitAutograd")
_LIB.impl("lstm_layer_backward", _lstm_layer_backward, "CompositeExplicitAutograd")
torch.library.register_fake("wfpass::lstm_layer", _lstm_layer_fake, lib=_LIB)
torch.library.register_fake("wfpass::lstm_layer_backward", _lstm_layer_backward_fake, lib=_LIB)


def _lstm_layer_setup(ctx, inputs, output):
    input, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, hidden_size, has_biases, train = inputs
    y, hy, cy, ws = output
    ctx.save_for_backward(input, w_ih, w_hh, b_ih, b_hh, hx, cx, y, hy, cy, ws)
    ctx.static = (reverse, hidden_size, has_biases, train)
    ctx.set_materialize_grads(False)


def _lstm_layer_grad(ctx, gy, ghy, gcy, _gws):
    input, w_ih, w_hh, b_ih, b_hh, hx, cx, y, hy, cy, ws = ctx.saved_tensors
    reverse, hidden_size, has_biases, train = ctx.static
    if not train:
        raise RuntimeError("wfpass: an LSTM layer run without grad was differentiated")
    grads = list(torch.ops.wfpass.lstm_layer_backward.default(
        input, w_ih, w_hh, b_ih, b_hh, hx, cx, y, hy, cy, gy, ghy, gcy, reverse, hidden_size, has_biases, ws))
    grads[5:7] = [g if h is not None else None for g, h in zip(grads[5:7], (hx, cx))]  # no grad for a state made inside
    return (*grads, None, None, None, None)


torch.library.register_autograd("wfpass::lstm_layer", _lstm_layer_grad, setup_context=_lstm_layer_setup, lib=_LIB)
