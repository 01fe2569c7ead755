"""RSS of a packed RNN's training over batches of varying size and length
(docs/results/rnn_varlen.md): a 2-layer bidirectional LSTM
between ``pack_padded_sequence`` / ``pad_packed_sequence`` and a Linear,
each call a batch of B in 1..32 sequences (unsorted), T in 5..80 steps, the
longest of length T (seeded: every backend sees the same batches), then
``.sum().backward()`` and an SGD step; one torch thread.

    python benchmarks/rnn/profile_packed_memory.py --backend wformat [--calls 1000] [--input 64 --hidden 128] [--trim]

``--backend``: ``eager`` (no torch.compile), ``inductor`` or ``wformat``.
At each mark (after ``gc.collect()``) it reads the process's RSS
(``/proc/self/statm``) and glibc's bytes in use and free in its heap
(``mallinfo2``, where glibc has it); with ``--trim`` also the RSS after
``malloc_trim(0)``, which hands glibc's free heap memory back to the
system: what is left is what the process holds (caches, kernels, live
tensors). Prints one line per mark (with the seconds since the first
call, wall and CPU, compiling included) and a last line ``MARKS {json}``
(``tests/rnn/test_varlen_memory.py`` reads it).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import time

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence


class Model(nn.Module):
    def __init__(self, inp: int, hidden: int) -> None:
        super().__init__()
        self.rnn = nn.LSTM(inp, hidden, num_layers=2, bidirectional=True)
        self.out = nn.Linear(2 * hidden, 8)

    def forward(self, x, lengths):
        y, _ = self.rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))
        return self.out(pad_packed_sequence(y)[0])


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("eager", "inductor", "wformat"), default="wformat")
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--input", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--marks", default="50,100,200,400,600,800,1000",
                    help="calls after which to measure (comma list; the last call is always one)")
    ap.add_argument("--trim", action="store_true", help="also the RSS after malloc_trim(0)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if a.backend == "wformat":
        import wfpass  # noqa: F401 - registers the backend
    libc = _libc()
    torch.manual_seed(0)
    model = Model(a.input, a.hidden)
    f = model if a.backend == "eager" else torch.compile(model, backend=a.backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    marks = sorted({int(m) for m in a.marks.split(",") if int(m) <= a.calls} | {a.calls})
    out = {}
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(1, a.calls + 1):
        B = int(torch.randint(1, 33, (1,), generator=g))
        T = int(torch.randint(5, 81, (1,), generator=g))
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        lengths[0] = T
        f(torch.randn(T, B, a.input, generator=g), lengths).sum().backward()
        opt.step()
        opt.zero_grad()
        if i in marks:
            gc.collect()
            row = {"rss": round(_rss_mb(), 1)}
            if libc is not None:
                m = libc.mallinfo2()
                row.update(in_use=round(m.uordblks / 2**20, 1), free=round(m.fordblks / 2**20, 1))
                if a.trim:
                    libc.malloc_trim(0)
                    row["rss_trimmed"] = round(_rss_mb(), 1)
            out[i] = row
            print(f"{a.backend} call {i}: " + ", ".join(f"{k} {v} MB" for k, v in row.items())
                  + f" ({time.perf_counter() - t0:.1f} s, {time.process_time() - c0:.1f} s of CPU)", flush=True)
    print("MARKS " + json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
