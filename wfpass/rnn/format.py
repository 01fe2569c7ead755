"""RNN weight format: one flat buffer, and the RNN call lowered to ATen.

Before (Dynamo flavour; ``torch.compile`` normally graph-breaks here, see
``wfpass.capture.install_rnn_capture``)::

    h0 = zeros(2, B, 8); c0 = zeros(2, B, 8)
    lstm = torch.lstm(x, (h0, c0), [w_ih_l0, w_hh_l0, b_ih_l0, b_hh_l0, ...], True, 2, 0.0, True, False, False)
    out = lstm[0]; h_n = lstm[1]; c_n = lstm[2]

After (the parameters now views of one flat block)::

    lstm = rnn_mkldnn(x, [h0, c0], w_ih_l0, w_hh_l0, ...)   # rnn/paths.RnnForward, path chosen from T
    out = lstm[0]; h_n = lstm[1]; c_n = lstm[2]               # users unchanged

AOTAutograd traces ``rnn_mkldnn`` into ``aten.mkldnn_rnn_layer`` per layer
(forward) and ``mkldnn_rnn_layer_backward`` (backward): one op per layer,
whatever the length T; at T <= ``seq_threshold`` into the unfused per-step
ops (``rnn_loop``). Everything the backward needs is a traced value.

``symbolic_trace`` graphs: ``call_module`` of an ``nn.LSTM/GRU/RNN`` becomes
``rnn_module_call(x, hx, *weights)`` over ``get_attr`` weights, which picks the
path per call.

The steps, side by side in ``wfpass/rnn/``: matcher ``match.py``, guards
and the flat block's layout ``guards.py``, rewrite ``rewrite.py``, the
kernels' paths ``paths.py`` (``auto.py``; the kernels in ``cpu/`` and
``cuda/``), variable-length batches ``packed/``, the calls of
``wfpass.apply`` graphs ``eager.py``.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch.fx as fx

from .. import capture as _capture
from ..core.graph import PassContext, mutated_state
from ..pipeline import Format
from .varlen import sequence as _packed
from .cpu import lstm_prepack as _lstm_prepack
from .capture import name_errors, note_seen, unname_errors
from .guards import call_problem
from .match import RNN_FUNCTIONS, RnnCall, RunState, match_call
from .plan import VARLEN_SUMMARY, plan_call
from .rewrite import planned_kernels, rewrite_call, trains

__all__ = ["FuseRnn", "RNN_FUNCTIONS"]


class FuseRnn(Format):
    """The RNN format: match every RNN call, guard it, rewrite it."""

    name, pattern = "fuse_rnn", "rnn"

    def install(self) -> None:
        # Let Dynamo put RNN modules into the graph for wformat backends only.
        _capture.install_rnn_capture(name_errors, note_seen)
        # ... and pack_padded_sequence / pad_packed_sequence around them.
        _packed.install()

    def restore(self, module) -> None:
        unname_errors(module)  # the errors Dynamo's wrapping gave the RNN name it no more
        # Copies in oneDNN's layout are derived state: the next call makes them again.
        for t in module.parameters(recurse=False):
            _lstm_prepack.drop(t)

    def matches(self, gm: fx.GraphModule, ctx: PassContext) -> Iterator[RnnCall]:
        # What this run's calls share: the weight sets already grouped (the
        # same RNN called twice is one group), the weights written in place.
        run = RunState(claimed={}, written=mutated_state(gm))
        for node in list(gm.graph.nodes):
            s = match_call(ctx, node)
            if s is not None:
                s.params, s.run = [r.name for r in s.weights], run
                yield s

    def guard(self, s: RnnCall, ctx: PassContext) -> Optional[str]:
        why = call_problem(s, ctx)
        if why is not None:
            return f"{s.name or s.node.name}: {why}"
        spec = s.spec
        s.plan = f"{spec.name}: {spec.summary()}"
        if s.batch_sizes is not None:
            s.kernel_plan = plan_call(spec, s.weights[0].tensor, None, spec.threshold, trains(s), varlen=True,
                                      cast=s.cast)  # the rewrite takes this one
            s.plan += "; a variable-length batch (pack_padded_sequence): " + VARLEN_SUMMARY[s.kernel_plan.path]
        if ctx.config.dry_run:  # a real run's row names each kernel with its counter instead (note_kernel)
            s.plan += planned_kernels(ctx, s, packs=ctx.config.prepack.mode != "off")
        s.detail = dict(threshold=spec.threshold, mode=spec.mode, layers=spec.num_layers,
                        bidirectional=spec.bidirectional, block_elements=spec.numel)
        return None

    def apply(self, s: RnnCall, ctx: PassContext) -> None:
        rewrite_call(ctx, s)
