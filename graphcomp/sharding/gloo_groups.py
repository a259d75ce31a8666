"""One gloo worker thread per process group for graphcomp's collectives on CPU.

``ProcessGroupGloo`` runs a group's collectives on 2 worker threads by default; two
collectives of one group in flight then run at the same time, and on torch 2.13 that
corrupts memory or deadlocks inside gloo, rarely but reproducibly; with one worker
thread the collective stress test does not reproduce it (docs/heap-corruption.md).
graphcomp keeps several collectives in flight (bucketed reduce-scatters in the
backward, prefetched gathers), so ``graphcomp.shard`` on CPU parameters and a gloo
group with more than one worker thread shards over a twin of that group instead: the
same ranks and collective timeout, one worker thread (made once per group; every
rank calls ``shard``). Its collectives then run one at a time, in issue order, while
compute still overlaps them. ``GRAPHCOMP_GLOO_SINGLE_THREAD=0`` keeps the group as
given.

Only a group spanning the whole world is twinned (``new_group`` is collective over
the world; a subgroup's non-members never call ``shard``); a subgroup is kept, with
a log line. ``is_serial(name)`` tells ``schedule_prefetch`` whether a CPU graph's
collectives all run on a one-thread gloo group (then prefetching is safe there too).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from graphcomp import _compat

log = logging.getLogger("graphcomp.sharding.gloo_groups")

__all__ = ["is_serial", "serial_group"]

_TWINS: dict[tuple[int, str], Any] = {}


def serial_group(group: Any) -> Any:
    """The group graphcomp's collectives use for CPU parameters sharded over
    ``group``: ``group`` itself when its gloo backend has one worker thread (or it is
    not gloo, or the opt-out is set, or it is a subgroup), else its one-thread twin."""
    import torch.distributed as dist

    if os.environ.get("GRAPHCOMP_GLOO_SINGLE_THREAD", "1") == "0":
        return group
    threads = _compat.gloo_worker_threads(group)
    name = _compat.process_group_name(group)
    if threads is None:
        return group
    if threads <= 1:
        return group
    if dist.get_world_size(group) != dist.get_world_size():
        log.info("graphcomp.shard: gloo group %s runs %d worker threads but is a subgroup: kept as given (several "
                 "of its collectives in flight can corrupt memory inside gloo: docs/heap-corruption.md)", name, threads)
        return group
    key = (id(group), name)
    twin = _TWINS.get(key)
    if twin is None or not _compat.group_is_live(twin):
        twin = _compat.new_gloo_group(None, 1, _compat.gloo_timeout(group))  # (the group's collective timeout)
        _TWINS[key] = twin
        log.info("graphcomp.shard: gloo group %s runs collectives on %d worker threads; graphcomp's collectives use "
                 "group %s instead (the same ranks, 1 worker thread: concurrent gloo collectives can corrupt memory "
                 "or hang, docs/heap-corruption.md; GRAPHCOMP_GLOO_SINGLE_THREAD=0 keeps the group)",
                 name, threads, _compat.process_group_name(twin))
    return twin


def is_serial(group_name: str) -> bool:
    """Whether the live group ``group_name`` is a gloo group with one worker thread
    (asked of the group itself: a name reused after its world was destroyed and
    initialized again answers for the group that has it now)."""
    group = _compat.group_by_name(group_name)
    return group is not None and _compat.gloo_worker_threads(group) == 1
