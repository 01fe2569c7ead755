"""A bidirectional packed layer's two directions at once. One layer (input
and hidden 128, batch 16, T = 100, lengths 20-100), forward without grad:
``wfpass::packed_layer_fw`` for the forward and the reverse direction one
after the other; the two calls made from two Python threads at the same
time (torch at 1 thread each); and ``wfpass::packed_bilayer_fw``, the op
wformat runs (both directions in one call, one per OpenMP thread), with
torch at 1 and at 2 threads.

    python benchmarks/rnn/profile_packed_threads.py [--calls 20]

Prints ms per pair of directions, each way.
"""
from __future__ import annotations

import argparse
import threading
import time

import torch
from torch.nn.utils.rnn import pack_padded_sequence

from wfpass import native
from wfpass.rnn.cpu import varlen_layer  # noqa: F401 - registers the op


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    native.load()  # the C++ kernels, where they build, before the first call
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    B, T = 16, 100
    lengths = torch.randint(20, T + 1, (B,))
    lengths[0] = T
    packed = pack_padded_sequence(torch.randn(T, B, 128), lengths.sort(descending=True).values)
    w = [t.detach() for t in torch.nn.LSTM(128, 128, bidirectional=True)._flat_weights]

    def one(d: int, n: int) -> None:
        for _ in range(n):
            torch.ops.wfpass.packed_layer_fw(packed.data, packed.batch_sizes, *w[4 * d:4 * d + 4], None, None, None,
                                             "LSTM", d == 1, False)

    one(0, 3)
    one(1, 3)
    t = time.perf_counter()
    one(0, args.calls)
    one(1, args.calls)
    seq = (time.perf_counter() - t) / args.calls * 1e3
    threads = [threading.Thread(target=one, args=(d, args.calls)) for d in (0, 1)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    par = (time.perf_counter() - t) / args.calls * 1e3
    pair = {}
    for n in (1, 2):
        torch.set_num_threads(n)
        for k in range(args.calls + 3):
            if k == 3:  # after 3 calls to warm up
                t = time.perf_counter()
            torch.ops.wfpass.packed_bilayer_fw(packed.data, packed.batch_sizes, w, None, None, "LSTM", True, False,
                                                 False)
        pair[n] = (time.perf_counter() - t) / args.calls * 1e3
    print(f"{native.status()}; fast loop: {native.fast_loop()}; both directions at once: "
          f"{native.parallel_directions()}")
    print(f"one after the other: {seq:.2f} ms per pair; two threads at once: {par:.2f} ms per pair")
    print(f"packed_bilayer_fw: {pair[1]:.2f} ms at 1 torch thread, {pair[2]:.2f} ms at 2")


if __name__ == "__main__":
    main()
