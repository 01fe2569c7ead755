"""What a lent GPU runs, in one call within a time budget: the tests that
need a GPU, the profile of a training step, then the tables (RNN models, a
variable-length packed LSTM, a bf16 CRNN with BatchNorm and a bf16 decoder
under eager PyTorch, ``torch.compile``'s default, Inductor with
``allow_rnn=True``, wformat with RNNs as one cuDNN call
(``rnn={"cuda": "cudnn"}``) and the same with CUDA graphs).

    python benchmarks/gpu/bench_gpu.py --check                               # any machine with a CUDA build of torch
    python benchmarks/gpu/bench_gpu.py --device cpu --budget 240 --rounds 1  # a dry run of everything below, on the CPU
    python benchmarks/gpu/bench_gpu.py --out docs/results/gpu_h200.md --budget 510  # on a GPU: ends within 510 s

One page per GPU model: docs/results/gpu_h100.md, docs/results/gpu_h200.md.

``--check`` needs no GPU: every model of the tables is built on fake CUDA
tensors (``FakeTensorMode``, ``device="cuda"``) and compiled with wformat,
and the graph that reaches the inner compiler is checked: one graph, each
RNN one cuDNN call, the expected rewrites in the report. Run it before
measuring on a GPU, so the GPU's time goes to measuring.

Without ``--check``, in this order, the page written after every step:

1. the tests that need a GPU (``python -m pytest -m gpu``: tests/test_gpu_invariants.py
   and the others marked ``gpu``), in a subprocess with a time limit; a
   wrong layout would make every table wrong;
2. ``benchmarks/gpu/profile_cuda_train.py`` (LSTM LM, T 16, batch 16): wall
   time against kernel time per training step;
3. the tables, most telling points first: a training step of each RNN
   model at T 16, batch 16 and 64; then at T 128 and 512; then the
   inference points and the rest of the grid. ``allow_rnn=True`` +
   Inductor is measured at each model's first point only (it unrolls the
   RNN: slow to compile and to run; ``--no-allow-rnn`` leaves it out).

Points are measured in a worker process (the same script, ``--serve``), so
a point still compiling when the budget or its own limit is reached is
stopped and the page says so. Each variant runs its own copy of the model
with a forward of its own (Dynamo's cache is per code object), rounds
interleaved, medians; x faster = baseline time / wformat time.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import select
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

import wfpass
from wfpass.tools.bench_models import CellLoop, Decoder, PackedLSTM, RnnLM, SpeechEncoder, built_in_dtype
from wfpass.tools.tables import markdown_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
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


PACKED_FEATURES = 80


def _inputs(name: str, T: int, B: int, device, dtype=torch.float32):
    """One model's input at length T and batch B: a tensor, or for the
    packed LSTM ``(x, lengths)``, the lengths drawn uniformly between T/5
    and T (one of them T), on the CPU as eager requires."""
    if name == "LSTM LM":
        return torch.randint(0, 500, (T, B), device=device)
    if name == "speech encoder":
        return torch.randn(B, 80, T, device=device)
    if name == "LSTMCell loop":
        return torch.randn(T, B, 128, device=device)
    if name == "packed LSTM":
        rng = random.Random(T * 1000 + B)  # the same lengths for every variant and run
        lengths = [T] + [rng.randint(max(1, T // 5), T) for _ in range(B - 1)]
        return torch.randn(T, B, PACKED_FEATURES, device=device), torch.tensor(lengths, device="cpu")
    if name == "CRNN bf16":
        return torch.randn(B, 1, 32, 2 * T, device=device, dtype=torch.bfloat16)
    if name == "decoder bf16":
        return torch.randn(B, T, 512, device=device, dtype=torch.bfloat16)
    raise ValueError(name)


def _call(fn: Callable, x):
    return fn(*x) if isinstance(x, tuple) else fn(x)


def _model(name: str) -> nn.Module:
    if name == "LSTM LM":
        return RnnLM(vocab=500, hidden=256, layers=2)
    if name == "speech encoder":
        return SpeechEncoder()
    if name == "LSTMCell loop":
        return nn.Sequential(CellLoop(128, 256), nn.Linear(256, 128))
    if name == "packed LSTM":
        return PackedLSTM(inp=PACKED_FEATURES, hidden=256, layers=2)
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
    "packed LSTM": {"rnn"},
    "CRNN bf16": {"rnn", "batchnorm"},
    "decoder bf16": {"linear"},
}
RNN_MODELS = ("LSTM LM", "speech encoder", "LSTMCell loop", "packed LSTM", "CRNN bf16")


# -- --check: the graphs, on fake CUDA ------------------------------------------


def _rnn_paths(graphs) -> List[str]:
    """The path of every RNN call in the graphs (``RnnForward`` for a
    padded batch, ``PackedRnnForward`` for a packed one)."""
    from wfpass.rnn.varlen.sequence import PackedRnnForward
    from wfpass.rnn.paths import RnnForward

    return [n.target.path for g in graphs for n in g.graph.nodes
            if n.op == "call_function" and isinstance(n.target, (RnnForward, PackedRnnForward))]


def check() -> int:
    """Compile every model on fake CUDA (training and inference) and check
    the graph the inner compiler receives. Returns the number of failures."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if torch.version.cuda is None:
        print("--check needs a CUDA build of torch (a CPU build refuses CUDA tensors, fake or not): nothing checked")
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
                        _call(torch.compile(model, backend=wfpass.backend(inner=keep, rnn=CUDNN)), x)
                except Exception as e:  # noqa: BLE001
                    problem = f"compile failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rnn_paths = _rnn_paths(graphs)
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


