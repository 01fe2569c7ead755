"""Where an RNN call's time goes: the measurements behind docs/results/rnn_profile.md.

    python benchmarks/rnn/profile_rnn.py kernel   # oneDNN's LSTM layer kernel (T=32): eager, in wformat's graph, called directly
    python benchmarks/rnn/profile_rnn.py floor    # the LM without its LSTM: torch.compile's own per-call cost
    python benchmarks/rnn/profile_rnn.py split    # the LM at T=16 batch 1: forward and forward+backward, eager vs wformat
    python benchmarks/rnn/profile_rnn.py guards   # Dynamo's guard evaluation per call
    python benchmarks/rnn/profile_rnn.py ops      # wfpass::rnn_layer (GRU, RNN) against eager autograd over the same kernel
    python benchmarks/rnn/profile_rnn.py opcost   # one LSTM layer call: oneDNN's kernel, the op (C++ kernel), its Python kernel

One thread; every comparison interleaved in one process (variants in turn,
round after round), medians over rounds.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn as nn

import wfpass
from wfpass.tools.bench import own_code
from wfpass.tools.bench_models import RnnLM


def _per_call(fn, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def interleaved(fns: dict, n: int = 100, rounds: int = 7) -> dict:
    for f in fns.values():
        f(), f()
    res = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            res[k].append(_per_call(f, n))
    return {k: statistics.median(v) for k, v in res.items()}


def _lm(T=16, B=1):
    torch.manual_seed(0)
    base = RnnLM()
    wf = torch.compile(own_code(copy.deepcopy(base)), backend="wformat")
    return base, wf, torch.randint(0, 500, (T, B))


def kernel() -> None:
    from torch.profiler import profile

    # 32 rows: an inference call of at most 16 rows (T x batch) runs on
    # wfpass's C++ loop, not on oneDNN's layer, and would have no such event.
    base, wf, tok = _lm(T=32)
    with torch.no_grad():
        wf(tok)
        x = base.emb(tok)
    ws = [p.detach() for p in base.rnn.parameters()]
    H, zero = 128, torch.zeros(1, 1, 128)
    op = torch.ops.aten.mkldnn_rnn_layer.default

    def direct():
        y = op(x, *ws[:4], zero, zero, False, [], 2, H, 1, True, False, False, False)[0]
        op(y, *ws[4:], zero, zero, False, [], 2, H, 1, True, False, False, False)

    fns = {"eager nn.LSTM": lambda: base(tok), "wformat graph": lambda: wf(tok), "kernel called directly": direct}
    res = {k: [] for k in fns}
    with torch.no_grad():
        for _ in range(5):
            for k, f in fns.items():
                for _ in range(5):
                    f()
                with profile() as p:
                    for _ in range(30):
                        f()
                e = next(e for e in p.key_averages() if e.key == "aten::mkldnn_rnn_layer")
                res[k].append(e.self_cpu_time_total / e.count)
    for k, v in res.items():
        print(f"{k:24s} aten::mkldnn_rnn_layer self time per call {statistics.median(v):7.1f} us")


def floor() -> None:
    class EmbLinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.out = nn.Embedding(500, 128), nn.Linear(128, 500)

        def forward(self, t):
            return self.out(self.emb(t))

    base = EmbLinear()
    tok = torch.randint(0, 500, (16, 1))
    ms = {"eager": base, "inductor": torch.compile(own_code(copy.deepcopy(base))),
          "wformat": torch.compile(own_code(copy.deepcopy(base)), backend="wformat")}
    with torch.no_grad():
        inf = interleaved({k: (lambda m=m: m(tok)) for k, m in ms.items()}, 300)
    tr = interleaved({k: (lambda m=m: m(tok).sum().backward()) for k, m in ms.items()}, 200)
    for k in ms:
        print(f"{k:10s} inference {inf[k]:7.1f} us   training step {tr[k]:7.1f} us")


def split() -> None:
    base, wf, tok = _lm()
    res = {}
    for k, m in (("eager", base), ("wformat", wf)):
        m(tok).sum().backward()
    fns = {"eager forward": lambda: base(tok), "wformat forward": lambda: wf(tok),
           "eager forward+backward": lambda: base(tok).sum().backward(),
           "wformat forward+backward": lambda: wf(tok).sum().backward()}
    res = interleaved(fns, 100, 5)
    for k, v in res.items():
        print(f"{k:26s} {v:8.1f} us")


def guards() -> None:
    base, wf, _ = _lm()
    tok = torch.randint(0, 500, (1, 1))
    with torch.no_grad():
        wf(tok)
        a = interleaved({"wformat": lambda: wf(tok)}, 200, 9)["wformat"]
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            b = interleaved({"wformat": lambda: wf(tok)}, 200, 9)["wformat"]
    print(f"T=1 batch 1 inference: {a:.1f} us with guards, {b:.1f} us without: guards {a - b:.1f} us per call")


def opcost() -> None:
    """What the layer op adds to oneDNN's LSTM layer kernel per call
    (inference, T=16, batch 1, 128 -> 128): the ATen kernel called
    directly, ``wfpass::lstm_layer_fw`` (its C++ kernel where built), and
    the op's Python kernel called as a function."""
    from wfpass import native
    from wfpass.rnn.cpu import lstm_layer as ll

    native.load()
    T, B, I, H = 16, 1, 128, 128
    x = torch.randn(T, B, I)
    w = (torch.randn(4 * H, I), torch.randn(4 * H, H), torch.randn(4 * H), torch.randn(4 * H))
    h = torch.zeros(1, B, H)
    fns = {
        "oneDNN kernel": lambda: torch.ops.aten.mkldnn_rnn_layer.default(x, *w, h, h, False, [], 2, H, 1, True,
                                                                          False, False, False),
        "the op": lambda: torch.ops.wfpass.lstm_layer_fw.default(x, *w, None, None, False, H, True, False),
        "Python kernel": lambda: ll._lstm_layer(x, *w, None, None, False, H, True, False),
    }
    with torch.no_grad():
        res = interleaved(fns, 300, 7)
    print(f"one LSTM layer call, T=16 batch 1, inference; the op runs {native.status()}:")
    for k, v in res.items():
        print(f"  {k:14s} {v:7.1f} us")


