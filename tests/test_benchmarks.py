"""The benchmarks: one folder per format, each script listed in
benchmarks/README.md with its command and its results page, every path to a
script in the docs and tests pointing at one that exists; and smoke runs of
the scripts whose tables the docs read (they must keep running, and their
pieces must add up the way the docs read them)."""
from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest
import torch

from wftest import needs_cuda_build

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _script(name: str) -> pathlib.Path:
    """A benchmark script by name, in whichever format's folder it sits."""
    (path,) = (ROOT / "benchmarks").glob(f"*/{name}.py")
    return path


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, _script(name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# -- the layout: a folder per format, each script in the README with its page ---------

BENCHMARKS = ROOT / "benchmarks"
FOLDERS = ("rnn", "linear", "prepack", "batchnorm", "gpu", "overall")


def _scripts():
    return sorted(p for p in BENCHMARKS.rglob("*.py") if not p.name.startswith("_"))


def _readme_sections():
    """``{folder: its section of benchmarks/README.md}``, by ``## folder/`` headings."""
    readme = (BENCHMARKS / "README.md").read_text()
    return {part.split("/", 1)[0]: part for part in readme.split("\n## ")[1:]}


def test_benchmarks_sit_in_a_folder_per_format():
    # At the root only the shared modules (named with a leading underscore).
    assert sorted(p.name for p in BENCHMARKS.glob("*.py")) == ["_out.py", "_worker.py"]
    assert {p.parent.relative_to(BENCHMARKS).as_posix() for p in _scripts()} == set(FOLDERS)
    assert set(_readme_sections()) == set(FOLDERS)


@pytest.mark.parametrize("script", _scripts(), ids=lambda p: p.relative_to(BENCHMARKS).as_posix())
def test_the_readme_lists_every_script_with_its_command_and_page(script):
    rel = script.relative_to(BENCHMARKS).as_posix()
    section = _readme_sections().get(script.parent.name, "")
    rows = [line for line in section.splitlines() if line.startswith(f"| `{script.name}` |")]
    assert len(rows) == 1, f"benchmarks/README.md lists {rel} {len(rows)} times under ## {script.parent.name}/"
    (row,) = rows
    assert f"`python benchmarks/{rel}" in row, f"{rel}: its command is not on its line: {row}"
    pages = re.findall(r"\]\(\.\./docs/results/([^)#]+)\)", row)
    assert pages, f"{rel}: its line links no results page: {row}"
    for page in pages:
        assert (ROOT / "docs" / "results" / page).is_file(), f"{rel}: docs/results/{page} does not exist"


@pytest.mark.parametrize("script", [p for p in _scripts() if p.parent.name != "gpu" and '"--out"' in p.read_text()],
                         ids=lambda p: p.relative_to(BENCHMARKS).as_posix())
def test_every_cpu_script_that_writes_a_page_names_the_cpu(script):
    # Figures differ by CPU vendor and instruction set (an MKL sgemm on an
    # AMD EPYC against an Intel Xeon's AMX): a page that says only "x86_64"
    # cannot be read. The GPU scripts name the GPU instead.
    src = script.read_text()
    assert "cpu_words()" in src, f"{script.name} writes a page (--out) without wfpass.tools.doctor.cpu_words()"
    assert "platform.machine()" not in src, f"{script.name} still names the machine by platform.machine()"


def test_every_readme_line_names_a_script_and_links_pages_that_exist():
    readme = (BENCHMARKS / "README.md").read_text()
    for folder, section in _readme_sections().items():
        for name in re.findall(r"^\| `(\w+\.py)` \|", section, re.M):
            assert (BENCHMARKS / folder / name).is_file(), f"README lists {folder}/{name}, which does not exist"
    links = re.findall(r"\]\((?!https?://)([^)#]+)", readme)
    assert len(links) > len(_scripts())
    for target in links:
        assert (BENCHMARKS / target).exists(), f"benchmarks/README.md links to a missing {target}"


def _mentions():
    """Every ``benchmarks/...py`` in README.md, docs/**/*.md, benchmarks/ and
    tests/, with where it is."""
    files = [ROOT / "README.md", BENCHMARKS / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "tests").rglob("*.py")), *_scripts()]
    for f in files:
        for m in re.finditer(r"\bbenchmarks/(?:[\w-]+/)*[\w-]+\.py\b", f.read_text()):
            yield f.relative_to(ROOT).as_posix(), m.group(0)


