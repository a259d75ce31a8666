"""What graphcomp's prefetching relies on from functional collectives on gloo
(docs/heap-corruption.md, suspects 1-3): a tensor handed to an in-flight collective
stays alive until its wait even when the graph drops it right after the issue, and
a reduce-scatter writes its output only in the wait, on the caller's thread."""

import threading
import time
import weakref

from _dist import run_distributed


def _lifetimes(rank, world):
    import torch
    import torch.distributed as dist

    c10d = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    out = {"input_died": [], "rs_output_written_by_wait": []}
    for trial in range(6):
        dist.barrier()
        if (rank + trial) % 2:
            time.sleep(0.05)  # alternate which rank is late
        died = []
        x = torch.full((1000,), float(rank))
        weakref.finalize(x, lambda: died.append(threading.current_thread() is threading.main_thread()))
        ag = c10d.all_gather_into_tensor(x, world, group)
        del x  # the graph's last-use free
        time.sleep(0.1)  # the collective completes meanwhile
        before = len(died)
        full = c10d.wait_tensor(ag)
        assert torch.equal(full, torch.arange(world, dtype=torch.float32).repeat_interleave(1000))
        out["input_died"].append((before, list(died)))

        g = torch.full((world * 8,), float(rank + 1))
        rs = c10d.reduce_scatter_tensor(g, "sum", world, group)
        del g
        time.sleep(0.1)  # the all-reduce behind it completes meanwhile
        rs.fill_(float("nan"))  # a value gloo would have to overwrite
        res = c10d.wait_tensor(rs)
        out["rs_output_written_by_wait"].append(torch.equal(res, torch.full((8,), float(sum(range(1, world + 1))))))
    return out


def test_gloo_keeps_collective_buffers_alive_until_the_wait():
    for res in run_distributed(_lifetimes, 2, timeout=180):
        # the input died after the wait, on the main thread, never before
        assert res["input_died"] == [(0, [True])] * 6
        # the reduce-scatter's output was written by the wait (over the NaNs), not before
        assert res["rs_output_written_by_wait"] == [True] * 6
