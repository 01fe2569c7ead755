"""How much memory this process may still take: the bound on derived copies.

A packed copy of a weight (``prepack``, the LSTMs' oneDNN copies) costs as
many bytes as the weight. The default budget (``prepack.max_bytes=
"weights"``) allows copies up to the weights' bytes; on its own that lets a
half-precision model that fills 60% of the memory push its process out of
it with its own copies. So the default budget is also held to what memory
leaves, read when a copy is about to be made: the process may use what the
machine has available (``MemAvailable`` in ``/proc/meminfo``) or, inside a
cgroup with a memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``,
each level up to the root), what is left under that limit, whichever is
lower; a copy is made only where at least ``1 - SHARE`` of the memory the
process may use (its limit: the cgroup's, else the machine's total) stays
free after it. Linux only; elsewhere nothing is known and only the
weights' bound holds.
"""
from __future__ import annotations

import dataclasses
import os
from typing import List, Optional, Tuple

__all__ = ["SHARE", "Memory", "memory_now", "copy_room", "describe"]

#: A copy may take the process up to this share of the memory it may use.
SHARE = 0.8

# Where the kernel says it (module names so a test can point them at files
# of its own).
MEMINFO = "/proc/meminfo"
SELF_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"

# cgroup v1 writes "no limit" as the largest page-aligned int64.
_NO_LIMIT = 1 << 62


@dataclasses.dataclass(frozen=True)
class Memory:
    """``limit``: the bytes the process may use in all (the cgroup's limit,
    else the machine's total); ``free``: of those, how many are free now;
    ``source``: where the tighter figure came from."""

    limit: int
    free: int
    source: str


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _meminfo() -> Optional[Tuple[int, int]]:
    """(MemTotal, MemAvailable) in bytes."""
    text = _read(MEMINFO)
    if text is None:
        return None
    got = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable") and rest.split():
            got[key] = int(rest.split()[0]) * 1024  # kB
    if "MemTotal" not in got:
        return None
    return got["MemTotal"], got.get("MemAvailable", got["MemTotal"])


def _int(text: Optional[str]) -> Optional[int]:
    if text is None:
        return None
    text = text.strip()
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _NO_LIMIT else value


def _levels(base: str, v2: bool) -> List[str]:
    """The process's cgroup folder under the mount ``base`` and each one
    above it, up to ``base``; ``base`` alone where the group is not under it
    (a cgroup namespace mounts the process's own group as the root)."""
    rel = ""
    for line in (_read(SELF_CGROUP) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and ((parts[0] == "0" and not parts[1]) if v2 else "memory" in parts[1].split(",")):
            rel = parts[2].strip().strip("/")
    here = os.path.join(base, rel) if rel else base
    if not os.path.isdir(here):
        here = base
    out = [here]
    while os.path.normpath(here) != os.path.normpath(base):
        here = os.path.dirname(here)
        out.append(here)
    return out


def _cgroup() -> Optional[Tuple[int, int]]:
    """(limit, free under it) of the tightest cgroup level with a memory
    limit; None where there is none."""
    best: Optional[Tuple[int, int]] = None
    for root, v2, limit_file, usage_file in ((CGROUP_ROOT, True, "memory.max", "memory.current"),
                                             (os.path.join(CGROUP_ROOT, "memory"), False, "memory.limit_in_bytes",
                                              "memory.usage_in_bytes")):
        if not os.path.isdir(root):
            continue
        for level in _levels(root, v2):
            limit = _int(_read(os.path.join(level, limit_file)))
            used = _int(_read(os.path.join(level, usage_file)))
            if limit is None or used is None:
                continue
            free = max(0, limit - used)
            if best is None or free < best[1]:
                best = (limit, free)
    return best


def memory_now() -> Optional[Memory]:
    """The memory this process may use and how much of it is free, read now;
    None where the system does not say (not Linux)."""
    info = _meminfo()
    if info is None:
        return None
    total, available = info
    group = _cgroup()
    if group is not None and group[1] < available:
        return Memory(limit=group[0], free=group[1], source="the cgroup's memory limit")
    return Memory(limit=min(total, group[0]) if group is not None else total, free=available,
                  source="MemAvailable")


def copy_room(share: float = SHARE) -> Optional[int]:
    """Bytes of new copies the process may make now and still keep
    ``1 - share`` of the memory it may use free; None where that is not
    known (no bound from memory)."""
    m = memory_now()
    return None if m is None else _room(m, share)


def _room(m: Memory, share: float) -> int:
    return max(0, m.free - int((1.0 - share) * m.limit))


def describe(share: float = SHARE) -> str:
    """One line for ``python -m wfpass doctor`` and the report."""
    m = memory_now()
    if m is None:
        return "not known here (no /proc/meminfo): only the weights' bytes bound the copies"
    room = _room(m, share)  # from the same reading as the figures beside it
    return (f"{room / 2**30:.2f} GiB more copies now: the process may use {m.limit / 2**30:.2f} GiB, "
            f"{m.free / 2**30:.2f} GiB of it free ({m.source}), and copies leave {1 - share:.0%} of it free")
