"""fp32 BatchNorm state in an exported program.

A bf16/fp16 model's BatchNorm keeps its weight, bias and running statistics
in half precision; bf16 rounds the momentum update of a running statistic
away whenever it is small next to the value, so in training the statistics
stall (``batchnorm/kernels.py``). ATen's BatchNorm takes a half-precision
input with float32 weight, bias and statistics (CPU and cuDNN) and returns
the input's dtype, and AOTInductor compiles that call as it is. So the
program computes each such BatchNorm from float32 tensors of its own::

    before: y = aten.batch_norm(x, w, b, mean, var, ...)   # all bfloat16
    after:  y = aten.batch_norm(x, w, b, mean, var, ...)   # x, y bfloat16; w, b, mean, var float32

The program's ``state_dict`` keeps the model's keys; its entries for these
tensors are float32 copies (one per tensor: the BatchNorm's few bytes), and
the model is left as it was (the trace sees float32 through ``.data`` for
its duration only, :func:`in_fp32`). A BatchNorm whose tensors another op of
the program also reads (it would see float32 where the model computes in
half precision), whose input is not half precision, or which is reachable
under two names is left as ``torch.export`` traces it, with the reason in
the report (:func:`check`).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Tuple

import torch
from torch import nn

from ..batchnorm.fp32 import dtype_name as _dtype
from ..batchnorm.kernels import HALF, ROLES
from ..core.records import Report
from ..core.storage import overlaps

__all__ = ["candidates", "in_fp32", "check", "into_program"]

_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _skip(report: Report, name: str, why: str, fqns: List[str]) -> None:
    report.add("batchnorm", "skipped", f"{name!r}: {why}", fqns)


def candidates(model: nn.Module, report: Report) -> Dict[str, Dict[str, torch.Tensor]]:
    """``{module name: {role: tensor}}`` of the BatchNorms whose present
    tensors are all one half-precision dtype; a row for each one left."""
    names: Dict[int, List[str]] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), []).append(n)
    state = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    out = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, _TYPES):
            continue
        tensors = {r: getattr(mod, r) for r in ROLES if getattr(mod, r, None) is not None}
        fqns = [f"{name}.{r}" for r in tensors]
        dtypes = {t.dtype for t in tensors.values()}
        if not tensors:
            _skip(report, name, "affine=False and track_running_stats=False: no weight, bias or statistics to keep in "
                  "fp32", [])
        elif not dtypes & set(HALF):
            _skip(report, name, f"weight/bias/statistics are {', '.join(sorted(map(_dtype, dtypes)))}: the "
                  "fp32-statistics format is for fp16/bf16 models, nothing to change", fqns)
        elif len(dtypes) > 1:
            _skip(report, name, f"its tensors mix {', '.join(sorted(map(_dtype, dtypes)))}: not one half-precision "
                  "dtype to move from", fqns)
        elif len(names[id(mod)]) > 1:
            _skip(report, name, f"the module is reachable as {', '.join(map(repr, names[id(mod)]))}: the program would "
                  "hold one entry under two keys", fqns)
        else:
            # Tied: the same tensor under another name, or another tensor over its bytes.
            mine = {f"{name}.{r}" for r in tensors}
            tied = next(((f"{name}.{r}", o) for r, t in tensors.items() for o, u in state
                         if o not in mine and (u is t or overlaps(t, u))), None)
            if tied:
                _skip(report, name, f"{tied[0]} shares storage with {tied[1]} (tied): a float32 copy would untie them "
                      "in the program", fqns)
            else:
                out[name] = tensors
    return out


@contextlib.contextmanager
def in_fp32(chosen: Dict[str, Dict[str, torch.Tensor]]) -> Iterator[Dict[str, torch.Tensor]]:
    """For the trace only, the chosen tensors hold float32 data (the same
    objects, ``.data`` swapped): yields ``{fqn: float32 data}``, the tensors
    the program keeps; the model's own data is put back on exit."""
    saved: List[Tuple[torch.Tensor, torch.Tensor]] = []
    fp32: Dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            for name, tensors in chosen.items():
                for role, t in tensors.items():
                    saved.append((t, t.data))
                    t.data = t.data.float()
                    fp32[f"{name}.{role}"] = t.data
        yield fp32
    finally:
        with torch.no_grad():
            for t, data in reversed(saved):
                t.data = data


def _is_batch_norm(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and "batch_norm" in str(node.target)


def check(program: "torch.export.ExportedProgram", chosen: Dict[str, Dict[str, torch.Tensor]]) -> Dict[str, str]:
    """``{module name: why}`` for each chosen BatchNorm the traced program
    cannot give float32 tensors: another op reads one of them, or the batch
    norm's input is not half precision (autocast, a cast in the forward)."""
    placeholder = {spec.target: spec.arg.name for spec in program.graph_signature.input_specs
                   if spec.target is not None and hasattr(spec.arg, "name")}
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    bad = {}
    for name, tensors in chosen.items():
        for role in tensors:
            node = nodes.get(placeholder.get(f"{name}.{role}", ""))
            if node is None:
                bad[name] = f"{name}.{role} is not an input of the program (the forward does not read it)"
                break
            other = next((u for u in node.users if not _is_batch_norm(u)), None)
            if other is not None:
                bad[name] = (f"{name}.{role} is also read by {other.name} ({other.target}), which would see float32 "
                             "instead of the model's dtype")
                break
            ins = [getattr(u.args[0].meta.get("val"), "dtype", None) for u in node.users]
            if any(d not in HALF for d in ins):
                bad[name] = f"its input is {_dtype(next(d for d in ins if d not in HALF))}, not fp16/bf16"
                break
    return bad


def into_program(program: "torch.export.ExportedProgram", model: nn.Module,
                 chosen: Dict[str, Dict[str, torch.Tensor]], fp32: Dict[str, torch.Tensor], report: Report) -> None:
    """The program's entries for the chosen tensors become their float32
    copies (the model's objects went back to half precision), one row each."""
    for name, tensors in chosen.items():
        fqns = [f"{name}.{r}" for r in tensors]
        for fqn, t in zip(fqns, tensors.values()):
            entry = fp32[fqn]
            program.state_dict[fqn] = nn.Parameter(entry, requires_grad=t.requires_grad) if isinstance(
                t, nn.Parameter) else entry
        src = _dtype(next(iter(tensors.values())).dtype)
        stats = "; running statistics update in float32" if "running_mean" in tensors and model.get_submodule(name).training else ""
        report.add("batchnorm", "rewritten", f"{name!r}: {', '.join(tensors)} held in float32 in the program for "
                   f"{src} input: mixed-precision kernel, output stays {src}{stats}; the model's own tensors stay "
                   f"{src}", fqns, extra_bytes=sum(t.numel() * 2 for t in tensors.values()))
