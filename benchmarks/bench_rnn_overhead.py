"""Where wformat's fixed per-call cost for an RNN goes, piece by piece.

Times, in one process and interleaved (rounds rotate the order), one no-grad
call of a one-layer ``nn.LSTM`` at T = 1 (the kernel is cheapest there, so the
fixed cost shows) through each layer of the stack:

* ``eager``: the ``nn.LSTM`` module (oneDNN's kernel).
* ``compiled``: the module compiled with ``backend="wformat"`` (Inductor).
* ``backend fn``: what wformat returned to Dynamo, called directly (prologue +
  AOTAutograd's runtime wrapper + Inductor's code): ``compiled`` minus this is
  Dynamo's frame and guard cost.
* ``guards``: Dynamo's guard check of that frame alone.
* ``prologue``: ``rnn_weight_block`` (find the flat block).
* ``op``: ``torch.ops.wfpass.rnn.default`` through the dispatcher.
* ``op as custom_op``: the same implementation registered the way wfpass did
  before (``torch.library.custom_op`` with ``register_autograd``), to measure
  what that registration costs per call.
* ``kernel``: the op's implementation called as a Python function.

Usage: ``python benchmarks/bench_rnn_overhead.py [--out docs/rnn_overhead.md]``.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
import timeit
from typing import List, Optional, Tuple

import torch

import wfpass
from wfpass.ops import rnn as rnn_ops
from wfpass.ops import runtime


def _spy_backend():
    """A wformat backend that keeps what it returns and the arguments of its
    last call (to time the backend's function without Dynamo's frame)."""
    seen = {}
    inner = wfpass.backend()

    def be(gm, example_inputs):
        fn = inner(gm, example_inputs)

        def call(*args):
            seen["fn"], seen["args"] = fn, args
            return fn(*args)

        return call

    be.config = inner.config  # so wfpass's RNN capture recognises it
    be.__wrapped__ = inner
    return be, seen


def _custom_op_copy():
    """``rnn_ops._rnn_op`` registered through ``torch.library.custom_op`` with
    an autograd formula, as wfpass did before: the reference for its cost."""

    @torch.library.custom_op("wfpass_bench::rnn", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
    def op(
        input: torch.Tensor, hx: List[torch.Tensor], weights: List[torch.Tensor], block: torch.Tensor,
        gid: str, train: bool, grad_mask: List[bool], dropout: Optional[torch.Tensor],
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return rnn_ops._rnn_op(input, hx, weights, block, gid, train, grad_mask, dropout)

    op.register_fake(rnn_ops._rnn_fake)
    op.register_autograd(lambda ctx, *grads: (None,) * 8, setup_context=lambda ctx, inputs, output: None)
    return torch.ops.wfpass_bench.rnn.default


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write a markdown table here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    t0 = time.perf_counter()

    m = torch.nn.LSTM(a.hidden, a.hidden)
    x = torch.randn(1, a.batch, a.hidden)
    be, seen = _spy_backend()
    cm = torch.compile(m, backend=be)
    with torch.no_grad():
        cm(x)
        fn, args = seen["fn"], seen["args"]
        gid = max(runtime._GROUPS, key=lambda k: int(k[3:]) if k.startswith("rnn") else -1)
        ws = list(m._flat_weights)
        hx = [torch.zeros(1, a.batch, a.hidden), torch.zeros(1, a.batch, a.hidden)]
        blk = rnn_ops.rnn_weight_block(gid, *ws)
        op_args = (x, hx, ws, blk, gid, False, [False] * 7, None)
        old_op = _custom_op_copy()
        guard_check = None
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo.external_utils import wrap_inline

        entries = _debug_get_cache_entry_list(wrap_inline(lambda: 0).__code__)  # private; torch 2.13.0
        if entries:
            gm_guard = entries[0].guard_manager
            f_locals = {"fn": m, "args": (x,), "kwargs": {}}
            if gm_guard.check(f_locals):
                guard_check = lambda: gm_guard.check(f_locals)  # noqa: E731

        cases = {
            "eager": lambda: m(x),
            "compiled": lambda: cm(x),
            "backend fn": lambda: fn(*args),
            "prologue": lambda: rnn_ops.rnn_weight_block(gid, *ws),
            "op": lambda: torch.ops.wfpass.rnn.default(*op_args),
            "op as custom_op": lambda: old_op(*op_args),
            "kernel": lambda: rnn_ops._rnn_op(*op_args),
        }
        if guard_check is not None:
            cases["guards"] = guard_check
        names = list(cases)
        times = {k: [] for k in names}
        for f in cases.values():
            f()
        for r in range(a.rounds):
            for k in names[r % len(names):] + names[: r % len(names)]:
                times[k].append(min(timeit.repeat(cases[k], number=a.calls // 5, repeat=5)) / (a.calls // 5) * 1e6)
    med = {k: statistics.median(v) for k, v in times.items()}

    lines = [
        "# RNN per-call cost, piece by piece",
        "",
        f"Command: `python benchmarks/bench_rnn_overhead.py --out docs/rnn_overhead.md` "
        f"({time.perf_counter() - t0:.0f} s). torch {torch.__version__}, {platform.machine()}, "
        f"{a.threads} thread(s), one-layer `nn.LSTM({a.hidden}, {a.hidden})`, input [1, {a.batch}, {a.hidden}] (T = 1), "
        "no grad. Microseconds per call: median over rounds of the best of 5 repeats, rounds interleaved.",
        "",
        "| piece | us per call | note |",
        "|---|---|---|",
    ]
    notes = {
        "eager": "eager `nn.LSTM` (oneDNN kernel)",
        "compiled": "`torch.compile(backend=\"wformat\")`, default N: the unfused (ATen native) kernel at T = 1",
        "backend fn": "prologue + AOTAutograd wrapper + Inductor code + op; compiled minus this = Dynamo's frame",
        "guards": "Dynamo's guard check of the frame",
        "prologue": "`rnn_weight_block`: is the flat block still in place?",
        "op": "`wfpass::rnn` through the dispatcher (Library op; autograd lives in `_Rnn`)",
        "op as custom_op": "the same kernel as a `torch.library.custom_op` with `register_autograd` (wfpass before)",
        "kernel": "the op's implementation called directly",
    }
    for k in ["eager", "compiled", "backend fn", "guards", "prologue", "op", "op as custom_op", "kernel"]:
        if k in med:
            lines.append(f"| {k} | {med[k]:.1f} | {notes[k]} |")
    lines += [
        "",
        f"- Dynamo's frame (compiled - backend fn): {med['compiled'] - med['backend fn']:.1f} us",
        f"- dispatcher cost of the op (op - kernel): {med['op'] - med['kernel']:.1f} us; as a custom_op: "
        f"{med['op as custom_op'] - med['kernel']:.1f} us",
        f"- compiled / eager: {med['compiled'] / med['eager']:.2f}",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
