"""The fp32-state BatchNorm format, and eval-time folding into conv/linear.

**fp32 state.** A half-precision model keeps BatchNorm's weight, bias,
running_mean and running_var in fp16/bf16. bf16 rounds a momentum update
``0.1 * (new - old)`` away whenever it is small next to the value, so the
running statistics stall; fp16 overflows above 65504. The format: the same
Parameter/buffer objects, with ``.data`` in float32. BatchNorm with fp16/bf16
input and fp32 weight, bias and statistics is a kernel PyTorch already has (CPU
and cuDNN); the output keeps the input dtype. (On the CPU it needs all four
fp32: a partial mix raises.)

Under ``torch.compile`` the graph is compiled for fp32 statistics from the
start and nothing here runs per call (see ``batchnorm/fp32_format.py``). In
``symbolic_trace`` graphs (``wfpass.apply``) the graph runs in place, and
``bn_fp32`` / ``bn_module_fp32`` check the format before each batch norm: a
tensor that lost it (``model.to(bf16)``, ``load_state_dict(assign=True)``,
``wfpass.restore``) is cast again, counted.

**Folding.** In eval mode without grad, ``bn(conv(x))`` is
``conv(x, W * s, (b - mean) * s + beta)`` with ``s = gamma / sqrt(var + eps)``.
``folded_params`` computes that in fp32 and casts to the conv's dtype; under
``torch.compile`` it is part of the compiled graph. In ``wfpass.apply``
graphs ``fold_weight`` / ``fold_bias`` cache the result on their call target,
recomputed only when a source tensor changes (data pointer, dtype or
in-place version counter).
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .._torch import kernels as _kernels, tensors as _tensors
from ..core.storage import register_undo, sharing_problem

__all__ = [
    "HALF", "ROLES", "to_fp32", "held_in_fp32", "bn_fp32", "bn_module_fp32", "bn_eager_pre_hook",
    "fold_weight", "fold_bias", "fold_module_call", "folded_params", "FoldSpec",
]

HALF = (torch.float16, torch.bfloat16)
#: Order of the BatchNorm tensors in ``bn_fp32``'s ``role`` argument.
ROLES = ("running_mean", "running_var", "weight", "bias")

# Tensors wfpass holds in fp32, and the dtype the model gave them. Weak keys:
# a deleted model is not kept alive.
_HELD = _tensors.weak_id_key_dict()


def held_in_fp32(t: torch.Tensor) -> bool:
    """Did wfpass move ``t`` to fp32 (and does it still hold it there)?"""
    return t.dtype == torch.float32 and t in _HELD


def _undo(dtype: torch.dtype, t: torch.Tensor) -> None:
    """``wfpass.restore``: back to the model's dtype, same object."""
    _HELD.pop(t, None)
    if t.dtype == dtype:
        return
    with torch.no_grad():
        t.data = t.data.to(dtype)
    if t.grad is not None:
        t.grad = t.grad.to(dtype)


def to_fp32(t: torch.Tensor) -> bool:
    """Give ``t`` (a Parameter or buffer) float32 data in place; the object
    stays the same, so the optimizer and ``state_dict`` still hold it. A
    gradient already accumulated is cast too (autograd requires a Parameter's
    ``.grad`` to have its dtype). Returns False if it was fp32 already."""
    if t.dtype == torch.float32:
        return False
    orig = t.dtype
    with torch.no_grad():
        t.data = t.data.float()
    if t.grad is not None:
        t.grad = t.grad.float()
    _HELD[t] = orig
    register_undo(t, functools.partial(_undo, orig))
    if isinstance(t, torch.nn.Parameter):
        _watch_optimizer_state(t)
    return True


# An optimizer that already stepped holds per-parameter state (Adam's exp_avg,
# SGD's momentum_buffer) in the parameter's old dtype; Adam then raises on the
# dtype mix. Before every optimizer step, state of a parameter whose dtype
# wfpass changed is cast to the parameter's dtype: the policy
# ``Optimizer.load_state_dict`` applies (floating state follows the
# parameter, ``step`` is left alone). Public hook API, installed once.
_TOUCHED = _tensors.weak_id_key_dict()
_HOOK: List[Any] = []


