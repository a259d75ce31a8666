"""graphcomp.shard on CPU parameters shards over a gloo group with one worker thread
(graphcomp.sharding.gloo_groups; docs/heap-corruption.md: two collectives of one group running
at once on gloo's worker threads can corrupt memory or hang)."""

from __future__ import annotations

import os

import torch

from _dist import run_distributed


def _groups(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import graphcomp
    from graphcomp import _compat
    from graphcomp.sharding import gloo_groups
    from graphcomp.models import TinyMLP
    from graphcomp.sharding.shard import shard_info

    out = {"world_threads": _compat.gloo_worker_threads(dist.group.WORLD),
           "world_name": _compat.process_group_name(dist.group.WORLD)}
    names = []
    for _ in range(2):
        m = TinyMLP(dim=8, hidden=13, out=3)
        graphcomp.shard(m)
        names.append(shard_info(m.fc1, "weight").group_name)
    out["names"] = names
    twin = next(g for g in gloo_groups._TWINS.values() if _compat.process_group_name(g) == names[0])
    out["twin_threads"] = _compat.gloo_worker_threads(twin)
    out["timeouts"] = (_compat.gloo_timeout(dist.group.WORLD), _compat.gloo_timeout(twin))
    out["serial"] = gloo_groups.is_serial(names[0])
    # a step through the twin: sharded training as usual
    torch.manual_seed(0)
    m = TinyMLP(dim=8, hidden=13, out=3)
    graphcomp.shard(m)
    x, y = torch.randn(4, 8), torch.randn(4, 3)
    m(x, y).backward()
    out["grad_ok"] = all(p.grad is not None for p in m.parameters())
    os.environ["GRAPHCOMP_GLOO_SINGLE_THREAD"] = "0"
    try:
        m = TinyMLP(dim=8, hidden=13, out=3)
        graphcomp.shard(m)
        out["opt_out_name"] = shard_info(m.fc1, "weight").group_name
    finally:
        del os.environ["GRAPHCOMP_GLOO_SINGLE_THREAD"]
    return out


def test_cpu_parameters_shard_over_a_one_thread_twin_of_the_group():
    for r in run_distributed(_groups, 2, timeout=120):
        assert r["world_threads"] == 2, r  # torch's default
        assert r["names"][0] == r["names"][1] != r["world_name"], r  # one twin, made once
        assert r["twin_threads"] == 1 and r["serial"], r
        assert r["timeouts"][0] == r["timeouts"][1] and r["timeouts"][0] is not None, r  # a hang fails as fast
        assert r["grad_ok"], r
        assert r["opt_out_name"] == r["world_name"], r


def test_destroying_a_subgroup_forgets_only_that_group(monkeypatch):
    """graphcomp's destroy_process_group wrapper forgets the destroyed group's name
    only: destroying an unrelated subgroup must leave shard()'s groups known (they
    decide which collectives are resharded), destroying the default group forgets all.
    The runtime's graphs are released on every destroy (conservative: which groups a
    captured graph uses is not recorded)."""
    import torch.distributed as dist

    from graphcomp import _compat, runtime
    from graphcomp.sharding import mesh as mesh_sharding

    torn = []
    monkeypatch.setattr(runtime, "teardown", lambda: torn.append(1) or 0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert _compat.wrap_destroy_process_group()
        world = _compat.process_group_name(dist.group.WORLD)
        sub = dist.new_group([0])
        sub_name = _compat.process_group_name(sub)
        mesh_sharding.register(world, False)
        mesh_sharding.register(sub_name, True)
        other = dist.new_group([0])
        dist.destroy_process_group(other)
        assert mesh_sharding.shard_groups() == {world: False, sub_name: True}
        dist.destroy_process_group(group=sub)
        assert mesh_sharding.shard_groups() == {world: False}
        assert len(torn) == 2
    finally:
        dist.destroy_process_group()
    assert mesh_sharding.shard_groups() == {}
    assert len(torn) == 3
