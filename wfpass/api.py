"""``apply``, ``explain`` and ``restore``: wfpass outside of ``torch.compile``."""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx as fx

from .compiler import backend, compile_with_report
from .config import Config
from .core.graph import PassContext
from .core.history import set_last
from .pipeline import registered
from .builtin import run_passes
from .core.records import Report
from .core.storage import overlaps, restore_tensor
from . import native

__all__ = ["apply", "explain", "report", "restore"]


def apply(gm: fx.GraphModule, config: Config | None = None, **options: Any) -> Report:
    """Rewrite a ``torch.fx.GraphModule`` (e.g. from ``symbolic_trace``) in place.

    The parameters of ``gm`` (shared with the traced model) are moved into
    fused storage; the graph calls the fused kernels. Returns the report.
    """
    if isinstance(gm, torch.export.ExportedProgram):
        raise TypeError("wfpass.apply rewrites a torch.fx.GraphModule (e.g. torch.fx.symbolic_trace(model)); an "
                        "ExportedProgram's RNNs are already traced step by step: export the model with "
                        "wfpass.export(model, args, dynamic_shapes=...) instead")
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"wfpass.apply expects a torch.fx.GraphModule (e.g. torch.fx.symbolic_trace(model)), got {type(gm).__name__}")
    if config is not None and options:
        raise ValueError("wfpass.apply: pass either config= or keyword options, not both")
    config = config or Config.from_options(**options)
    report = Report(f"wfpass report ({type(gm).__name__}, {len(list(gm.graph.nodes))} nodes)")
    # wfpass's C++ kernels: built on the first compile on this machine (it
    # says so on stderr), loaded before any rewritten graph can call them.
    native.build()
    ctx = PassContext(gm, config, report)
    run_passes(gm, ctx)
    if not ctx.config.dry_run:
        from .core.runtime import file_report

        file_report(report, {r.name: r.tensor for r in ctx.state_tensors()})
    if ctx.kept:
        gm._wfpass_kept = ctx.kept  # the graph's calls find these by id while it lives
    ctx.run_deferred()
    for move in ctx.take_first_call_moves():
        move()
    set_last(report)
    return report


def explain(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Report:
    """Dry run: what ``backend="wformat"`` would rewrite or skip for these
    inputs, and why. Nothing in ``model`` changes: a deep copy is compiled
    and run once under ``no_grad``."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"wfpass.explain expects an nn.Module, got {type(model).__name__}")
    probe = copy.deepcopy(model)
    be = backend(inner="eager", dry_run=True)
    reports = Report(f"wfpass explain ({type(model).__name__}, dry run: nothing changed)", dry_run=True)

    def collect(gm, example_inputs):
        out, rep = compile_with_report(be.config, gm, example_inputs)
        reports.extend(rep)
        return out

    with torch.no_grad():
        torch.compile(probe, backend=collect)(*args, **kwargs)
    return reports


def report(model: torch.nn.Module) -> Report:
    """Everything wfpass did to ``model``: one row per decision about its
    parameters and buffers, over every compiled graph, recompile and graph
    break (``last_report()`` is only the most recent compile), named as in
    ``model.named_parameters()``, with live counters summed over all graphs.
    Works on the model you compiled and on the ``torch.compile`` wrapper."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"wfpass.report expects an nn.Module, got {type(model).__name__}")
    from .core.runtime import model_report

    return model_report(model)


def restore(model: torch.nn.Module) -> int:
    """Give every parameter and buffer wfpass fused its own storage again, with
    the same values and the same objects; also parameters and buffers that
    are disjoint views of one storage for another reason (a checkpoint saved
    from a fused model and loaded with ``assign=True``). Ties (the same
    object, or overlapping bytes) stay tied. Returns how many tensors moved."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"wfpass.restore expects an nn.Module, got {type(model).__name__}")
    formats = registered()
    for m in model.modules():
        for fmt in formats:
            fmt.restore(m)  # what each format attached to the module besides storage
    n = 0
    seen = set()
    tensors = []
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        tensors.append(t)
        n += restore_tensor(t)
    return n + _separate_views(tensors)


def _separate_views(tensors) -> int:
    """Tensors that are disjoint views of one storage although wfpass did not
    fuse them get their own storage too. That is what ``load_state_dict(
    assign=True)`` of a checkpoint saved from a fused model gives, even to a
    model that never saw wfpass: ``torch.save`` writes a view's whole storage
    and ``torch.load`` rebuilds the views. Overlapping tensors are ties and
    stay as they are; a Parameter used twice is one object."""
    by_storage = {}
    for t in tensors:
        if type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type != "meta":
            by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(t)
    moved = 0
    for group in by_storage.values():
        if len(group) < 2 or any(overlaps(a, b) for i, a in enumerate(group) for b in group[i + 1 :]):
            continue
        for t in group:
            with torch.no_grad():
                t.data = t.data.clone(memory_format=torch.contiguous_format)
            moved += 1
    return moved
