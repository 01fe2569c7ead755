"""BatchNorm in half-precision models: fp32 weight, bias and running statistics.

Dynamo flavour: the graph does not change::

    add_ = num_batches_tracked.add_(1)
    y = batch_norm(x_bf16, running_mean, running_var, weight, bias, True, 0.1, 1e-5)

but the inner compiler gets new fp32 example tensors for the four
placeholders (``ctx.compile_example``), and after it has run the real
Parameter/buffer objects get fp32 data (a deferred move). Why not cast first:
Dynamo traced with bf16 fake tensors memoised per real tensor object, and
AOTAutograd would reuse them; a new example object is fakified afresh, so the
compiled code is built for fp32 statistics and updates them in place, from
the first call on. Dynamo builds its guards from the live tensors after the
backend returns, so they see fp32: no recompile (measured, torch 2.13.0), and
nothing runs per call. A later ``model.to(bf16)`` fails those guards; the
recompile casts again.

``symbolic_trace`` flavours (``wfpass.apply``) run in place, so a cheap
check before each batch norm restores the format if it was lost (counted)::

    y = batch_norm(x, rm, rv, w, b, ...)   ->   y = batch_norm(x, bn_fp32("bn0", 0, rm, True), ...)
    y = bn(x)                              ->   x2 = bn_module_fp32("bn0", x); y = bn(x2)

A ``call_module`` BatchNorm keeps running its own forward (train/eval switches
after the pass, ``num_batches_tracked``, ``momentum=None``: all as eager); its
tensors are fp32.

The steps (``Fp32BatchNorm``), side by side in ``wfpass/batchnorm/``:
``matches`` yields every batch norm of the graph (``batchnorm_sites`` of
``match.py``; ``fp32.batchnorm_calls``, a ``BatchNormCall`` each), then, in
Dynamo graphs, the BatchNorms Dynamo runs eagerly (below, ``eager.py``);
``guard`` decides (``fp32.call_problem``) and ``apply`` rewrites
(``fp32.rewrite_call``, with the wrappers and the fp32 move of
``kernels.py``). A batch norm whose tensors a previous run already holds in
fp32 (a recompile, a second ``wfpass.apply``) is taken with nothing to
rewrite: its ``rewritten`` row says so (``idempotent=True``).

Guards, in the order ``fp32.call_problem`` checks them, each a skip record
when it fails: the BatchNorm has a weight, bias or statistics at all; every
tensor resolves to a Parameter/buffer of the model; the input is fp16/bf16
(fp32 input: nothing to do); the tensors are not already fp32 (autocast
with fp32 parameters runs the mixed kernel already); none shares storage
with another tensor; none belongs to a DistributedDataParallel whose
forward is being compiled (its reducer's hooks would be lost with the
dtype: ``ddp_problem``); in a Dynamo graph each is a graph input; nothing
but batch norms reads them in this graph (it would see fp32).

BatchNorms Dynamo runs eagerly. A BatchNorm with ``momentum=None`` in
training mode is not in any graph: Dynamo (torch 2.13.0) graph-breaks on
``float(self.num_batches_tracked)`` and calls that module eagerly. While the
backend compiles a graph of the same frame, the format finds such modules among
the modules the frame can reach (``_torch.dynamo.traced_frame_modules``): matches
of their own kind, ``EagerBatchNorm``, found, guarded and applied by
``wfpass/batchnorm/eager.py``. It moves their half tensors to fp32 (eager's
BatchNorm then runs the mixed kernel with fp32 statistics, as in the graphs)
and adds a forward pre-hook that keeps the format (``bn_eager_pre_hook``, the same check as ``bn_module_fp32``). The
record is ``rewritten`` with ``flavour="eager"``, filed under the module's
tensors (no graph reads them), and says how many training calls the module
ran in half precision before a graph of its frame was compiled (when it is
the first thing its frame runs, that is one). Because of the hook, Dynamo
compiles that module's forward up to the break as a graph of its own where
the module runs inside a compiled call: its match is ``EagerForwardGraph``,
whose row is the module's record, saying so (``forward_graphs``).
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch.fx as fx

from .. import capture as _capture
from .eager import (EagerBatchNorm, EagerForwardGraph, drop_eager_hook, eager_apply, eager_batchnorms,
                               eager_guard, forward_graph_apply, note_item_break)
from .fp32 import BatchNormCall, batchnorm_calls, call_problem, rewrite_call
from ..core.graph import PassContext
from ..pipeline import Format, Match

__all__ = ["Fp32BatchNorm", "BatchNormCall"]


class Fp32BatchNorm(Format):
    """Keep every half-precision BatchNorm's tensors in fp32: the graph's
    batch norms (``BatchNormCall``), then, in Dynamo graphs, the BatchNorms
    Dynamo runs eagerly (``EagerBatchNorm``, ``wfpass/batchnorm/eager.py``)."""

    name, pattern = "fp32_batchnorm", "batchnorm"

    def install(self) -> None:
        # Tells the user which BatchNorm (``momentum=None``) stops a compile.
        _capture.install_item_break_probe(note_item_break)

    def restore(self, module) -> None:
        drop_eager_hook(module)  # the fp32 hook on a BatchNorm Dynamo runs eagerly

    def matches(self, gm: fx.GraphModule, ctx: PassContext) -> Iterator[Match]:
        yield from batchnorm_calls(ctx)
        if ctx.is_dynamo and ctx.region is None:
            # BatchNorms Dynamo runs eagerly belong to the frame, not to a
            # region inside its graph.
            yield from eager_batchnorms(ctx)

    def guard(self, m: Match, ctx: PassContext) -> Optional[str]:
        if isinstance(m, EagerForwardGraph):
            return None  # a row only: the graph is the hooked BatchNorm's own forward
        return eager_guard(m) if isinstance(m, EagerBatchNorm) else call_problem(m, ctx)

    def apply(self, m: Match, ctx: PassContext) -> None:
        if isinstance(m, EagerForwardGraph):
            forward_graph_apply(m, ctx)
        elif isinstance(m, EagerBatchNorm):
            eager_apply(m, ctx)
        else:
            rewrite_call(m, ctx)

