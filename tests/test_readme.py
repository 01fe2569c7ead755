"""The README as a newcomer meets it: exactly two set-up commands (.ci/run
runs the test one verbatim), every python block runs exactly as written, and
its first screen says what wfpass gives with the numbers' sources linked."""
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _bash_blocks(text):
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def _python_blocks(text):
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_ci_runs_the_readme_test_command():
    blocks = _bash_blocks(README)
    assert len(blocks) == 2, blocks
    demo, test = blocks
    assert "python -m wfpass demo" in demo and "pip install torch==2.13.0" in demo
    assert "pytest" in test and "pip install torch==2.13.0" in test
    ci_lines = [l for l in (ROOT / ".ci/run").read_text().splitlines() if l and not l.startswith(("#", "set ", "cd "))]
    # The README's command first, verbatim; then the same suite on the
    # oldest and newest supported torch, the way the README tells users to.
    assert ci_lines[0] == test
    rest = "\n".join(ci_lines[1:])
    for version in ("2.11.0", "2.15.0"):
        assert f"bash tests/on_torch.sh {version} " in rest, rest
    assert "pytest" not in rest  # nothing looser than the README's command: the same script users run
    # Only the tests marked slow are left out on the other releases (tests/conftest.py says which).
    assert rest.count('-m "not slow"') == 2 and "-k" not in rest and " -m " not in rest.replace('-m "not slow"', ""), rest
    assert "`bash tests/on_torch.sh 2.15.0`" in README


def test_every_slow_entry_names_a_test_that_exists():
    """A renamed test would silently leave the slow list (and run on every
    release): every entry names a test function in its file. (A case id in
    an entry is not checked here; a wrong one marks nothing.)"""
    import ast

    from conftest import SLOW

    assert SLOW
    for entry in sorted(SLOW):
        path, name = entry.split("::")
        func = name.split("[", 1)[0]
        tree = ast.parse((ROOT / path).read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == func for n in tree.body), entry


def test_readme_has_python_blocks():
    assert len(_python_blocks(README)) >= 1


@pytest.mark.parametrize("index", range(len(_python_blocks(README))))
def test_readme_python_block_runs_as_written(index, tmp_path):
    # A fresh interpreter in an empty folder: nothing defined beforehand,
    # nothing the block did not write itself.
    code = _python_blocks(README)[index]
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"README python block {index + 1} failed:\n{code}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"


def test_first_screen_says_what_it_does_then_how_to_start():
    first_screen = README.split("## Set up")[0]
    # One short paragraph under the title: what wfpass does for a model.
    paragraphs = [p for p in first_screen.split("\n\n")[1:] if p.strip()]
    assert len(paragraphs) == 1 and len(first_screen.splitlines()) <= 15, first_screen
    assert 'backend="wformat"' in first_screen
    # Then the two commands, then a short Python example, then the results table.
    order = [README.index(s) for s in ("```bash", "```python", "## Results")]
    assert order == sorted(order)
    example = _python_blocks(README)[0]
    assert 10 <= len(example.strip().splitlines()) <= 25, len(example.splitlines())


def test_results_table_is_short_and_names_its_machines():
    section = README.split("## Results", 1)[1]
    rows = [l for l in section.splitlines() if l.startswith("| ") and not l.startswith(("| what ", "|---"))]
    assert 1 <= len(rows) <= 8, rows
    machines = ("AMD EPYC", "Intel Xeon", "NVIDIA H100", "NVIDIA H200", "model not recorded")
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 4 and all(len(c) <= 120 for c in cells), row
        assert any(m in cells[2] for m in machines), row
        # A source, where given, is a committed results page.
        for target in re.findall(r"\]\((docs/[^)#]+)", cells[3]):
            assert target.startswith("docs/results/") and (ROOT / target).exists(), row
    assert all("](docs/results/" in r for r in rows), [r for r in rows if "](docs/results/" not in r]
    # The decoder's figures on more than one CPU, each with its own machine: they differ by vendor and ISA.
    assert len({c.split("|")[3].strip() for c in rows if "decoder" in c}) >= 2


def test_readme_is_short():
    assert len(README.splitlines()) <= 150


def test_relative_links_resolve():
    for target in re.findall(r"\]\((?!https?://|#)([^)#]+)", README):
        assert (ROOT / target).exists(), target

