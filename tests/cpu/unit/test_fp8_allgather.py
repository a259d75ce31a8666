"""fp8_allgather on hand-built graphs: a gathered weight's FP8 cast (the annotated
nodes of ``graphcomp.fp8.scaling.quantize_weight``) moves onto the shard; exact op
counts, FP8 bytes on the wire, one amax all-reduce for every weight, the scales of
rowwise rows beside their bytes, refusals counted by reason, bitwise semantics on a
real world-1 group, and the chain matchers of the scheduling passes see the new
gathers whole."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from _graphs import counts, gather, run_pass, world1_group

from graphcomp import _compat
from graphcomp.analysis import graph_utils as gu
from graphcomp.analysis import verify
from graphcomp.fp8 import scaling
from graphcomp.fp8.scaling import RECIPES
from graphcomp.session import SESSION

AG = "_c10d_functional.all_gather_into_tensor.default"
AR = "_c10d_functional.all_reduce.default"
TW, RW = RECIPES["tensorwise"], RECIPES["rowwise"]


def trace(fn, *args):
    """``fn`` traced to an aten graph with its annotations (as Dynamo and AOTAutograd keep them)."""
    with _compat.preserve_node_meta():
        gm = make_fx(fn, tracing_mode="fake")(*args)
    from graphcomp.compiler.compile_env import CompileEnv

    gu.mark_foreign(gm, CompileEnv.of_session(SESSION).is_foreign_group)
    return gm


def _gathers(gm):
    return [n for n in gm.graph.nodes if gu.op_name(n) == AG]


def _linear(x, w, recipe, backward_cast=False):
    """What the FP8 layer's forward (and, rowwise, its backward's column cast) traces."""
    w8, wi = scaling.quantize_weight(w, recipe.weight)
    x8, xi = scaling.quantize(x, recipe.input)
    row = recipe.weight.axis == "row"
    out = [torch._scaled_mm(x8, w8.t(), xi, wi.reshape(1, -1) if row else wi, out_dtype=torch.float32)]
    if backward_cast:
        wt8, wti = scaling.quantize_weight(w, recipe.weight_t)
        out += [wt8.float(), wti]
    return out


def _model(recipe, group, world, cast=None, backward_cast=False):
    """Three weights, the last of 5 rows: on 2 ranks its shard holds 3 rows, one of them padding."""
    def f(s1, s2, s3, x):
        outs = []
        for s, rows in ((s1, 6), (s2, 4), (s3, 5)):
            w = gather(s, world, group, rows=rows)
            if cast is not None:
                w = w.to(cast)
            outs += _linear(x, w, recipe, backward_cast)
        return outs

    return f


def _args(world):
    c = lambda rows: -(-rows // world)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    return (torch.randn(c(6), 16, generator=g), torch.randn(c(4), 16, generator=g),
            torch.randn(c(5), 16, generator=g), torch.randn(8, 16, generator=g))


def test_tensorwise_casts_shards_gathers_fp8_with_one_amax_all_reduce():
    gm = trace(_model(TW, "g", 2), *_args(2))
    inv0 = verify.inventory(gm)
    assert [n.meta["val"].dtype for n in _gathers(gm)] == [torch.float32] * 3 and counts(gm)[AR] == 0
    gm, rec = run_pass("fp8_allgather", gm)
    ags = _gathers(gm)
    assert len(ags) == 3 and counts(gm)[AR] == 1  # one all-reduce: every weight's amax
    assert [n.meta["val"].dtype for n in ags] == [torch.uint8] * 3  # the FP8 bytes
    assert [n.meta[gu.FP8_WIRE] for n in ags] == ["float8_e4m3fn"] * 3
    (ar,) = [n for n in gm.graph.nodes if gu.op_name(n) == AR]
    assert ar.args[1] == "max" and tuple(ar.args[0].meta["val"].shape) == (3,)
    # the all-reduce is at the top: before every gather
    order = list(gm.graph.nodes)
    assert all(order.index(ar) < order.index(a) for a in ags)
    assert rec.counts == {"weights_fp8": 3, "gathers_fp8": 3, "amax_all_reduces": 1,
                          "wire_bytes_before": (6 + 4 + 6) * 16 * 4, "wire_bytes_after": (6 + 4 + 6) * 16}
    # collectives report FP8, the verifier accepts the FP8 wire and the same gather counts
    assert [c["dtype"] for c in gu.collectives(gm) if c["kind"] == "all_gather"] == ["float8_e4m3fn"] * 3
    verify.check(inv0, verify.inventory(gm), "fp8_allgather", "joint", 0)
    # no gathered float32 weight is left: the old casts are gone
    assert not any(_compat.fx_annotations(n).get(scaling.ANNOTATION) for n in gm.graph.nodes)


def test_rowwise_rows_carry_their_scales_and_columns_share_one_all_reduce():
    gm = trace(_model(RW, "g", 2, backward_cast=True), *_args(2))
    inv0 = verify.inventory(gm)
    gm, rec = run_pass("fp8_allgather", gm)
    ags = _gathers(gm)
    assert len(ags) == 6 and counts(gm)[AR] == 1  # rows and columns per weight; one all-reduce (columns)
    widths = sorted(tuple(a.args[0].meta["val"].shape) for a in ags)
    # row casts send [c, 16 + 4] (each row's float32 inverse scale beside its bytes), column casts [c, 16]
    assert widths == sorted([(3, 20), (2, 20), (3, 20), (3, 16), (2, 16), (3, 16)])
    (ar,) = [n for n in gm.graph.nodes if gu.op_name(n) == AR]
    assert tuple(ar.args[0].meta["val"].shape) == (3 * 16,)  # one amax per column per weight
    assert rec.counts["gathers_fp8"] == 6 and rec.counts["weights_fp8"] == 3
    verify.check(inv0, verify.inventory(gm), "fp8_allgather", "joint", 0)  # two FP8 gathers count as one


def test_bucketed_after_and_param_dtype_cast_moved_onto_the_shard():
    """The cast to ``param_dtype`` between the gather and the weight is applied to the
    shard (casts commute with the gather), fused or not; bucket_collectives then packs
    the FP8 gathers into one bucket of FP8 bytes."""
    for fuse in (False, True):
        gm = trace(_model(TW, "g", 2, cast=torch.bfloat16), *_args(2))
        if fuse:
            gm, _ = run_pass("fuse_allgather_downcast", gm)
            assert [n.meta["val"].dtype for n in _gathers(gm)] == [torch.bfloat16] * 3
        inv0 = verify.inventory(gm)
        gm, rec = run_pass("fp8_allgather", gm)
        assert rec.counts["wire_bytes_after"] * (2 if fuse else 4) == rec.counts["wire_bytes_before"]
        # the amax and the cast read the shard as bf16, as the unfused cast read the weight
        casts = [n for n in gm.graph.nodes if gu.dtype_cast(n) == torch.bfloat16]
        assert len(casts) >= 3
        inv1 = verify.inventory(gm)
        verify.check(inv0, inv1, "fp8_allgather", "joint", 0)
        gm, brec = run_pass("bucket_collectives", gm, bucket_bytes=1 << 20)
        assert brec.counts["all_gathers_bucketed"] == 3
        (ag,) = _gathers(gm)
        assert ag.meta[gu.FP8_WIRE] == "float8_e4m3fn" and ag.meta["val"].dtype == torch.uint8
        verify.check(inv1, verify.inventory(gm), "bucket_collectives", "joint", 0)


def test_scheduling_passes_see_the_cast_and_unpack_as_the_gathers_chains():
    from graphcomp.passes import schedule_free

    for recipe in (TW, RW):
        gm = trace(_model(recipe, "g", 2), *_args(2))
        gm, _ = run_pass("fp8_allgather", gm)
        groups = schedule_free.gather_groups(gm)
        assert len(groups) == 3
        for g in groups:
            # the shard's FP8 cast is the gather's input chain (freed and recomputed with it)
            assert any(gu.dtype_cast(n) == torch.float8_e4m3fn for n in g.pre), [gu.op_name(n) for n in g.pre]
            assert any(n.target is torch.ops.aten.view.dtype for n in g.values)
            if recipe is RW:  # the unpacking copies of bytes and scales belong to the gathered value
                assert sum(gu.op_name(n) == "aten.clone.default" for n in g.values) == 2


def test_refusals_are_counted_and_leave_the_graph_alone():
    def uncast(s, x):  # the gathered weight also read in high precision
        w = gather(s, 2, "g", rows=6)
        return _linear(x, w, TW) + [w.sum()]

    def local(w, x):  # not gathered (world size 1 / unsharded)
        return _linear(x, w, TW)

    def plain(s, x):  # no FP8 cast at all
        return [x @ gather(s, 2, "g", rows=6).t()]

    cases = [(uncast, (torch.randn(3, 16), torch.randn(8, 16)), "used_beside_fp8"),
             (local, (torch.randn(6, 16), torch.randn(8, 16)), "not_gathered"),
             (plain, (torch.randn(3, 16), torch.randn(8, 16)), None)]
    for fn, args, why in cases:
        gm = trace(fn, *args)
        code = gm.code
        gm, rec = run_pass("fp8_allgather", gm)
        assert gm.code == code, fn.__name__
        assert rec.reason, fn.__name__
        if why:
            assert rec.counts[f"skipped:{why}"] == 1, (fn.__name__, rec.counts)
        else:
            assert "no FP8 weight cast" in rec.reason


@pytest.fixture
def tp_foreign():
    SESSION.shard_groups["dp"] = True  # (what shard(mesh=...) records: "tp" is not graphcomp's)
    yield
    del SESSION.shard_groups["dp"]


def test_tensor_parallel_gathers_are_never_matched(tp_foreign):
    def f(s_dp, s_tp, x):
        return _linear(x, gather(s_dp, 2, "dp", rows=6), TW) + _linear(x, gather(s_tp, 2, "tp", rows=6), TW)

    gm = trace(f, torch.randn(3, 16), torch.randn(3, 16), torch.randn(8, 16))
    gm, rec = run_pass("fp8_allgather", gm)
    assert rec.counts["weights_fp8"] == 1 and rec.counts["skipped:tensor_parallel"] == 1
    dp, tp = sorted(_gathers(gm), key=lambda n: n.args[2])
    assert dp.meta["val"].dtype == torch.uint8 and tp.meta["val"].dtype == torch.float32


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_semantics_on_a_real_world1_group_are_bitwise(recipe):
    r = RECIPES[recipe]
    with world1_group() as group:
        for cast in (None, torch.bfloat16):
            f = _model(r, group, 1, cast=cast, backward_cast=recipe == "rowwise")
            args = _args(1)
            gm = trace(f, *args)
            ref = gm(*args)
            gm, _ = run_pass("fp8_allgather", gm)
            gm, _ = run_pass("bucket_collectives", gm, bucket_bytes=1 << 20)
            for a, b in zip(ref, gm(*args), strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape
                torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_prefetch_moves_each_fp8_gather_with_its_cast(recipe):
    """Three FP8 layers ``x = tanh(layer_i(x))``: after the pass, schedule_prefetch issues
    each later gather (its shard's FP8 cast with it) behind the previous layer's compute,
    as it does a plain gather; the all-reduce of the amaxes stays at the top."""
    r = RECIPES[recipe]

    def f(x, *shards):
        for s in shards:
            x = torch.tanh(_linear(x, gather(s, 2, "g", rows=16), r)[0])
        return x

    gm = trace(f, torch.randn(8, 16), *[torch.randn(8, 16) for _ in range(3)])
    gm, _ = run_pass("fp8_allgather", gm)
    one = next(a for a in _gathers(gm)).meta["val"].numel()  # one FP8 gather's bytes
    gm, rec = run_pass("schedule_prefetch", gm, stage="fwd", prefetch_bytes=one)
    nodes = list(gm.graph.nodes)
    ags = _gathers(gm)
    ahead = [sum(n.op == "call_function" and gu.op_name(n) == "aten.tanh.default"
                 for n in nodes[nodes.index(a):nodes.index(next(iter(a.users)))]) for a in ags]
    assert ahead == [0, 1, 1], ahead  # each next layer's gather in flight during the previous layer
    for a in ags:  # its FP8 cast moved with it: no model compute between the cast and the gather
        (cast,) = [n for n in nodes[:nodes.index(a)] if gu.dtype_cast(n) == torch.float8_e4m3fn
                   and a in _descendants(n)]
        between = nodes[nodes.index(cast):nodes.index(a)]
        assert not any(gu.op_name(n) in ("aten.tanh.default", "aten._scaled_mm.default") for n in between)


def _descendants(n):
    out, stack = set(), list(n.users)
    while stack:
        u = stack.pop()
        if u not in out:
            out.add(u)
            stack.extend(u.users)
    return out
