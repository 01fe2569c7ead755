import os
import tempfile

import pytest
import torch

# Kernel decisions are kept between processes in WFPASS_CACHE_DIR
# (wfpass/pack/choose.py): the suite keeps its own, fresh each run, and its
# subprocesses inherit it, so no test reads a decision a developer's runs made.
os.environ["WFPASS_CACHE_DIR"] = tempfile.mkdtemp(prefix="wfpass-test-cache-")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Every test compiles the shared toy models anew; without a reset their
    # code objects hit Dynamo's recompile limit (8) across tests.
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()
