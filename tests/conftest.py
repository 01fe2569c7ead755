import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Every test compiles the shared toy models anew; without a reset their
    # code objects hit Dynamo's recompile limit (8) across tests.
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()
