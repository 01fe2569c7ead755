"""Smoke test of the benchmark that backs docs/rnn.md's per-call table: it
must keep running (it reads a private Dynamo helper) and its pieces must add
up the way the docs read them."""
from __future__ import annotations

import importlib.util
import pathlib

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rnn_overhead_benchmark_runs_and_writes_its_table(tmp_path):
    torch._dynamo.reset()
    bench = _load("bench_rnn_overhead")
    out = tmp_path / "overhead.md"
    assert bench.main(["--calls", "50", "--rounds", "1", "--out", str(out)]) == 0
    text = out.read_text()
    rows = {line.split("|")[1].strip(): float(line.split("|")[2]) for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| piece")}
    assert {"eager", "compiled", "backend fn", "guards", "prologue", "op", "op as custom_op", "kernel"} <= set(rows)
    assert all(v > 0 for v in rows.values()), rows
    # The compiled call contains the backend's function plus Dynamo's frame
    # (tens of microseconds: robust even on a loaded machine).
    assert rows["compiled"] > rows["backend fn"], rows
