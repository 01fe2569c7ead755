"""The GPU tables: RNN models, a bf16 CRNN with BatchNorm and a bf16 decoder
under eager PyTorch, ``torch.compile``'s default, Inductor with
``allow_rnn=True``, wformat with RNNs as one cuDNN call
(``rnn={"cuda": "cudnn"}``) and the same with CUDA graphs.

    python benchmarks/bench_gpu.py --check                       # any machine with a CUDA build of torch
    python benchmarks/bench_gpu.py --out docs/gpu_results.md     # on a GPU

``--check`` needs no GPU: every model of the tables is built on fake CUDA
tensors (``FakeTensorMode``, ``device="cuda"``) and compiled with wformat,
and the graph that reaches the inner compiler is checked: one graph, each
RNN one cuDNN call, the expected rewrites in the report. Run it before
measuring on a GPU, so the GPU's time goes to measuring.

Without ``--check`` it first runs the tests that need a GPU
(``tests/test_cudnn.py``), then measures, on the GPU, each variant in its own copy
of the model with a forward of its own (Dynamo's cache is per code
object), rounds interleaved, medians; x faster = baseline time / wformat
time. Written for torch 2.11 (the GPU machine's); not yet run on a GPU.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import types
from typing import Callable, Dict, List

import torch
import torch.nn as nn

import wfpass
from wfpass.tools.bench_models import CellLoop, Decoder, RnnLM, SpeechEncoder, built_in_dtype

CUDNN = {"cuda": "cudnn"}


class CRNN(nn.Module):
    """Conv-BatchNorm blocks, then a bidirectional LSTM over the width:
    text recognition's shape. Input [batch, 1, 32, width]."""

    def __init__(self, width: int = 64, hidden: int = 128):
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d((2, 1)))
        self.rnn = nn.LSTM(width * 8, hidden, bidirectional=True)
        self.out = nn.Linear(2 * hidden, 40)

    def forward(self, x):
        f = self.cnn(x)  # [B, C, 8, W/2]
        f = f.flatten(1, 2).permute(2, 0, 1)  # [W/2, B, C*8]
        return self.out(self.rnn(f)[0])


def _inputs(name: str, T: int, B: int, device, dtype=torch.float32):
    if name == "LSTM LM":
        return torch.randint(0, 500, (T, B), device=device)
    if name == "speech encoder":
        return torch.randn(B, 80, T, device=device)
    if name == "LSTMCell loop":
        return torch.randn(T, B, 128, device=device)
    if name == "CRNN bf16":
        return torch.randn(B, 1, 32, 2 * T, device=device, dtype=torch.bfloat16)
    if name == "decoder bf16":
        return torch.randn(B, T, 512, device=device, dtype=torch.bfloat16)
    raise ValueError(name)


def _model(name: str) -> nn.Module:
    if name == "LSTM LM":
        return RnnLM(vocab=500, hidden=256, layers=2)
    if name == "speech encoder":
        return SpeechEncoder()
    if name == "LSTMCell loop":
        return nn.Sequential(CellLoop(128, 256), nn.Linear(256, 128))
    if name == "CRNN bf16":
        return built_in_dtype(torch.bfloat16, CRNN)
    if name == "decoder bf16":
        return built_in_dtype(torch.bfloat16, lambda: Decoder(d=512, layers=2, heads=8, kv_heads=2, ffn=1376))
    raise ValueError(name)


#: What the check expects in wformat's report for each model: patterns rewritten.
EXPECT = {
    "LSTM LM": {"rnn"},
    "speech encoder": {"rnn"},
    "LSTMCell loop": {"rnn"},
    "CRNN bf16": {"rnn", "batchnorm"},
    "decoder bf16": {"linear"},
}
RNN_MODELS = ("LSTM LM", "speech encoder", "LSTMCell loop", "CRNN bf16")


# -- --check: the graphs, on fake CUDA ------------------------------------------


