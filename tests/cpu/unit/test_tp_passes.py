"""The passes on graphs that mix graphcomp's collectives (group "dp", registered as
``shard(mesh=...)`` registers its group) with tensor-parallel ones (group "tp"):
graphcomp's are fused, bucketed, freed and moved as before; TP ones are left exactly
where and as they are; the partitioner keeps each TP collective with its wait."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _graphs import c10d, counts, gather, reduce_scatter, run_pass, trace, world1_group

from graphcomp.analysis import graph_utils as gu
from graphcomp.session import SESSION as STATE

AG = "_c10d_functional.all_gather_into_tensor.default"
RS = "_c10d_functional.reduce_scatter_tensor.default"
AR = "_c10d_functional.all_reduce.default"
WAIT = "_c10d_functional.wait_tensor.default"
PACK = "graphcomp.pack_cast.default"
PACK_RS = "graphcomp.pack_for_reduce_scatter.default"
CONVERT = "prims.convert_element_type.default"


@pytest.fixture
def tp_foreign():
    """graphcomp shards over "dp" beside tensor parallelism (what shard(mesh=...)
    records): collectives on "tp" are not graphcomp's."""
    STATE.shard_groups["dp"] = True
    yield "tp"
    del STATE.shard_groups["dp"]


def _tp_gather(x, world=2):
    """A sequence-parallel all-gather of an activation over tp."""
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x, world, "tp"))


def _group_of(n):
    return gu.collective_group(n)


def _colls(gm, op=AG):
    return [n for n in gm.graph.nodes if gu.op_name(n) == op]


# ------------------------------------------------------------------ matching
def test_collective_group_and_foreign_flag(tp_foreign):
    def f(s, x, g):
        w = gather(s, 2, "dp")
        h = _tp_gather(x)
        r = c10d.wait_tensor(c10d.all_reduce(h, "sum", "tp"))
        return w.sum() + r.sum() + reduce_scatter(g, 2, "dp").sum()

    gm = trace(f, torch.randn(2, 4), torch.randn(3, 4), torch.randn(4, 4))
    rows = gu.collectives(gm)
    assert [(r["kind"], r["group"], r["foreign"]) for r in rows] == [
        ("all_gather", "dp", False), ("all_gather", "tp", True), ("all_reduce", "tp", True),
        ("reduce_scatter", "dp", False),
    ]
    # graphcomp's bytes only (the TP gather's 6x4 fp32 are counted apart)
    assert gu.collective_bytes_by_dtype(rows, "all_gather") == {"float32": 4 * 4 * 4}
    assert gu.collective_bytes_by_dtype(rows, "all_gather", foreign=True) == {"float32": 6 * 4 * 4}
    assert [n.args[2] for n in gu.gathers(gm)] == ["dp"]


def test_without_a_mesh_every_collective_is_graphcomps():
    """The 1-D path: nothing registered, nothing foreign (the passes behave as before)."""
    assert not any(STATE.shard_groups.values())
    gm = trace(lambda x: _tp_gather(x).sum(), torch.randn(3, 4))
    (ag,) = _colls(gm)
    assert not gu.is_foreign_collective(ag) and gu.gathers(gm) == [ag]


# ------------------------------------------------------------------ fuse
def _fuse_graph():
    def f(s, x):
        w = gather(s, 2, "dp", shape=(4, 4)).to(torch.bfloat16)
        h = _tp_gather(x).to(torch.bfloat16)
        return (h @ w).float().sum()

    return trace(f, torch.randn(2, 4), torch.randn(3, 4))


def test_fuse_downcasts_only_graphcomps_gather(tp_foreign):
    gm = _fuse_graph()
    before = counts(gm)
    gm, rec = run_pass("fuse_allgather_downcast", gm)
    assert rec.counts["gathers_fused"] == 1
    dp_ag, tp_ag = sorted(_colls(gm), key=lambda n: n.args[2])
    assert gu.op_name(dp_ag.args[0]) == CONVERT and dp_ag.meta["val"].dtype == torch.bfloat16  # cast, then gathered
    assert tp_ag.args[0].op == "placeholder" and tp_ag.meta["val"].dtype == torch.float32  # untouched
    (cast,) = [u for u in next(iter(tp_ag.users)).users]
    assert gu.dtype_cast(cast) == torch.bfloat16  # its cast still follows the wait
    # the dp gather's cast became a convert of the shard; the TP gather's cast is still there
    after = counts(gm)
    assert after[CONVERT] - before[CONVERT] == 1 and after["aten._to_copy.default"] - before["aten._to_copy.default"] == -1


