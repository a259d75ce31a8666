import os

# Inductor's C++ kernels without the vector ISA (scalar loops) in this process and in
# every rank and subprocess it starts (they inherit the environment): a supported
# Inductor setting (torch/_inductor/config.py cpp.vec_isa_ok) set before torch is
# imported. With the machine's ISA every kernel's g++ run includes and optimizes
# ATen's Vectorized templates: test_backend.py's Inductor-vs-Inductor test, empty
# Inductor cache, this 2-core machine: g++ 34 calls, 41.5 s -> 24 calls, 20 s; test
# 59 -> 32 s. Tests compare Inductor against Inductor under the same setting, and
# against eager within their tolerances; test_codegens_match_eager[inductor] compiles
# with the machine's vector ISA (what users get).
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts with no compiled frames, zero counters and Dynamo's caches cleared.
    When no process group is alive, the groups ``shard()`` registered are forgotten:
    graphcomp forgets them in its ``destroy_process_group`` wrapper, which the CPU
    stand-ins (``install_stand_in``, ``_fakecuda``) turn off, and a later test's new
    group reusing a name would be taken for a sharded one (test_tp_passes after
    test_step_capture)."""
    import graphcomp
    from graphcomp.sharding import mesh as mesh_sharding

    torch._dynamo.reset()
    graphcomp.reset()
    if not dist.is_initialized():  # (a module-scoped group may still be alive here)
        mesh_sharding._forget_groups()
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


# One pool of 2 and one of 4 gloo ranks for the whole session: the multi-rank modules
# whose tasks start from a fresh compile state (each resets Dynamo and graphcomp, or the
# module's pool did it as its setup) take them with their own per-call timeout
# (``shared_ranks2.view(timeout=...)``) instead of starting their own pair of processes
# (5-7 s each on CI's 2 cores). Pools whose ranks differ (test_faults.py: the gloo
# timeout is what it tests; test_rank_agreement.py: GRAPHCOMP_DEBUG in the ranks) stay
# their modules' own. A task that fails kills the ranks; the next run starts new ones.
@pytest.fixture(scope="session")
def shared_ranks2():
    from _dist import DistPool, reset_compile_state

    with DistPool(2, setup=reset_compile_state, timeout=600) as pool:
        yield pool


@pytest.fixture(scope="session")
def shared_ranks4():
    from _dist import DistPool, reset_compile_state

    with DistPool(4, setup=reset_compile_state, timeout=600) as pool:
        yield pool


# Under pytest-xdist (``make test``: 2 workers, whole files each), the slowest modules
# are handed out first, so that no long file starts last while the other worker idles
# (longest-first). Ordered by each module's seconds (its tests' wall time, setup and
# teardown included) in a 2-worker .ci/run on a clean clone at e834dfd, this 2-core
# machine, its Inductor cache warm for the kernels but not for that commit's graphcomp
# source: hf_zoo 687, sharded_training 459, embedding_exchange 231, examples 197,
# tensor_parallel 181, remat 167, bench_smoke 95, chunk_lm_loss_e2e 87, bench_hf 86,
# defer_weight_grads 60, rank_local_capture 55, inductor_order 43, sharding 42, faults
# 40, prefetch_across_steps 34, step_capture 31, backend 30, debug_tools 26; the rest
# 20 s or less (gloo_stress 18, listed since it starts a subprocess that could start
# last; hf_trainer, 24 s alone with a cold Inductor cache, one task on the shared
# ranks that compiles twice). A file not listed keeps its place after these. The order
# within each module is unchanged, and a run in one process keeps the collection order.
_SLOW_MODULES_FIRST = (
    "test_hf_zoo.py", "test_sharded_training.py", "test_embedding_exchange.py", "test_examples.py",
    "test_tensor_parallel.py", "test_remat.py", "test_bench_smoke.py", "test_chunk_lm_loss_e2e.py",
    "test_bench_hf.py", "test_defer_weight_grads.py", "test_rank_local_capture.py", "test_inductor_order.py",
    "test_sharding.py", "test_faults.py", "test_prefetch_across_steps.py", "test_step_capture.py",
    "test_backend.py", "test_debug_tools.py", "test_hf_trainer.py", "test_gloo_stress.py",
)


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {name: i for i, name in enumerate(_SLOW_MODULES_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))  # stable: keeps the rest in order


def pytest_collection_finish(session):
    """After collection (torch, the test modules and what they import are loaded), the
    objects alive now move to the garbage collector's permanent generation, once, with
    Dynamo, Inductor and graphcomp imported first: the in-process compiles' full
    collections then walk only what the tests create (see ``_freeze_survivors`` in
    tests/cpu/_dist.py, which does the same before each task in the ranks)."""
    import gc
    import warnings

    with warnings.catch_warnings():  # (torch.jit's deprecation warnings, raised while importing Inductor)
        warnings.simplefilter("ignore", DeprecationWarning)
        import torch._dynamo  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401

        import graphcomp  # noqa: F401

    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    """Wait for the ranks' fork server (tests/cpu/_dist.py ``rank_context``; the
    session's pools are closed by now), so that the CPU time of the ranks forked from
    it counts as this process's children's. First among the sessionfinish hooks: a
    pytest-xdist worker reports that it finished from its own, after which the
    controller may terminate it."""
    import sys

    if "_dist" in sys.modules:
        sys.modules["_dist"].stop_fork_server()

