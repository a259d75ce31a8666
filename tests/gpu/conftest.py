"""GPU tests: every test is marked ``gpu`` and skipped without CUDA (or with fewer
GPUs than it needs). Run: ``python -m pytest -q -m gpu tests/gpu -x``."""

import os

import pytest
import torch

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(autouse=True)
def _fresh_state():
    import graphcomp
    import graphcomp.runtime

    torch._dynamo.reset()
    graphcomp.reset()
    yield
    graphcomp.runtime.reset()  # releases every graph first (teardown)
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def world1():
    """A single-rank NCCL process group in this process (for graphcomp.shard)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    import graphcomp.runtime

    graphcomp.runtime.teardown()  # always before destroy_process_group
    dist.destroy_process_group()