# -- a point: every variant of one model at one (T, batch, mode) -----------------------------------


def fresh_copy(base: nn.Module) -> nn.Module:
    """A deep copy with each RNN's weights back in cuDNN's flat buffer:
    ``Parameter.__deepcopy__`` clones each weight on its own, so a copied
    ``nn.LSTM`` would compact its weights on every call (cuDNN's "not part
    of single contiguous chunk of memory" warning), which a user's model,
    moved with ``.cuda()``, does not do. Every variant starts from one."""
    m = copy.deepcopy(base)
    for mod in m.modules():
        if isinstance(mod, nn.RNNBase):
            mod.flatten_parameters()
    return m


def own_code(model: nn.Module) -> nn.Module:
    """A forward with a code object of its own (Dynamo's cache is per code object)."""
    f = type(model).forward
    code = f.__code__.replace()
    fn = types.FunctionType(code, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    model.forward = types.MethodType(fn, model)
    return model


#: The tables' columns, in this order (a variant a point did not run is blank).
COLUMNS = ("eager", "Inductor", "allow_rnn + Inductor", "wformat", "wformat + CUDA graphs")
#: Warmed up (compiled) in this order: the cheap compiles first, so that a
#: point that runs out of time still has its eager and wformat figures.
WARM_ORDER = ("eager", "wformat", "wformat + CUDA graphs", "Inductor", "allow_rnn + Inductor")


def variants_of(name: str, with_allow_rnn: bool) -> List[str]:
    """The variants measured for ``name``: the packed LSTM against eager
    cuDNN and ``torch.compile``'s default only (its graph has sizes known
    at run time, which CUDA graphs cannot hold; Dynamo breaks on the packing
    with ``allow_rnn`` too)."""
    if name == "packed LSTM":
        return ["eager", "Inductor", "wformat"]
    out = ["eager", "Inductor", "wformat", "wformat + CUDA graphs"]
    if with_allow_rnn and name in RNN_MODELS:
        out.insert(2, "allow_rnn + Inductor")
    return out


def _variant(base: nn.Module, variant: str) -> Tuple[Callable, nn.Module]:
    """(callable, the model copy it runs)."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    if variant == "eager":
        m = fresh_copy(base)
        return m, m
    m = own_code(fresh_copy(base))
    if variant == "Inductor":
        return torch.compile(m), m
    if variant == "allow_rnn + Inductor":
        compiled = torch.compile(m)

        def allow_rnn(*x):
            with dynamo_config.patch(allow_rnn=True):
                return compiled(*x)
        return allow_rnn, m
    compiled = torch.compile(m, backend=wfpass.backend(rnn=CUDNN))
    if variant == "wformat":
        return compiled, m

    def with_graphs(*x):
        with inductor_config.patch({"triton.cudagraphs": True}):
            return compiled(*x)
    return with_graphs, m


def _step(fn: Callable, x, train: bool, params):
    """One inference call, or one training step: forward, backward of the
    output's sum, an SGD step (what a user's loop runs)."""
    opt = torch.optim.SGD(params, lr=1e-4) if train else None

    def run():
        if train:
            out = _call(fn, x)
            out.float().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                _call(fn, x)
    return run


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def measure_point(name: str, T: int, B: int, train: bool, dev: torch.device, rounds: int, variants: List[str],
                  soft_s: float = 100.0) -> dict:
    """Median ms per call of each variant at one point: ``{"ms": {variant:
    ms}, "errors": {variant: why}}``. A variant not yet compiled when the
    point has run ``soft_s`` seconds is left out (its compile could take
    minutes: the cell loop under Inductor unrolls every step)."""
    start = time.perf_counter()
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = _model(name).to(dev).train(train)
    x = _inputs(name, T, B, dev)
    steps: Dict[str, Callable] = {}
    errors: Dict[str, str] = {}
    for k in sorted(variants, key=WARM_ORDER.index):
        if time.perf_counter() - start > soft_s:
            errors[k] = f"not compiled: the point had run {soft_s:.0f} s"
            continue
        fn, m = _variant(base, k)
        run = _step(fn, x, train, list(m.parameters()))
        try:
            for _ in range(3):
                run()
            steps[k] = run
        except Exception as e:  # noqa: BLE001 - a variant that fails is shown as failed
            errors[k] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            print(f"{name} T={T} B={B} {k}: {errors[k]}", file=sys.stderr, flush=True)
    times: Dict[str, List[float]] = {k: [] for k in steps}
    for r in range(rounds):
        order = list(steps.items())
        order = order[r % len(order):] + order[:r % len(order)] if order else order  # rotate who goes first
        for k, run in order:
            _sync(dev)
            t = time.perf_counter()
            for _ in range(5):
                run()
            _sync(dev)
            times[k].append((time.perf_counter() - t) / 5 * 1e3)
    return {"ms": {k: statistics.median(v) for k, v in times.items() if v}, "errors": errors}


def bn_stats_error(dev, steps: int = 30) -> List[str]:
    """The CRNN's BatchNorm running statistics after ``steps`` bf16
    training steps (same inputs, weights not updated), against an fp32
    copy's: the largest relative error of running_var over the layers."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = CRNN().to(dev).train()
    variants = {"eager bf16": copy.deepcopy(ref).to(torch.bfloat16)}
    variants["Inductor bf16"] = own_code(fresh_copy(variants["eager bf16"]))
    variants["wformat bf16"] = own_code(fresh_copy(variants["eager bf16"]))
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


