"""Runtime prologue functions and the group table they report into.

A *prologue* function finds a fused block at call time ("are these views of
one parent?", the check the Flux reviewer proposes and PyTorch's cuDNN RNN
makes). It returns an alias of the parameters' storage, which a traced graph
cannot express, so the backend hoists every prologue node out of the graph and
runs it before the compiled function (see ``backend.py``). In a plain
``GraphModule`` (``wfpass.apply``) it simply runs in place.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

import torch

from ..report import Record
from ..storage import FusedStorage, refuse, sharing_problem

__all__ = ["Group", "register_group", "group", "prologue", "is_prologue"]


class Group:
    """What a prologue needs at run time: the report record whose counters it
    bumps and the fused storage it may rebuild."""

    def __init__(self, gid: str, record: Record, storage: Optional[FusedStorage], spec: Any = None):
        self.gid = gid
        self.record = record
        self.storage = storage
        self.spec = spec  # format-specific static layout, e.g. (sizes, has_bias)

    def try_refuse(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Fuse ``tensors`` (this call's members) into one buffer again after
        the layout was lost (``param.data = ...``, ``.to()``,
        ``load_state_dict(assign=True)`` which brings new Parameter objects),
        unless a member's storage is shared: moving it would silently untie it."""
        fs = self.storage
        if fs is None or len(tensors) != len(fs.shapes):
            return False
        for name, t in zip(fs.names, tensors):
            if sharing_problem(t, name, (), allowed=tensors) is not None:
                return False
        if refuse(fs, tensors):
            self.record.bump("refused")
            return True
        return False


_GROUPS: Dict[str, Group] = {}


def register_group(g: Group) -> None:
    _GROUPS[g.gid] = g


def group(gid: str) -> Group:
    return _GROUPS[gid]


def prologue(example: Callable) -> Callable[[Callable], Callable]:
    """Mark a function as a prologue: hoisted out of compiled graphs by the
    backend. ``example`` computes a value of the same shape and dtype without
    touching layouts or counters (used once, at compile time)."""

    def mark(fn: Callable) -> Callable:
        fn._wfpass_prologue = True
        fn.example = example
        return fn

    return mark


def is_prologue(target) -> bool:
    return getattr(target, "_wfpass_prologue", False)