def _align_optimizer_state(opt, args, kwargs) -> None:
    if not _TOUCHED:
        return
    for p in list(_TOUCHED.keys()):
        st = opt.state.get(p) if p in opt.state else None
        if not st:
            continue
        for k, v in list(st.items()):
            if k != "step" and torch.is_tensor(v) and v.is_floating_point() and v.dtype != p.dtype and v.shape == p.shape:
                st[k] = v.to(p.dtype)


def _watch_optimizer_state(p: torch.nn.Parameter) -> None:
    _TOUCHED[p] = True
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOK.append(register_optimizer_step_pre_hook(_align_optimizer_state))


# -- fp32 state: the per-call check of wfpass.apply graphs ----------------------

def _drifted(g, role: int, t: torch.Tensor) -> torch.Tensor:
    """``t`` is no longer fp32 (``model.half()``, ``load_state_dict(assign=True)``
    with half tensors, ``wfpass.restore``): cast it again, counted, unless its
    storage is shared, in which case this call computes on an fp32 copy
    (counted; a training step's statistics update then goes to the copy)."""
    name = g.spec[role] if isinstance(g.spec, tuple) else ROLES[role]
    if t.dtype in HALF and sharing_problem(t, name, ()) is None:
        to_fp32(t)
        g.record.bump("recast")
        return t
    g.record.bump("fallback_calls")
    return t.float()


def bn_fp32(g, role: int, t: Optional[torch.Tensor], count: bool = False) -> Optional[torch.Tensor]:
    """The BatchNorm tensor ``t`` (``ROLES[role]``) in fp32: ``t`` itself, no
    copy, when it is fp32, which it is from the first call after the pass on.
    ``count``: this call bumps the record's ``fp32_calls`` (one per batch norm)."""
    if t is None:
        return None
    if t.dtype is torch.float32:
        if count:
            g.record.bump("fp32_calls")
        return t
    return _drifted(g, role, t)


def _check_module(g, mod: Optional[torch.nn.Module]) -> None:
    if mod is not None:
        for role, name in enumerate(ROLES):
            t = getattr(mod, name, None)
            if t is not None and t.dtype is not torch.float32:
                _drifted(g, role, t)
    g.record.bump("fp32_calls")


def bn_module_fp32(g, x: torch.Tensor) -> torch.Tensor:
    """``call_module`` flavour: runs before an ``nn.BatchNorm*`` call and returns
    ``x`` unchanged. The module's own forward then reads its (fp32) tensors and
    keeps train/eval, ``num_batches_tracked`` and ``momentum=None`` exactly as
    eager; this only checks, and restores, the fp32 format."""
    _check_module(g, g.spec())
    return x


@torch.compiler.disable
def bn_eager_pre_hook(g, module: torch.nn.Module, args: Any) -> None:
    """Forward pre-hook of a BatchNorm that Dynamo runs eagerly (a graph
    break): the same check as ``bn_module_fp32``, on the module the hook is
    called for (a deep copy's hook then checks the copy). Bound with
    ``functools.partial`` so the module still pickles (the disabled
    function keeps this name and module).

    Never traced: the module runs eagerly inside a compiled call, where
    Dynamo compiles every Python frame it can, this hook's too. It then
    guarded on the counter ``_check_module`` bumps (``fp32_calls == 0``), so
    the second call failed that guard and compiled one more graph (the
    counter's ``+ 1``, nothing of the model's; torch 2.13.0)."""
    _check_module(g, module)


# -- folding -------------------------------------------------------------------

class FoldSpec:
    """Static facts of one folded BatchNorm, and the cache of its folded tensors."""

    def __init__(self, eps: float, kind: str, modules: Optional[Tuple[Any, Any]] = None):
        self.eps = float(eps)
        self.kind = kind  # "conv" | "linear"
        self.modules = tuple(weakref.ref(m) for m in modules) if modules else None
        self._key: Optional[tuple] = None
        self._value: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self._last: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # fold_weight -> fold_bias, same call


