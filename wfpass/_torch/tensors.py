"""Tensor internals (torch 2.13.0): storage use counts, identity-keyed weak
dicts, version counters. Imports nothing from wfpass."""
from __future__ import annotations

from typing import Optional

import torch


def storage_use_count(t: torch.Tensor) -> Optional[int]:
    """How many TensorImpls hold ``t``'s storage (``torch._C._storage_Use_Count``,
    private; torch 2.13.0). ``None`` where it is unavailable: callers treat that
    as "unknown" and rely on the data_ptr overlap check alone."""
    fn = getattr(torch._C, "_storage_Use_Count", None)
    if fn is None:
        return None
    try:
        # The Python UntypedStorage object we create here holds one reference.
        return int(fn(t.untyped_storage()._cdata)) - 1
    except Exception:  # pragma: no cover - defensive: meta/fake tensors
        return None



def weak_id_key_dict():
    """A dict with weak, identity-compared tensor keys (``torch.utils.weak.
    WeakIdKeyDictionary``, undocumented; torch 2.13.0). ``weakref.
    WeakKeyDictionary`` cannot hold tensors: its lookups compare keys with
    ``==``, which is elementwise for tensors and raises "Boolean value of
    Tensor with more than one value is ambiguous"."""
    from torch.utils.weak import WeakIdKeyDictionary

    return WeakIdKeyDictionary()


def version(t: torch.Tensor) -> int:
    """The in-place write counter of ``t`` (``Tensor._version``, private;
    torch 2.13.0)."""
    return t._version
