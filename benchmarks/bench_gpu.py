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
time. Run on an H200 with torch 2.11 (docs/gpu_results.md).
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
from wfpass.tools.tables import markdown_table

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
    """One inference call, or one training step: forward, backward of a
    fixed projection, an SGD step (what a user's loop runs)."""
    opt = torch.optim.SGD(params, lr=1e-4) if train else None

    def run():
        if train:
            out = fn(x)
            out.float().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                fn(x)
    return run


#: The tests that need a real GPU (they skip elsewhere): equality with eager
#: cuDNN, autocast, dropout, and the layout wfpass assumes without a GPU.
GPU_TESTS = "on_a_gpu or layout_without_a_gpu"


def gpu_tests(timeout_s: float = 240) -> str:
    """Run the GPU tests of tests/test_cudnn.py first (a wrong layout or
    reserve would make every table below wrong); their summary line."""
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        import pytest  # noqa: F401
    except ImportError:
        return "GPU tests not run: pytest is not installed here"
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cudnn.py",
                               "-k", GPU_TESTS], cwd=root, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"GPU tests (`pytest tests/test_cudnn.py -k \"{GPU_TESTS}\"`): not finished in {timeout_s:.0f} s"
    print(done.stdout[-6000:], done.stderr[-2000:], file=sys.stderr, flush=True)
    tail = [line for line in done.stdout.splitlines() if line.strip()]
    return f"GPU tests (`pytest tests/test_cudnn.py -k \"{GPU_TESTS}\"`): {tail[-1] if tail else done.returncode}"


#: Each model's points, most telling first: with ``--budget`` the run stops
#: starting new points when time is up, and every model gets its first
#: points before any gets its later ones.
POINTS = {
    "LSTM LM": [(16, 16), (128, 64), (1, 1), (512, 16), (16, 1), (128, 16), (512, 64), (1, 16),
                (16, 64), (128, 1), (512, 1), (1, 64)],
    "LSTMCell loop": [(16, 16), (128, 1), (512, 16), (1, 1), (16, 1), (128, 64)],
    "speech encoder": [(128, 16), (512, 64), (16, 1), (1, 1), (128, 1), (512, 16)],
    "CRNN bf16": [(16, 16), (128, 64), (16, 1), (512, 16)],
    "decoder bf16": [(1, 1), (8, 1), (1, 16), (8, 16)],
}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _measure_point(name: str, T: int, B: int, train: bool, dev, rounds: int) -> Dict[str, float]:
    """Median ms per call of every variant at one point."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = _model(name).to(dev).train(train)
    x = _inputs(name, T, B, dev)
    steps = {}
    for k, (fn, m) in _variants(base, name).items():
        steps[k] = _step(fn, x, train, list(m.parameters()))
        try:
            for _ in range(3):
                steps[k]()
        except Exception as e:  # noqa: BLE001 - a variant that fails is shown as failed
            steps[k] = None
            print(f"{name} T={T} B={B} {k}: {type(e).__name__}: {str(e).splitlines()[0][:160]}",
                  file=sys.stderr, flush=True)
    times: Dict[str, List[float]] = {k: [] for k in steps}
    for r in range(rounds):
        order = list(steps.items())
        order = order[r % len(order):] + order[:r % len(order)]  # rotate who goes first
        for k, run in order:
            if run is None:
                continue
            _sync(dev)
            t = time.perf_counter()
            for _ in range(5):
                run()
            _sync(dev)
            times[k].append((time.perf_counter() - t) / 5 * 1e3)
    return {k: statistics.median(v) if v else float("nan") for k, v in times.items()}


def bn_stats_error(dev, steps: int = 30) -> List[str]:
    """The CRNN's BatchNorm running statistics after ``steps`` bf16
    training steps (same inputs, weights not updated), against an fp32
    copy's: the largest relative error of running_var over the layers."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = CRNN().to(dev).train()
    variants = {"eager bf16": copy.deepcopy(ref).to(torch.bfloat16)}
    variants["Inductor bf16"] = own_code(copy.deepcopy(variants["eager bf16"]))
    variants["wformat bf16"] = own_code(copy.deepcopy(variants["eager bf16"]))
    fns = {"eager bf16": variants["eager bf16"], "Inductor bf16": torch.compile(variants["Inductor bf16"]),
           "wformat bf16": torch.compile(variants["wformat bf16"], backend=wfpass.backend(rnn=CUDNN))}
    xs = [torch.randn(16, 1, 32, 64, device=dev) * 3 + 1 for _ in range(steps)]
    for x in xs:
        ref(x).sum().backward()
        for k, fn in fns.items():
            fn(x.to(torch.bfloat16)).float().sum().backward()
    ref_bns = [m for m in ref.modules() if isinstance(m, nn.BatchNorm2d)]
    body = []
    for k, m in variants.items():
        bns = [b for b in m.modules() if isinstance(b, nn.BatchNorm2d)]
        var_err = max(((b.running_var.float() - r.running_var).abs() / r.running_var.abs()).max().item()
                      for b, r in zip(bns, ref_bns))
        mean_err = max((b.running_mean.float() - r.running_mean).abs().max().item() for b, r in zip(bns, ref_bns))
        body.append([k, f"{var_err:.2e}", f"{mean_err:.2e}"])
    return [f"### CRNN bf16: BatchNorm running statistics after {steps} training steps", "",
            markdown_table(["variant", "running_var max rel. error vs fp32", "running_mean max abs. error vs fp32"], body),
            ""]


