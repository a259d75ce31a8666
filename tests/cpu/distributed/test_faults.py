"""Fault tests: one rank raising mid-step (forward, backward, optimizer)
or interrupted by Ctrl-C makes the other rank fail within a bounded time with a
message, never hang; a
checkpoint written during a step that then fails is complete, and one whose write
fails on a rank is not half-written (DCP semantics).

Two ways a rank fails, two bounds (README "Distributed safety"):

* the failing rank's process exits (an uncaught exception ends a training script):
  its sockets close, and the peer's next gloo collective raises at once
  ("Connection closed by peer" / "Connection reset"), seconds, not the timeout;
* the failing rank stays alive (it caught the exception, or hangs elsewhere): the
  peer's collective raises after the process group's timeout
  (``init_process_group(timeout=...)``; ``PG_TIMEOUT_S`` here).

Each run is bounded by ``HARD_S`` (the ranks are killed past it, and the test fails).
"""

from __future__ import annotations

import datetime
import os
import queue
import time

import pytest
import torch
from torch import nn

from _dist import DistPool, free_port, rank_context

PG_TIMEOUT_S = 15.0
HARD_S = 240.0
STEP_OF_FAILURE = 2


class Net(nn.Module):
    def __init__(self, where: str, fail: bool) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.where, self.fail, self.step = where, fail, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        x = _maybe_fail(self, x)  # a graph break: eager code between two compiled frames
        return self.b(x).pow(2).mean()


class _BoomInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        raise RuntimeError("injected failure in backward")


@torch._dynamo.disable
def _maybe_fail(net: Net, x: torch.Tensor) -> torch.Tensor:
    if net.fail and net.step == STEP_OF_FAILURE:
        if net.where == "sigint":  # the user's Ctrl-C, mid-forward
            import signal

            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # (the KeyboardInterrupt arrives here)
        if net.where == "forward":
            raise RuntimeError("injected failure in forward")
        if net.where == "backward":
            return _BoomInBackward.apply(x)
    return x


def _report(results, msg: tuple) -> None:  # noqa: ANN001
    results.put(msg)
    results.close()
    results.join_thread()  # (flushed before os._exit, which skips the queue's feeder thread)


def _rank_main(rank: int, world: int, port: int, where: str, exits: bool, results) -> None:  # noqa: ANN001
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                       "TORCHINDUCTOR_COMPILE_THREADS": "1"})
    import torch.distributed as dist

    import graphcomp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    torch.manual_seed(0)
    net = Net(where, fail=rank == 0)
    graphcomp.shard(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if rank == 0 and where == "optimizer":
        def hook(o, args, kwargs):  # noqa: ANN001, ANN202
            if net.step == STEP_OF_FAILURE:
                raise RuntimeError("injected failure in optimizer.step")
        opt.register_step_pre_hook(hook)
    cm = torch.compile(net, backend="graphcomp", options={"codegen": "eager"})
    t_fail = None
    try:
        for step in range(STEP_OF_FAILURE + 3):
            net.step = step
            if step == STEP_OF_FAILURE:
                t_fail = time.monotonic()
            cm(torch.randn(4, 8)).backward()
            opt.step()
            opt.zero_grad()
        _report(results, (rank, "finished", "", 0.0))
    except KeyboardInterrupt as e:  # Ctrl-C: report, then let it end the process as it would a script
        _report(results, (rank, "raised", f"KeyboardInterrupt: {e}", time.monotonic() - (t_fail or time.monotonic())))
        raise
    except Exception as e:  # noqa: BLE001
        took = time.monotonic() - (t_fail or time.monotonic())
        _report(results, (rank, "raised", f"{type(e).__name__}: {e}", took))
        if rank == 0 and not exits:
            time.sleep(PG_TIMEOUT_S + 30)  # stays alive: the peer must not need it to exit
        os._exit(1)  # (no destroy_process_group: a crashed script does not run one)
    os._exit(0)


def _run(where: str, exits: bool) -> dict[int, tuple]:
    # fresh processes (a failing rank exits), forked from _dist's fork server, which has
    # torch and graphcomp imported (its TORCHINDUCTOR_COMPILE_THREADS is 2: eager
    # codegen here, no Inductor compile)
    ctx = rank_context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, where, exits, results)) for r in range(2)]
    for p in procs:
        p.start()
    got: dict[int, tuple] = {}
    deadline = time.monotonic() + HARD_S
    try:
        while len(got) < 2 and time.monotonic() < deadline:
            try:
                m = results.get(timeout=1.0)
            except queue.Empty:
                continue
            got[m[0]] = m
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    assert len(got) == 2, f"ranks {sorted(set(range(2)) - set(got))} neither finished nor raised in {HARD_S} s: {got}"
    return got


