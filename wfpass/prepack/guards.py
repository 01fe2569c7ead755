"""The packed-weight format's guards: whether a linear's weight is packed,
and with which kernel for a static row count. Each reason is the text of a
``skipped`` row; nothing here changes the graph or a tensor (a taken match
gets its kernel and its row's words recorded on it)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from .._torch import kernels as _k, tensors as _tensors
from ..native import ops as _nops
from ..config import PrepackOptions
from ..core.graph import PassContext, meta_value
from ..linear.site import weight_not_2d, weight_ref_problem, written_in_place
from ..core.storage import unmovable
from . import choose
from .match import PackMatch

__all__ = ["pack_problem", "describe_choice", "choose_kernel", "copy_free_kernel", "graph_weight_bytes"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def graph_weight_bytes(ctx: PassContext) -> int:
    """Bytes of the parameters the graph reads per call: the weights a
    decision is timed among (``choose.pool_mib``)."""
    return sum(r.tensor.numel() * r.tensor.element_size() for r in ctx.state_tensors() if r.kind == "parameter")


def choose_kernel(opts: PrepackOptions, dtype: torch.dtype, k: int, n: int, m: int, pool_bytes: int = 0) -> str:
    """The kernel for ``m`` rows of an ``n x k`` weight of ``dtype``, in a
    graph reading ``pool_bytes`` of weights per call (with
    ``prepack.max_bytes=0``, the best that needs no copy)."""
    if opts.max_bytes == 0:
        return copy_free_kernel(opts, dtype, k, n, m, pool_bytes)
    if opts.mode == "always":
        return _always(dtype)
    return choose.measured(dtype, k, n, m, pool_bytes)[0]


def copy_free_kernel(opts: PrepackOptions, dtype: torch.dtype, k: int, n: int, m: int, pool_bytes: int = 0) -> str:
    """The kernel that runs where a copy is not allowed: ``"direct"``
    (``prepack.mode="always"``: wherever it runs; else where it was measured
    faster than the plain GEMM), or ``"plain"``."""
    if opts.mode == "always":
        return "direct" if _nops.direct_runs(dtype) else "plain"
    return choose.copy_free(choose.decide(dtype, k, n, m, pool_bytes))


def _always(dtype: torch.dtype) -> str:
    """``prepack.mode="always"``: the first packed kernel ``choose`` would try
    (brgemm, where the CPU and the dtype allow it), else oneDNN's."""
    if _nops.panel_packs(dtype):
        return "brgemm"
    return "onednn" if _k.onednn_packs(dtype) else "plain"


def describe_choice(opts: PrepackOptions, dtype: torch.dtype, k: int, n: int, m: int, pool_bytes: int = 0) -> str:
    """The row's words for the choice at ``m`` rows."""
    if opts.mode == "always":
        kernel = choose_kernel(opts, dtype, k, n, m, pool_bytes)
        zero = ", prepack.max_bytes=0: no copies" if opts.max_bytes == 0 else ""
        return f"M={m}: {_KERNEL_WORDS.get(kernel, 'the plain GEMM')} (prepack.mode='always'{zero}, not measured)"
    d = choose.decide(dtype, k, n, m, pool_bytes)
    if opts.max_bytes == 0 and d.kernel not in choose.COPY_FREE:
        # A copy would be faster still, and is not allowed: say what runs instead and what it gave up.
        alt = choose.copy_free(d)
        us = {name: t * 1e6 for name, t in d.times.items()}
        what = (f"{_KERNEL_WORDS['direct']}, {1 / d.median_ratio('direct'):.2f}x faster than the plain GEMM "
                f"({us['direct']:.0f} us vs {us['plain']:.0f} us)" if alt == "direct" else
                f"the plain GEMM ({us['plain']:.0f} us)")
        return (f"M={m}: {what}; prepack.max_bytes=0 allows no copy ({d.kernel} over a copy measured "
                f"{us[d.kernel]:.0f} us)")
    pool = choose.pool_mib(pool_bytes)
    us = {name: t * 1e6 for name, t in d.times.items()}
    op = choose.op_cost_s() * 1e6
    where = ("measured now" if d.source == "measured" else
             f"measured {d.when} by an earlier process on this machine ({choose.choices_file()})")
    rounds = f"{choose.ROUNDS} interleaved rounds, {where}" + (
        f", the weight cycling through {pool} MiB of copies as among the graph's weights" if pool else "")
    if d.noisy:
        path = choose.choices_file()
        by = "now" if d.source != "file" else f"on {d.when} by an earlier process on this machine"
        return (f"M={m}: the plain GEMM: the measurement could not decide (its rounds' quartiles "
                f"do not hold their median's verdict on whether to pack, the rounds spread {d.spread():.2f} "
                f"of their median: a near-tie, or another process using the cores or the memory; "
                f"{choose.ATTEMPTS} measurements of {choose.ROUNDS} interleaved rounds {by}); "
                + (f"kept in {path} so that every process on this machine runs the same (delete it to measure "
                   f"again)" if path else "kept for this process (WFPASS_CACHE_DIR is off)"))
    if d.kernel == "plain":
        alt = ", ".join(f"{name} {us[name]:.0f} us ({d.median_ratio(name):.2f}x its time in the median round, "
                        f"{d.clear_ratio(name):.2f}x in round {choose.CLEAR_ROUND} from the worst)"
                        for name in us if name != "plain")
        return (f"M={m}: the plain GEMM ({us['plain']:.0f} us; packed {alt}, {op:.0f} us for the op's call "
                f"included: no clear gain, which needs {choose.MARGIN:.2f}x in the median round, MKL "
                f"{choose.MKL_MARGIN:.2f}x; {rounds})")
    name = _KERNEL_WORDS[d.kernel]
    return (f"M={m}: {name}, {1 / d.median_ratio(d.kernel):.2f}x faster than the plain GEMM "
            f"in the median round ({us[d.kernel]:.0f} us + {op:.0f} us for the op's call vs {us['plain']:.0f} us), "
            f"{1 / d.clear_ratio(d.kernel):.2f}x in round {choose.CLEAR_ROUND} from the worst; "
            + (f"its copy {_kib(d.nbytes.get(d.kernel, 0))}" if d.kernel != "direct" else "no copy") + f" ({rounds})")