def serve(dev: torch.device, rounds: int) -> int:
    """The worker: one JSON job per line on stdin, one JSON answer per line
    on the original stdout (everything else printed goes to stderr, so
    nothing can break a line of the protocol)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        job = json.loads(line)
        t0 = time.perf_counter()
        try:
            if job["kind"] == "bn":
                answer = {"lines": bn_stats_error(dev)}
            else:
                answer = measure_point(job["model"], job["T"], job["B"], job["train"], dev, rounds, job["variants"],
                                       job.get("soft_s", 100.0))
        except Exception as e:  # noqa: BLE001 - the coordinator writes it into the page
            answer = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        answer["seconds"] = time.perf_counter() - t0
        proto.write(json.dumps(answer) + "\n")
    return 0


# -- the coordinator -------------------------------------------------------------------------------


def _kill_group(p: subprocess.Popen) -> None:
    """Stop a child started in a session of its own, and every process it
    started (pytest's xdist workers, Inductor's compile workers)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def run_for(cmd: List[str], timeout_s: float, env: Optional[dict] = None) -> Tuple[Optional[int], str, str]:
    """``cmd`` with a time limit: (exit status, or None if it was stopped
    at the limit; stdout; stderr)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, text=True, env=env, start_new_session=True)
        try:
            rc: Optional[int] = p.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            _kill_group(p)
            rc = None
        out.seek(0)
        err.seek(0)
        return rc, out.read(), err.read()


class Worker:
    """A ``--serve`` process measuring the points asked of it; ``ask``
    gives up (and stops it) at a deadline."""

    def __init__(self, dev: torch.device, rounds: int):
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", "--device", str(dev),
                                   "--rounds", str(rounds)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  start_new_session=True)
        self.buf = b""

    def ask(self, job: dict, timeout_s: float) -> Optional[dict]:
        """The answer, or None if none came within ``timeout_s`` (the worker
        is then stopped); ``{"failed": ...}`` if it died."""
        try:
            self.p.stdin.write((json.dumps(job) + "\n").encode())
            self.p.stdin.flush()
        except BrokenPipeError:
            return {"failed": f"the worker had exited ({self.p.poll()})"}
        end = time.monotonic() + timeout_s
        fd = self.p.stdout.fileno()
        while b"\n" not in self.buf:
            left = end - time.monotonic()
            if left <= 0:
                self.stop()
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return {"failed": f"the worker died (exit status {self.p.wait()})"}
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def alive(self) -> bool:
        return self.p.poll() is None

    def stop(self) -> None:
        _kill_group(self.p)


#: The test command: every test that needs a GPU (they skip elsewhere).
TEST_ARGS = ["-m", "pytest", "-m", "gpu", "-v", "-rfEx", "--tb=short", "-p", "no:cacheprovider", "-p", "no:logging"]


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def gpu_tests(timeout_s: float, log_path: Optional[str] = None) -> List[str]:
    """Run the tests marked ``gpu`` (a wrong layout or reserve would make
    every table below wrong): the page's lines, the summary first, then
    each test that failed, errored or is expected to fail, with why. The
    whole output, tracebacks included, goes to ``log_path`` (the GPU is
    lent for minutes: a failure must be readable after it is gone)."""
    if not _has("pytest"):
        return ["Not run: pytest is not installed here."]
    args = list(TEST_ARGS)
    if _has("xdist"):  # 4 processes: the tests are compile-bound (CPU), the GPU is barely used
        args += ["-n", "4"]
    if _has("pytest_timeout"):  # one hung test must not take the whole budget
        args += ["--timeout", "150"]
    shown = "python " + " ".join(args)
    rc, out, err = run_for([sys.executable, *args], timeout_s)
    print(out[-8000:], err[-3000:], file=sys.stderr, flush=True)
    if log_path:
        with open(log_path, "w") as f:
            f.write(out + "\n" + err)
    lines = [ln for ln in out.splitlines() if ln.strip()]
    if rc is None:
        counts = {w: sum(f" {w}" in ln for ln in lines) for w in ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL")}
        head = (f"`{shown}`: **not finished in {timeout_s:.0f} s** (stopped); so far "
                + ", ".join(f"{n} {w.lower()}" for w, n in counts.items() if n) + ".")
        bad = [ln.strip() for ln in lines if " FAILED" in ln or " ERROR" in ln]
    else:
        summary = lines[-1].strip("= ") if lines else f"exit status {rc}, no output"
        head = f"`{shown}`: {summary}" + ("" if rc in (0, 5) else f" (exit status {rc})")
        bad = [ln.strip() for ln in lines if ln.startswith(("FAILED ", "ERROR ", "XFAIL "))]
    if rc not in (0, 5, None) and not bad and err.strip():
        bad = ["stderr: " + err.strip().splitlines()[-1][:300]]
    return [head, ""] + [f"- {ln[:400]}" for ln in bad] + ([""] if bad else [])


def profile(dev: torch.device, timeout_s: float) -> List[str]:
    """``profile_cuda_train.py`` for the LSTM LM at T 16, batch 16: its page."""
    fd, path = tempfile.mkstemp(suffix=".md")
    os.close(fd)
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu", "profile_cuda_train.py"), "--model", "LSTM LM",
           "--T", "16", "--B", "16", "--device", str(dev), "--out", path]
    rc, out, err = run_for(cmd, timeout_s)
    text = open(path).read().strip()
    os.unlink(path)
    if rc == 0 and text:
        return text.splitlines() + [""]
    print(out[-3000:], err[-3000:], file=sys.stderr, flush=True)
    why = f"not finished in {timeout_s:.0f} s" if rc is None else f"exit status {rc}: " + (
        err.strip().splitlines()[-1][:300] if err.strip() else "no message")
    return [f"`profile_cuda_train.py` failed ({why}).", ""]


#: T and batch, most telling first, for the rest of the grid.
REST = [(16, 1), (1, 1), (128, 64), (512, 64), (128, 1), (1, 16), (512, 1), (1, 64)]
DECODER_POINTS = [(1, 1), (8, 1), (1, 16), (8, 16)]


def plan() -> List[tuple]:
    """Every job, most telling first: ``("point", model, T, B, train)`` or
    ``("bn",)``. A training step of each RNN model at T 16 (batch 16, then
    64), then at T 128 and 512 (batch 16); the BatchNorm statistics check;
    inference at those points; the decoder; the rest of the grid."""
    first = [(m, 16, B, True) for B in (16, 64) for m in RNN_MODELS]
    lengths = [(m, T, 16, True) for T in (128, 512) for m in RNN_MODELS]
    jobs: List[tuple] = [("point", *p) for p in first + lengths] + [("bn",)]
    jobs += [("point", m, T, B, False) for m, T, B, _ in first + lengths]
    jobs += [("point", "decoder bf16", T, B, train) for T, B in DECODER_POINTS for train in (True, False)]
    for T, B in [(16, 16), (16, 64), (128, 16), (512, 16)] + REST:
        for train in (True, False):
            jobs += [("point", m, T, B, train) for m in RNN_MODELS]
    return list(dict.fromkeys(jobs))


def _points_table(rs: list) -> str:
    """``rs``: ``(T, batch, {variant: ms})`` per point of one model and mode;
    one line per point, in (T, batch) order: every variant's ms, then
    eager's and Inductor's time / wformat's."""
    cols = [c for c in COLUMNS if any(c in med for _, _, med in rs)]

    def ratio(med, base):
        return f"{med[base] / med['wformat']:.2f}" if base in med and "wformat" in med else "-"

    return markdown_table(["T", "batch", *cols, "x faster than eager", "x faster than Inductor"],
                          [[T, B, *(f"{med[c]:.3f}" if c in med else "-" for c in cols), ratio(med, "eager"),
                            ratio(med, "Inductor")] for T, B, med in sorted(rs, key=lambda r: (r[0], r[1]))])


