"""The docs cite tests by name (`file.py::test_name`, and `::test_name` after
a file): every cited test must exist, so a renamed or deleted test cannot
leave a guarantee pointing at nothing."""
from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def _citations(text: str):
    out = []
    # `file.py::test_a` optionally followed by `, `::test_b`` continuations
    # (possibly with parameter ids) in the same cell or sentence.
    for m in re.finditer(r"`(test_\w+\.py)::(test_\w+)[^`]*`((?:[^`|]*?`::test_\w+[^`]*`)*)", text):
        out.append((m.group(1), m.group(2)))
        out += [(m.group(1), n) for n in re.findall(r"`::(test_\w+)", m.group(3))]
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_cited_test_exists(doc):
    cites = _citations(doc.read_text())
    missing = []
    for f, name in cites:
        path = ROOT / "tests" / f
        if not path.exists() or not re.search(rf"^def {name}\(", path.read_text(), re.M):
            missing.append(f"{f}::{name}")
    assert not missing, f"{doc.name} cites tests that do not exist: {missing}"


def test_the_guarantees_page_cites_tests():
    # The parser above must find the page's citations (else the check is empty).
    assert len(_citations((ROOT / "docs" / "guarantees.md").read_text())) > 100
