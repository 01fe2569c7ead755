"""The torch releases wfpass runs on, its C++ build on each, and what
``python -m wfpass doctor`` tells a user about their machine."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

from wfpass.tools import cli
from wfpass import native
from wfpass._torch import kernels, versions
from wfpass.native import ops as _nops


def test_this_torch_is_in_the_supported_range():
    v = versions.torch_version()
    assert versions.OLDEST <= v[:2] <= versions.NEWEST_TESTED, torch.__version__


@pytest.mark.parametrize("text", versions.TESTED + ("2.13.0+cpu", "2.15.0+cu132", "2.11.0+cu130"))
def test_every_tested_release_is_accepted_quietly(text):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.check(text)


@pytest.mark.parametrize("text", ["2.10.0+cpu", "2.9.1", "1.13.1"])
def test_an_older_torch_is_refused_with_the_range(text):
    with pytest.raises(ImportError, match=r"wfpass needs torch 2\.11 or newer; this is torch " + text.replace("+", r"\+")):
        versions.check(text)


def test_a_newer_torch_warns_and_goes_on():
    with pytest.warns(versions.UnsupportedTorchWarning, match=r"tested on torch 2\.11 to 2\.15 .*this is torch 2\.16\.0\.dev"):
        versions.check("2.16.0.dev20261101+cpu")


def test_importing_wfpass_on_an_older_torch_names_the_version_not_a_private_module():
    code = "import torch; torch.__version__ = '2.10.0+cpu'; import wfpass"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: wfpass needs torch 2.11 or newer; this is torch 2.10.0+cpu"), out.stderr[-2000:]


def test_the_cxx_standard_is_the_one_the_headers_ask_for():
    text = (native._TORCH_DIR / "include" / "ATen" / "ATen.h").read_text()
    want = "c++20" if "C++20 or later compatible compiler is required" in text else "c++17"
    assert native.cxx_standard() == want
    assert f"-std={want}" in native._flags()


def test_the_cache_key_follows_the_compiler_and_its_flags(monkeypatch):
    first = native.library_path()
    monkeypatch.setattr(native, "cxx_standard", lambda: "c++23")
    assert native.library_path() != first


def test_a_failed_build_reports_the_compilers_first_error(tmp_path):
    fake = tmp_path / "fakecxx"
    fake.write_text("#!/bin/sh\n"
                    "echo 'In file included from pack.cpp:1:' >&2\n"
                    "echo 'ATen.h:9:2: error: #error C++20 or later compatible compiler is required' >&2\n"
                    "echo 'pack.cpp:40:1: error: a later error that follows from the first' >&2\n"
                    "echo 'compilation terminated.' >&2\nexit 1\n")
    fake.chmod(0o755)
    code = "from wfpass import native; print(native.status())"
    env = {**os.environ, "CXX": str(fake), "WFPASS_CACHE": str(tmp_path / "cache"), "WFPASS_NATIVE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "the C++ build failed: fakecxx -std=" in out.stdout, out.stdout
    assert "error: #error C++20 or later compatible compiler is required" in out.stdout, out.stdout
    assert "later error" not in out.stdout


def test_a_kernel_whose_probe_fails_is_not_chosen_and_the_probe_runs_once(monkeypatch):
    calls = []

    def probe(dtype):
        calls.append(dtype)
        raise RuntimeError("could not create a primitive descriptor")

    monkeypatch.setattr(kernels, "_PROBED", {})
    monkeypatch.setattr(kernels, "_probe_lstm", probe)
    monkeypatch.setattr(kernels, "onednn_cpu_flag", lambda d: True)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch")
    assert not kernels.mkldnn_rnn_dtype(torch.float16)
    assert not kernels.mkldnn_rnn_dtype(torch.float16)
    assert calls == [torch.float16]
    assert kernels.probed()[("lstm", torch.float16)] is False


def test_probes_run_on_real_tensors_inside_a_fake_mode():
    # The formats ask while AOTAutograd traces, under FakeTensorMode.
    from torch._subclasses.fake_tensor import FakeTensorMode

    kernels._PROBED.clear()
    with FakeTensorMode():
        assert kernels.mkldnn_rnn_dtype(torch.float32) == torch.backends.mkldnn.is_available()


def test_doctor_says_which_torch_kernels_and_build(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out
    assert "oneDNN float32: LSTM kernel yes, packed linear yes" in out or "oneDNN: not in this torch build" in out
    assert "C++ kernels: " in out
    assert ("in use" in out) == native.is_loaded()
    if native.is_loaded():
        line = next(ln for ln in out.splitlines() if ln.startswith("packed RNN loop on raw pointers"))
        assert line.split(": ", 1)[1].startswith("yes" if native.fast_loop() else "no"), line
        line = next(ln for ln in out.splitlines() if ln.startswith("direct linear (float32"))
        from wfpass._torch import kernels

        isa = _nops.direct_isa()
        said = line.split("no copy): ", 1)[1]
        assert said.startswith({"avx512f": "yes (AVX-512F", "avx2": "yes (AVX2"}.get(isa, "no")), line
        assert ("AMX tiles" in said) == _nops.direct_amx(), line
        line = next(ln for ln in out.splitlines() if ln.startswith("packed copies, default bound"))
        assert "GiB more copies now" in line or "not known here" in line, line
        line = next(ln for ln in out.splitlines() if ln.startswith("bidirectional packed layers, both directions"))
        assert line.split(": ", 1)[1].startswith("yes" if native.parallel_directions() else "no"), line
        # torch's wheels run on OpenMP: where the loop runs, the kernels use torch's OpenMP threads
        if native.fast_loop() and torch.backends.openmp.is_available():
            assert native.parallel_directions()
    if torch.version.cuda:  # a CUDA build: which bodies the cuDNN RNN ops run
        line = next(ln for ln in out.splitlines() if ln.startswith("cuDNN RNN ops"))
        assert line.split("per-call work: ", 1)[1].startswith("C++" if native.cudnn_cxx() else "Python"), line


def test_a_cpu_user_of_a_cuda_build_sees_no_cuda_warning():
    # torch.utils.cpp_extension logs "No CUDA runtime is found" when a CUDA
    # build imports it on a machine without CUDA; wfpass's build must not.
    code = ("import sys, wfpass; from wfpass import native; native.load(); "
            "print('cpp_extension' in ' '.join(sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "No CUDA runtime" not in out.stderr + out.stdout
    assert out.stdout.strip().splitlines()[-1] == "False"
