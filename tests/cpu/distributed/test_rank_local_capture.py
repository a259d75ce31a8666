"""A rank that captures a piece while its peers replay theirs issues the same
collectives (issue 16: the 2-GPU soak, per-rank sequence lengths, hung on 2 H200s
at 6220390).

A capture call used to run its piece ``WARMUP_ITERS`` times with real collectives,
then replay a trial capture's throwaway graph, then replay the real capture: a rank
capturing alone (a sequence length only it sees) issued four all-gathers where its
peer issued one. The warm-up and the trial now stand in for collectives
(``_compat.collectives_not_run``); the stand-in device's capture records them, as a
CUDA capture does, and its trial replays like the CUDA one. The 2-rank run below
hangs in its second step (gloo timeout) without either fix."""

from __future__ import annotations

import pytest
import torch


# per rank and step: rank 0 meets a new length at steps 1 and 3, rank 1 at step 2:
# every step has a rank that captures while the other replays
LENGTHS = {0: [32, 16, 16, 24, 32], 1: [32, 32, 8, 8, 32]}


def _train(rank: int, world: int, cudagraphs: str) -> dict:
    from _fakecuda import fake_cuda_runtime

    import graphcomp
    from graphcomp.models import Llama, synthetic_batch
    from graphcomp.sharding.shard import full_state_dict

    with fake_cuda_runtime():
        torch.manual_seed(0)
        m = Llama("tiny")
        m.reset_parameters(seed=0)
        graphcomp.shard(m)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        cm = torch.compile(m, backend="graphcomp", dynamic=False,
                           options={"codegen": "eager", "cudagraphs": cudagraphs})
        losses = []
        for step, seq in enumerate(LENGTHS[rank]):
            tok, tgt = synthetic_batch(m.cfg, 2, seq, seed=100 * rank + step)
            loss = cm(tok, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        counters = dict(graphcomp.counters)
        params = full_state_dict(m)
        graphcomp.runtime.teardown()
    return {"losses": losses, "params": params, "counters": counters}


def _train_on_then_off(rank: int, world: int) -> tuple[dict, dict]:
    """Both runs in one pair of processes (starting a pair costs seconds in CI)."""
    import graphcomp

    on = _train(rank, world, "auto")
    torch._dynamo.reset()
    graphcomp.reset()
    return on, _train(rank, world, "off")


@pytest.fixture(scope="module")
def ranks2(shared_ranks2):
    """The module's two tests share one pair of ranks (starting a pair costs seconds in CI)."""
    return shared_ranks2.view(timeout=240)


def test_rank_capturing_alone_stays_in_step_with_its_peer(ranks2):
    res = ranks2.run(_train_on_then_off)
    on, off = [r[0] for r in res], [r[1] for r in res]
    for r in range(2):
        c = on[r]["counters"]
        assert c.get("captures", 0) > 0 and c.get("replays", 0) > 0, c
        assert c.get("warmup_collectives_stood_in", 0) > 0, c
        assert c.get("cudagraph_fallbacks", 0) == 0 and c.get("capture_failures", 0) == 0, c
        assert on[r]["losses"] == pytest.approx(off[r]["losses"], rel=1e-6, abs=0), r
        for k, v in off[r]["params"].items():
            torch.testing.assert_close(on[r]["params"][k], v, rtol=1e-6, atol=0)
    # the ranks captured at different steps: rank 0 compiled 3 lengths, rank 1 two
    assert on[0]["counters"]["frames_compiled"] != on[1]["counters"]["frames_compiled"]


def _modes(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from graphcomp import _compat

    group = _compat.process_group_name(dist.group.WORLD)
    x = torch.full((3,), float(rank + 1))
    warmed: set[str] = set()
    with _compat.collectives_not_run(warmed) as mode:
        first = _compat.funcol_all_gather(x, group, world)  # the group's first: runs
        second = _compat.funcol_all_gather(x, group, world)  # recorded: zeros of its shape
        out = torch.full((6,), 5.0)
        torch.ops._c10d_functional.all_gather_into_tensor_out(x, world, group, out=out)
        inplace = torch.ops._c10d_functional.all_reduce_(x.clone(), "sum", group)
        # zero_copy_buckets' grouped forms: a list of recorded zeros, one per member
        c10d = torch.ops._c10d_functional
        grouped = [c10d.wait_tensor(t) for t in c10d.all_gather_into_tensor_coalesced([x, x[:1]], world, group)]
        grouped += [c10d.wait_tensor(t) for t in
                    c10d.reduce_scatter_tensor_coalesced([torch.ones(4), torch.ones(2)], "sum", world, group)]
    # one real collective after the mode: the ranks are still in step
    check = _compat.funcol_all_gather(torch.tensor([float(rank)]), group, world)
    return {"first": first, "second": second, "out": out, "inplace": inplace, "grouped": grouped,
            "ran": mode.ran, "stood_in": mode.stood_in, "warmed": sorted(warmed), "check": check}


def test_collectives_not_run_records_all_but_a_groups_first(ranks2):
    res = ranks2.run(_modes, timeout=120)
    for r, d in enumerate(res):
        assert torch.equal(d["first"], torch.tensor([1.0] * 3 + [2.0] * 3)), d["first"]
        assert torch.equal(d["second"], torch.zeros(6)), d["second"]
        assert torch.equal(d["out"], torch.zeros(6)), d["out"]  # recorded: the out= buffer zeroed
        assert torch.equal(d["inplace"], torch.full((3,), float(r + 1))), d["inplace"]  # not reduced
        assert [t.tolist() for t in d["grouped"]] == [[0.0] * 6, [0.0] * 2, [0.0] * 2, [0.0]], d["grouped"]
        assert d["ran"] == 1 and d["stood_in"] == 5 and len(d["warmed"]) == 1, d
        assert torch.equal(d["check"], torch.tensor([0.0, 1.0])), d["check"]


def test_capture_failure_names_the_piece_line_not_the_stand_in():
    """An op that fails in a warm-up or trial capture passes through the stand-in's
    dispatch mode: the failure's source is the piece's own line (the op), not the
    mode's pass-through (2 H200s, 2507922: TP's trial-capture failure read
    '_compat_collectives.py:84 (return func(*args, **kwargs))')."""
    from graphcomp import _compat
    from graphcomp.errors import failing_source

    class M(torch.nn.Module):
        def forward(self, a, b):
            return torch.mm(a, b)

    gm = torch.fx.symbolic_trace(M())
    with pytest.raises(RuntimeError) as info, _compat.collectives_not_run(None):
        gm(torch.ones(2, 3), torch.ones(2, 3))
    where = failing_source(info.value)
    assert where is not None and "_compat_collectives" not in where, where
    assert "torch.mm" in where, where


def test_higher_order_operators_pass_through_the_stand_in():
    """A higher-order operator in a piece runs under the warm-up's mode (W3 on 4
    H100s, b5e65ab: Inductor's graphsafe_run_with_rng_state around a recomputed cuDNN
    attention raised NotImplementedError in every warm-up, and both pieces ran
    eagerly); one that wraps a functional collective raises, so the piece fails its
    capture instead of issuing the collective alone."""
    from torch._prims.rng_prims import graphsafe_run_with_rng_state

    from graphcomp import _compat

    x = torch.randn(3)
    with _compat.collectives_not_run(None) as mode:
        out = torch.ops.higher_order.cond(torch.tensor(True), lambda a: a + 1, lambda a: a - 1, (x,))
    out = out[0] if isinstance(out, (list, tuple)) else out
    assert torch.equal(out, x + 1) and mode.stood_in == 0
    with pytest.raises(NotImplementedError, match="wraps a functional collective"), \
            _compat.collectives_not_run(None):
        graphsafe_run_with_rng_state(torch.ops._c10d_functional.all_reduce.default, torch.ones(2), "sum", "0",
                                     rng_state=torch.get_rng_state())
