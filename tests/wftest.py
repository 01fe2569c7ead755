"""Shared test helpers: compare a compiled/rewritten model against eager on a deep copy."""
from __future__ import annotations

import copy
import socket
from typing import Callable, Sequence

import pytest
import torch

__all__ = ["TOL", "Capture", "free_port", "assert_applied", "assert_same_fwd_bwd", "clone_inputs", "param_ids",
           "train_steps", "needs_gpu", "pytest_in_a_process"]

#: (rtol, atol) per dtype: fp32 GEMMs differ from eager only by summation order.
TOL = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-10, 1e-12), torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3)}


def clone_inputs(xs: Sequence[torch.Tensor]):
    return [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in xs]


def _loss(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        # A fixed, non-uniform weighting so every output element's gradient differs.
        w = torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype, device=out.device).view(out.shape)
        return (out * w).sum()
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    return sum(_loss(o) for o in out if isinstance(o, (torch.Tensor, tuple, list)))


def assert_applied(model: torch.nn.Module, pattern: str) -> None:
    """The format ``pattern`` ran on ``model``: its report has a rewritten
    row for it, and the parameters of each such row that the row says were
    moved share one storage (the fused block). A comparison with eager
    alone would pass if the format silently did nothing."""
    import wfpass

    report = wfpass.report(model)
    rows = report.find(pattern, "rewritten")
    assert rows, f"no rewritten {pattern!r} row:\n{report}"
    params = dict(model.named_parameters(remove_duplicate=False))
    for row in rows:
        if "left where they are" in row.reason:  # tied weights: rewritten, deliberately not moved
            continue
        moved = [params[n] for n in row.params if n in params]
        assert moved, (row.params, list(params))
        blocks = {p.untyped_storage().data_ptr() for p in moved}
        assert len(blocks) == 1, f"{row.params} are not one block: {row.reason}"


def assert_same_fwd_bwd(model: torch.nn.Module, transform: Callable[[torch.nn.Module], Callable], inputs: Sequence, rtol=None, atol=None, dtype=torch.float32):
    """Run ``transform(model)(*inputs)`` and a deep-copied eager model on the
    same inputs; assert outputs, input grads and every parameter grad agree.
    A transform with an ``expect`` attribute (a format's name) must also
    have applied that format (``assert_applied``)."""
    d_rtol, d_atol = TOL[dtype]
    rtol = d_rtol if rtol is None else rtol
    atol = d_atol if atol is None else atol
    ref = copy.deepcopy(model)
    fn = transform(model)
    a_in, r_in = clone_inputs(inputs), clone_inputs(inputs)
    out = fn(*a_in)
    ref_out = ref(*r_in)
    if getattr(transform, "expect", None):
        assert_applied(model, transform.expect)
    la, lr = _loss(out), _loss(ref_out)
    torch.testing.assert_close(la, lr, rtol=rtol, atol=atol * max(1, la.numel()))
    _assert_tree_close(out, ref_out, rtol, atol)
    la.backward()
    lr.backward()
    for x, y in zip(a_in, r_in):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            torch.testing.assert_close(x.grad, y.grad, rtol=rtol, atol=atol)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            assert p.grad is None, n
            continue
        assert p.grad is not None, f"no grad reached {n}"
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=lambda m: f"grad of {n}: {m}")
    return out, ref


def _assert_tree_close(a, b, rtol, atol):
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    elif hasattr(a, "to_tuple"):
        _assert_tree_close(a.to_tuple(), b.to_tuple(), rtol, atol)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_tree_close(x, y, rtol, atol)


def param_ids(model: torch.nn.Module):
    return [id(p) for p in model.parameters()]


def train_steps(model, fn, make_batch, opt_cls, steps=5, **opt_kw):
    """``steps`` optimizer steps of ``fn`` (the compiled or eager callable of
    ``model``) on batches from ``make_batch(i)``; returns the losses."""
    opt = opt_cls(model.parameters(), **opt_kw)
    losses = []
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = _loss(fn(*make_batch(i)))
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


class Capture:
    """An inner backend that keeps the graph it was given (what wfpass handed on)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def count(self, pred) -> int:
        """Call nodes whose target satisfies ``pred``, over every graph kept."""
        return sum(1 for g in self.graphs for n in g.graph.nodes if n.op == "call_function" and pred(n.target))


#: A CUDA build of torch: it makes fake CUDA tensors on a machine without a
#: GPU (a CPU build refuses them even when fake).
CUDA_BUILD = torch.version.cuda is not None
needs_cuda_build = pytest.mark.skipif(not CUDA_BUILD, reason=f"needs a CUDA build of torch for fake CUDA tensors "
                                      f"(this torch, {torch.__version__}, is a CPU build)")


def fake_mode():
    """A ``FakeTensorMode`` with a shape environment, for graphs traced on
    fake (CUDA) tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv())


def needs_gpu(reason: str = "needs a GPU"):
    """Decorator for a test that needs a CUDA GPU: skipped without one, and
    marked ``gpu``, so that ``python -m pytest -m gpu`` on a GPU machine runs
    every such test (``benchmarks/gpu/bench_gpu.py`` does, first)."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason=reason)

    def mark(fn):
        return pytest.mark.gpu(skip(fn))

    return mark


def free_port() -> int:
    """A TCP port free right now on localhost, for a test's process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_in_a_process(env: dict, check: str, args: Sequence[str], timeout: int = 900) -> str:
    """pytest with ``args`` (paths from the project's root) in a fresh
    process whose environment adds ``env``, after ``check`` (statements
    asserting the environment took effect: a switch read once per process,
    such as the instruction set a kernel runs on); fails unless every test
    it ran passed. Returns its output."""
    import os
    import pathlib
    import subprocess
    import sys

    code = f"import sys, pytest; {check}; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', *{list(args)!r}]))"
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True,
                       timeout=timeout, cwd=str(pathlib.Path(__file__).resolve().parent.parent))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-2000:]
    return r.stdout
