"""Record where cuDNN puts each RNN weight in its flat weight buffer, for
the layouts wfpass must know without a GPU (a model traced on fake CUDA
tensors). On a GPU:

    python benchmarks/gpu/probe_cudnn_layout.py --out tests/data/cudnn_layouts.json

Each entry: the module's arguments, the dtype, each weight's shape, the
element offset cuDNN gives it (``torch._cudnn_rnn_flatten_weight``, as
wfpass asks on a GPU) and the buffer's size. ``tests/rnn/test_cudnn.py``
checks wfpass's no-GPU layout against every entry.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn as nn

from wfpass._torch import kernels

MODES = {"LSTM": nn.LSTM, "GRU": nn.GRU, "RNN_TANH": nn.RNN, "RNN_RELU": nn.RNN}


def configs():
    for mode, layers, bi, bias, (I, H) in itertools.product(MODES, (1, 2, 3), (False, True), (True, False),
                                                            ((8, 16), (5, 7))):
        kw = dict(num_layers=layers, bidirectional=bi, bias=bias)
        if mode == "RNN_RELU":
            kw["nonlinearity"] = "relu"
        yield mode, I, H, dict(kw)
        if mode == "LSTM":
            yield mode, I, H, dict(kw, proj_size=3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="cudnn_layouts.json")
    a = ap.parse_args()
    entries = []
    for mode, I, H, kw in configs():
        for dtype in (torch.float32, torch.float16):
            m = MODES[mode](I, H, device="cuda", dtype=dtype, **kw)
            ws = list(m._flat_weights)
            D = 2 if m.bidirectional else 1
            per = len(ws) // (m.num_layers * D)
            got = kernels.cudnn_flat_layout(ws, per, I, mode, H, m.proj_size, m.num_layers, False, m.bidirectional)
            entries.append(dict(mode=mode, input_size=I, hidden_size=H, dtype=str(dtype).split(".")[-1],
                                kwargs={k: v for k, v in kw.items() if k != "nonlinearity"},
                                shapes=[list(w.shape) for w in ws],
                                offsets=None if got is None else list(got[0]),
                                numel=None if got is None else int(got[1])))
    doc = dict(torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
               gpu=torch.cuda.get_device_name(0), entries=entries)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=0)
    print(f"{len(entries)} layouts written to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
