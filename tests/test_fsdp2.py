"""FSDP2 (``fully_shard``): 2 processes, gloo, CPU. A model of Q/K/V blocks
and a BatchNorm, each block ``fully_shard``-ed, compiled with the wformat
backend, trains like plain (uncompiled) FSDP2, and the report says for every
group what wfpass did with it."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from wftest import free_port

STEPS = 4
BF16 = torch.bfloat16


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x):
        a = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2) / 4.0, -1) @ self.v(x)
        return x + self.bn(a.flatten(0, 1)).view_as(a)


class Model(nn.Module):
    def __init__(self, d=16, n=2):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    import wfpass
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    base = Model().to(BF16)
    results = {}
    for name in ("plain", "wformat"):
        model = copy.deepcopy(base)
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        fn = torch.compile(model, backend=wfpass.backend(inner="aot_eager")) if name == "wformat" else model
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(100 + rank)
        for step in range(STEPS):
            x = torch.randn(4, 6, 16, generator=g).to(BF16)
            proj = torch.randn(4, 6, 1, generator=torch.Generator().manual_seed(step)).to(BF16)
            opt.zero_grad()
            (fn(x) * proj).float().sum().backward()
            opt.step()
        results[name] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                         for k, v in model.state_dict().items()}
        if name == "wformat":
            rep = wfpass.report(model)
            results["report"] = [(r.pattern, r.action, tuple(r.params), r.reason) for r in rep.records]
            results["names"] = sorted(model.state_dict())
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo not available")
def test_fsdp2_two_processes_train_like_plain_fsdp2_and_report_every_group(tmp_path):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        for k, v in res["plain"].items():
            # bf16: the compiled graph rounds like eager's ops; 2 bf16 ulps.
            torch.testing.assert_close(res["wformat"][k].float(), v.float(), rtol=1.6e-2, atol=1e-3,
                                       msg=lambda m: f"rank {rank} {k}: {m}")
        rep = res["report"]
        # Every Q/K/V group and every BatchNorm has a row that says what
        # wfpass did: left alone, because FSDP2 owns the storage.
        for b in range(2):
            linear = [r for r in rep if r[0] == "linear" and f"blocks.{b}.q.weight" in r[2]]
            assert linear and all(a == "skipped" and "FSDP2-managed module" in why for _, a, _, why in linear), rep
            bn = [r for r in rep if r[0] == "batchnorm" and f"blocks.{b}.bn.weight" in r[2]]
            assert bn and all(a == "skipped" and "FSDP2-managed module" in why for _, a, _, why in bn), rep
        names = {p for r in rep for p in r[2]}
        assert names <= set(res["names"]), sorted(names - set(res["names"]))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt")["wformat"] for r in range(2))
    for k in r0:
        if "running" not in k and "num_batches" not in k:
            assert torch.equal(r0[k], r1[k]), k