def test_fuse_matches_both_without_the_registration():
    gm, rec = run_pass("fuse_allgather_downcast", _fuse_graph())
    assert rec.counts["gathers_fused"] == 2


# ------------------------------------------------------------------ bucket
def test_bucket_groups_graphcomps_collectives_and_skips_tp(tp_foreign):
    """Forward: parameter gathers interleaved with sequence-parallel all-gathers, and
    TP reduce-scatters whose results feed the next layer (bucketing those would
    make a cycle); backward-like: two gradient reduce-scatters over dp."""

    def f(x, s1, s2, g1, g2):
        h = x
        for s in (s1, s2):
            w = gather(s, 2, "dp", shape=(8, 4))
            full = _tp_gather(h)  # [2*3, 4]
            h = c10d.wait_tensor(c10d.reduce_scatter_tensor(torch.tanh(full @ w.t() @ w), "sum", 2, "tp"))
        return h.sum(), reduce_scatter(g1, 2, "dp"), reduce_scatter(g2, 2, "dp")

    gm = trace(f, torch.randn(3, 4), torch.randn(4, 4), torch.randn(4, 4), torch.randn(8, 4), torch.randn(8, 4))
    gm, rec = run_pass("bucket_collectives", gm, bucket_bytes=10**6)
    c = counts(gm)
    assert c[PACK] == 1 and c[PACK_RS] == 1  # one bucket of each kind, graphcomp's
    ags, rss = _colls(gm, AG), _colls(gm, RS)
    assert sorted(_group_of(n) for n in ags) == ["dp", "tp", "tp"]
    assert sorted(_group_of(n) for n in rss) == ["dp", "tp", "tp"]
    for n in ags + rss:  # TP collectives: still one op per activation, read straight from it
        if _group_of(n) == "tp":
            assert n.args[0].op != "call_function" or "graphcomp" not in gu.op_name(n.args[0])
            assert gu.single_wait(n) is not None
    assert rec.counts["all_gathers_bucketed"] == 2 and rec.counts["reduce_scatters_bucketed"] == 2


# ------------------------------------------------------------------ schedule_free
def test_schedule_free_tags_only_parameter_gathers(tp_foreign):
    from graphcomp.passes.schedule_free import gather_groups

    def f(s, x):
        return (_tp_gather(x) @ gather(s, 2, "dp", shape=(4, 4))).sum()

    gm = trace(f, torch.randn(2, 4), torch.randn(3, 4))
    (g,) = gather_groups(gm)
    assert _group_of(g.coll) == "dp"


