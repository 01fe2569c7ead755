"""What Inductor's size asserts cost a compiled RNN call on the CPU.

Inductor's generated wrapper checks the size and strides of every graph
input and of every output of every op it calls outside its own kernels
(``assert_size_stride``): about 50 checks in a 1-layer LSTM's training step
under wformat. ``torch.compile(..., backend="wformat",
options={"size_asserts": False})`` turns them off for that model. This
times, for small RNNs (input 32, hidden 64, T 4, batch 4), an inference call
and a training step (forward, ``sum().backward()``, SGD step, zero_grad)
under eager, ``torch.compile``'s default, wformat and wformat without size
asserts: every variant its own deep copy and its own forward code object,
9 interleaved rounds of ~0.15 s, medians, and the median of the per-round
ratios wformat / wformat without asserts.

    python benchmarks/overall/size_asserts.py --threads 1 --cases lstm1,lstm2,gru1
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import wfpass  # noqa: F401  (registers the "wformat" backend)
from wfpass.tools.bench import own_code

CASES = {
    "lstm1": lambda: torch.nn.LSTM(32, 64, num_layers=1),
    "lstm2": lambda: torch.nn.LSTM(32, 64, num_layers=2),
    "lstm2bi": lambda: torch.nn.LSTM(32, 64, num_layers=2, bidirectional=True),
    "gru1": lambda: torch.nn.GRU(32, 64, num_layers=1),
}
VARIANTS = {"eager": (None, None), "default": ("inductor", None), "wformat": ("wformat", None),
            "wformat, no size asserts": ("wformat", {"size_asserts": False})}


class _Net(torch.nn.Module):
    """The RNN's output alone (its states dropped)."""

    def __init__(self, rnn: torch.nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        return self.rnn(x)[0]


def _variant(base: torch.nn.Module, backend, options):
    # A forward code object of its own: Dynamo's cache is per code object.
    m = own_code(_Net(copy.deepcopy(base)))
    fn = m
    if backend is not None:
        fn = torch.compile(m, backend=backend, **({"options": options} if options else {}))
    return fn, torch.optim.SGD(m.parameters(), lr=1e-6)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cases", default="lstm1,lstm2,gru1")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--sample-s", type=float, default=0.15)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} thread(s), {a.rounds} interleaved rounds; us per call or step, "
          "medians; x: wformat's time / wformat's without size asserts, the median of per-round ratios\n")
    print("| case | step | " + " | ".join(VARIANTS) + " | x |")
    print("|---|---|" + "---|" * (len(VARIANTS) + 1))
    x = torch.randn(4, 4, 32)
    for case in a.cases.split(","):
        torch.manual_seed(0)
        base = CASES[case]()
        vs = {name: _variant(base, *spec) for name, spec in VARIANTS.items()}

        def infer(name):
            with torch.no_grad():
                vs[name][0](x)

        def train(name):
            fn, opt = vs[name]
            fn(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for step in (infer, train):
            for name in vs:
                for _ in range(5):
                    step(name)
            res: dict = {name: [] for name in vs}
            for r in range(a.rounds):
                for name in (list(vs) if r % 2 == 0 else list(vs)[::-1]):
                    n, t0 = 0, time.perf_counter()
                    while time.perf_counter() - t0 < a.sample_s:
                        step(name)
                        n += 1
                    res[name].append((time.perf_counter() - t0) / n * 1e6)
            ratio = statistics.median(w / v for w, v in zip(res["wformat"], res["wformat, no size asserts"]))
            cells = " | ".join(f"{statistics.median(res[name]):.0f}" for name in vs)
            print(f"| {case} | {'inference' if step is infer else 'training step'} | {cells} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