def _points_table(rs: list) -> str:
    """``rs``: ``(T, batch, {variant: ms})`` per point of one model and mode; one line per point, in (T, batch)
    order: every variant's ms, then eager's and Inductor's time / wformat's."""
    cols = list(rs[0][2])
    return markdown_table(["T", "batch", *cols, "x faster than eager", "x faster than Inductor"],
                          [[T, B, *(f"{med[c]:.3f}" for c in cols), f"{med['eager'] / med['wformat']:.2f}",
                            f"{med['Inductor'] / med['wformat']:.2f}"]
                           for T, B, med in sorted(rs, key=lambda r: (r[0], r[1]))])


def measure(out_path: str, rounds: int, budget_s: float, dev: torch.device, only: str = "") -> int:
    """The tables, on ``dev`` (``--device cpu`` runs the same code on the
    CPU with no GPU figure: a dry run of this script before a GPU is at hand)."""
    assert dev.type != "cuda" or torch.cuda.is_available(), "the tables need a GPU (--check does not)"
    start = time.perf_counter()
    name = torch.cuda.get_device_properties(0).name if dev.type == "cuda" else "CPU (dry run: no GPU figure)"
    flags = f" --budget {budget_s:.0f}" if budget_s != float("inf") else ""
    flags += f' --only "{only}"' if only else ""
    head = [f"Command: `python benchmarks/bench_gpu.py --out {out_path} --rounds {rounds}{flags}`  ",
            f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
            f"{torch.backends.cudnn.version()}; medians of {rounds} interleaved rounds (5 calls each), ms per call; "
            "a training step is forward, backward and an SGD step; "
            "x faster = baseline time / wformat time.", "", gpu_tests() if dev.type == "cuda" and not only else "", ""]
    points = POINTS
    if only:  # "decoder bf16:8x1,LSTM LM:128x64": these points alone, no tests, no BatchNorm check
        points = {}
        for item in only.split(","):
            name, tb = item.rsplit(":", 1)
            if name not in POINTS:
                raise ValueError(f"--only: no model {name!r}; models: {', '.join(POINTS)}")
            points.setdefault(name, []).append(tuple(int(v) for v in tb.split("x")))
    rows: Dict[tuple, list] = {}

    def write():
        lines = list(head)
        for (name, train), rs in rows.items():
            lines += [f"### {name}, {'training step' if train else 'inference'}", "", _points_table(rs), ""]
        with open(out_path, "w") as f:
            f.write("\n".join(lines + tail))

    tail: List[str] = []
    try:
        tail = bn_stats_error(dev) if not only else []
    except Exception as e:  # noqa: BLE001
        tail = [f"BatchNorm statistics check failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", ""]
    print("\n".join(tail), flush=True)
    skipped = []
    for i in range(max(len(p) for p in points.values())):
        for name, its in points.items():
            if i >= len(its):
                continue
            T, B = its[i]
            for train in (True, False):
                if time.perf_counter() - start > budget_s:
                    skipped.append(name)
                    continue
                t0 = time.perf_counter()
                med = _measure_point(name, T, B, train, dev, rounds)
                rows.setdefault((name, train), []).append((T, B, med))
                print(f"{name} T={T} B={B} {'train' if train else 'infer'} ({time.perf_counter() - t0:.0f} s): "
                      + ", ".join(f"{k} {v:.3f}" for k, v in med.items()), flush=True)
                write()
    if skipped:
        head.append(f"Not measured within the {budget_s:.0f} s budget (points x modes): "
                    + ", ".join(f"{n} {skipped.count(n)}" for n in dict.fromkeys(skipped)) + ".")
        head.append("")
    write()
    print(open(out_path).read())
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="no GPU: check every model's graph on fake CUDA")
    ap.add_argument("--out", default="gpu_results.md")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=float("inf"),
                    help="seconds after which no new point is started (the GPU is lent for minutes)")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the measuring code, no GPU figure")
    ap.add_argument("--only", default="", help='these points alone, e.g. "decoder bf16:8x1,LSTM LM:128x64"')
    args = ap.parse_args()
    if args.check:
        return 1 if check() else 0
    return measure(args.out, args.rounds, args.budget, torch.device(args.device), args.only)


if __name__ == "__main__":
    raise SystemExit(main())
