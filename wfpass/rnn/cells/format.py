"""Fold Python loops of RNN cells into one RNN call.

Code that steps an ``nn.LSTMCell`` / ``nn.GRUCell`` / ``nn.RNNCell`` in a
Python loop reaches the backend unrolled: T cell calls sharing one set of
weights, each step's state threaded into the next. Compiled as is, every
step is a separate small GEMM and the compile time grows with T. The cell's
weights are exactly one layer of the RNN format's flat block, so the loop is
one ``torch.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` call over the
stacked step inputs, which ``fuse_rnn`` (the next pass) lowers and whose
weights it moves into one flat block.

Before (Dynamo graph of ``for t in range(3): h, c = cell(x[t], (h, c)); outs.append(h)``)::

    x0 = x[0];  s0 = lstm_cell(x0, (h, c), w_ih, w_hh, b_ih, b_hh);  h1 = s0[0];  c1 = s0[1]
    x1 = x[1];  s1 = lstm_cell(x1, (h1, c1), w_ih, w_hh, b_ih, b_hh);  h2 = s1[0];  c2 = s1[1]
    x2 = x[2];  s2 = lstm_cell(x2, (h2, c2), w_ih, w_hh, b_ih, b_hh);  h3 = s2[0]
    y = stack([h1, h2, h3])

After::

    r = lstm(x, (h.unsqueeze(0), c.unsqueeze(0)), [w_ih, w_hh, b_ih, b_hh], True, 1, 0.0, True, False, False)
    out = r[0];  h_n = r[1]
    y = out                     # stack of every step's h, in order: the output itself
    h3 = h_n[0]                 # (any other step's h: out[t]; the last c: c_n[layer])

Stacked cells in one loop (``h1 = c1(x[t], h1); h2 = c2(h1, h2)``) become one
multi-layer call when each layer reads only the layer below at the same step.

A chain is folded only when it is provably the same computation; otherwise
it is left exactly as it was, with a record saying why:

* a step input depends on an earlier step's state (attention decoders,
  feedback, autoregressive loops): ``fuse_rnn`` could not run the steps at once;
* the state passes through other operations between steps (masking, resets);
* consecutive steps use different weights;
* an intermediate cell state ``c`` is read outside the loop (the fused call
  returns only the last one);
* the loop has at most ``seq_threshold`` steps (the RNN format's unfused
  region: the cells are that path already);
* ``fuse_rnn`` would not take the RNN call (its own guards: dtype, autocast,
  weights that are not parameters...).

``wfpass.apply`` graphs (``symbolic_trace``) hold ``call_module`` cells with
no shapes: a folded loop there calls ``CellLoopCall``, which does what the
cells' ``forward`` did (unbatched steps, zero state) and picks the path per call.

The steps, side by side in ``wfpass/rnn/cells/``: matcher ``match.py``,
guards ``guards.py``, rewrite ``rewrite.py``.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Tuple

import torch.fx as fx

from ...core.graph import PassContext
from ...pipeline import Format, Match
from .guards import refusal, rnn_format_refusal
from .match import Chain, chains_in, loop_label, loop_params
from .rewrite import module_group, rewrite_loop

__all__ = ["FoldCells"]


class CellLoop(Match):
    """A stack of chains (one chain: a one-layer loop) to fold into one RNN call."""

    def __init__(self, layers: List[Chain], claimed: Dict[Tuple[int, ...], Any], checked: bool = False):
        T = len(layers[0].cells)
        self.label = loop_label(layers)
        super().__init__(loop_params(layers), f"{self.label}: {T} cell steps -> one RNN call", steps=T)
        self.layers = layers
        self.claimed = claimed  # symbolic_trace: ids of a layer stack's weights -> its group, for this run
        self.checked = checked  # the matcher already found no refusal for this stack


class FoldCells(Format):
    """Fold every foldable cell loop into one RNN call (the next format,
    ``fuse_rnn``, lowers it)."""

    name, pattern = "fold_cells", "rnn"

    def matches(self, gm: fx.GraphModule, ctx: PassContext) -> Iterator[CellLoop]:
        claimed: Dict[Tuple[int, ...], Any] = {}
        for ch in chains_in(ctx, gm):
            if ch.below is not None:
                continue  # matched with the layer below
            layers = [ch]
            while layers[-1].above is not None:
                layers.append(layers[-1].above)
            checked = False
            if len(layers) > 1 and not any(c.problem for l in layers for c in l.cells):
                if refusal(ctx, layers):
                    # Not foldable as one stack: each layer by itself, bottom first.
                    for l in layers:
                        l.below = l.above = None
                    for l in layers:
                        yield CellLoop([l], claimed)
                    continue
                checked = True  # the guard need not ask again
            yield CellLoop(layers, claimed, checked)

    def guard(self, loop: CellLoop, ctx: PassContext):
        why = None if loop.checked else refusal(ctx, loop.layers)
        if why is not None:
            return f"{loop.label}: {why}"
        if ctx.is_dynamo:
            why = rnn_format_refusal(ctx, loop.layers)
            if why is not None:
                return f"{loop.label}: the RNN format would not take it ({why})"
        return None

    def apply(self, loop: CellLoop, ctx: PassContext) -> None:
        if ctx.is_dynamo:
            rewrite_loop(ctx, loop.layers, loop.label)
        else:  # symbolic_trace graph: an eager call target, grouped here
            rewrite_loop(ctx, loop.layers, loop.label, module_group(ctx, loop.layers, loop.label, loop.claimed))
