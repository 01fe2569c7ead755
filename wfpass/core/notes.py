"""Records filed under the tensors they concern: what ``wfpass.report(model)``
reads, named as the model names its parameters, each tensor once."""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Sequence

import torch

from .._torch import distributed as _distributed, tensors as _tensors
from .records import Record, Report

__all__ = ["note", "note_provisional", "file_report", "unnote", "model_report", "rename", "records_of",
           "state_names", "tracked_ids"]


# tensor -> the records that concern it. Weak keys: a deleted model's records go with it.
_NOTES = _tensors.weak_id_key_dict()


def note(record: Record, names: Sequence[str], tensors: Sequence[Optional[torch.Tensor]]) -> None:
    """File ``record`` under each of ``tensors`` (for ``wfpass.report(model)``),
    remembering which of the record's ``params`` names each one is, so the
    model's report can show it under the model's own name. A record for the
    same decision on the same tensors (a recompile taking it again) replaces
    the older one: a model's report does not grow with recompiles."""
    refs = record.detail.setdefault("_tensors", {})
    for n, t in zip(names, tensors):
        if isinstance(t, torch.Tensor):
            _track(record, refs, n, t)
    sig = _signature(record)
    provisional = record.detail.get("_provisional", False)
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        recs = _NOTES.get(t)
        if recs is None:
            _NOTES[t] = recs = []
        if any(r is record for r in recs):
            continue
        recs[:] = [r for r in recs if _signature(r) != sig
                   and not (r.detail.get("_provisional") and r.pattern == record.pattern and not provisional)]
        recs.append(record)


def _track(record: Record, refs: Dict[str, Any], name: str, t: torch.Tensor) -> None:
    """``record`` concerns ``t``, called ``name`` in the graph being
    compiled. A tensor is listed once: a new name for a tensor the record
    already tracks (the model wrapped in another module, PEFT or DDP, and
    compiled again) replaces its old name in ``params``."""
    old = next((k for k, r in refs.items() if r() is t), None)
    if old is not None and old != name:
        del refs[old]
        if name in record.params:
            record.params[:] = [p for p in record.params if p != old]
        elif old in record.params:
            record.params[record.params.index(old)] = name
    refs[name] = weakref.ref(t)
    if name not in record.params:
        record.params.append(name)


def rename(records: Sequence[Record], names: Dict[int, str]) -> None:
    """Name the tensors ``records`` track as ``names`` does (``id(tensor)
    -> name``: the ``named_parameters`` of the module a compile was called
    on), so ``last_report()`` uses that module's names, not those of the
    frame Dynamo compiled (a submodule's, after a graph break inside it)."""
    for rec in records:
        refs = rec.detail.get("_tensors")
        for old, r in list((refs or {}).items()):
            t = r()
            if t is not None and names.get(id(t), old) != old:
                _track(rec, refs, names[id(t)], t)


def tracked_ids(record: Record) -> frozenset:
    """The ids of the live tensors ``record`` concerns."""
    refs = record.detail.get("_tensors") or {}
    return frozenset(id(t) for t in (r() for r in refs.values()) if t is not None)


def records_of(t: torch.Tensor) -> List[Record]:
    """The records filed under ``t``."""
    return list(_NOTES.get(t, ()))


def _signature(record: Record) -> tuple:
    """What makes two records one decision on the same tensors (by identity, whatever their names)."""
    return record.pattern, record.action, record.reason, record.decision, tracked_ids(record) or tuple(record.params)


def note_provisional(pattern: str, reason: str, names: Sequence[str],
                     tensors: Sequence[torch.Tensor]) -> Optional[Record]:
    """A skip record that stands until a pass files a real one for the same
    tensors and pattern (``note`` drops it then): for calls Dynamo saw but
    may never hand to a backend. Not filed where a record already exists;
    returns the record filed, or the same one filed before, or None."""
    for t in tensors:
        for r in _NOTES.get(t, ()) if isinstance(t, torch.Tensor) else ():
            if r.pattern == pattern:
                return r if r.detail.get("_provisional") and r.reason == reason else None
    rec = Record(pattern, "skipped", reason, list(names), detail={"_provisional": True})
    note(rec, names, tensors)
    return rec