#: How the report names each packed kernel.
_KERNEL_WORDS = {"direct": "wfpass's dot-product kernel over the weight as it is (direct)",
                 "brgemm": "oneDNN's small-GEMM ukernel over a copy in 64-column panels (brgemm)",
                 "onednn": "oneDNN's packed kernel", "mkl": "MKL's packed kernel"}


def _kib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:.0f} KiB"


def _rows_hint(x) -> Optional[int]:
    """M as the example inputs had it (the hints of a symbolic shape)."""
    v = meta_value(x)
    shape = getattr(v, "shape", None)
    if shape is None:
        return None
    dims = [_tensors.size_hint(d) for d in shape[:-1]]
    return None if any(d is None for d in dims) else math.prod(dims)


def _options_problem(m: PackMatch, ctx: PassContext) -> Optional[str]:
    """Packing switched off, or no bytes allowed for packed copies."""
    opts: PrepackOptions = ctx.config.prepack
    if opts.mode == "off":
        return "prepack.mode='off'"
    if opts.max_bytes == 0 and not _nops.direct_runs(m.weights[0].tensor.dtype):
        return "prepack.max_bytes=0: no packed copies (and no copy-free kernel here: direct needs float32, bfloat16 or float16 on AVX2 or AVX-512)"
    return None


def _weights_problem(m: PackMatch, ctx: PassContext) -> Optional[str]:
    """Each weight is a Parameter or buffer the pass can see, not a constant
    of a Dynamo graph, and one a packed copy could be kept for."""
    for w in m.weights:
        why = weight_ref_problem(w)
        if why is not None:
            return why
        if w.node is not None and w.node.op == "get_attr" and ctx.is_dynamo:
            return (f"{w.name} is a constant of the Dynamo graph (Inductor's freezing=True), which Inductor packs "
                    f"itself")
        why = unmovable(w.tensor, w.name)
        if why is not None:
            return why.replace("wfpass leaves it alone", "a packed copy would be made again every call; left alone")
    return None


def _kernel_problem(m: PackMatch, ctx: PassContext) -> Optional[str]:
    """The weight is 2-D, on the CPU, in a dtype a packed kernel of this
    CPU's oneDNN or MKL, or the copy-free direct kernel, multiplies (fp16 on
    an AVX2 CPU: direct alone)."""
    w = m.weights[0]
    t = w.tensor
    if t.dim() != 2 or m.rows <= 0:
        return weight_not_2d(w)
    if t.device.type != "cpu":
        return f"on {t.device}: the packed kernels are the CPU's (oneDNN, MKL); left to the device's GEMM"
    if t.dtype not in _DTYPES:
        return f"no packed kernel for {t.dtype}"
    if not torch.backends.mkldnn.is_available() or not _k.get_mkldnn_enabled():
        return "oneDNN is not available or switched off (torch.backends.mkldnn)"
    if not _k.onednn_packs(t.dtype) and not _k.mkl_packs(t.dtype) and not _nops.direct_runs(t.dtype):
        # No packed kernel and no copy-free one: the plain GEMM it is.
        need = {torch.float16: "avx512_fp16 or avx_ne_convert", torch.bfloat16: "avx512 with bf16 support"}.get(t.dtype, "")
        return f"oneDNN cannot multiply {t.dtype} on this CPU{' (it needs ' + need + ')' if need else ''}"
    return None


