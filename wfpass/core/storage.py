"""Fused storage: a group's existing tensors moved once into one buffer.

``fuse`` allocates one zero-filled buffer, copies each member in at a fixed
element offset and points the member at its slice (``tensor.data = view``).
The member objects (the user's ``nn.Parameter``s, the optimizer's leaves) stay
the same; only where their bytes live changes, exactly as PyTorch's own
``flatten_parameters`` does for cuDNN RNNs. Slots no member covers stay zero:
they are the "fake biases" a fused kernel needs where a member has none.

Nothing here keeps a member alive: the registry holds weak references and
drops an entry when its member dies, so a deleted model frees its buffer.
"""
from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .._torch import distributed as _distributed, tensors as _tensors

__all__ = [
    "FusedStorage", "fuse", "re_fuse", "fused_storage_of", "layout_of", "layout_of_set", "entry_by_id", "live_layouts", "restore_tensor", "register_undo", "undo_registered",
    "overlaps", "sharing_problem", "byte_extent", "unmovable",
    "first_unmovable", "first_sharing_problem", "move_problem",
]

# -- tensors wfpass must not move ---------------------------------------------
# Exactly these types own plain storage that wfpass may re-point. A subclass
# (DTensor, FakeTensor, a quantized or user wrapper) may keep its data
# elsewhere or attach meaning to where it lives: wfpass cannot prove a move
# safe, so it leaves it alone (invariant 7).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain(t: torch.Tensor) -> bool:
    """A tensor that keeps its values in its own storage: ``torch.Tensor``,
    ``nn.Parameter``, or a fake tensor standing in for one (a model built
    under ``FakeTensorMode``, traced without a device)."""
    cls = type(t)
    return cls in _PLAIN or cls is _tensors.fake_tensor_type()


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
    registry of composable-API modules (``_torch.distributed.fsdp2_modules``): that
    registry is the one place reachable from a tensor alone.
    Where it is missing, the DTensor check and ``sharing_problem``'s
    storage-use count (the all-gather buffer holds the storage too) still skip it."""
    modules = _distributed.fsdp2_modules()
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
    if not _plain(t):
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
    if _plain(t):
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
    if not _plain(a) or not _plain(b):
        return any(_overlaps_plain(x, y) for x in _storage_parts(a) for y in _storage_parts(b))
    return _overlaps_plain(a, b)


def _overlaps_plain(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or _tensors.storage_ptr(a) != _tensors.storage_ptr(b):
        return False
    a0, a1 = byte_extent(a)
    b0, b1 = byte_extent(b)
    return a0 < b1 and b0 < a1


class FusedStorage:
    """One block and the tensors that are views of it: a *layout*.

    It belongs to its members: the registry maps each member (by identity,
    removed by a weak-reference callback when the member dies) to its layout,
    and nothing else holds it. The layout holds the block, so while it lives
    no other allocation can start inside the block's bytes: a member whose
    ``data_ptr()`` is the address recorded here *is* a view at its offset.
    That makes the per-call check complete and cheap (``ptrs`` compared to
    the members' ``data_ptr()``, no storage objects created).

    ``key`` says which layout this is (format, sizes, offsets); a compiled
    graph reads a block only through a layout with its own key. ``record``
    is the report record of this set of parameters: its counters add up over
    every graph that runs with them and decided the same (``records``).
    """

    def __init__(self, kind: str, block: torch.Tensor, names: Sequence[str], members: Sequence[torch.Tensor],
                 offsets: Sequence[int], key: Any = None, record: Any = None):
        self.kind = kind
        self.key = key if key is not None else (kind, tuple(offsets), tuple(tuple(m.shape) for m in members))
        self.record = record
        self.records: dict = {}  # decision -> the rows of compiles that decided otherwise
        self.names = list(names)
        self.offsets = list(offsets)
        self.shapes = [tuple(m.shape) for m in members]
        self.numel = block.numel()
        self._set(block, members)

    def _set(self, block: torch.Tensor, members: Sequence[torch.Tensor]) -> None:
        self.block = block
        es = block.element_size()
        base = block.data_ptr()
        self.ptrs = tuple(base + off * es for off in self.offsets)
        self._members = [weakref.ref(m) for m in members]
        for m in members:
            _own(m, self)

    @property
    def members(self) -> List[Optional[torch.Tensor]]:
        return [r() for r in self._members]

    def holds(self, ts: Sequence[torch.Tensor]) -> bool:
        """Are ``ts`` views of this block at the layout's offsets? Address
        arithmetic only (shapes, strides and dtypes are the compiled graph's
        guards; :meth:`intact` checks them too)."""
        return self.block is not None and tuple([t.data_ptr() for t in ts]) == self.ptrs

    def intact(self) -> bool:
        """Are all members still alive, contiguous views at their offsets of the block?"""
        ms = self.members
        if self.block is None or any(m is None for m in ms):
            return False
        return self.holds(ms) and all(
            tuple(m.shape) == s and m.is_contiguous() and m.dtype == self.block.dtype for m, s in zip(ms, self.shapes))

    def is_member(self, t: torch.Tensor) -> bool:
        return any(m is t for m in self.members)

    def release(self, t: torch.Tensor) -> None:
        """``t`` leaves the layout (``wfpass.restore``); the block goes with the last member."""
        _OWNER.pop(id(t), None)
        self._members = [r for r in self._members if r() is not None and r() is not t]
        if not self._members:
            self.block = None


# id(member) -> (weak reference to the member, its layout). An entry goes
# when its member dies (weak-reference callback), so the table holds only
# live members and a deleted model frees its blocks.
_OWNER: Dict[int, Tuple["weakref.ref", FusedStorage]] = {}
#: ``entry_by_id(id(t))``: ``(weak reference to t, its layout)`` or None, the
#: table's own ``get``: the per-call layout check's fast path
#: (``runtime.guarded_call``), which checks the reference itself.
entry_by_id = _OWNER.get


def _own(t: torch.Tensor, fs: FusedStorage) -> None:
    key = id(t)
    old = _OWNER.get(key)
    if old is not None and old[0]() is t:
        _OWNER[key] = (old[0], fs)
        return

    def gone(ref, key=key):
        entry = _OWNER.get(key)
        if entry is not None and entry[0] is ref:
            del _OWNER[key]

    _OWNER[key] = (weakref.ref(t, gone), fs)


def layout_of(t: torch.Tensor) -> Optional[FusedStorage]:
    """The layout ``t`` was fused into, intact or not (None if never, or released)."""
    entry = _OWNER.get(id(t))
    if entry is None or entry[0]() is not t:
        return None
    return entry[1]


def layout_of_set(tensors: Sequence[torch.Tensor], key: Any) -> Optional[FusedStorage]:
    """The layout, intact or lost, whose members are exactly ``tensors`` (the
    same objects, in order) under ``key``; None if there is none."""
    fs = layout_of(tensors[0])
    members = fs.members if fs is not None else ()
    if fs is None or fs.key != key or len(members) != len(tensors) or not all(a is b for a, b in zip(members, tensors)):
        return None
    return fs


def live_layouts() -> int:
    """How many layouts have a live member (tests check that deleted models leave none)."""
    return len({id(fs) for _, fs in _OWNER.values() if fs.block is not None})


def fused_storage_of(t: torch.Tensor) -> Optional[FusedStorage]:
    """The intact layout ``t`` belongs to, if any."""
    if not _plain(t):
        return None  # wfpass never fuses a subclass (``unmovable``)
    fs = layout_of(t)
    if fs is not None and fs.intact():
        return fs
    return None


def fuse(kind: str, names: Sequence[str], members: Sequence[torch.Tensor], offsets: Sequence[int], numel: int,
         key: Any = None, record: Any = None) -> FusedStorage:
    """Move ``members`` into one new zero-filled buffer of ``numel`` elements.

    Members must share dtype and device; ``offsets`` are element offsets and
    must not overlap. Values are copied exactly; the old storages are freed
    when nothing else holds them (the caller has checked nothing does).
    """
    block = _copy_into_block(members, offsets, numel)
    return FusedStorage(kind, block, names, members, offsets, key=key, record=record)


def _copy_into_block(members: Sequence[torch.Tensor], offsets: Sequence[int], numel: int) -> torch.Tensor:
    first = members[0]
    # ``new_zeros`` of a member: a real block for real members; for fake
    # members (a model traced on fake CUDA, no GPU) a fake one, made by the
    # members' own fake mode even where that mode is not active.
    block = first.new_zeros((numel,))
    with torch.no_grad():
        for m, off in zip(members, offsets):
            view = block[off : off + m.numel()].view(m.shape)
            view.copy_(m.detach())
            m.data = view
    return block


def re_fuse(fs: FusedStorage, members: Sequence[torch.Tensor]) -> bool:
    """Bring a layout that was lost back into one buffer. ``members`` are the
    tensors in use now (they may be new objects after
    ``load_state_dict(assign=True)``); they must agree on dtype and device and
    keep the layout's shapes. Returns True if it re-fused."""
    if len({(m.dtype, m.device) for m in members}) != 1 or [tuple(m.shape) for m in members] != fs.shapes:
        return False
    for m in fs.members:
        if m is not None and not any(m is n for n in members):
            _OWNER.pop(id(m), None)
    fs._set(_copy_into_block(members, fs.offsets, fs.numel), members)
    return True


# Formats that change a tensor in some other way (a dtype cast, say) register
# how to undo it here; ``wfpass.restore`` runs it. Weak keys: no leak.
# Identity-keyed: a WeakKeyDictionary compares tensor keys with == (elementwise).
_UNDO = _tensors.weak_id_key_dict()


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
    if not _plain(t):
        return undo is not None  # never fused (``unmovable``); a DTensor has no storage of its own
    fs = layout_of(t)
    if fs is None:
        return undo is not None
    if fs.block is not None and _tensors.storage_ptr(t) == _tensors.storage_ptr(fs.block):
        with torch.no_grad():
            t.data = t.data.clone(memory_format=torch.contiguous_format)
    fs.release(t)
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
    uses = _tensors.storage_use_count(t)
    ptr = _tensors.storage_ptr(t)
    expected = 1 + sum(1 for a in allowed if a is not t and _plain(a) and _tensors.storage_ptr(a) == ptr)
    own = layout_of(t)
    if own is not None and own.block is not None and _tensors.storage_ptr(own.block) == ptr:
        expected += 1  # the layout's own reference to its block
    if uses is not None and uses > expected:
        return f"{name}'s storage is also held by {uses - expected} other tensor(s) outside this graph; moving it would untie them"
    return None


# -- the sharing checks before a format moves tensors ---------------------------
#
# ``unmovable`` first, over all the tensors: a DTensor or FSDP2 tensor never
# reaches a format's own check (which may read its data). Then the format's
# own check, then ``sharing_problem`` over all of them (``move_problem``, what
# ``ParamFormat`` runs; the built-in formats call the pieces they need). Each
# returns the first reason, which becomes the ``skipped`` row of the report.


def first_unmovable(named: Iterable[Tuple[str, Optional[torch.Tensor]]]) -> Optional[str]:
    """The first ``unmovable`` reason among ``(name, tensor)`` pairs (None tensors skipped)."""
    return next((w for w in (unmovable(t, n) for n, t in named if t is not None) if w), None)


def first_sharing_problem(named: Iterable[Tuple[str, Optional[torch.Tensor]]], others: Sequence[Tuple[str, torch.Tensor]],
                          allowed: Sequence[torch.Tensor] = ()) -> Optional[str]:
    """The first ``sharing_problem`` among ``(name, tensor)`` pairs (None tensors skipped)."""
    return next((w for w in (sharing_problem(t, n, others, allowed) for n, t in named if t is not None) if w), None)


def move_problem(named: Sequence[Tuple[str, Optional[torch.Tensor]]], others: Sequence[Tuple[str, torch.Tensor]],
                 check: Optional[Callable[[], Optional[str]]] = None) -> Optional[str]:
    """The whole sequence: ``first_unmovable``, then ``check()`` (the format's
    own), then ``first_sharing_problem``; the first reason, or None."""
    return first_unmovable(named) or (check() if check is not None else None) or first_sharing_problem(named, others)
