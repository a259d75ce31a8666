import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts with no compiled frames, zero counters and Dynamo's caches cleared."""
    import graphcomp

    torch._dynamo.reset()
    graphcomp.reset()
    yield
    torch._dynamo.reset()
