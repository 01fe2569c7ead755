"""README's two set-up commands exist and .ci/run runs the test one verbatim."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bash_blocks(text):
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_ci_runs_the_readme_test_command():
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    assert len(blocks) == 2, blocks
    demo, test = blocks
    assert "python -m wfpass demo" in demo and "pip install torch==2.13.0" in demo
    assert "pytest" in test and "pip install torch==2.13.0" in test
    ci_lines = [l for l in (ROOT / ".ci/run").read_text().splitlines() if l and not l.startswith(("#", "set ", "cd "))]
    assert ci_lines == [test]
