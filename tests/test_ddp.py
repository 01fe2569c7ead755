"""DistributedDataParallel: 2 processes, gloo, CPU. A model with Q/K/V, an
LSTM and a BatchNorm compiled with the wformat backend trains 5 steps to the
same parameters as un-compiled DDP; a bf16 model's BatchNorm, held in fp32 by
the batchnorm format, trains like DDP with the BatchNorm moved to fp32 by hand
(gloo all-reduces bf16 gradients on torch 2.13)."""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from wftest import free_port

STEPS = 5


class Mixed(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.lstm = nn.LSTM(d, d, batch_first=True)
        self.bn = nn.BatchNorm1d(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        a = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2) / 4.0, -1) @ self.v(x)
        h, _ = self.lstm(a)
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h).mean()


def _worker(rank, world, port, inner, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    import wfpass

    torch.manual_seed(0)
    base = Mixed()
    results = {}
    for name in ("plain", "wformat"):
        model = copy.deepcopy(base)
        ddp = nn.parallel.DistributedDataParallel(model)
        fn = torch.compile(ddp, backend=wfpass.backend(inner=inner, linear_path="fused")) if name == "wformat" else ddp
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(STEPS):
            x = torch.randn(4, 6, 16, generator=g)
            opt.zero_grad()
            fn(x).backward()
            opt.step()
        results[name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if name == "wformat":
            ptr = lambda t: t.untyped_storage().data_ptr()
            results["layout"] = {
                "qkv_one_buffer": len({ptr(model.q.weight), ptr(model.k.weight), ptr(model.v.weight)}) == 1,
                "lstm_one_buffer": len({ptr(p) for p in model.lstm.parameters()}) == 1,
            }
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo not available")
def test_ddp_two_processes_train_like_plain_ddp(tmp_path):
    # Inductor, the default inner compiler. (aot_eager fails on this model in
    # torch 2.13 with or without wfpass: BatchNorm's fake kernel predicts
    # transposed strides for a transposed 3-D CPU input, the real kernel
    # returns contiguous, and a later view fails.)
    mp.spawn(_worker, args=(2, free_port(), "inductor", str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        for k, v in res["plain"].items():
            torch.testing.assert_close(res["wformat"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {k}: {m}")
        assert res["layout"] == {"qkv_one_buffer": True, "lstm_one_buffer": True}, res["layout"]
    # Both ranks end with the same parameters (DDP kept them in sync; the
    # BatchNorm running stats differ per rank in plain DDP too: each rank
    # updates them from its own batch after DDP's broadcast).
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt")["wformat"] for r in range(2))
    params = {n for n, _ in Mixed().named_parameters()}
    for k in params:
        torch.testing.assert_close(r0[k], r1[k])



class ConvBN(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.conv = nn.Conv2d(3, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.head = nn.Linear(c, 1)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.head(h.mean((2, 3))).float().mean()


def _bf16_batchnorm_worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    import wfpass

    be = wfpass.backend(inner="aot_eager")
    torch.manual_seed(0)
    base = ConvBN().to(torch.bfloat16)
    results = {}
    for name in ("by_hand", "wformat", "plain", "wrapped_first"):
        model = copy.deepcopy(base)
        if name == "by_hand":
            model.bn.float()
        elif name == "wformat":
            # The format is taken before DDP wraps the model: one compiled
            # call in eval mode without grad (no statistics update, no
            # gradient). DDP's reducer hooks the parameters' gradient
            # accumulators when it is built, and autograd drops a parameter's
            # accumulator when its dtype changes.
            model.eval()
            with torch.no_grad():
                torch.compile(model, backend=be)(torch.randn(1, 3, 8, 8).to(torch.bfloat16))
            model.train()
            results["cast_before_ddp"] = {k: v.dtype for k, v in model.bn.state_dict().items()}
        ddp = nn.parallel.DistributedDataParallel(model)
        # "wrapped_first": compiled only after DDP was built around the bf16
        # model, so the format must be refused (with a reason) and the model
        # train exactly like plain bf16 DDP.
        fn = torch.compile(ddp, backend=be) if name in ("wformat", "wrapped_first") else ddp
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(STEPS):
            x = torch.randn(4, 3, 8, 8, generator=g).mul(3).add(1).to(torch.bfloat16)
            opt.zero_grad()
            fn(x).backward()
            opt.step()
        results[name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if name in ("wformat", "wrapped_first"):
            results[f"report_{name}"] = [(r.pattern, r.action, tuple(r.params), r.reason) for r in wfpass.last_report().records]
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo not available")
def test_ddp_bf16_batchnorm_format_trains_like_fp32_batchnorm_by_hand(tmp_path):
    # inner aot_eager: a Conv2d + BatchNorm2d model has no transposed 3-D
    # input (see above), and it compiles in seconds.
    mp.spawn(_bf16_batchnorm_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    res = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    bn = {f"bn.{n}" for n in ("weight", "bias", "running_mean", "running_var")}
    for rank, r in enumerate(res):
        assert set(r["cast_before_ddp"].values()) == {torch.float32, torch.int64}, r["cast_before_ddp"]
        # Named as the compiled model, the DDP, names them (its state_dict keys).
        assert any(p == "batchnorm" and a == "rewritten" and "module.bn.weight" in params for p, a, params, _ in r["report_wformat"]), r["report_wformat"]
        # Compiled after DDP was built: refused, with DDP named, and trained
        # bit for bit like plain bf16 DDP (the BatchNorm stayed bf16).
        skips = [why for p, a, params, why in r["report_wrapped_first"] if p == "batchnorm" and a == "skipped"]
        assert skips and "DistributedDataParallel" in skips[0] and "before wrapping" in skips[0], r["report_wrapped_first"]
        for k, v in r["plain"].items():
            assert r["wrapped_first"][k].dtype == v.dtype, k
            assert torch.equal(r["wrapped_first"][k], v), k
        for k, v in r["by_hand"].items():
            w = r["wformat"][k]
            assert w.dtype == v.dtype == (torch.float32 if k in bn else torch.int64 if k.endswith("num_batches_tracked") else torch.bfloat16), (k, w.dtype)
            tol = dict(rtol=1e-5, atol=1e-6) if v.dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
            torch.testing.assert_close(w, v, **tol, msg=lambda m: f"rank {rank} {k}: {m}")
    # The fp32 BatchNorm weight and bias were all-reduced: both ranks hold the
    # same parameters, bit for bit.
    for k, _ in ConvBN().named_parameters():
        assert torch.equal(res[0]["wformat"][k], res[1]["wformat"][k]), k
