"""The RNN calls of ``wfpass.apply`` graphs, which run eagerly: the module's
own checks, the layout check, then the path for this call's length."""
from __future__ import annotations

import weakref

import torch

from .auto import measure_threshold
from .paths import fused_path, unfused_path
from .spec import CLASS_NAMES, RnnSpec, zero_state

__all__ = ["RnnModuleCall", "CellLoopCall"]


class RnnModuleCall:
    """``nn.LSTM/GRU/RNN.forward`` for ``wfpass.apply`` graphs, which run
    eagerly: the module's own argument checks (their errors name the RNN),
    unbatched input, zero initial state, the layout check, then the path for
    this call's T, under eager autograd."""

    __module__ = __name__

    def __init__(self, spec: RnnSpec, site, module):
        self.spec, self.site = spec, site
        self._module = weakref.ref(module)
        self.__name__ = self.__qualname__ = "rnn_module_call"

    def __call__(self, input, hx, *weights):
        spec, site = self.spec, self.site
        mod = self._module()
        if mod is None:
            raise RuntimeError(f"wfpass: {spec.name} was deleted")
        rec = site.record
        if isinstance(input, torch.nn.utils.rnn.PackedSequence):
            rec.bump("packed_fallback_calls")
            return type(mod).forward(mod, input, hx)
        lstm = spec.mode == "LSTM"
        if input.dim() not in (2, 3):
            raise ValueError(f"{spec.name}: {CLASS_NAMES[spec.mode]}: Expected input to be 2D or 3D, got {input.dim()}D instead")
        batched = input.dim() == 3
        batch_dim = 0 if spec.batch_first else 1
        if not batched:
            input = input.unsqueeze(batch_dim)
            if hx is not None:
                parts = hx if lstm else (hx,)
                if any(h.dim() != 2 for h in parts):
                    raise RuntimeError(f"{spec.name}: for unbatched 2-D input, the hidden state should also be 2-D, got "
                                       f"{', '.join(f'{h.dim()}-D' for h in parts)}")
                hx = tuple(h.unsqueeze(1) for h in parts) if lstm else hx.unsqueeze(1)
        if hx is None:
            zeros = zero_state(spec, input)
            hx = tuple(zeros) if lstm else zeros[0]
        try:
            mod.check_forward_args(input, hx, None)
        except (RuntimeError, ValueError, TypeError) as e:
            raise type(e)(f"{spec.name}: {e}") from None
        fs = site.find(weights)
        if fs is None:
            rec.bump("unfused_layout_calls")
        else:
            rec = site.record_of(fs)
        hx_list = list(hx) if lstm else [hx]
        train = mod.training
        ws, has_b = weights, spec.has_biases
        need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (input, *hx_list, *weights))
        n = measure_threshold(spec, rec, input, hx_list, ws, has_b, train, spec.dropout, need_grad)
        if input.shape[1 if spec.batch_first else 0] <= n:
            rec.bump("unfused_calls")
            outs = unfused_path(spec, input, hx_list, ws, has_b, train, spec.dropout)
        else:
            rec.bump("fused_calls")
            outs = fused_path(spec, input, hx_list, ws, has_b, train, spec.dropout)
        out, hy = outs[0], outs[1]
        cy = outs[2] if lstm else None
        if not batched:
            out, hy = out.squeeze(batch_dim), hy.squeeze(1)
            cy = cy.squeeze(1) if lstm else None
        return (out, (hy, cy)) if lstm else (out, hy)


class CellLoopCall:
    """A folded cell loop in a ``wfpass.apply`` graph, which runs eagerly:
    ``(stacked step inputs, initial h per layer, initial c per layer, *weights)
    -> (out, h_n[, c_n])``. Does what each ``nn.*Cell.forward`` did (unbatched
    1-D steps, a zero state where none was given), then one RNN call: the
    fused kernel above ``seq_threshold`` steps, the unfused path at or below."""

    __module__ = __name__

    def __init__(self, site):
        self.site, self.spec = site, site.spec
        self.__name__ = self.__qualname__ = "cell_loop"

    def __call__(self, X, h0s, c0s, *weights):
        spec, site = self.spec, self.site
        lstm = spec.mode == "LSTM"
        if X.dim() not in (2, 3):
            raise ValueError(f"wfpass: {spec.name}: each step's input must be 1-D or 2-D, got {X.dim() - 1}-D")
        batched = X.dim() == 3
        if not batched:
            X = X.unsqueeze(1)
        B = X.shape[1]

        def state(parts):
            return torch.stack([X.new_zeros(B, spec.hidden_size) if p is None else (p if batched else p.unsqueeze(0))
                                for p in parts], 0)

        hx = [state(h0s), state(c0s)] if lstm else [state(h0s)]
        fs = site.find(weights)
        rec = site.record if fs is None else site.record_of(fs)
        if fs is None:
            rec.bump("unfused_layout_calls")
        need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (X, *hx, *weights))
        n = measure_threshold(spec, rec, X, hx, weights, spec.has_biases, False, 0.0, need_grad)
        if X.shape[0] <= n:
            rec.bump("unfused_calls")
            outs = unfused_path(spec, X, hx, weights, spec.has_biases, False, 0.0)
        else:
            rec.bump("fused_calls")
            outs = fused_path(spec, X, hx, weights, spec.has_biases, False, 0.0)
        outs = list(outs)
        if not batched:
            outs = [outs[0].squeeze(1)] + [o.squeeze(1) for o in outs[1:]]
        return tuple(outs)
