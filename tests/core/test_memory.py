"""The default bound on derived copies holds to what memory leaves: the
process's cgroup limit or the machine's MemAvailable, read from the files
the kernel writes (here files of the test's own, in the same formats)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import wfpass
from wfpass.core import memory
from wfpass.prepack import kernel as pk

GiB = 1 << 30


def _system(monkeypatch, tmp_path, *, total_kb, available_kb, v2=None, v1=None, own="/jobs/run"):
    """A /proc/meminfo, a /proc/self/cgroup and cgroup folders: ``v2`` /
    ``v1`` map a folder under the process's group (``""`` its own, ``".."``
    its parent) to (limit or "max", usage)."""
    (tmp_path / "meminfo").write_text(f"MemTotal:       {total_kb} kB\nMemFree:        1000 kB\n"
                                      f"MemAvailable:   {available_kb} kB\nBuffers:        10 kB\n")
    lines = []
    root = tmp_path / "cgroup"
    root.mkdir()
    if v2 is not None:
        lines.append(f"0::{own}")
        for where, (limit, used) in v2.items():
            d = (root / own.strip("/") / where).resolve()
            d.mkdir(parents=True, exist_ok=True)
            (d / "memory.max").write_text(f"{limit}\n")
            (d / "memory.current").write_text(f"{used}\n")
    if v1 is not None:
        lines.append(f"4:memory:{own}")
        for where, (limit, used) in v1.items():
            d = (root / "memory" / own.strip("/") / where).resolve()
            d.mkdir(parents=True, exist_ok=True)
            (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
            (d / "memory.usage_in_bytes").write_text(f"{used}\n")
    (tmp_path / "self_cgroup").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(memory, "MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(memory, "SELF_CGROUP", str(tmp_path / "self_cgroup"))
    monkeypatch.setattr(memory, "CGROUP_ROOT", str(root))


def test_without_a_cgroup_limit_the_machines_available_memory_bounds_copies(monkeypatch, tmp_path):
    _system(monkeypatch, tmp_path, total_kb=16 << 20, available_kb=10 << 20, v2={"": ("max", 5 * GiB)})
    m = memory.memory_now()
    assert (m.limit, m.free, m.source) == (16 * GiB, 10 * GiB, "MemAvailable")
    assert memory.copy_room() == 10 * GiB - int(0.2 * 16 * GiB)


def test_the_tightest_cgroup_level_bounds_copies(monkeypatch, tmp_path):
    """A limit on the parent group (v2) is the process's too; v1's "no
    limit" (the largest int64 page) is none."""
    _system(monkeypatch, tmp_path, total_kb=64 << 20, available_kb=60 << 20,
            v2={"": ("max", 3 * GiB), "..": (4 * GiB, 3 * GiB)})
    m = memory.memory_now()
    assert (m.limit, m.free, m.source) == (4 * GiB, 1 * GiB, "the cgroup's memory limit")
    assert memory.copy_room() == max(0, 1 * GiB - int(0.2 * 4 * GiB))
    assert "the cgroup's memory limit" in memory.describe()


@pytest.mark.parametrize("limit,bound", [(9223372036854771712, False), (2 * GiB, True)])
def test_cgroup_v1_limits_count_and_its_no_limit_does_not(monkeypatch, tmp_path, limit, bound):
    _system(monkeypatch, tmp_path, total_kb=8 << 20, available_kb=7 << 20, v1={"": (limit, GiB)})
    m = memory.memory_now()
    assert (m.limit, m.free) == ((2 * GiB, GiB) if bound else (8 * GiB, 7 * GiB))


def test_no_meminfo_no_bound_from_memory(monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "MEMINFO", str(tmp_path / "missing"))
    assert memory.memory_now() is None and memory.copy_room() is None
    assert "not known" in memory.describe()


class _Block(nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        return self.o(self.q(x) * self.k(x) + self.v(x)) + x


def test_a_default_budget_over_what_memory_leaves_runs_copy_free_and_says_so(monkeypatch, tmp_path):
    """Memory that leaves less than the copies need (a cgroup limit of 2 GiB
    with 1.7 GiB in use: 0.3 GiB free, of which a fifth of the limit must
    stay free): the default budget makes no copy, the linears run the
    kernel that needs none with eager's values, and each row says why."""
    _system(monkeypatch, tmp_path, total_kb=64 << 20, available_kb=60 << 20,
            v2={"": (2 * GiB, int(1.7 * GiB))})
    assert memory.copy_room() == 0
    torch.manual_seed(0)
    model = _Block().eval()
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=wfpass.backend(prepack={"mode": "always"}))
    x = torch.randn(1, 2, 256)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(fn(x), ref(x), rtol=1e-5, atol=1e-5)
    rows = wfpass.report(model).find("prepack", "rewritten")
    assert rows and sum(r.stats.get("packed_bytes", 0) for r in rows) == 0
    assert not pk.copies_of(model.o.weight)
    over = [r for r in rows if r.stats.get("over_bound_calls")]
    assert over and all("what memory leaves" in r.reason and "the cgroup's memory limit" in r.reason
                        for r in over), [r.reason for r in rows]

