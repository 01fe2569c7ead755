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




def test_pass_time_benchmark_runs_and_checks_the_tree_it_imported(tmp_path):
    """``bench_pass_time.py``: one round of one model in a worker process,
    the table written; a worker that imports wfpass from elsewhere than the
    tree asked for is an error, not a silently wrong comparison."""
    import pytest

    mod = _load("bench_pass_time")
    out = tmp_path / "t.md"
    assert mod.main(["--models", "cell_loop", "--rounds", "1", "--reps", "1", "--out", str(out)]) == 0
    row = next(line for line in out.read_text().splitlines() if line.startswith("| cell_loop |"))
    assert row.rstrip(" |").endswith("1"), row  # the loop was folded: one rewritten row
    with pytest.raises(SystemExit, match="imported wfpass from"):
        mod.main(["--trees", str(tmp_path), "--models", "cell_loop", "--rounds", "1", "--reps", "1"])
