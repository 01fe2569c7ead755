"""``python -m wfpass``: help and version without importing torch, help
text for every option, ``bench --quick`` writing its table and plot, the
demo tour, and ``WFPASS_REPORT=1`` printing at exit."""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import wfpass
from wfpass.tools import bench, bench_cases, cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_help_and_version_answer_without_importing_torch():
    res = _run("-X", "importtime", "-m", "wfpass", "--help")
    assert res.returncode == 0, res.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "wfpass.tools.cli" in imported
    assert "demo" in res.stdout and "bench" in res.stdout and "--version" in res.stdout
    res = _run("-m", "wfpass", "--version")
    assert res.returncode == 0 and res.stdout.startswith(f"wfpass {wfpass.__version__} (torch ")


def test_every_option_has_help_and_no_markup():
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parsers = [parser] + list(subs.choices.values())
    assert set(subs.choices) == {"demo", "bench", "doctor", "libraries"}
    for p in parsers:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                assert all(c.help for c in action._choices_actions)
                continue
            assert action.help and len(action.help) > 10, (p.prog, action.option_strings)
        text = p.format_help()
        # reStructuredText markup reads as noise in a terminal
        assert "``" not in text and ":func:" not in text and ":class:" not in text, p.prog


def test_bad_option_values_are_refused_with_the_option_named(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--only", "decoder,gpt"])
    assert "--only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["demo", "--rounds", "0"])
    assert "--rounds" in capsys.readouterr().err


def test_bench_writes_its_table_figures_and_plot_each_variant_in_its_own_process(tmp_path):
    res = _run("-m", "wfpass", "bench", "--quick", "--only", "cnn", "--rounds", "2", "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-5000:]
    table = (tmp_path / "out" / "bench.md").read_text()
    png = (tmp_path / "out" / "bench.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()
            if line.startswith("| bf16")]
    # Two timed rows, then the same two in the first-call table.
    assert [r[1] for r in rows[:2]] == ["training step", "eval forward"], table
    ratios = []
    for cells in rows[:2]:
        row = " | ".join(cells)
        for cell in cells[3:7]:
            assert re.fullmatch(r"\d+\.\d{3} ±\d+%", cell), row
        ratios.append(float(cells[7]))
        assert float(cells[7]) > 0 and float(cells[8]) > 0
        assert cells[9].startswith("ok"), row
        assert re.search(r"\d+ batchnorm", cells[10]), row  # wformat's format ran in its timed calls
    # Above the table: the worst row against each baseline, named.
    worst = re.search(r"Worst row: wformat at \*\*(\d+\.\d+)x\*\* of torch.compile's default \(Inductor\) \((.+?)\); "
                      r"at \*\*(\d+\.\d+)x\*\* of eager PyTorch \((.+?)\)", table)
    assert worst and float(worst.group(1)) == min(ratios), (table, ratios)
    stats = {c[0]: c[1] for c in ([x.strip() for x in line.strip().strip("|").split("|")] for line in table.splitlines()
                                   if line.startswith(("| eager ", "| wformat ")))}
    assert "running_var error" in table and stats == {"eager": "bfloat16", "wformat": "float32"}, table
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert [r["step"] for r in data["rows"]] == ["training step", "eval forward"] and all(r["ok"] for r in data["rows"])
    # Every variant in a process of its own; progress on stderr, the table on stdout.
    assert "starting 4 processes" in res.stderr and "| model " in res.stdout


@pytest.mark.parametrize("case", bench_cases.cases(bench_cases.QUICK), ids=lambda c: f"{c.model}, {c.step}, {c.size}")
def test_every_bench_row_builds_and_wformat_rewrites_it_and_matches_eager(case):
    """The rows the timing test above does not run: each builds its eager
    and wformat variants, their outputs agree, and wformat's report has the
    row's format rewritten (a row that silently ran unrewritten would time
    Inductor against itself)."""
    torch.compiler.reset()
    ref = case.build("eager")[1]().float()
    model, step, _ = case.build("wformat")
    out = step().float()
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= case.tol
    want = {"LLaMA-like decoder": "linear", "HF LLaMA generate()": "linear", "RNN language model": "rnn",
            "speech encoder": "rnn", "packed LSTM (variable lengths)": "rnn", "speech encoder (variable lengths)": "rnn",
            "bf16 CNN with BatchNorm": "batchnorm", "LSTMCell loop": "rnn", "GRUCell loop": "rnn"}
    assert want[case.model] in bench._rewrites(model), wfpass.report(model)
    torch.compiler.reset()


def test_plot_is_optional_with_a_clear_message(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    case = bench.Case("m", "s", "z", lambda: None, 1e-4)
    res = bench.Result(case, {k: bench.Timing([1.0, 1.1, 0.9]) for k in bench.VARIANTS}, {}, {}, True)
    msg = bench.plot([res], str(tmp_path / "x.png"))
    assert "matplotlib is not installed" in msg and not (tmp_path / "x.png").exists()


def test_interleaved_timing_rotates_the_order_and_keeps_every_round():
    seen = []
    steps = {k: (lambda k=k: seen.append(k)) for k in "abc"}
    t = bench.interleaved(steps, rounds=3, min_s=0.0)
    assert {k: len(v.samples) for k, v in t.items()} == {"a": 3, "b": 3, "c": 3}
    timed = seen[6:]  # after one warm-up and one calibration call each
    assert timed[:3] == ["a", "b", "c"] and timed[3:6] == ["b", "c", "a"] and timed[6:] == ["c", "a", "b"]
    assert bench.Timing([1.0, 2.0, 3.0, 4.0, 100.0]).median == 3.0
    assert bench.Timing([1.0, 1.0, 1.0]).spread == 0.0


def test_demo_leads_with_measured_wins_checks_them_and_shows_zero_bytes():
    res = _run("-m", "wfpass", "demo", "--rounds", "2")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert "1 thread(s)" in out and "x faster = baseline time / wformat time" in out
    first = out.index("1. A Python loop of nn.LSTMCell")
    assert first < out.index("2. BatchNorm statistics") < out.index("3. Decoding one token") < out.index("4. What changed")
    # Each comparison is a ratio or the sentence saying it is within noise.
    assert re.search(r"(than|level with) the eager loop", out) and re.search(r"(than|level with) Inductor", out), out
    assert "the same nn.Parameter objects as before compiling: yes" in out and "(+0)" in out
    assert "layers.0.{q.weight, k.weight, v.weight}" in out
    assert out.rstrip().endswith("OK: every check passed")
    assert "compiling" in res.stderr  # progress while the compiles run


def test_wfpass_report_env_prints_at_exit_with_live_counters():
    code = (
        "import torch, wfpass\n"
        "from torch import nn\n"
        "class QKV(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 8), nn.Linear(16, 8)\n"
        "    def forward(self, x):\n"
        "        return self.q(x).sum() + self.k(x).sum() + self.v(x).sum()\n"
        "f = torch.compile(QKV(), backend=wfpass.backend(inner='eager'))\n"
        "for _ in range(3):\n"
        "    f(torch.randn(1, 16))\n"
        "print('done')\n"
    )
    res = _run("-c", code, env={"WFPASS_REPORT": "1"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "done"  # the report goes to stderr, after the program's own output
    assert "wfpass report" in res.stderr and "fused_calls=3" in res.stderr and "q.weight, q.bias, k.weight" in res.stderr
    res = _run("-c", code, env={"WFPASS_REPORT": "0"})
    assert "wfpass report" not in res.stderr


def test_bench_refuses_an_out_that_is_a_file_before_timing_anything(tmp_path, capsys):
    """``--out`` names a folder: a file there is refused at once (exit 2,
    the option named), not after the run's ten minutes, when the figures
    could not be written."""
    from wfpass.tools import bench, cli

    page = tmp_path / "bench.md"
    page.write_text("kept")
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--out", str(page)])
    assert e.value.code == 2 and "--out must name a folder" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--out must name a folder"):
        bench.main(out=str(page))
    assert page.read_text() == "kept"
