"""Fused storage: a group's existing tensors moved once into one buffer.

``fuse`` allocates one zero-filled buffer, copies each member in at a fixed
element offset and points the member at its slice (``tensor.data = view``).
The member objects (the user's ``nn.Parameter``s, the optimizer's leaves) stay
the same; only where their bytes live changes, exactly as PyTorch's own
``flatten_parameters`` does for cuDNN RNNs. Slots no member covers stay zero:
they are the "fake biases" a fused kernel needs where a member has none.

Nothing here keeps a member alive: the registry holds weak references, so a
deleted model frees its buffer.
"""
from __future__ import annotations

import sys
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import _compat

__all__ = [
    "FusedStorage", "fuse", "refuse", "fused_storage_of", "restore_tensor", "register_undo", "undo_registered",
    "overlaps", "sharing_problem", "byte_extent", "unmovable",
]

# storage data_ptr -> FusedStorage. A stale entry (its members gone or moved)
# fails ``intact()`` and is replaced on the next fuse of that address.
_REGISTRY: Dict[Tuple[str, int], "FusedStorage"] = {}


def _key(t: torch.Tensor) -> Tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


# -- tensors wfpass must not move ---------------------------------------------
# Exactly these types own plain storage that wfpass may re-point. A subclass
# (DTensor, FakeTensor, a quantized or user wrapper) may keep its data
# elsewhere or attach meaning to where it lives: wfpass cannot prove a move
# safe, so it leaves it alone (invariant 7).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _loaded(module: str, attr: str):
    """``module.attr`` if ``module`` is already imported, else None. No such
    object can exist before its module is imported, so the checks below cost
    nothing (and import nothing) for a model that does not use
    torch.distributed, and work on builds without it."""
    return getattr(sys.modules.get(module), attr, None)


def _fsdp_owner(t: torch.Tensor) -> Optional[torch.nn.Module]:
    """The FSDP2 module (``fully_shard``) whose parameters include ``t``, or None.

    Between its pre-forward and post-forward hooks FSDP2 registers plain
    unsharded Parameters on the module, views of its all-gather buffer that
    it frees and re-allocates every step: a plain tensor on the outside, but
    FSDP owns its storage. ``fully_shard`` swaps the module's class to a
    subclass of ``FSDPModule`` and records its state in torch.distributed's
    registry of composable-API modules (``_compat.fsdp2_modules``): that
    registry is the one place reachable from a tensor alone.
    Where it is missing, the DTensor check and ``sharing_problem``'s
    storage-use count (the all-gather buffer holds the storage too) still skip it."""
    modules = _compat.fsdp2_modules()
    for m in modules:
        if any(p is t for p in m.parameters()):
            return m
    return None


def unmovable(t: torch.Tensor, name: str) -> Optional[str]:
    """Why wfpass must not move ``t`` into a fused format at all, or None.

    * a DTensor (FSDP2's sharded parameters, tensor parallel): its storage
      is one rank's shard and torch.distributed owns it;
    * any other tensor subclass: only ``torch.Tensor`` and ``nn.Parameter``
      are known to keep their values in their own storage;
    * a parameter of an FSDP2-managed module (``fully_shard``), even when it
      is a plain tensor: FSDP re-allocates its storage every forward.

    Every pass asks this first (``sharing_problem`` does); the pattern is
    then reported ``skipped`` with this reason.
    """
    cls = type(t)
    if cls not in _PLAIN:
        dtensor = _loaded("torch.distributed.tensor", "DTensor")
        if dtensor is not None and isinstance(t, dtensor):
            placements = ", ".join(map(repr, getattr(t, "placements", ()) or ()))
            return (f"{name} is a DTensor ({placements + ', ' if placements else ''}FSDP2 or tensor parallel): its storage "
                    f"is sharded across ranks and owned by torch.distributed; wfpass leaves it alone")
        return (f"{name} is a {cls.__module__}.{cls.__qualname__}, a torch.Tensor subclass: wfpass moves only plain "
                f"tensors and Parameters (it cannot tell where a subclass keeps its data); left alone")
    owner = _fsdp_owner(t)
    if owner is not None:
        return (f"{name} belongs to an FSDP2-managed module ({type(owner).__name__}, fully_shard): FSDP re-allocates "
                f"its unsharded storage every forward; wfpass leaves it alone")
    return None


