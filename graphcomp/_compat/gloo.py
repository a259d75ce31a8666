"""Private torch APIs for gloo process groups (re-exported from ``graphcomp._compat``;
the same rules apply: torch 2.11 and 2.13, nothing of graphcomp imported).

Why. ``ProcessGroupGloo`` runs collectives on 2 worker threads by default, so two
collectives of one group in flight run at the same time. On torch 2.13 (CPU) that
corrupts memory or deadlocks inside gloo, rarely but reproducibly, also with raw
functional collectives and no graphcomp graph (SIGABRT from glibc's heap checks,
SIGSEGV, or a hang); with one worker thread the stress test does not reproduce it
(``tests/stress/gloo_collectives_stress.py --gloo-threads`` compares the two;
docs/heap-corruption.md). ``dist.new_group`` ignores gloo options, so a group with
one worker thread is made by constructing its backend with options, for the one
``new_group`` call.
"""

from __future__ import annotations

from typing import Any

import torch


def gloo_worker_threads(group: Any) -> int | None:
    """How many worker threads the gloo backend of ``group`` (for CPU tensors) runs
    collectives on; None when the group has no gloo backend or torch does not say."""
    try:
        backend = group._get_backend(torch.device("cpu"))
    except Exception:  # noqa: BLE001 - no CPU backend, or another torch
        return None
    from torch.distributed import ProcessGroupGloo

    if not isinstance(backend, ProcessGroupGloo):
        return None
    threads = getattr(getattr(backend, "options", None), "_threads", None)
    return int(threads) if isinstance(threads, int) else None


def gloo_timeout(group: Any) -> Any:
    """The collective timeout (a ``timedelta``) of the gloo backend of ``group``, or None."""
    try:
        backend = group._get_backend(torch.device("cpu"))
        return backend.options._timeout
    except Exception:  # noqa: BLE001
        return None


def new_gloo_group(ranks: list[int] | None, threads: int, timeout: Any = None) -> Any:
    """``dist.new_group(ranks, timeout, backend="gloo")`` whose backend runs collectives
    on ``threads`` worker threads. Collective over the default group (every rank calls it)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d_py
    from torch.distributed import ProcessGroupGloo

    real = c10d_py.ProcessGroupGloo

    class _WithThreads(real):  # (a subclass: c10d checks isinstance against the name)
        def __init__(self, store: Any, rank: int, size: int, timeout: Any) -> None:
            opts = ProcessGroupGloo._Options()
            opts._threads = threads
            opts._timeout = timeout
            opts._devices = [ProcessGroupGloo.create_default_device()]
            super().__init__(store, rank, size, opts)

    c10d_py.ProcessGroupGloo = _WithThreads
    try:
        return dist.new_group(ranks=ranks, timeout=timeout, backend="gloo")
    finally:
        c10d_py.ProcessGroupGloo = real


def group_by_name(name: str) -> Any:
    """The live process group registered under ``name``, or None."""
    import torch.distributed.distributed_c10d as c10d_py

    try:
        return c10d_py._resolve_process_group(name)
    except Exception:  # noqa: BLE001 - unknown or destroyed
        return None


def group_is_live(group: Any) -> bool:
    """Whether ``group`` is still registered (not destroyed with its world)."""
    import torch.distributed.distributed_c10d as c10d_py

    try:
        return group in c10d_py._world.pg_map
    except Exception:  # noqa: BLE001
        return False