@pytest.mark.timeout(HARD_S + 60)
@pytest.mark.parametrize("where", ["forward", "backward", "optimizer"])
def test_a_rank_that_raises_and_exits_fails_its_peer_quickly(where):
    got = _run(where, exits=True)
    assert got[0][1] == "raised" and f"injected failure in {where}" in got[0][2].replace(".step", ""), got
    status, msg, took = got[1][1:]
    assert status == "raised", got
    # gloo reports the closed connection of the rank that exited, long before the timeout
    assert took < PG_TIMEOUT_S, got
    assert any(s in msg.lower() for s in ("connection closed", "connection reset", "peer", "broken pipe")), got


@pytest.mark.timeout(HARD_S + 60)
def test_ctrl_c_on_one_rank_ends_it_and_fails_its_peer_quickly():
    """SIGINT to rank 0 in the middle of a compiled step: a KeyboardInterrupt ends that
    process (its atexit hooks, graphcomp's teardown among them, run), and the peer's next
    collective raises in seconds, not at the process-group timeout."""
    got = _run("sigint", exits=True)
    assert got[0][1] == "raised" and got[0][2].startswith("KeyboardInterrupt"), got
    status, msg, took = got[1][1:]
    assert status == "raised" and took < PG_TIMEOUT_S, got
    assert any(s in msg.lower() for s in ("connection closed", "connection reset", "peer", "broken pipe")), got


@pytest.mark.timeout(HARD_S + 60)
def test_a_rank_that_raises_and_stays_alive_fails_its_peer_at_the_timeout():
    got = _run("forward", exits=False)
    status, msg, took = got[1][1:]
    assert status == "raised", got
    assert PG_TIMEOUT_S * 0.5 <= took < PG_TIMEOUT_S + 30, got
    assert "timed out" in msg.lower() or "timeout" in msg.lower(), got


# ------------------------------------------------------------------ checkpoints
def _ckpt_body(rank: int, world: int, root: str, fail_write: bool) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    import graphcomp

    class FailingWriter(FileSystemWriter):
        def write_data(self, plan, planner):  # noqa: ANN001, ANN201
            if rank == 1:
                raise OSError("injected: disk full on rank 1")
            return super().write_data(plan, planner)

    torch.manual_seed(0)
    net = Net("none", fail=False)
    graphcomp.shard(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    cm = torch.compile(net, backend="graphcomp", options={"codegen": "eager"})
    cm(torch.randn(4, 8)).backward()
    opt.step()
    opt.zero_grad()
    saved = {k: v.full_tensor().clone() for k, v in net.state_dict().items()}
    path = os.path.join(root, "ckpt")
    out: dict = {}
    try:
        writer = FailingWriter(path) if fail_write else FileSystemWriter(path)
        dcp.save(net.state_dict(), storage_writer=writer)
        out["saved"] = True
        # the step goes on, then fails: the checkpoint is what was saved, whole
        cm(torch.randn(4, 8)).backward()
        opt.step()
        raise RuntimeError("injected failure after the checkpoint")
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - (DCP's is a BaseException)
        out["error"] = f"{type(e).__name__}: {e}"
    dist_barrier()
    out["metadata"] = os.path.exists(os.path.join(path, ".metadata"))
    fresh = Net("none", fail=False)
    graphcomp.shard(fresh)
    sd = fresh.state_dict()
    try:
        dcp.load(sd, checkpoint_id=path)
        fresh.load_state_dict(sd)
        out["loaded"] = all(torch.equal(v.full_tensor(), saved[k]) for k, v in fresh.state_dict().items())
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        out["load_error"] = f"{type(e).__name__}: {e}"
    return out


def dist_barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


@pytest.fixture(scope="module")
def ranks2():
    with DistPool(2, timeout=HARD_S) as pool:
        yield pool


@pytest.mark.timeout(HARD_S + 60)
def test_checkpoint_saved_before_a_failing_step_is_whole(ranks2, tmp_path):
    out = ranks2.run(_ckpt_body, str(tmp_path), False, timeout=HARD_S)
    for r in out:
        assert r["saved"] and "after the checkpoint" in r["error"], r
        assert r["metadata"] and r.get("loaded") is True, r


@pytest.mark.timeout(HARD_S + 60)
def test_checkpoint_whose_write_fails_on_one_rank_is_not_half_written(ranks2, tmp_path):
    out = ranks2.run(_ckpt_body, str(tmp_path), True, timeout=HARD_S)
    for r in out:
        assert "saved" not in r, r  # dcp.save raised on every rank, not only the one whose write failed
        assert "disk full on rank 1" in r["error"], r
        assert r["metadata"] is False, r  # no metadata: DCP's commit point was never reached
        assert "load_error" in r, r  # and loading it is an error, not a silent partial load