def _storage_parts(t: torch.Tensor) -> List[torch.Tensor]:
    """The plain tensors whose storage ``t`` reads: ``t`` itself, or the
    inner tensors of a wrapper subclass (``__tensor_flatten__``: a DTensor's
    local shard). Empty where that cannot be told."""
    if type(t) in _PLAIN:
        return [t]
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None:
        try:
            attrs, _ = flatten()
            inner = [getattr(t, a, None) for a in attrs]
            return [p for i in inner if isinstance(i, torch.Tensor) for p in _storage_parts(i)]
        except Exception:
            return []
    try:
        t.untyped_storage().data_ptr()
    except Exception:
        return []
    return [t]


def byte_extent(t: torch.Tensor) -> Tuple[int, int]:
    """[start, end) in bytes of the storage ``t`` can touch."""
    es = t.element_size()
    if t.numel() == 0:
        return (t.storage_offset() * es, t.storage_offset() * es)
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    return (t.storage_offset() * es, (t.storage_offset() + last + 1) * es)


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True if ``a`` and ``b`` can read or write the same bytes (the data_ptr check the forum thread asks for).
    A wrapper subclass (DTensor) is compared through the tensors it wraps."""
    if type(a) not in _PLAIN or type(b) not in _PLAIN:
        return any(_overlaps_plain(x, y) for x in _storage_parts(a) for y in _storage_parts(b))
    return _overlaps_plain(a, b)


def _overlaps_plain(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, a1 = byte_extent(a)
    b0, b1 = byte_extent(b)
    return a0 < b1 and b0 < a1


class FusedStorage:
    """One buffer and the members that are views into it."""

    def __init__(self, kind: str, block: torch.Tensor, names: Sequence[str], members: Sequence[torch.Tensor], offsets: Sequence[int]):
        self.kind = kind
        self.names = list(names)
        self.offsets = list(offsets)
        self.shapes = [tuple(m.shape) for m in members]
        self.numel = block.numel()
        self._members = [weakref.ref(m) for m in members]
        self._key = _key(block)
        self.refusions = 0

    @property
    def members(self) -> List[Optional[torch.Tensor]]:
        return [r() for r in self._members]

    def intact(self) -> bool:
        """Are all members still views at their offsets of one live buffer?"""
        ms = self.members
        if any(m is None for m in ms):
            return False
        ptr = ms[0].untyped_storage().data_ptr()
        base = ms[0].storage_offset() - self.offsets[0]
        for m, off, shape in zip(ms, self.offsets, self.shapes):
            if (
                m.untyped_storage().data_ptr() != ptr
                or m.storage_offset() != base + off
                or tuple(m.shape) != shape
                or not m.is_contiguous()
            ):
                return False
        return True

    def block_offset(self, ts: Sequence[Optional[torch.Tensor]], offsets: Sequence[int]) -> Optional[int]:
        """Storage offset of this buffer if every present ``ts[i]`` is a
        contiguous view at element ``offsets[i]`` of it, else None. The
        per-call "are these views of one parent?" check of every format:
        address arithmetic only. The buffer must be the one wfpass built
        (its gaps are the zero fake biases), and must fit inside the first
        member's storage: that storage is alive, so no other allocation can
        start inside it and a matching address means the same storage."""
        first = None
        for t, off in zip(ts, offsets):
            if t is None:
                continue
            if first is None:
                first, es = t, t.element_size()
                storage = t.untyped_storage()
                sptr = storage.data_ptr()
                if sptr != self._key[1]:  # not (or no longer) our buffer
                    return None
                start = t.data_ptr() - off * es
            if t.data_ptr() - off * es != start or not t.is_contiguous() or t.dtype != first.dtype:
                return None
        if first is None:
            return None
        base_bytes = start - sptr
        if base_bytes < 0 or base_bytes + self.numel * es > storage.nbytes():
            return None
        return base_bytes // es

    def is_member(self, t: torch.Tensor) -> bool:
        return any(m is t for m in self.members)


def fused_storage_of(t: torch.Tensor) -> Optional[FusedStorage]:
    """The live FusedStorage ``t`` belongs to, if any."""
    if type(t) not in _PLAIN:
        return None  # wfpass never fuses a subclass (``unmovable``)
    fs = _REGISTRY.get(_key(t))
    if fs is not None and fs.is_member(t) and fs.intact():
        return fs
    return None


def fuse(kind: str, names: Sequence[str], members: Sequence[torch.Tensor], offsets: Sequence[int], numel: int) -> FusedStorage:
    """Move ``members`` into one new zero-filled buffer of ``numel`` elements.

    Members must share dtype and device; ``offsets`` are element offsets and
    must not overlap. Values are copied exactly; the old storages are freed
    when nothing else holds them (the caller has checked nothing does).
    """
    first = members[0]
    block = torch.zeros(numel, dtype=first.dtype, device=first.device)
    with torch.no_grad():
        for m, off in zip(members, offsets):
            view = block[off : off + m.numel()].view(m.shape)
            view.copy_(m.detach())
            m.data = view
    fs = FusedStorage(kind, block, names, members, offsets)
    _REGISTRY[fs._key] = fs
    return fs


def refuse(fs: FusedStorage, members: Sequence[torch.Tensor]) -> bool:
    """Bring a group whose layout was lost back into one buffer. ``members``
    are the tensors in use now (they may be new objects after
    ``load_state_dict(assign=True)``); they must agree on dtype and device and
    keep the group's shapes. Returns True if it re-fused."""
    if len({(m.dtype, m.device) for m in members}) != 1 or [tuple(m.shape) for m in members] != fs.shapes:
        return False
    _REGISTRY.pop(fs._key, None)
    new = fuse(fs.kind, fs.names, members, fs.offsets, fs.numel)
    fs._key, fs._members = new._key, new._members
    fs.refusions += 1
    _REGISTRY[fs._key] = fs
    return True