def test_schedule_free_regathers_parameters_not_tp_activations():
    """A real joint graph (AOTAutograd, real 1-rank groups): the parameter gather is
    re-gathered in backward, the TP activation gather is not recomputed."""
    from functorch.compile import aot_function

    from graphcomp import _compat
    from graphcomp.sharding.shard import _GatherParam

    with world1_group() as dp:
        tp = dist.new_group([0]).group_name
        STATE.shard_groups[dp] = True
        try:
            def f(x, s):
                w = _GatherParam.apply(s, 4, (4, 4), None, torch.float32, dp, 1)
                h = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_gather_into_tensor(x, 1, tp))
                return torch.tanh(torch.tanh(h) @ w.t()).sum()

            got = {}

            def partition(joint, joint_inputs, **kw):
                joint, got["rec"] = run_pass("schedule_free", joint, reshard_after_forward=True)
                got["fwd"], got["bwd"] = _compat.min_cut_partition(joint, joint_inputs, **kw)
                return got["fwd"], got["bwd"]

            cf = aot_function(f, fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g, partition_fn=partition)
            x, s = torch.randn(3, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
            cf(x, s).backward()
        finally:
            del STATE.shard_groups[dp]
    assert got["rec"].counts["gathers_resharded"] == 1
    bwd_groups = [_group_of(n) for n in _colls(got["bwd"])]
    assert bwd_groups == [dp]  # the parameter re-gathered; the activation gather saved, not re-run
    assert sorted(_group_of(n) for n in _colls(got["fwd"])) == sorted([dp, tp])


# ------------------------------------------------------------------ schedule_prefetch
def test_schedule_prefetch_moves_parameter_gathers_and_leaves_tp_in_place(tp_foreign):
    def f(x, *shards):
        for s in shards:
            w = gather(s, 2, "dp", shape=(8, 8))
            h = _tp_gather(x)  # [2*2, 8]
            x = c10d.wait_tensor(c10d.reduce_scatter_tensor(torch.tanh(h @ w), "sum", 2, "tp"))
        return x

    gm = trace(f, torch.randn(2, 8), *[torch.randn(4, 8) for _ in range(3)])

    def tp_and_compute(g):
        return [n.name for n in g.graph.nodes
                if n.op == "call_function" and (_group_of(n) == "tp" or gu.is_target(n, torch.ops.aten.mm.default,
                                                                                    torch.ops.aten.tanh.default))
                or (gu.is_target(n, c10d.wait_tensor.default) and _group_of(n.args[0]) == "tp")]

    before = tp_and_compute(gm)
    gm, rec = run_pass("schedule_prefetch", gm, stage="fwd", prefetch_bytes=10**6)
    # every parameter gather moved ahead (the first one past the TP gather before its use)
    assert rec.counts["gathers"] == 3 and rec.counts["gathers_moved"] == 3
    assert tp_and_compute(gm) == before  # TP collectives, their waits and the compute: same order
    nodes = list(gm.graph.nodes)
    for n in nodes:  # each TP wait still right where it was: directly after nothing but its collective's users
        if gu.is_target(n, c10d.wait_tensor.default) and _group_of(n.args[0]) == "tp":
            assert nodes.index(n.args[0]) < nodes.index(n)


# ------------------------------------------------------------------ partition_graph
def _cuda(gm):
    from test_partition_graph import cudaify

    return cudaify(gm)


def test_partition_keeps_tp_collective_and_wait_in_one_piece(tp_foreign):
    """TP collectives follow the partitioner's collective rule like graphcomp's: the
    TP all-gather and reduce-scatter (nothing uncapturable before their waits) are
    each captured in one piece with their wait; a host sync between a TP all-reduce
    and its wait makes both run eagerly (``collective_pair``), never one captured
    and the other not."""
    from torch.fx.experimental.proxy_tensor import make_fx

    import graphcomp.passes.partition_graph as pg

    def f(x, s):
        w = gather(s, 2, "dp", shape=(8, 8))
        h = _tp_gather(x)  # captured with its wait
        ar = c10d.all_reduce(h @ w, "sum", "tp")
        n = x.sum().item()  # a host sync while the all-reduce is in flight
        y = c10d.wait_tensor(ar) * n
        r = c10d.wait_tensor(c10d.reduce_scatter_tensor(torch.tanh(y).sin().cos(), "sum", 2, "tp"))
        return r.exp().tanh().sin()

    gm = _cuda(make_fx(f, tracing_mode="symbolic")(torch.randn(4, 8), torch.randn(4, 8)))
    assign, rows, reasons = pg.plan_pieces(gm)
    by_name = {r.node: r.kind for r in reasons}
    ar = next(n for n in gm.graph.nodes if gu.op_name(n) == AR)
    (ar_wait,) = ar.users
    assert by_name[ar.name] == "collective_pair" and by_name[ar_wait.name] == "collective_pair"
    assert rows[assign[ar]]["mode"] == "eager" and rows[assign[ar_wait]]["mode"] == "eager"
    for op in (AG, RS):
        for c in _colls(gm, op):
            (w,) = c.users
            assert assign[c] == assign[w] and rows[assign[c]]["mode"] == "cudagraph", (op, _group_of(c))
    # the split module: every captured piece holds each of its collectives' waits
    split = pg.split_graph(gm, assign)
    modes = {f"piece_{r['piece']}": r["mode"] for r in rows}
    captured = 0
    for name, sub in split.named_children():
        for n in sub.graph.nodes:
            if gu.collective_kind(n) is not None and modes[name] == "cudagraph":
                assert any(gu.is_target(u, c10d.wait_tensor.default) for u in n.users), (name, n.name)
                captured += _group_of(n) == "tp"
    assert captured == 2  # the TP all-gather and reduce-scatter
