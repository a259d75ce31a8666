"""bucket_collectives on hand-built graphs: bucket counts, breaks, fused dtype, semantics."""

import pytest
import torch

import graphcomp

from _graphs import c10d, counts, gather, reduce_scatter, run_pass, trace, world1_group

AG = "_c10d_functional.all_gather_into_tensor.default"
RS = "_c10d_functional.reduce_scatter_tensor.default"
WAIT = "_c10d_functional.wait_tensor.default"
PACK = "graphcomp.pack_cast.default"
UNPACK = "graphcomp.unpack_gathered.default"
PACK_RS = "graphcomp.pack_for_reduce_scatter.default"


def _layers(n, world=2, group="g", dtype=torch.float32):
    """n linear layers, each gathering its [8, 4] weight (shard [8/world, 4]) at use."""

    def f(x, *shards):
        for s in shards:
            w = gather(s, world, group, shape=(8, 4))
            x = torch.tanh(x @ w.t() @ w)
        return x.sum()

    return trace(f, torch.randn(2, 4, dtype=dtype), *[torch.randn(8 // world, 4, dtype=dtype) for _ in range(n)])


@pytest.mark.parametrize(
    "limit, expected_buckets",
    [
        (10**9, [6]),  # everything in one bucket
        (2 * 128, [2, 2, 2]),  # each gathered weight is 8*4*4 = 128 bytes
        (3 * 128, [3, 3]),
        (5 * 128, [5]),  # the sixth is left alone (a bucket of one is no bucket)
        (127, []),  # nothing fits two: no-op
    ],
)
def test_gather_bucket_counts(limit, expected_buckets):
    gm = _layers(6)
    gm, rec = run_pass("bucket_collectives", gm, bucket_bytes=limit)
    c = counts(gm)
    n_buckets = len(expected_buckets)
    assert c[PACK] == n_buckets and c[UNPACK] == n_buckets
    assert c[AG] == 6 - sum(expected_buckets) + n_buckets
    assert c[WAIT] == c[AG]
    sizes = [len(n.meta["graphcomp_params"]) for n in gm.graph.nodes if n.meta.get("graphcomp_bucket")]
    assert sizes == expected_buckets
    if not expected_buckets:
        assert "no two consecutive" in rec.reason


def test_buckets_break_on_group_and_dtype():
    def f(x, a, b, c, d):
        ws = [gather(a, 2, "g1"), gather(b, 2, "g1"), gather(c, 2, "g2"), gather(d.to(torch.bfloat16), 2, "g2")]
        return sum(w.float().sum() for w in ws) + x.sum()

    gm = trace(f, torch.randn(2), *[torch.randn(3, 4) for _ in range(4)])
    gm, _ = run_pass("bucket_collectives", gm)
    assert counts(gm)[AG] == 3  # [a, b] | [c] | [d]: c and d differ in dtype


def test_bucket_carries_fused_downcast_into_pack():
    """fuse first, then bucket: one pack_cast in bf16 reads the fp32 shards directly."""

    def f(x, *shards):
        for s in shards:
            x = x @ gather(s, 2, "g", shape=(4, 4)).to(torch.bfloat16)
        return x.float().sum()

    gm = trace(f, torch.randn(2, 4, dtype=torch.bfloat16), *[torch.randn(2, 4) for _ in range(3)])
    gm, _ = run_pass("fuse_allgather_downcast", gm)
    assert counts(gm)["prims.convert_element_type.default"] == 3
    gm, rec = run_pass("bucket_collectives", gm)
    c = counts(gm)
    assert c[AG] == 1 and c[PACK] == 1
    assert c["prims.convert_element_type.default"] == 0  # absorbed into pack_cast
    (pack,) = [n for n in gm.graph.nodes if n.target is torch.ops.graphcomp.pack_cast.default]
    assert pack.args[1] == torch.bfloat16 and all(a.op == "placeholder" for a in pack.args[0])
    (ag,) = [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    assert ag.meta["val"].dtype == torch.bfloat16 and ag.meta["val"].shape == (2 * 3 * 8,)


def test_reduce_scatter_buckets():
    def f(*grads):
        return [reduce_scatter(g * 2, 2, "g") for g in grads]

    gm = trace(f, *[torch.randn(8, 4) for _ in range(4)])
    gm, rec = run_pass("bucket_collectives", gm, bucket_bytes=3 * 128)
    c = counts(gm)
    assert c[RS] == 2 and c[PACK_RS] == 1  # [g0, g1, g2] bucketed, g3 alone
    assert rec.counts["reduce_scatters_bucketed"] == 3


def test_reduce_scatters_have_their_own_cap():
    """reduce_bucket_bytes caps the reduce-scatter buckets; the gathers keep bucket_bytes."""
    def f(*shards):
        ws = [gather(s, 2, "g") for s in shards]
        return [reduce_scatter(w * 2, 2, "g") for w in ws]

    args = [torch.randn(4, 4) for _ in range(4)]  # gathered 8x4 fp32: 128 bytes each, as the grads
    gm, rec = run_pass("bucket_collectives", trace(f, *args), bucket_bytes=2 * 128, reduce_bucket_bytes=4 * 128)
    c = counts(gm)
    assert c[AG] == 2 and c[RS] == 1 and c[PACK_RS] == 1  # gathers in 2 buckets of 2, grads in 1 of 4
    assert rec.counts["all_gathers_bucketed"] == 4 and rec.counts["reduce_scatters_bucketed"] == 4
    gm, _ = run_pass("bucket_collectives", trace(f, *args), bucket_bytes=4 * 128, reduce_bucket_bytes=0)
    c = counts(gm)
    assert c[AG] == 1 and c[RS] == 4 and PACK_RS not in c  # 0 turns reduce-scatter bucketing off only
    gm, _ = run_pass("bucket_collectives", trace(f, *args), bucket_bytes=2 * 128, reduce_bucket_bytes=None)
    assert counts(gm)[RS] == 2  # None: the gathers' cap


def test_reduce_bucket_bytes_is_validated():
    with pytest.raises(ValueError, match="reduce_bucket_bytes"):
        graphcomp.Config.from_options({"reduce_bucket_bytes": -1})
    with pytest.raises(ValueError, match="reduce_bucket_bytes"):
        graphcomp.Config.from_options({"reduce_bucket_bytes": "big"})


def test_semantics_on_a_real_world1_group():
    with world1_group() as group:
        def f(x, *shards):
            outs = []
            for i, s in enumerate(shards):
                w = gather(s, 1, group, rows=5 - i % 2).to(torch.bfloat16)
                outs.append(reduce_scatter(w.float() * (i + 1), 1, group))
                x = x + w.float().sum()
            return x, outs

        args = (torch.randn(()), *[torch.randn(5, 3) for _ in range(4)])
        gm = trace(f, *args)
        ref = gm(*args)
        for p in ("fuse_allgather_downcast", "bucket_collectives"):
            gm, _ = run_pass(p, gm)
        assert counts(gm)[PACK] >= 1 and counts(gm)[PACK_RS] >= 1
        torch.testing.assert_close(gm(*args), ref, rtol=0, atol=0)


def test_decisions_depend_only_on_graph_and_config():
    a = run_pass("bucket_collectives", _layers(6), bucket_bytes=300)[0]
    b = run_pass("bucket_collectives", _layers(6), bucket_bytes=300)[0]
    assert a.code == b.code


def test_bucket_layout_matches_unbucketed_gathers_for_world_2():
    """pack on each rank, 'gather' (concatenate ranks), unpack == per-shard gathers;
    and the reduce-scatter packing gives each rank its rows of every gradient."""
    from graphcomp.ops import collectives as ops

    world = 2
    shards = [[torch.randn(3, 4), torch.randn(2), torch.randn(5, 1, 2)] for _ in range(world)]
    packs = [ops.pack_cast(s, torch.bfloat16) for s in shards]
    gathered = torch.cat(packs)
    parts = ops.unpack_gathered(gathered, world, [t.numel() for t in shards[0]])
    for i, part in enumerate(parts):
        expect = torch.cat([shards[r][i].to(torch.bfloat16).reshape(-1) for r in range(world)])
        torch.testing.assert_close(part, expect, rtol=0, atol=0)
    grads = [torch.randn(world * 3, 4), torch.randn(world * 2)]
    packed = ops.pack_for_reduce_scatter(grads, world, torch.float32)
    per_rank = packed.view(world, -1)
    for r in range(world):
        expect = torch.cat([g.view(world, -1)[r] for g in grads])
        torch.testing.assert_close(per_rank[r], expect, rtol=0, atol=0)


def test_collectives_are_found_inside_split_pieces():
    from torch.fx.passes.split_module import split_module

    from graphcomp.analysis.graph_utils import collectives

    gm = _layers(3)
    n_before = len(collectives(gm))
    nodes = list(gm.graph.nodes)
    cut = {n: (0 if i < len(nodes) // 2 else 1) for i, n in enumerate(nodes)}
    split = split_module(gm, None, lambda n: cut[n], keep_original_order=True)
    assert any(n.op == "call_module" for n in split.graph.nodes)
    assert len(collectives(split)) == n_before == 3
