"""The collective verifier (graphcomp.analysis.verify): deliberately broken passes are caught
with an error naming the pass; the product passes (fused, bucketed forms) pass it."""

import pytest
import torch
import torch.fx as fx

from _graphs import c10d, gather, reduce_scatter, trace
from graphcomp.config import Config
from graphcomp.errors import CollectiveVerifyError
from graphcomp.analysis.graph_utils import is_target
from graphcomp.compiler.pipeline import PassContext, register_pass, run_stage, temporary_registry
from graphcomp.compiler.plan import FramePlan

aten = torch.ops.aten


def _joint(n=3, world=2, group="g", cast=torch.bfloat16):
    """A joint-like graph: n weights gathered (then cast to ``cast``) and used, and n
    gradients reduce-scattered into the outputs."""

    def f(x, *args):
        shards, grads = args[:n], args[n:]
        for s in shards:
            w = gather(s, world, group, shape=(8, 4))
            w = w.to(cast) if cast is not None else w
            x = torch.tanh(x @ w.t().float() @ w.float())
        outs = [reduce_scatter(g, world, group) / world for g in grads]
        return (x.sum(), *outs)

    return trace(f, torch.randn(2, 4), *[torch.randn(8 // world, 4) for _ in range(n)],
                 *[torch.randn(8, 4) for _ in range(n)])


def _stage(gm, extra=None, **options):
    cfg = Config.from_options({"passes": {"schedule_free": False}, **options})
    ctx = PassContext(config=cfg, frame_id=0, stage="joint", frame=FramePlan())
    if extra is None:
        return run_stage(gm, ctx)
    with temporary_registry(extra.pass_spec, replace=False):
        cfg = Config.from_options({"passes": {"schedule_free": False, extra.pass_spec.name: True}, **options})
        ctx = PassContext(config=cfg, frame_id=0, stage="joint", frame=FramePlan())
        return run_stage(gm, ctx)


@register_pass("drop_reduce_scatter", stages=("joint",), default=False, after=("bucket_collectives",))
def drop_reduce_scatter(gm: fx.GraphModule, ctx: PassContext):
    """A broken pass: the first reduce-scatter becomes a slice of its input (same shape,
    wrong gradient: silent, exit code 0)."""
    rs = next(n for n in gm.graph.nodes if is_target(n, c10d.reduce_scatter_tensor.default))
    (wait,) = rs.users
    inp = rs.args[0]
    rows = wait.meta["val"].shape[0]
    with gm.graph.inserting_before(wait):
        sl = gm.graph.call_function(aten.slice.Tensor, (inp, 0, 0, rows))
    sl.meta["val"] = wait.meta["val"]
    wait.replace_all_uses_with(sl)
    gm.graph.erase_node(wait)
    gm.graph.erase_node(rs)
    return ctx.changed(gm)


@register_pass("gather_in_fp16", stages=("joint",), default=False, after=("bucket_collectives",))
def gather_in_fp16(gm: fx.GraphModule, ctx: PassContext):
    """A broken pass: the first all-gather runs in fp16 (cast before, back after)."""
    ag = next(n for n in gm.graph.nodes if is_target(n, c10d.all_gather_into_tensor.default))
    src = ag.args[0]
    with gm.graph.inserting_before(ag):
        down = gm.graph.call_function(torch.ops.prims.convert_element_type.default, (src, torch.float16))
    down.meta["val"] = src.meta["val"].to(torch.float16)
    ag.replace_input_with(src, down)
    ag.meta["val"] = ag.meta["val"].to(torch.float16)
    return ctx.changed(gm)


@register_pass("drop_gather", stages=("joint",), default=False, after=("bucket_collectives",))
def drop_gather(gm: fx.GraphModule, ctx: PassContext):
    """A broken pass: the last parameter use reads the previous use's gathered weight."""
    waits = [n for n in gm.graph.nodes if is_target(n, c10d.wait_tensor.default)
             and is_target(n.args[0], c10d.all_gather_into_tensor.default)]
    a, b = waits[-2], waits[-1]
    ag = b.args[0]
    b.replace_all_uses_with(a)
    gm.graph.erase_node(b)
    gm.graph.erase_node(ag)
    return ctx.changed(gm)


def test_product_passes_keep_every_collective():
    from graphcomp.session import SESSION

    SESSION.counters.reset()
    gm, records = _stage(_joint(), bucket_bytes=10**9)
    changed = {r.name for r in records if r.changed}
    assert {"fuse_allgather_downcast", "bucket_collectives"} <= changed, records  # fused and bucketed forms
    assert SESSION.counters["collectives_verified"] >= 2
    assert all(r.verify_seconds >= 0 for r in records)


@pytest.mark.parametrize("bucket", [False, True])
def test_dropped_reduce_scatter_is_caught_naming_the_pass(bucket):
    with pytest.raises(CollectiveVerifyError, match=r"pass 'drop_reduce_scatter' broke the collectives of the joint "
                       r"graph.*gradient output #1 .* reduce-scattered 0 time\(s\) on group 'g', 1 before"):
        _stage(_joint(), drop_reduce_scatter, bucket_bytes=10**9 if bucket else 0)


def test_gather_in_the_wrong_dtype_is_caught():
    with pytest.raises(CollectiveVerifyError, match=r"pass 'gather_in_fp16'.*gathered in \['float16'\].*"
                       r"allowed: that, or the dtype it was cast to right after the gather"):
        _stage(_joint(cast=None), gather_in_fp16, bucket_bytes=0)


def test_wrong_dtype_after_a_fused_downcast_is_caught():
    # fuse_allgather_downcast moves the bf16 cast onto the shard: bf16 is then the
    # only dtype allowed on the wire, and the broken pass's fp16 is caught
    with pytest.raises(CollectiveVerifyError, match=r"pass 'gather_in_fp16'.*\['float16'\].*\['bfloat16'\]"):
        _stage(_joint(), gather_in_fp16, bucket_bytes=0)


def test_dropped_gather_is_caught():
    with pytest.raises(CollectiveVerifyError, match=r"pass 'drop_gather'.*all-gathered 0 time\(s\) on group 'g', "
                       r"1 before"):
        _stage(_joint(), drop_gather, bucket_bytes=0)


def test_verifier_off_lets_a_broken_pass_through():
    _stage(_joint(), drop_reduce_scatter, bucket_bytes=0, verify_collectives=False)
    _stage(_joint(), drop_reduce_scatter, bucket_bytes=0, verify_collectives="debug")  # debug off: not checked
    with pytest.raises(CollectiveVerifyError):
        _stage(_joint(), drop_reduce_scatter, bucket_bytes=0, verify_collectives="debug", debug=True)


def _tied(world=2, group="g"):
    """A tied weight (one shard) read twice, gathered at each read, and its gradient
    the sum of two reduce-scattered contributions (as Dynamo traces GPT-2's head)."""

    def f(x, shard, g1, g2):
        w1 = gather(shard, world, group, shape=(8, 4))
        x = torch.tanh(x @ w1.t() @ w1)
        w2 = gather(shard, world, group, shape=(8, 4))
        x = torch.tanh(x @ w2.t())
        grad = reduce_scatter(g1, world, group) / world + reduce_scatter(g2, world, group) / world
        return (x.sum(), grad)

    return trace(f, torch.randn(2, 4), torch.randn(8 // world, 4), torch.randn(8, 4), torch.randn(8, 4))


def test_tied_weight_merged_into_one_bucket_passes_and_is_still_checked():
    from graphcomp.analysis.verify import inventory

    gm = _tied()
    before = inventory(gm)
    assert sum(before.gathers.values()) == 2 and sum(before.reduces.values()) == 2
    out, records = _stage(gm, bucket_bytes=10**9)  # both gathers in one bucket, both contributions in another
    assert any(r.name == "bucket_collectives" and r.changed for r in records), records
    after = inventory(out)
    assert sum(after.gathers.values()) == 1 and sum(after.reduces.values()) == 1  # merged, still there
    # the rule still holds a pass to "gathered before => gathered after": all of a tied
    # weight's gathers dropped (here: the graph before the pass had 2, the one after 0) is caught
    from graphcomp.analysis.verify import check

    empty = inventory(trace(lambda x: (x.sum(),), torch.randn(2, 4)))
    with pytest.raises(CollectiveVerifyError, match=r"all-gathered 0 time\(s\) on group 'g', 2 before"):
        check(before, empty, "a_broken_pass", "joint", 0)