def file_report(report: Report, tensors: Dict[str, torch.Tensor]) -> None:
    """File every record of a compile under the tensors its ``params`` name
    (``tensors``: name -> tensor of the graph's parameters and buffers), so
    ``wfpass.report(model)`` shows skips and rewrites of every format."""
    sharded = {}
    if _distributed.fsdp2_modules():
        # FSDP2: the graph saw the unsharded Parameters, which FSDP frees
        # after the forward; file the records under the sharded ones too,
        # which ``model.named_parameters()`` holds.
        for n, t in tensors.items():
            s = _distributed.fsdp2_sharded_of(t)
            if s is not None:
                sharded[n] = s
    for rec in report.records:
        found = [(n, tensors[n]) for n in rec.params if n in tensors]
        if found:
            note(rec, [n for n, _ in found], [t for _, t in found])
        shards = [(n, sharded[n]) for n in rec.params if n in sharded]
        if shards:
            _note_also(rec, [t for _, t in shards])
            aliases = rec.detail.setdefault("_aliases", {})
            for n, t in shards:
                aliases[n] = weakref.ref(t)


def unnote(record: Record, tensors: Sequence[torch.Tensor]) -> None:
    """Withdraw ``record`` from ``tensors`` (a later decision replaced it)."""
    for t in tensors:
        recs = _NOTES.get(t)
        if recs:
            recs[:] = [r for r in recs if r is not record]


def _note_also(record: Record, tensors: Sequence[torch.Tensor]) -> None:
    """File ``record`` under more tensors without changing the names it tracks."""
    for t in tensors:
        recs = _NOTES.get(t)
        if recs is None:
            _NOTES[t] = recs = []
        if not any(r is record for r in recs):
            recs.append(record)


def _carry_records(module: torch.nn.Module, name: str, new) -> None:
    """A Parameter or buffer replaced by another object under the same name
    (``load_state_dict(assign=True)``, ``module.weight = nn.Parameter(...)``
    in an init function): its records go on under the new tensor, whose
    values the compiled graphs read from then on (they take the module's
    tensors as inputs). Called by torch's global registration hooks, before
    the module stores ``new``."""
    if not isinstance(new, torch.Tensor):
        return None
    old = module.__dict__.get("_parameters", {}).get(name)
    if old is None:
        old = module.__dict__.get("_buffers", {}).get(name)
    if old is None or old is new:
        return None
    recs = _NOTES.get(old)
    for rec in list(recs or ()):
        refs = rec.detail.get("_tensors") or {}
        key = next((k for k, r in refs.items() if r() is old), None)
        if key is not None:
            refs[key] = weakref.ref(new)
        _note_also(rec, [new])
    return None


def _install_registration_hooks() -> None:
    """torch's public global hooks on parameter and buffer registration
    (``torch.nn.modules.module.register_module_*_registration_hook``)."""
    from torch.nn.modules import module as nn_module

    nn_module.register_module_parameter_registration_hook(_carry_records)
    nn_module.register_module_buffer_registration_hook(_carry_records)


_install_registration_hooks()


def model_report(model: torch.nn.Module) -> Report:
    """Everything wfpass did to ``model``'s parameters and buffers, across every
    graph, recompile and graph break: one row per decision, named with the
    model's own ``named_parameters`` / ``named_buffers`` names, live counters."""
    names = state_names(model)
    tensors = [t for t in list(model.parameters()) + list(model.buffers()) if id(t) in names]
    out = Report(f"wfpass report for {type(model).__name__} (every graph, recompile and graph break)")
    seen, decisions = set(), set()
    for t in tensors:
        for rec in _NOTES.get(t, ()):
            if id(rec) not in seen and _signature(rec) not in decisions:  # one row per decision
                seen.add(id(rec))
                decisions.add(_signature(rec))
                out.records.append(rec.named(names))
    return out


def state_names(model: torch.nn.Module) -> Dict[int, str]:
    """``id(tensor) -> name`` of ``model``'s parameters and buffers, each
    under its first name in ``named_parameters`` / ``named_buffers``."""
    names: Dict[int, str] = {}
    for n, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), n)
    return names
