"""Inputs a captured piece writes in place, in a sharded model on 2 gloo ranks
(CPU stand-in device, tests/cpu/_fakecuda.py): BatchNorm's running statistics and
step count are functionalized writes into the forward piece's inputs, next to the
parameter gathers whose collectives the warm-ups stand in for. With CUDA graphs
(the stand-in) the buffers and parameters after 5 steps equal those of the same
sharded run with CUDA graphs off, bitwise (eager codegen); each rank's buffers
follow its own batches (no SyncBatchNorm)."""

from __future__ import annotations

import pytest
import torch


def _train(rank: int, world: int, cudagraphs: str) -> dict:
    from _fakecuda import fake_cuda_runtime

    import graphcomp
    from graphcomp.models import BatchNormMLP
    from graphcomp.sharding.shard import full_state_dict

    with fake_cuda_runtime():
        torch.manual_seed(0)
        m = BatchNormMLP(8, 16, 4)
        graphcomp.shard(m)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        cm = torch.compile(m, backend="graphcomp", options={"codegen": "eager", "cudagraphs": cudagraphs})
        for step in range(5):
            x = torch.randn(12, 8, generator=torch.Generator().manual_seed(100 * rank + step))
            cm(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        out = {"counters": dict(graphcomp.counters), "params": full_state_dict(m),
               "buffers": {k: v.clone() for k, v in m.named_buffers()}}
        graphcomp.runtime.teardown()
    return out


def _train_on_then_off(rank: int, world: int) -> tuple[dict, dict]:
    """Both runs in one task (each from a fresh compile state)."""
    import graphcomp

    on = _train(rank, world, "auto")
    torch._dynamo.reset()
    graphcomp.reset()
    return on, _train(rank, world, "off")


@pytest.fixture(scope="module")
def ranks2(shared_ranks2):
    """The session's pair of ranks (tests/cpu/conftest.py; its setup resets the compile
    state before each task): a fresh pair for this one test cost two processes'
    start (importing torch, Dynamo and graphcomp) in CI."""
    return shared_ranks2.view(timeout=300)


def test_batchnorm_buffers_of_a_sharded_model_match_graphs_off(ranks2):
    res = ranks2.run(_train_on_then_off)
    on, off = [r[0] for r in res], [r[1] for r in res]
    for r in range(2):
        c = on[r]["counters"]
        assert c.get("captures", 0) >= 2 and c.get("replays", 0) >= 8, c
        assert c.get("warmup_collectives_stood_in", 0) > 0, c  # the warm-ups ran with gathers stood in
        assert c.get("cudagraph_fallbacks", 0) == 0 and c.get("capture_failures", 0) == 0, c
        assert int(on[r]["buffers"]["1.num_batches_tracked"]) == 5
        for k, v in off[r]["buffers"].items():
            torch.testing.assert_close(on[r]["buffers"][k], v, rtol=0, atol=0, msg=f"rank {r} buffer {k}")
        for k, v in off[r]["params"].items():
            torch.testing.assert_close(on[r]["params"][k], v, rtol=0, atol=0, msg=f"rank {r} param {k}")
    # each rank's statistics follow its own batches
    assert not torch.equal(on[0]["buffers"]["1.running_mean"], on[1]["buffers"]["1.running_mean"])
