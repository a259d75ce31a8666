import os

import pytest
import torch
import torch.distributed as dist

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts with no compiled frames, zero counters and Dynamo's caches cleared."""
    import graphcomp

    torch._dynamo.reset()
    graphcomp.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def pg1():
    """A one-process gloo group in the test process, destroyed afterwards (a test file
    may define its own, e.g. module-scoped in ``_optim_standin``)."""
    if dist.is_initialized():
        pytest.fail("a process group leaked from an earlier test (each in-process test must destroy its group)")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