def measure(out_path: str, rounds: int, budget_s: float, dev: torch.device, only: str = "",
            tests_s: float = 240.0, point_s: float = 200.0, allow_rnn: bool = True) -> int:
    """The page, on ``dev`` (``--device cpu`` runs the same code on the CPU
    with no GPU figure: a dry run of this script before a GPU is at hand).
    Nothing is started after ``budget_s`` seconds, and whatever runs then
    is stopped: the call ends within the budget."""
    assert dev.type != "cuda" or torch.cuda.is_available(), "the tables need a GPU (--check does not)"
    start = time.monotonic()

    def left() -> float:
        return budget_s - (time.monotonic() - start)

    where = torch.cuda.get_device_properties(0).name if dev.type == "cuda" else "CPU (dry run: no GPU figure)"
    head = [f"Command: `python benchmarks/gpu/bench_gpu.py {' '.join(shlex.quote(a) for a in sys.argv[1:])}`  ",
            f"{where}, torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
            f"{torch.backends.cudnn.version()}; budget {budget_s:.0f} s.", ""]
    tests: List[str] = []
    prof: List[str] = []
    rows: Dict[tuple, list] = {}
    errors: List[str] = []
    bn: List[str] = []
    notes: List[str] = []

    def write():
        lines = list(head)
        if tests:
            lines += ["## Tests that need a GPU", ""] + tests
        if prof:
            lines += ["## Where a training step's time goes", ""] + prof
        if rows or bn:
            lines += ["## Tables", "",
                      f"Medians of {rounds} interleaved rounds (5 calls each), ms per call; a training step is "
                      "forward, backward and an SGD step; x faster = baseline time / wformat time; the packed LSTM's "
                      "lengths are uniform between T/5 and T.", ""]
        for (name, train), rs in rows.items():
            lines += [f"### {name}, {'training step' if train else 'inference'}", "", _points_table(rs), ""]
        lines += bn
        if errors:
            lines += ["Variants that failed or were left out:", ""] + [f"- {e}" for e in errors] + [""]
        lines += notes
        with open(out_path, "w") as f:
            f.write("\n".join(lines) + "\n")

    if only:  # "decoder bf16:8x1,LSTM LM:128x64": these points alone (both modes), no tests, no profile
        jobs = []
        for item in only.split(","):
            name, tb = item.rsplit(":", 1)
            if name not in EXPECT:
                raise ValueError(f"--only: no model {name!r}; models: {', '.join(EXPECT)}")
            T, B = (int(v) for v in tb.split("x"))
            jobs += [("point", name, T, B, train) for train in (True, False)]
    else:
        write()
        tests = gpu_tests(min(tests_s, 0.45 * left()), os.path.splitext(out_path)[0] + "_tests.log")
        print("\n".join(tests), flush=True)
        write()
        prof = profile(dev, min(150.0, 0.3 * left()))
        print("\n".join(prof), flush=True)
        write()
        jobs = plan()

    worker: Optional[Worker] = None
    allow_rnn_done = set() if allow_rnn else set(RNN_MODELS)  # its compile alone can take minutes
    not_run: List[str] = []
    try:
        for job in jobs:
            label = "BatchNorm statistics check" if job[0] == "bn" else \
                f"{job[1]} T={job[2]} B={job[3]} {'train' if job[4] else 'infer'}"
            if left() < 15:
                not_run.append(label)
                continue
            if worker is None or not worker.alive():
                worker = Worker(dev, rounds)
            if job[0] == "bn":
                request = {"kind": "bn"}
            else:
                _, name, T, B, train = job
                names = variants_of(name, name not in allow_rnn_done)
                allow_rnn_done.add(name)
                request = {"kind": "point", "model": name, "T": T, "B": B, "train": train, "variants": names,
                           "soft_s": min(100.0, 0.5 * point_s)}
            limit = min(point_s, left() - 5)
            t0 = time.monotonic()
            answer = worker.ask(request, limit)
            took = time.monotonic() - t0
            if answer is None:
                why = "the budget" if limit < point_s else "its limit"
                errors.append(f"{label}: stopped after {took:.0f} s ({why})")
                worker = None
            elif "failed" in answer:
                errors.append(f"{label}: failed: {answer['failed']}")
            elif job[0] == "bn":
                bn = answer["lines"]
            else:
                rows.setdefault((job[1], job[4]), []).append((job[2], job[3], answer["ms"]))
                errors += [f"{label}, {k}: {why}" for k, why in answer["errors"].items()]
            print(f"{label} ({took:.0f} s): " + (json.dumps(answer) if answer is not None else "stopped"), flush=True)
            write()
    finally:  # (in a session of its own: an interrupt here would not reach it)
        if worker is not None and worker.alive():
            worker.stop()
    if not_run:
        notes += [f"Not measured within the {budget_s:.0f} s budget: {len(not_run)} of {len(jobs)} jobs "
                  f"(first: {', '.join(not_run[:6])}{', ...' if len(not_run) > 6 else ''}).", ""]
    write()
    print(open(out_path).read())
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="no GPU: check every model's graph on fake CUDA")
    ap.add_argument("--out", default="gpu_results.md")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=540.0,
                    help="seconds for the whole call: nothing starts after it, and what runs then is stopped")
    ap.add_argument("--tests-timeout", type=float, default=240.0, help="at most this long for the GPU tests")
    ap.add_argument("--point-timeout", type=float, default=200.0, help="at most this long for one point")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the measuring code, no GPU figure")
    ap.add_argument("--only", default="", help='these points alone, e.g. "decoder bf16:8x1,LSTM LM:128x64"')
    ap.add_argument("--no-allow-rnn", action="store_true",
                    help="leave out allow_rnn + Inductor (measured once per model otherwise; it compiles for minutes)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the worker that measures points
    args = ap.parse_args()
    if args.check:
        return 1 if check() else 0
    if args.serve:
        return serve(torch.device(args.device), args.rounds)
    return measure(args.out, args.rounds, args.budget, torch.device(args.device), args.only, args.tests_timeout,
                   args.point_timeout, not args.no_allow_rnn)


if __name__ == "__main__":
    raise SystemExit(main())
