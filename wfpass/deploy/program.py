"""``wfpass.export``: ``torch.export.export`` with wfpass's RNN ops in the
program (``deploy/rnn.py``), so an RNN exports with a dynamic sequence
length, in a graph whose size does not grow with T, that AOTInductor
compiles into calls of wfpass's kernels.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from .. import native
from ..config import Config
from ..core.history import set_last
from ..core.records import Report
from ..core.storage import byte_extent
from . import batchnorm as _bn, linear as _linear, rnn as _rnn

__all__ = ["export"]


def export(model: nn.Module, args: Tuple, kwargs: Optional[Dict[str, Any]] = None, *,
           dynamic_shapes: Any = None, strict: bool = False, **options: Any) -> "torch.export.ExportedProgram":
    """Export ``model`` as ``torch.export.export(model, args, kwargs,
    dynamic_shapes=..., strict=...)`` does (every argument has its meaning
    there), each ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` in it traced as
    wfpass's layer ops: T may be dynamic, the graph holds one op per layer
    and direction whatever T is, and the ops read the model's own
    Parameters. ``options``: the formats' options as ``wfpass.backend()``
    takes them (``rnn={"cpu_kernel": "eager"}``, ``passes=(...)``).

    Returns the ``ExportedProgram``; what was rewritten or left, and why, is
    ``wfpass.last_report()`` and, per parameter, ``wfpass.report(model)``.
    The model is left as it was. An RNN module in training mode is traced
    with the ops that carry gradient formulas (the program differentiates
    as eager does, dropout included); in eval mode with their twins that
    keep no workspace for a backward (a backward through them gets no
    gradient for the RNN: torch warns "an autograd kernel was not
    registered"). Variable-length batches (``PackedSequence``) take
    wfpass's packed-batch ops. In a bf16/fp16 model each BatchNorm computes
    from float32 copies of its weight, bias and statistics held by the
    program (``deploy/batchnorm.py``). Sibling linears (Q/K/V, gate/up) are
    one ``wfpass::linear_group`` op over their weights as the program holds
    them, on the copy-free direct kernel up to the row count measured faster
    on this machine (``deploy/linear.py``); no prepacked copies are made.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"wfpass.export expects an nn.Module, got {type(model).__name__}")
    if not isinstance(args, tuple):
        raise TypeError(f"wfpass.export: args must be a tuple of the forward's positional arguments, got "
                        f"{type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"wfpass.export: kwargs must be a dict or None, got {type(kwargs).__name__}")
    config = Config.from_options(**options)
    native.build()  # the program's ops run on the C++ kernels where they build (it says so on stderr)
    report = Report(f"wfpass export ({type(model).__name__})")
    norms = _bn.candidates(model, report) if config.runs("fp32_batchnorm") else {}
    while True:  # traced again only if the trace shows a BatchNorm that cannot take float32 (it is then left)
        traced = Report(report.title)  # the RNN rows of the trace that is kept
        program, fp32 = _trace(model, args, kwargs, dynamic_shapes, strict, config, norms, traced, report)
        bad = _bn.check(program, norms)
        for name, why in bad.items():
            report.add("batchnorm", "skipped", f"{name!r}: {why}", [f"{name}.{r}" for r in norms.pop(name)])
        if not bad:
            break
    report.extend(traced)
    _bn.into_program(program, model, norms, fp32, report)
    if config.runs("fuse_linears") and config.linear.path != "split":
        _linear.into_program(program, config, report)
    _own_storages(program, report)
    _note_left_alone(model, config, report)
    from ..core.runtime import file_report

    file_report(report, {**dict(model.named_parameters(remove_duplicate=False)),
                         **dict(model.named_buffers(remove_duplicate=False))})
    set_last(report)
    return program


def _trace(model, args, kwargs, dynamic_shapes, strict, config, norms, traced: Report, report: Report):
    """``torch.export.export`` with the RNNs swapped and the BatchNorms in
    float32: the program and the BatchNorms' float32 tensors."""
    try:
        with _rnn.swapped(model, config, traced), _bn.in_fp32(norms) as fp32:
            return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=strict), fp32
    except Exception as e:
        # torch.export's own error (a T that specialized, ...): the RNNs left
        # to it are often why, so the error names them and the report
        # (wfpass.last_report()) has their rows.
        report.extend(traced)
        set_last(report)
        left = traced.find("rnn", "skipped")
        if left:
            e.add_note("wfpass.export left these RNNs to torch.export as they are: " + "; ".join(r.reason for r in left))
        raise


def _note_left_alone(model: nn.Module, config: Config, report: Report) -> None:
    """A row for what a compiled graph would do to the linears and a program
    does not: prepacked copies (a program holds each weight once)."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if linears and config.runs("prepack_linears") and config.prepack.mode != "off":
        report.add("prepack", "skipped", f"{len(linears)} nn.Linear: no prepacked copies in an exported program (it holds "
                   "each weight once); its linears run the copy-free kernels (the plain GEMM, wfpass's direct kernel "
                   "where measured faster)", [])


def _own_storages(program: "torch.export.ExportedProgram", report: Report) -> None:
    """Each weight of the program in a storage of exactly its own bytes.

    A model ``torch.compile(backend="wformat")`` already served holds its
    RNN's (and sibling linears') Parameters as views of one flat block.
    AOTInductor packages each constant's whole storage (``untyped_storage()
    .nbytes()``, torch 2.11-2.15), so a program holding those views packages
    the block once per Parameter: 31 MB instead of 5 MB for a 2-layer LSTM
    of 3.7 MB. The program's entry becomes an alias of the same bytes (a
    slice of the storage, nothing copied: the model's and the program's
    weights stay one), a storage AOTInductor and ``torch.export.save``
    store once each."""
    narrowed = []
    # The state_dict's entries, and the constants (non-persistent buffers,
    # lifted tensors) that AOTInductor packages the same way.
    for state, name, t in [(d, n, v) for d in (program.state_dict, program.constants) for n, v in list(d.items())]:
        if not isinstance(t, torch.Tensor) or type(t) not in (torch.Tensor, nn.Parameter) \
                or t.device.type == "meta" or t.numel() == 0:
            continue
        start, end = byte_extent(t)
        storage = t.untyped_storage()
        if start == 0 and end == storage.nbytes():
            continue
        es = t.element_size()
        alias = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            storage[start:end], t.storage_offset() - start // es, t.shape, t.stride())
        if isinstance(t, nn.Parameter):
            alias = nn.Parameter(alias, requires_grad=t.requires_grad)
        state[name] = alias
        narrowed.append(name)
    if narrowed:
        report.add("export", "rewritten", f"{len(narrowed)} weight(s) are views of a larger block in the model (wfpass's "
                   "flat block after torch.compile, or the user's): the program holds each as an alias of only its "
                   "own bytes (nothing copied), so AOTInductor packages each weight once, not the block per weight",
                   narrowed)
