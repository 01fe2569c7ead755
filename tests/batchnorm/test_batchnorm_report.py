"""BatchNorms converted outside the graphs (``momentum=None`` in training:
Dynamo graph-breaks on ``float(num_batches_tracked)`` and runs them eagerly)
are in ``wfpass.report(model)``, one row each, from the first call on; the
graphs compiled are Inductor's, plus the ones the rows name (a graph of a
hooked BatchNorm's own forward); the numbers equal eager with the
BatchNorms moved to fp32 by hand.

Two ways the BatchNorms sit between compiled regions (``VARIANTS``):
``module``, a submodule compiled in place (``features.compile``), which
Dynamo splits at each BatchNorm; ``blocks``, the conv blocks compiled one by
one, the BatchNorms outside every compiled region.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import wfpass
from wfpass.batchnorm.eager import FORWARD_GRAPH

VARIANTS = ["module", "blocks"]
ROLES = ("running_mean", "running_var", "weight", "bias")
BNS = ("bn1", "bn2", "bn3")


class Features(nn.Module):
    """conv -> bn -> relu, three times; bn3 has other channels than bn1/bn2."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16, momentum=None)
        self.c2, self.bn2 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16, momentum=None)
        self.c3, self.bn3 = nn.Conv2d(16, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=None)

    def block1(self, x):
        return self.c1(x)

    def block2(self, x):
        return self.c2(F.relu(x))

    def block3(self, x):
        return self.c3(F.relu(x))

    def forward(self, x):
        x = self.bn1(self.block1(x))
        x = self.bn2(self.block2(x))
        return F.relu(self.bn3(self.block3(x)))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = Features()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


def compiled(model: CNN, variant: str, backend) -> CNN:
    """``model`` with its regions compiled in place: parameter names stay the model's."""
    f = model.features
    if variant == "module":
        f.compile(backend=backend)
    else:
        for name in ("block1", "block2", "block3"):
            setattr(f, name, torch.compile(getattr(f, name), backend=backend))
    return model


def inputs(n=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 8, 8, generator=g) * 2 + 0.5).to(torch.bfloat16) for _ in range(n)]


def step(model, opt, x):
    out = model(x)
    out.float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out


def check_rows(model, calls):
    """One ``rewritten`` row per BatchNorm, named as the model names its
    tensors, saying what was done and why, counting ``calls`` fp32 calls."""
    rows = wfpass.report(model).find("batchnorm")
    assert sorted(r.params[0] for r in rows) == [f"features.{b}.running_mean" for b in BNS], rows
    for r in rows:
        bn = r.params[0].rsplit(".", 1)[0]
        assert r.action == "rewritten" and r.detail["flavour"] == "eager"
        assert r.params == [f"{bn}.{k}" for k in ROLES]
        assert "momentum=None in training" in r.reason and "held in float32" in r.reason
        assert r.stats["fp32_calls"] == calls, (bn, dict(r.stats))
    return rows


# -- the rows, after each call ------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_every_batchnorm_converted_outside_the_graphs_has_a_row_after_every_call(variant):
    model = compiled(CNN().to(torch.bfloat16), variant, wfpass.backend(inner="aot_eager"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i, x in enumerate(inputs(), 1):
        step(model, opt, x)
        check_rows(model, calls=i)
        if variant == "module":
            # Every graph of the call is in last_report(), and no later
            # compile replaced it with a graph that shows no pattern.
            last = wfpass.last_report()
            assert len(last.find("batchnorm", "rewritten")) == 3, last
    for b in BNS:
        assert getattr(model.features, b).running_var.dtype == torch.float32


# -- graphs compiled, against Inductor -------------------------------------------------

def graphs_per_call(model, variant, backend):
    torch._dynamo.reset()
    counters.clear()
    model = compiled(model, variant, backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    for x in inputs():
        step(model, opt, x)
        seen.append(counters["stats"]["unique_graphs"])
    return seen


@pytest.mark.parametrize("variant", VARIANTS)
def test_graphs_compiled_are_inductor_s_plus_the_ones_the_rows_name(variant):
    """No recompile on the second call (the pre-hook's counter was a guard
    when Dynamo traced the hook). Where the BatchNorms run inside a compiled
    call, Dynamo also compiles each hooked BatchNorm's forward up to its
    break, once per set of guards (bn1 and bn2 share one, bn3 has other
    shapes); each of those is on the row of the BatchNorm that compiled it."""
    base = CNN().to(torch.bfloat16)
    wf_model = copy.deepcopy(base)
    # The graphs counted are Dynamo's, which it makes before any backend
    # runs. ``blocks`` compiles with Inductor on both sides (what users run);
    # ``module`` with aot_eager, as plain and as wformat's inner compiler:
    # its many split graphs' Inductor compiles, twice, took 34 s on CI.
    if variant == "module":
        wf_backend, plain = wfpass.backend(inner="aot_eager"), "aot_eager"
    else:
        wf_backend, plain = "wformat", "inductor"
    wf = graphs_per_call(wf_model, variant, wf_backend)
    ind = graphs_per_call(copy.deepcopy(base), variant, plain)
    assert ind[0] == ind[1] == ind[2] > 0
    assert wf[0] == wf[1] == wf[2], wf
    rows = check_rows(wf_model, calls=3)
    named = [r for r in rows if r.detail.get("forward_graphs")]
    extra = sum(r.detail["forward_graphs"] for r in named)
    assert wf[0] == ind[0] + extra, (wf, ind, extra)
    assert all(FORWARD_GRAPH in r.reason for r in named)
    if variant == "module":
        # torch 2.13-2.15 compile the hooked forwards; 2.11's Dynamo does not
        # (then wformat's count is Inductor's, and no row names a graph).
        assert sorted(r.params[0] for r in named) in ([], ["features.bn1.running_mean", "features.bn3.running_mean"])
    else:
        assert extra == 0  # no BatchNorm runs inside a compiled call


# -- values ------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_values_equal_eager_with_fp32_batchnorms(variant):
    base = CNN().to(torch.bfloat16)
    ref = copy.deepcopy(base)
    for b in BNS:
        getattr(ref.features, b).float()  # eager with the mixed kernel: what wformat should equal
    plain = copy.deepcopy(base)
    model = compiled(copy.deepcopy(base), variant, wfpass.backend(inner="aot_eager"))
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, ref, plain)]
    for x in inputs():
        out, ref_out, _ = (step(m, o, x) for m, o in zip((model, ref, plain), opts))
        torch.testing.assert_close(out, ref_out, rtol=1e-2, atol=1e-2)
    for b in BNS:
        mine, theirs = getattr(model.features, b), getattr(ref.features, b)
        for k in ROLES:
            torch.testing.assert_close(getattr(mine, k), getattr(theirs, k), rtol=1e-5, atol=1e-6, msg=f"{b}.{k}")
        assert mine.num_batches_tracked.item() == 3
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q.to(p.dtype), rtol=2e-2, atol=2e-2, msg=k)
    # Not vacuous: plain bf16 statistics differ from the fp32 ones.
    assert not torch.equal(plain.features.bn1.running_var.float(), model.features.bn1.running_var)
    check_rows(model, calls=3)  # the rows count the calls that ran