def _dtype_problem(m: PackMatch, ctx: PassContext) -> Optional[str]:
    """Input, output and bias of the weight's dtype (no autocast inside
    the call)."""
    t = m.weights[0].tensor
    xv, yv = meta_value(m.x), meta_value(m.node)
    for what, v in (("input", xv), ("output", yv)):
        if isinstance(v, torch.Tensor) and v.dtype != t.dtype:
            return (f"the {what} is {v.dtype}, the weight {t.dtype} (autocast casts inside the call): left to the "
                    f"plain GEMM")
    if m.bias_ref is not None and (m.bias_ref.tensor.dtype != t.dtype or m.bias_ref.tensor.device != t.device):
        return f"bias {m.bias_ref.name} has dtype {m.bias_ref.tensor.dtype}, the weight {t.dtype}"
    return None


def _written_problem(m: PackMatch, ctx: PassContext) -> Optional[str]:
    """No weight is written in place inside the graph."""
    return written_in_place(m.weights, m.written, "a copy would be packed on every call; left to the plain GEMM")


def _grad_problem(m: PackMatch, ctx: PassContext) -> Optional[str]:
    """No gradient through the call unless ``prepack.training``, and none ever
    through a block (its members' biases get theirs from ``fused_linear``)."""
    grad = m.needs_grad()
    if grad is None and ctx.is_dynamo:
        grad = True  # a Dynamo call whose value says nothing: assume it trains, never the reverse
    if m.block and not m.members and not ctx.is_dynamo:
        n_bias = len(m.node.args) - 4 - len(m.weights)
        if 0 < n_bias < len(m.weights):
            return ("only some members of the block have a bias, and a traced graph may compute gradients: "
                    "left to fused_linear, which sends each bias its gradient")
    if grad and m.block:
        return ("the one-GEMM block in a graph that computes gradients: its biases' gradients go to each member "
                "through fused_linear; left to it")
    if grad and not ctx.config.prepack.training:
        return ("the graph computes gradients through it (training): packing is for inference unless "
                "prepack.training=True (a copy made again after every optimizer step; measured in docs/guide/prepack.md)")
    return None


def _symbolic_rows_choice(m: PackMatch, ctx: PassContext) -> Optional[str]:
    """A graph for every M: packed only where packing was measured to pay at
    the size the graph was compiled for; sets ``m.kernel`` and ``m.why``."""
    opts: PrepackOptions = ctx.config.prepack
    t = m.weights[0].tensor
    # One graph for every M: the op would serve sizes nobody measured,
    # and its call costs even where it then runs the plain GEMM. So it
    # goes in only where packing was measured to pay at the M this graph
    # was compiled for (its hint); then each further M is measured on its
    # second call (PackSite.kernel_for). Else the linear stays the
    # compiler's own GEMM.
    if not ctx.is_dynamo:
        # ``wfpass.apply`` graphs carry no shapes and run eagerly: each M
        # is measured on the op's second call at it.
        m.kernel = ""
        m.why = ("row count M unknown in this graph: the kernel is chosen per M on its second call (the first "
                 "runs the plain GEMM)")
        return None
    hint = _rows_hint(m.x)
    if hint is None:
        return "row count M symbolic with no size to measure at: left to the plain GEMM"
    pool = graph_weight_bytes(ctx)
    kernel = choose_kernel(opts, t.dtype, t.shape[1], m.rows, hint, pool)
    words = describe_choice(opts, t.dtype, t.shape[1], m.rows, hint, pool)
    if kernel == "plain":
        return f"row count M symbolic; measured at the size this graph was compiled for, {words}"
    m.kernel, m.hint = "", hint
    m.why = (f"row count M symbolic: measured at the size this graph was compiled for, {words}; every other M "
             f"is measured on its second call (the first runs the plain GEMM)")
    return None


def _kernel_choice(m: PackMatch, ctx: PassContext) -> Optional[str]:
    """The kernel measured fastest at this graph's row count, the plain GEMM
    refused as no gain; sets ``m.kernel`` and ``m.why`` (a symbolic M:
    ``_symbolic_rows_choice``)."""
    if m.m is None:
        return _symbolic_rows_choice(m, ctx)
    opts: PrepackOptions = ctx.config.prepack
    t = m.weights[0].tensor
    pool = graph_weight_bytes(ctx)
    kernel = choose_kernel(opts, t.dtype, t.shape[1], m.rows, m.m, pool)
    words = describe_choice(opts, t.dtype, t.shape[1], m.rows, m.m, pool)
    if kernel == "plain":
        return words
    m.kernel, m.why = kernel, words
    return None


# The guard's checks, in the order they run: the first to find a problem gives the row's reason.
_CHECKS = (_options_problem, _weights_problem, _kernel_problem, _dtype_problem, _written_problem, _grad_problem,
           _kernel_choice)


def pack_problem(m: PackMatch, ctx: PassContext) -> Optional[str]:
    """Why ``m``'s weight is not packed, or None: then ``m`` holds the kernel
    for its static row count (or "" for the op to choose per M) and its
    row's words."""
    for check in _CHECKS:
        why = check(m, ctx)
        if why is not None:
            return why
    return None
