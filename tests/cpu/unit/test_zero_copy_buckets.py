"""zero_copy_buckets on hand-built graphs: the flat buckets of bucket_collectives become
grouped collectives (exact op counts), the values are bitwise the flat bucket's,
the collective verifier accepts the result, and buckets whose flat buffer is read
elsewhere are left alone. (Multi-rank numerics: test_sharded_training, where the
pass is on by default, and its bitwise on/off test.)"""

import operator

import torch

from _graphs import c10d, counts, gather, reduce_scatter, run_pass, trace, world1_group
from graphcomp.analysis import verify

AG = "_c10d_functional.all_gather_into_tensor.default"
AG_CO = "_c10d_functional.all_gather_into_tensor_coalesced.default"
RS = "_c10d_functional.reduce_scatter_tensor.default"
RS_CO = "_c10d_functional.reduce_scatter_tensor_coalesced.default"
WAIT = "_c10d_functional.wait_tensor.default"
PACK = "graphcomp.pack_cast.default"
UNPACK = "graphcomp.unpack_gathered.default"
PACK_RS = "graphcomp.pack_for_reduce_scatter.default"
SPLIT = "aten.split_with_sizes.default"


def _model(world, group, n=3):
    """n layers, each gathering its [8, 4] weight in bf16 at use, and n gradients
    (the weights' products, fp32) reduce-scattered at the end."""

    def f(x, *shards):
        ws = []
        for s in shards:
            w = gather(s, world, group, shape=(8, 4)).to(torch.bfloat16)
            x = torch.tanh(x @ w.t().float() @ w.float())
            ws.append(w)
        grads = [(w.float() * (i + 1) + x.sum()).contiguous() for i, w in enumerate(ws)]
        return x, [reduce_scatter(g, world, group) for g in grads]

    return f, (torch.randn(2, 4), *[torch.randn(8 // world, 4) for _ in range(n)])


def _bucketed(world, group, n=3):
    f, args = _model(world, group, n)
    gm = trace(f, *args)
    for p in ("fuse_allgather_downcast", "bucket_collectives"):
        gm, _ = run_pass(p, gm)
    return gm, args


def test_buckets_become_grouped_collectives_with_exact_op_counts():
    gm, _ = _bucketed(2, "g")
    c = counts(gm)
    assert (c[AG], c[UNPACK], c[PACK], c[RS], c[PACK_RS], c[WAIT]) == (1, 1, 1, 1, 1, 2)
    before = verify.inventory(gm)
    gm, rec = run_pass("zero_copy_buckets", gm, stage="fwd")
    c = counts(gm)
    assert c[AG] == 0 and c[UNPACK] == 0 and c[AG_CO] == 1 and c[PACK] == 1 and c[SPLIT] == 1
    assert c[RS] == 0 and c[PACK_RS] == 0 and c[RS_CO] == 1
    assert c[WAIT] == 3 + 3  # one per member on each side
    assert rec.counts["zero_copy_gather_buckets"] == 1 and rec.counts["zero_copy_reduce_scatter_buckets"] == 1
    (ag,) = [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor_coalesced.default]
    assert [v.shape for v in ag.meta["val"]] == [(32,)] * 3 and ag.meta["val"][0].dtype == torch.bfloat16
    assert ag.meta.get("graphcomp_bucket") and ag.meta["graphcomp_zero_copy"]
    # every member's wait reads its own output of the grouped collective, in order
    idx = [w.args[0].args[1] for w in gm.graph.nodes if w.target is c10d.wait_tensor.default
           and w.args[0].args[0] is ag]
    assert idx == [0, 1, 2]
    verify.check(before, verify.inventory(gm), "zero_copy_buckets", "fwd", 0)  # raises on a lost collective


def test_values_are_bitwise_the_flat_buckets_on_a_real_group():
    with world1_group() as group:
        gm, args = _bucketed(1, group)
        ref = gm(*args)
        gm, _ = run_pass("zero_copy_buckets", gm, stage="bwd")
        assert counts(gm)[AG_CO] == 1 and counts(gm)[RS_CO] == 1
        torch.testing.assert_close(gm(*args), ref, rtol=0, atol=0)


def test_a_bucket_read_as_one_buffer_is_left_alone():
    """The partitioner may save a whole gathered bucket for the backward (the flat
    buffer is then a graph output): the flat form stays, counted."""
    gm, _ = _bucketed(2, "g")
    (wait,) = [n for n in gm.graph.nodes if n.target is c10d.wait_tensor.default
               and n.args[0].target is c10d.all_gather_into_tensor.default]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = ((*out.args[0], wait),) if isinstance(out.args[0], tuple) else ([*out.args[0], wait],)
    gm.recompile()
    gm, rec = run_pass("zero_copy_buckets", gm, stage="fwd")
    c = counts(gm)
    assert c[AG] == 1 and c[UNPACK] == 1 and c[AG_CO] == 0
    assert c[RS_CO] == 1  # the reduce-scatter bucket is still regrouped
    assert rec.counts["zero_copy:gather_buffer_read"] == 1


def test_a_reduce_scatter_bucket_that_casts_is_left_alone():
    gm, _ = _bucketed(2, "g")
    (pack,) = [n for n in gm.graph.nodes if n.target is torch.ops.graphcomp.pack_for_reduce_scatter.default]
    pack.args = (pack.args[0], pack.args[1], torch.float64)  # members fp32, buffer fp64: the pack casts
    gm, rec = run_pass("zero_copy_buckets", gm, stage="bwd")
    assert counts(gm)[RS] == 1 and counts(gm)[RS_CO] == 0
    assert rec.counts["zero_copy:reduce_scatter_cast"] == 1


def test_no_buckets_is_a_no_op():
    def f(x, s):
        return x @ gather(s, 2, "g", shape=(8, 4)).t()

    gm = trace(f, torch.randn(2, 4), torch.randn(4, 4))
    code = gm.code
    gm, rec = run_pass("zero_copy_buckets", gm, stage="fwd")
    assert gm.code == code and "no flat bucket" in rec.reason
    assert not any(n.target is operator.getitem for n in gm.graph.nodes)