def test_every_path_to_a_benchmark_exists():
    mentions = list(_mentions())
    assert len(mentions) > 200  # the check sees the docs' commands
    missing = sorted({(f, path) for f, path in mentions if not (ROOT / path).is_file()})
    assert not missing, missing


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


@needs_cuda_build
def test_gpu_benchmark_check_compiles_every_model_to_the_expected_graph():
    """``bench_gpu.py --check``: what a GPU session will measure compiles, on
    fake CUDA, to one graph per model with each RNN one cuDNN call."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(_script("bench_gpu")), "--check"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "every model compiles to the expected graph" in out.stdout
    assert out.stdout.count("ok   ") == 12, out.stdout  # 6 models, training and inference


def test_packed_threads_profile_runs():
    """``profile_packed_threads.py`` (docs/results/rnn_varlen.md cites it): it runs, and
    says which kernels and both timings."""
    import re
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(_script("profile_packed_threads")), "--calls", "2"],
                         capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"one after the other: [\d.]+ ms per pair; two threads at once: [\d.]+ ms per pair",
                     out.stdout), out.stdout
    assert re.search(r"packed_bilayer_fw: [\d.]+ ms at 1 torch thread, [\d.]+ ms at 2", out.stdout), out.stdout


def test_gpu_summary_reads_the_committed_pages():
    """``gpu_summary.py`` made docs/results/gpu_grid_h100.md's summary from the two
    pages beside it: the same table comes out of them again, and a page's
    ratios are the baseline's time / wformat's."""
    mod = _load("gpu_summary")
    pages = [str(ROOT / "docs" / "results" / f"gpu_grid_h100_run{i}.md") for i in (1, 2)]
    rows = mod.read_pages(pages)
    lm = rows[("LSTM LM", "inference")]
    assert len({(r["T"], r["batch"]) for r in lm}) == 12
    r = next(r for r in lm if (r["T"], r["batch"]) == ("1", "1"))
    assert float(r["eager"]) / float(r["wformat"]) == pytest.approx(float(r["x faster than eager"]), abs=0.006)
    table = mod.summary(rows)
    assert table in (ROOT / "docs" / "results" / "gpu_grid_h100.md").read_text()


def test_host_cost_benchmark_runs_quick_and_its_tables_add_up(tmp_path):
    """``host_cost.py --quick`` (docs/results/host_cost.md): one case in a process of
    its own, every variant timed; the table has both steps with ratios,
    floor and the direct check; the parts table a row per compiled variant
    whose parts add up to its total; the wformat variant rewrote the RNN."""
    import json
    import re

    mod = _load("host_cost")
    out, raw = tmp_path / "t.md", tmp_path / "t.json"
    assert mod.main(["--quick", "--cases", "lstm2", "--out", str(out), "--json", str(raw)]) == 0
    text = out.read_text()
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| LSTM 2 layers, T 4, batch 4 |")]
    timed = [r for r in rows if r[2].isdigit()]
    assert [r[1] for r in timed] == ["inference", "training step"], text
    for r in timed:
        assert all(float(c) > 0 for c in r[2:5]), r
        assert re.fullmatch(r"\d+\.\d\dx ±\d+%", r[5]) and re.fullmatch(r"\d+\.\d\dx ±\d+%", r[6]), r
        assert float(r[10]) > 0, r  # the layout check, timed directly
    parts = [r for r in rows if not r[2].isdigit()]
    assert all(len(r) == 3 + len(mod.PARTS) + 1 for r in parts), text
    assert {(r[1], r[2]) for r in parts} == {(s, v) for s in mod.STEPS for v in ("inductor", "wformat")}, text
    for r in parts:
        assert abs(sum(float(c) for c in r[3:-1]) - float(r[-1])) <= len(mod.PARTS), r
    saved = json.loads(raw.read_text())
    (res,) = saved["results"]
    assert res["rewritten"]["wformat"] == ["rnn"] and res["threads"] == 1
    # The tables come out of the raw figures again, targets included.
    again = tmp_path / "again.md"
    assert mod.main(["--from-json", str(raw), "--out", str(again)]) == 0
    assert again.read_text() == text and "### Targets" in text
    assert mod.part_of("## Call CompiledFxGraph abc ##") == "Inductor wrapper"
    assert mod.part_of("wfpass::lstm_layer_fw") == "wfpass op bodies"
    assert mod.part_of("aten::mm") == "kernels and the rest"


def test_size_asserts_benchmark_runs(capsys):
    """``size_asserts.py`` (docs/results/host_cost_parts.md): one case, both steps, every
    variant timed, and the ratio column."""
    _load("size_asserts").main(["--cases", "gru1", "--rounds", "1", "--sample-s", "0.002"])
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| gru1 |")]
    assert [r[1] for r in rows] == ["inference", "training step"], rows
    assert all(float(c) > 0 for r in rows for c in r[2:]), rows


def test_cpu_rnn_kernels_benchmark_times_both_kernels_per_step(capsys):
    """``cpu_rnn_kernels.py`` (docs/results/rnn_cpu_kernels.md): both kernels of each size timed
    in both steps, the ratios their quotients, and what auto takes."""
    from wfpass import native

    if not native.fast_loop():
        pytest.skip("the C++ loop's fast steps need the C++ kernels and AVX-512 or AVX2 with FMA")
    _load("cpu_rnn_kernels").main(["--quick"])
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| LSTM |") or line.startswith("| GRU |")]
    rows = list({tuple(r): r for r in rows}.values())  # printed as it goes and again in the table
    assert [r[0] for r in rows] == ["LSTM", "GRU"], rows
    for r in rows:
        ei, li, xi, et, lt, xt = map(float, r[5:11])
        assert abs(xi - ei / li) < 0.01 * xi and abs(xt - et / lt) < 0.01 * xt, r
        assert r[11] == "loop", r  # both sizes are small: the loop


def test_pack_real_calls_benchmark_times_every_linear_in_both_variants(tmp_path):
    """``pack_real_calls.py --quick`` (docs/results/choice_spread_model_calls.md): every linear
    shape of the small decoder (Q/K/V block, o, gate/up block, down) is
    found by its recorded shapes at each length in both variants, with a
    time, and the summary line counts the packed ones."""
    import os
    import re
    import subprocess
    import sys

    out = tmp_path / "t.md"
    r = subprocess.run([sys.executable, "pack_real_calls.py", "--quick", "--rounds", "1", "--calls", "2",
                        "--tokens", "1", "5", "--out", str(out)], capture_output=True, text=True, timeout=600,
                       cwd=str(ROOT / "benchmarks" / "prepack"), env={**os.environ, "WFPASS_CACHE_DIR": "off"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.read_text().splitlines()
            if re.match(r"\| \d+x\d+ \|", line)]
    got = {(row[0], row[1]) for row in rows}
    assert got == {(s, m) for s in ("128x64", "64x64", "344x64", "64x172") for m in ("1", "5")}, rows
    for row in rows:
        assert row[2] in ("plain", "brgemm", "onednn", "mkl"), row
        assert float(row[3]) > 0 and float(row[4]) > 0 and float(row[5]) > 0, row
    assert re.search(r"slower than the plain GEMM on the real calls \(median round\): \d+ of \d+", out.read_text())


def test_cudnn_body_cost_benchmark_runs():
    """The Python body's host cost beyond an op call, with ATen's cuDNN call
    stubbed (docs/results/rnn_cuda_path.md): runs on the CPU and prints its figure."""
    import re
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(_script("cudnn_body_cost")), "--rounds", "1", "--calls", "50"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r"Python body, kernel stubbed: ([\d.]+) us; a C\+\+ op call with the same weights: ([\d.]+) us", r.stdout)
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, r.stdout


def test_lstm_pack_kernel_packed_mode_reads_the_copy_with_the_same_bits(capsys, monkeypatch):
    """``lstm_pack_kernel.py --packed`` (docs/results/rnn_onednn_layout.md): every packed size
    timed from the plain weights and from the copy (the script stops if the
    copy was never read), the outputs the same bits."""
    from wfpass._torch.kernels import mkldnn_rnn_dtype

    if not torch.backends.mkldnn.is_available() or not mkldnn_rnn_dtype(torch.float32):
        pytest.skip("needs oneDNN's LSTM")
    assert _load("lstm_pack_kernel").main(["--packed", "--rounds", "1", "--sample-s", "0.001"]) == 0
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 4, rows
    for r in rows:
        plain, copy, x, diff = float(r[5]), float(r[6]), float(r[7]), float(r[8])
        assert plain > 0 and copy > 0 and x > 0 and diff == 0.0, r


def test_layer_call_ab_times_each_checkout_in_its_own_process(capsys):
    """``layer_call_ab.py --quick`` (docs/results/host_cost_loop_call.md): this checkout twice,
    each in its own process importing it from its path, every size timed
    in both and the ratio of the two columns printed."""
    from wfpass import native

    if not (native.loaded() and native.fast_loop()):
        pytest.skip("needs the C++ loop")
    assert _load("layer_call_ab").main(["--quick"]) == 0
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| LSTM")]
    assert len(rows) == 2, rows
    for r in rows:
        a, b, x = float(r[1]), float(r[2]), float(r[3])
        assert a > 0 and b > 0 and _ratio_of_printed(x, a, b), r


def test_encoder_two_kernels_times_both_kernels_in_one_process(capsys):
    """``encoder_two_kernels.py`` (docs/results/rnn_speed.md): the encoder's
    training step on the loop and on oneDNN's layer, both timed, the ratio
    printed from them."""
    from wfpass import native

    if not (native.loaded() and native.fast_loop()):
        pytest.skip("needs the C++ loop")
    assert _load("encoder_two_kernels").main(["--rounds", "1", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    times = [float(line.split(": ")[1].split()[0]) for line in out.splitlines() if "ms per training step" in line]
    ratio = float(out.split("oneDNN / loop: ")[1].split()[0])
    assert len(times) == 2 and all(t > 0 for t in times), out
    assert ratio == pytest.approx(times[1] / times[0], abs=0.01), out


@pytest.mark.parametrize("pool", [[], ["--pool-mib", "1"]], ids=["alone", "pool"])
def test_brgemm_kernel_times_the_kernels_and_their_kernel_bytes(capsys, pool):
    """``brgemm_kernel.py`` (docs/results/prepack_kernels.md): each kernel timed per shape and
    row count, alone or cycling through copies (brgemm and direct checked
    against the plain GEMM first), the ratios printed from the times, and
    the heap a new row count leaves."""
    from wfpass._torch import kernels
    from wfpass.native import ops as _nops

    if not _nops.panel_packs(torch.float32):
        pytest.skip("no brgemm kernel here")
    assert _load("brgemm_kernel").main(["--rounds", "1", "--shapes", "100x40", "--rows", "1,2", *pool]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| 100x40")]
    assert len(rows) == 3, out  # two row counts timed, one line of heap figures
    direct = _nops.direct_runs(torch.float32)
    for r in rows[:2]:
        plain, onednn, brgemm, d, xo, xb, xd = r[2:]
        assert _ratio_of_printed(float(xo), float(plain), float(onednn)), r
        assert _ratio_of_printed(float(xb), float(plain), float(brgemm)), r
        if direct:
            assert _ratio_of_printed(float(xd), float(plain), float(d)), r
        else:
            assert d == xd == "-", r


def _ratio_of_printed(x: float, a: float, b: float) -> bool:
    """Is ``x`` (printed to 0.01) the ratio of two times printed to 0.1 us
    and computed from the unrounded ones? A time of 6.8 us printed is 6.75
    to 6.85: 1.5% either way, which a fixed relative tolerance missed now
    and then."""
    lo, hi = (a - 0.05) / (b + 0.05), (a + 0.05) / max(b - 0.05, 1e-9)
    return lo - 0.006 <= x <= hi + 0.006


def test_decode_profile_page_is_its_json_and_events_land_in_their_parts():
    """docs/results/decode_profile_amd.md's table is what profile_decode.py
    renders from the run's JSON (no figure typed by hand), and the
    profiler's events land in the part their names say."""
    import json
    import types

    mod = _load("profile_decode")
    data = json.loads((ROOT / "docs/results/data/decode_profile_amd.json").read_text())
    page = (ROOT / "docs/results/decode_profile_amd.md").read_text()
    table = [line for line in mod._md(data["runs"], data["command"]).splitlines() if line.startswith("|")]
    assert table and all(line in page for line in table)
    events = [types.SimpleNamespace(key=k, self_cpu_time_total=t * 1e3) for k, t in (
        ("wfpass::packed_linear", 5.0), ("aten::_scaled_dot_product_flash_attention_for_cpu", 2.0),
        ("graph_2_cpp_fused__scaled_dot_product_flash_attention_for_cpu_mul_1", 0.5),
        ("## Call CompiledFxGraph fabc ##", 1.0), ("TorchDynamo Cache Lookup", 0.25), ("aten::copy_", 0.125))]
    got = mod._parts(events)
    assert got["linears"] == 5.0 and got["attention"] == 2.0 and got["Inductor's fused kernels"] == 0.5
    assert got["Inductor's wrapper code"] == 1.0 and got["Dynamo's guards"] == 0.25 and got["other ATen ops"] == 0.125
