"""Host cost of the cuDNN RNN op's Python body beyond an op call, measured on the
CPU: ATen's cuDNN call is stubbed (it cannot run without a GPU) and everything
else runs as on CUDA (the flat-buffer check, the zero states, the dropout
arguments, the call through the dispatcher). On CUDA the C++ body
(``wfpass/native/rnn/cudnn.cpp``) does the same steps in C++ inside the
op call; the figure is what it saves per call, the cuDNN call aside.

    python benchmarks/gpu/cudnn_body_cost.py [--rounds 9] [--calls 2000]
"""
import argparse
import statistics as st
import time

import torch

import wfpass  # noqa: F401 - defines the ops
from wfpass import native
from wfpass._torch import kernels
from wfpass.rnn.cuda import cudnn  # noqa: F401 - the cuDNN op and its Python body

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--rounds", type=int, default=9)
ap.add_argument("--calls", type=int, default=2000)
args = ap.parse_args()
why = native.load()
if why is not None:
    raise SystemExit(f"needs the C++ kernels (for the op-call baseline): {why}")
torch.set_num_threads(1)
H, I, T, B, L = 64, 32, 4, 4, 2
shapes = [(256, 32), (256, 64), (256,), (256,), (256, 64), (256, 64), (256,), (256,)]
n = sum(torch.Size(s).numel() for s in shapes)
block = torch.zeros(n)
ws, offs, off = [], [], 0
for s in shapes:
    k = torch.Size(s).numel(); ws.append(block[off:off + k].view(s)); offs.append(off); off += k
offs.append(off)
x = torch.randn(T, B, I)
outs = (torch.empty(T, B, H), torch.empty(L, B, H), torch.empty(L, B, H), torch.empty(0, dtype=torch.uint8), torch.empty(0))
kernels.cudnn_rnn = lambda *a: outs  # the stub: what ATen's call returns, at no cost
LSTM = kernels.CUDNN_MODES["LSTM"]
op = torch.ops.wfpass._cudnn_rnn_python.default  # the Python body, as the C++ kernel's fallback calls it
floor = torch.ops.wfpass._cudnn_flat_buffer.default  # an op call with the weights' list and the offsets, in C++
def body(): return op(x, ws, None, None, LSTM, H, 0, L, False, False, offs, 0.0)
def call(): return floor(ws, offs)
def t(f, n=args.calls):
    s = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - s) / n * 1e6
t(body, 200); t(call, 200)
a, b = [], []
for r in range(args.rounds):
    a.append(t(body)); b.append(t(call))
print(f"2-layer nn.LSTM(32, 64), T {T}, batch {B}, inference, zero states, 1 thread, {args.rounds} rounds: "
      f"Python body, kernel stubbed: {st.median(a):.1f} us; a C++ op call with the same weights: {st.median(b):.1f} us; "
      f"difference (median of rounds) {st.median(x - y for x, y in zip(a, b)):.1f} us")