# Formats that change a tensor in some other way (a dtype cast, say) register
# how to undo it here; ``wfpass.restore`` runs it. Weak keys: no leak.
# Identity-keyed: a WeakKeyDictionary compares tensor keys with == (elementwise).
_UNDO = _compat.weak_id_key_dict()


def undo_registered(t: torch.Tensor) -> bool:
    """Has a format changed ``t`` in a way ``wfpass.restore`` would undo?"""
    return t in _UNDO


def register_undo(t: torch.Tensor, undo: Callable[[torch.Tensor], None]) -> None:
    """Record how ``wfpass.restore`` returns ``t`` to its standard format."""
    _UNDO[t] = undo


def restore_tensor(t: torch.Tensor) -> bool:
    """Return ``t`` to its standard format: independent storage if wfpass fused
    it, and any registered undo (e.g. a dtype cast back). Same values."""
    undo = _UNDO.pop(t, None)
    if undo is not None:
        undo(t)
    if type(t) not in _PLAIN:
        return undo is not None  # never fused (``unmovable``); a DTensor has no storage of its own
    fs = _REGISTRY.get(_key(t))
    if fs is None or not fs.is_member(t):
        return undo is not None
    with torch.no_grad():
        t.data = t.data.clone(memory_format=torch.contiguous_format)
    if not any(m is not None and m.untyped_storage().data_ptr() == fs._key[1] for m in fs.members):
        _REGISTRY.pop(fs._key, None)
    return True


def sharing_problem(t: torch.Tensor, name: str, others: Sequence[Tuple[str, torch.Tensor]], allowed: Sequence[torch.Tensor] = ()) -> Optional[str]:
    """Why moving ``t`` into a new buffer could silently untie it, or None.

    First ``unmovable``: a DTensor, another tensor subclass or an FSDP2
    parameter is never moved. Then two checks: byte overlap with any other
    tensor the model has (ties inside the model), and the storage's reference
    count (aliases held anywhere else, e.g. a tensor the user kept from
    ``param.data``). Tensors in ``allowed`` (the same group's members already
    fused together) do not count.
    """
    why = unmovable(t, name)
    if why is not None:
        return why
    for oname, o in others:
        if o is t or any(o is a for a in allowed):
            continue
        if overlaps(t, o):
            return f"{name} shares storage with {oname} (tied weights); moving it would untie them"
    uses = _compat.storage_use_count(t)
    ptr = t.untyped_storage().data_ptr()
    expected = 1 + sum(1 for a in allowed if a is not t and type(a) in _PLAIN and a.untyped_storage().data_ptr() == ptr)
    if uses is not None and uses > expected:
        return f"{name}'s storage is also held by {uses - expected} other tensor(s) outside this graph; moving it would untie them"
    return None