def ops() -> None:
    import wfpass.rnn.cpu.native_layer  # noqa: F401  (registers wfpass::rnn_layer)

    for mode, cls in (("GRU", nn.GRU), ("RNN_TANH", nn.RNN)):
        for T, B, I in ((32, 4, 64), (128, 4, 64), (512, 4, 64), (64, 8, 128)):
            torch.manual_seed(0)
            m = cls(I, 128)
            ps = list(m.parameters())
            x = torch.randn(T, B, I, requires_grad=True)
            R = torch.randn(T, B, 128)

            def eager_train():
                (m(x)[0] * R).sum().backward()

            def op_train():
                (torch.ops.wfpass.rnn_layer(x, *ps, None, mode, False)[0] * R).sum().backward()

            def eager_infer():
                with torch.no_grad():
                    m(x)

            def op_infer():
                with torch.no_grad():
                    torch.ops.wfpass.rnn_layer(x, *ps, None, mode, False)

            n = max(3, int(2e4 / (T * B)))
            r = interleaved({"et": eager_train, "ot": op_train, "ei": eager_infer, "oi": op_infer}, n, 5)
            print(f"{mode:8s} T={T:3d} batch {B}: training step eager {r['et'] / 1e3:6.2f} ms, op {r['ot'] / 1e3:6.2f} ms "
                  f"({r['et'] / r['ot']:.2f}x faster); inference eager {r['ei'] / 1e3:6.2f} ms, op {r['oi'] / 1e3:6.2f} ms "
                  f"({r['ei'] / r['oi']:.2f}x)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["kernel", "floor", "split", "guards", "ops", "opcost"])
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 64
    globals()[a.what]()


if __name__ == "__main__":
    main()
