#!/usr/bin/env bash
# The test suite on another torch release, in a venv of its own
# (.venv-torch-VERSION beside .venv), e.g.
#   bash tests/on_torch.sh 2.15.0
#   bash tests/on_torch.sh 2.11.0 -k rnn      (arguments after the version go to pytest)
# PyPI's torch for Linux is a CUDA build: it runs on the CPU, and it is the
# build the tests that trace models made for CUDA need (a CPU build refuses
# CUDA tensors even when they are fake).
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: bash tests/on_torch.sh TORCH_VERSION [PYTEST_ARGS...] (e.g. 2.15.0)}"
shift
venv=".venv-torch-$version"
# A machine-wide pip constraint file may cap torch below the release asked
# for by name here; this venv holds that release and nothing else.
export PIP_CONSTRAINT=/dev/null
python3 -m venv "$venv" && . "$venv/bin/activate"
pip install -q "torch==$version" && pip install -q -e ".[test]"
python -c "import torch; print('torch', torch.__version__)"
python -m pytest -q -p no:cacheprovider "$@"
