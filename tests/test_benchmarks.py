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