def _key_of(ts: Sequence[Optional[torch.Tensor]]) -> Optional[tuple]:
    """What identifies the current contents of the source tensors: the object,
    its data pointer (``.data =`` and casts move it), dtype and version counter
    (in-place updates: optimizer steps, ``load_state_dict``). Cheap: no storage
    objects are created; this runs on every call."""
    try:
        return tuple(None if t is None else (id(t), t.data_ptr(), t.dtype, _tensors.version(t)) for t in ts)
    except RuntimeError:  # inference tensors keep no version counter: do not cache
        return None


def folded_params(eps: float, w: torch.Tensor, b: Optional[torch.Tensor], rm: torch.Tensor, rv: torch.Tensor,
                  gamma: Optional[torch.Tensor], beta: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The folded weight and bias, computed in fp32 and cast to ``w``'s dtype.
    Same formula as ``torch.nn.utils.fusion.fuse_conv_bn_weights``, written
    out so it stays differentiable (that helper returns new leaves)."""
    f32 = torch.float32
    scale = torch.rsqrt(rv.to(f32) + eps)
    if gamma is not None:
        scale = scale * gamma.to(f32)
    shape = (-1,) + (1,) * (w.dim() - 1)
    wf = (w.to(f32) * scale.reshape(shape)).to(w.dtype)
    bf = (b.to(f32) if b is not None else torch.zeros_like(scale)) - rm.to(f32)
    bf = bf * scale
    if beta is not None:
        bf = bf + beta.to(f32)
    return wf, bf.to(b.dtype if b is not None else w.dtype)


def _folded(g, w, b, rm, rv, gamma, beta) -> Tuple[torch.Tensor, torch.Tensor]:
    spec: FoldSpec = g.spec
    srcs = (w, b, rm, rv, gamma, beta)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in srcs):
        # Eval-mode folding is exact algebra: with grad on, compute it in the
        # autograd graph so gradients reach every source tensor. Not cached.
        g.record.bump("grad_calls")
        return folded_params(spec.eps, w, b, rm, rv, gamma, beta)
    key = _key_of(srcs)
    if key is None or key != spec._key or spec._value is None:
        with torch.no_grad():
            spec._value = folded_params(spec.eps, w, b, rm, rv, gamma, beta)
        spec._key = key
        g.record.bump("folds_computed")
    return spec._value


def fold_weight(g, w, b, rm, rv, gamma, beta) -> torch.Tensor:
    """``wfpass.apply`` graphs: the conv/linear weight with the BatchNorm
    folded in (cached on the group, which the graph's call target owns)."""
    g.record.bump("folded_calls")
    pair = _folded(g, w, b, rm, rv, gamma, beta)
    g.spec._last = pair
    return pair[0]


def fold_bias(g, w, b, rm, rv, gamma, beta) -> torch.Tensor:
    """The conv/linear bias with the BatchNorm folded in (a conv without bias
    gets one). ``fold_weight`` runs just before it in every graph (it comes
    first in graph order) and has checked the sources: take its result."""
    spec: FoldSpec = g.spec
    pair, spec._last = spec._last, None
    if pair is None:
        pair = _folded(g, w, b, rm, rv, gamma, beta)
    return pair[1]


def fold_module_call(g, x: torch.Tensor) -> torch.Tensor:
    """``call_module`` flavour of ``bn(conv(x))``. Train/eval and grad mode
    can change after ``wfpass.apply``, so they are checked on every call: the
    folded path runs only in eval mode; with grad enabled the fold is computed
    differentiably; in training mode (or for a linear output that is not 2-D)
    the two modules run as they are (counted)."""
    spec: FoldSpec = g.spec
    conv, bn = (r() for r in spec.modules)
    if conv is None or bn is None:
        raise RuntimeError("wfpass: the modules a folded BatchNorm belongs to were deleted")
    rank = 2 if spec.kind == "linear" else conv.weight.dim()
    if bn.training or not bn.track_running_stats or bn.running_mean is None or x.dim() != rank:
        g.record.bump("unfolded_calls")
        return bn(conv(x))
    g.record.bump("folded_calls")
    wf, bf = _folded(g, conv.weight, conv.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias)
    if spec.kind == "linear":
        return F.linear(x, wf, bf)
    return _kernels.conv_forward(conv, x, wf, bf)