def check() -> int:
    """Compile every model on fake CUDA (training and inference) and check
    the graph the inner compiler receives. Returns the number of failures."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from wfpass.rnn.paths import RnnForward

    if torch.version.cuda is None:
        print("--check needs a CUDA build of torch (a CPU build refuses CUDA tensors, fake or not)")
        return 1
    failures = 0
    for name in EXPECT:
        for train in (False, True):
            torch._dynamo.reset()
            graphs: List[torch.fx.GraphModule] = []

            def keep(gm, example_inputs, graphs=graphs):
                graphs.append(gm)
                return gm.forward

            problem = ""
            with FakeTensorMode(shape_env=ShapeEnv()), torch.device("cuda"):
                model = _model(name).train(train)
                x = _inputs(name, 16, 4, "cuda")
                try:
                    with torch.set_grad_enabled(train):
                        torch.compile(model, backend=wfpass.backend(inner=keep, rnn=CUDNN))(x)
                except Exception as e:  # noqa: BLE001
                    problem = f"compile failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rnn_paths = [n.target.path for g in graphs for n in g.graph.nodes
                         if n.op == "call_function" and isinstance(n.target, RnnForward)]
            rewritten = {r.pattern for r in wfpass.report(model).rewritten}
            if not problem:
                if len(graphs) != 1:
                    problem = f"{len(graphs)} graphs (a graph break)"
                elif name in RNN_MODELS and rnn_paths != ["cudnn"]:
                    problem = f"RNN calls in the graph: {rnn_paths} (expected one cuDNN call)"
                elif not EXPECT[name] <= rewritten:
                    problem = f"rewritten {sorted(rewritten)}, expected {sorted(EXPECT[name])}"
            mode = "training" if train else "inference"
            print(f"{'FAIL' if problem else 'ok  '} {name}, {mode}: "
                  + (problem or f"one graph; rewritten: {', '.join(sorted(rewritten))}"
                     + ("; the RNN is one cuDNN call" if name in RNN_MODELS else "")))
            failures += bool(problem)
    print(f"{failures} failed" if failures else "every model compiles to the expected graph")
    return failures


# -- on a GPU: the tables --------------------------------------------------------


def own_code(model: nn.Module) -> nn.Module:
    """A forward with a code object of its own (Dynamo's cache is per code object)."""
    f = type(model).forward
    code = f.__code__.replace()
    fn = types.FunctionType(code, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    model.forward = types.MethodType(fn, model)
    return model


def _variants(base: nn.Module, name: str) -> Dict[str, tuple]:
    """name -> (callable, the model copy it runs)."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    def copy_() -> nn.Module:
        return own_code(copy.deepcopy(base))

    m = copy.deepcopy(base)
    out = {"eager": (m, m)}
    m = copy_()
    out["Inductor"] = (torch.compile(m), m)
    if name in RNN_MODELS:
        m = copy_()
        compiled = torch.compile(m)

        def allow_rnn(x, compiled=compiled):
            with dynamo_config.patch(allow_rnn=True):
                return compiled(x)

        out["allow_rnn + Inductor"] = (allow_rnn, m)
    m = copy_()
    out["wformat"] = (torch.compile(m, backend=wfpass.backend(rnn=CUDNN)), m)
    m = copy_()
    cg = torch.compile(m, backend=wfpass.backend(rnn=CUDNN))

    def with_graphs(x, cg=cg):
        with inductor_config.patch({"triton.cudagraphs": True}):
            return cg(x)

    out["wformat + CUDA graphs"] = (with_graphs, m)
    return out


def _step(fn: Callable, x, train: bool, params):
    def run():
        if train:
            out = fn(x)
            out.float().sum().backward()
            for p in params:
                p.grad = None
        else:
            with torch.no_grad():
                fn(x)
    return run


#: The tests that need a real GPU (they skip elsewhere): equality with eager
#: cuDNN, autocast, dropout, and the layout wfpass assumes without a GPU.
GPU_TESTS = "on_a_gpu or layout_without_a_gpu"


def gpu_tests() -> str:
    """Run the GPU tests of tests/test_cudnn.py first (a wrong layout or
    reserve would make every table below wrong); their summary line."""
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        import pytest  # noqa: F401
    except ImportError:
        return "GPU tests not run: pytest is not installed here"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cudnn.py",
                           "-k", GPU_TESTS], cwd=root, capture_output=True, text=True)
    print(done.stdout[-4000:], done.stderr[-2000:], file=sys.stderr)
    tail = [line for line in done.stdout.splitlines() if line.strip()]
    return f"GPU tests (`pytest tests/test_cudnn.py -k \"{GPU_TESTS}\"`): {tail[-1] if tail else done.returncode}"


def measure(out_path: str, rounds: int) -> int:
    assert torch.cuda.is_available(), "the tables need a GPU (--check does not)"
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(0)
    lines = [f"Command: `python benchmarks/bench_gpu.py --out {out_path} --rounds {rounds}`  ",
             f"{props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
             f"{torch.backends.cudnn.version()}; medians of {rounds} interleaved rounds, ms per step; "
             "x faster = baseline time / wformat time.", "", gpu_tests(), ""]
    for name in EXPECT:
        Ts = (1, 16, 128, 512) if name in RNN_MODELS else (1, 8)
        for train in (False, True):
            rows = []
            for T in Ts:
                for B in ((1, 16, 64) if name in RNN_MODELS else (1,)):
                    torch._dynamo.reset()
                    torch.manual_seed(0)
                    base = _model(name).to(dev).train(train)
                    x = _inputs(name, T, B, dev)
                    variants = _variants(base, name)
                    steps = {}
                    for k, (fn, m) in variants.items():
                        steps[k] = _step(fn, x, train, list(m.parameters()))
                        try:
                            for _ in range(3):
                                steps[k]()
                        except Exception as e:  # noqa: BLE001 - a variant that fails is shown as failed
                            steps[k] = None
                            print(f"{name} T={T} B={B} {k}: {type(e).__name__}: {str(e).splitlines()[0][:120]}",
                                  file=sys.stderr)
                    times: Dict[str, List[float]] = {k: [] for k in steps}
                    for _ in range(rounds):
                        for k, run in steps.items():
                            if run is None:
                                continue
                            torch.cuda.synchronize()
                            t = time.perf_counter()
                            for _ in range(5):
                                run()
                            torch.cuda.synchronize()
                            times[k].append((time.perf_counter() - t) / 5 * 1e3)
                    med = {k: statistics.median(v) if v else float("nan") for k, v in times.items()}
                    rows.append((T, B, med))
            cols = list(rows[0][2])
            lines += [f"### {name}, {'training step' if train else 'inference'}", "",
                      "| T | batch | " + " | ".join(cols) + " | x faster than eager | x faster than Inductor |",
                      "|" + "---|" * (len(cols) + 4)]
            for T, B, med in rows:
                w = med["wformat"]
                lines.append(f"| {T} | {B} | " + " | ".join(f"{med[c]:.3f}" for c in cols)
                             + f" | {med['eager'] / w:.2f} | {med['Inductor'] / w:.2f} |")
            lines.append("")
    with open(out_path, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="no GPU: check every model's graph on fake CUDA")
    ap.add_argument("--out", default="gpu_results.md")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.check:
        return 1 if check() else 0
    return measure(args.out, args.rounds)


if __name__ == "__main__":
    raise SystemExit(main())
