"""schedule_free on joint graphs from AOTAutograd: what the min-cut partitioner
saves and re-gathers under each reshard policy, the fused dtype of re-gathers,
and the "auto" budget (hand-built graphs + hypothesis)."""

import logging

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from _graphs import gather, run_pass, trace, world1_group

from graphcomp import _compat
from graphcomp.analysis import memory
from graphcomp.analysis.graph_utils import is_target
from graphcomp.sharding.shard import _GatherParam
from graphcomp.passes import schedule_free as sf
from graphcomp.passes.schedule_free import choose_kept, gather_groups, is_post_op

c10d = torch.ops._c10d_functional
AG = c10d.all_gather_into_tensor.default


def _mlp(group, param_dtype=None):
    """Two layers over shards of a 1-rank group (real collectives): both gathered
    weights are needed again in backward (grad of the input goes through them)."""

    def f(x, s1, s2):
        w1 = _GatherParam.apply(s1, 8, (8, 6), param_dtype, torch.float32, group, 1)
        w2 = _GatherParam.apply(s2, 4, (4, 8), param_dtype, torch.float32, group, 1)
        if param_dtype is not None:
            x = x.to(param_dtype)
        return (torch.tanh(x @ w1.t()) @ w2.t()).float()

    return f


def _compile(f, joint_passes, **options):
    """aot_function with our joint passes before the min-cut partitioner; returns
    the compiled fn and a dict that gets the joint/fwd/bwd graphs and records."""
    from functorch.compile import aot_function

    got = {}

    def partition(joint, joint_inputs, **kw):
        recs = {}
        for name in joint_passes:
            joint, recs[name] = run_pass(name, joint, **options)
        got["joint"], got["records"] = joint, recs
        fwd, bwd = _compat.min_cut_partition(joint, joint_inputs, **kw)
        got["fwd"], got["bwd"] = fwd, bwd
        return fwd, bwd

    def nop(gm, _):
        return gm

    return aot_function(f, fw_compiler=nop, bw_compiler=nop, partition_fn=partition), got


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 6, generator=g, requires_grad=True)
    s1 = torch.randn(8, 6, generator=g, requires_grad=True)
    s2 = torch.randn(4, 8, generator=g, requires_grad=True)
    return x, s1, s2


def _run(f, inputs):
    """Forward, backward of the sum; the output and the gradient of every input that
    requires one (cleared after)."""
    out = f(*inputs)
    out.sum().backward()
    leaves = [t for t in inputs if t.requires_grad]
    grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return out.detach(), grads


def _compiled_matches_eager(model, inputs, passes, **options):
    """``model(group)`` run eagerly and through ``_compile(passes, **options)`` on a
    1-rank group: outputs and input gradients bitwise equal; returns ``got``."""
    with world1_group() as group:
        f = model(group)
        ref = _run(f, inputs())
        cf, got = _compile(f, passes, **options)
        res = _run(cf, inputs())
    torch.testing.assert_close(res, ref, rtol=0, atol=0)
    return got


def _saved_gathers(fwd):
    """fwd outputs that are (views/casts of) a gathered value."""
    out = next(n for n in fwd.graph.nodes if n.op == "output")
    bad = []
    for a in out.args[0]:
        n = a
        while isinstance(n, torch.fx.Node) and (is_post_op(n) or is_target(n, c10d.wait_tensor.default)):
            n = n.args[0]
        if isinstance(n, torch.fx.Node) and is_target(n, AG):
            bad.append(a.name)
    return bad


def _gathers(gm):
    return [n for n in gm.graph.nodes if is_target(n, AG)]


@pytest.mark.parametrize("fuse", [False, True])
def test_reshard_true_regathers_in_backward_and_saves_no_gathered_param(fuse):
    passes = ["fuse_allgather_downcast", "schedule_free"] if fuse else ["schedule_free"]
    got = _compiled_matches_eager(lambda g: _mlp(g, torch.bfloat16 if fuse else None), _inputs, passes,
                                  reshard_after_forward=True)
    assert _saved_gathers(got["fwd"]) == []
    assert len(_gathers(got["fwd"])) == 2 and len(_gathers(got["bwd"])) == 2
    rec = got["records"]["schedule_free"]
    assert rec.counts["gathers_resharded"] == 2 and rec.counts["gathers_kept"] == 0
    if fuse:  # the re-gather moves bf16 too (the fused downcast survives recompute)
        for ag in _gathers(got["bwd"]):
            assert ag.meta["val"].dtype == torch.bfloat16
            assert ag.args[0].meta["val"].dtype == torch.bfloat16


def test_reshard_false_saves_every_gathered_param():
    got = _compiled_matches_eager(_mlp, _inputs, ["schedule_free"], reshard_after_forward=False)
    assert len(_saved_gathers(got["fwd"])) == 2
    assert _gathers(got["bwd"]) == []
    assert got["records"]["schedule_free"].counts["gathers_kept"] == 2


def test_except_last_keeps_the_gather_the_backward_reads_first():
    """Two layers: the backward reads w2 (the last layer's) first. ``except_last``
    saves w2's gathered value for the backward and re-gathers only w1."""
    got = _compiled_matches_eager(_mlp, _inputs, ["schedule_free"], reshard_after_forward="except_last")
    (saved,) = _saved_gathers(got["fwd"])
    (ag,) = _gathers(got["bwd"])
    assert tuple(ag.meta["val"].shape) == (8, 6)  # w1 re-gathered: (8, 6); w2 is (4, 8)
    rec = got["records"]["schedule_free"]
    assert rec.counts["gathers_resharded"] == 1 and rec.counts["gathers_kept"] == 1
    assert "kept" in " ".join(rec.notes) and "reads it first" in " ".join(rec.notes)


def test_bucketed_gathers_regather_as_one_bucket():
    got = _compiled_matches_eager(lambda g: _mlp(g, torch.bfloat16), _inputs,
                                  ["fuse_allgather_downcast", "bucket_collectives", "schedule_free"])
    (ag,) = _gathers(got["bwd"])
    assert ag.meta["val"].dtype == torch.bfloat16
    assert _saved_gathers(got["fwd"]) == []


def _joint_like(sizes, bwd_uses):
    """A joint-shaped graph: gather i (sizes[i] rows of 16 fp32) is used in forward,
    and again after the tangent (the backward part) when bwd_uses[i]."""
    world = 2

    def f(x, tangents_1, *shards):
        ws = [gather(s, world, "g", shape=(world * s.shape[0], 16)) for s in shards]
        h = x
        for w in ws:
            h = torch.tanh(h @ w.t()[:16, :16].contiguous())
        big = torch.ones(4096) * h.sum()  # a forward peak after the last weight use (16 KiB)
        h = h + big.sum()
        g = tangents_1
        for w, use in zip(reversed(ws), reversed(bwd_uses)):
            if use:
                g = torch.tanh(g @ w[:16, :16])  # backward use: depends on the tangent
        return h.sum(), g

    shards = [torch.randn(n, 16) for n in sizes]
    gm = trace(f, torch.randn(4, 16), torch.randn(4, 16), *shards)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    phs[1]._rename("tangents_1")  # AOTAutograd's name for the cotangent input (varargs lost it)
    gm.recompile()
    return gm


def test_auto_keeps_what_fits_cheapest_first():
    gm = _joint_like([8, 8, 64, 8], [True, True, True, True])
    groups = gather_groups(gm, memory.backward_nodes(gm))
    assert len(groups) == 4
    all_resh = memory.estimate(gm, set().union(*(g.roots() for g in groups))).peak_bytes
    keep_all = memory.estimate(gm).peak_bytes
    assert keep_all > all_resh
    kept, est, reason = choose_kept(gm, groups, all_resh)
    assert reason is None and est.peak_bytes <= all_resh
    kept, est, reason = choose_kept(gm, groups, keep_all)
    assert kept == {0, 1, 2, 3} and reason is None
    # budget for the three small ones but not the big one: small gathers cost more per byte to re-gather
    small = all_resh + 3 * groups[0].held_bytes
    kept, est, reason = choose_kept(gm, groups, small)
    assert 2 not in kept and est.peak_bytes <= small


def test_auto_infeasible_budget_warns_and_reshards_everything(caplog):
    gm = _joint_like([8, 8], [True, True])
    with caplog.at_level(logging.WARNING, logger="graphcomp.passes.schedule_free"):
        gm, rec = run_pass("schedule_free", gm, reshard_after_forward="auto", memory_budget=1000)
    assert rec.counts["budget_infeasible"] == 1 and rec.counts["gathers_resharded"] == 2
    assert any("infeasible" in r.message for r in caplog.records)
    assert all(n.meta["recompute"] == _compat.checkpoint_policy().MUST_RECOMPUTE
               for n in gm.graph.nodes if is_target(n, AG))


def test_auto_without_budget_reshards_everything():
    gm = _joint_like([8, 8], [True, False])
    gm, rec = run_pass("schedule_free", gm, reshard_after_forward="auto")
    assert rec.counts["gathers_kept"] == 0 and rec.counts["gathers_resharded"] == 2
    assert any("without a memory budget" in n for n in rec.notes)


def test_default_is_auto():
    from graphcomp.config import Config

    assert Config().reshard_after_forward == "auto"


def test_auto_under_the_default_budget_leaves_room_for_optimizer_state(monkeypatch):
    """memory_budget="auto" (0.9 of the device) keeps gathers only while the estimate
    plus 2x the shards' bytes fits; an explicit budget of the same size keeps more."""
    from graphcomp.analysis import memory

    gm = _joint_like([8, 8], [True, True])
    _, rec0 = run_pass("schedule_free", _joint_like([8, 8], [True, True]), reshard_after_forward=False)
    full = rec0.counts["estimated_peak_bytes"]
    groups = sf.gather_groups(gm, memory.backward_nodes(gm))
    reserve = sf.optimizer_reserve(groups)
    assert reserve == 2 * sum(memory.value_bytes(n) for n in sf.shard_inputs(groups)) > 0
    monkeypatch.setattr(memory, "resolve_budget", lambda b, g: full if b == "auto" else int(b))
    gm, rec = run_pass("schedule_free", gm, code_id=1, reshard_after_forward="auto", memory_budget="auto")
    assert rec.counts["optimizer_reserve_bytes"] == reserve and rec.counts["gathers_kept"] < 2
    gm2, rec2 = run_pass("schedule_free", _joint_like([8, 8], [True, True]), code_id=2, reshard_after_forward="auto",
                         memory_budget=full)
    assert rec2.counts["gathers_kept"] == 2 and "optimizer_reserve_bytes" not in rec2.counts


def test_auto_under_the_default_budget_leaves_room_for_other_frames(monkeypatch):
    """Two compiled functions (graph breaks) hold their kept gathers at the same time:
    the second's decision sees the first's; a recompile of the first replaces its own."""
    from graphcomp.analysis import memory
    from graphcomp.session import SESSION

    g = lambda: _joint_like([8, 8], [True, True])  # noqa: E731
    _, rec0 = run_pass("schedule_free", g(), reshard_after_forward=False)
    groups = sf.gather_groups(g(), None)
    budget = rec0.counts["estimated_peak_bytes"] + sf.optimizer_reserve(groups)
    monkeypatch.setattr(memory, "resolve_budget", lambda b, gm: budget)
    _, a = run_pass("schedule_free", g(), code_id=1, reshard_after_forward="auto", memory_budget="auto")
    assert a.counts["gathers_kept"] == 2 and a.counts["other_frames_kept_bytes"] == 0
    held = next(b for k, b in SESSION.kept_gather_bytes.items() if k[0] == 1)
    assert held == sum(x.held_bytes for x in groups) > 0
    _, b = run_pass("schedule_free", g(), code_id=2, reshard_after_forward="auto", memory_budget="auto")
    assert b.counts["other_frames_kept_bytes"] == held and b.counts["gathers_kept"] < 2
    _, a2 = run_pass("schedule_free", g(), code_id=1, reshard_after_forward="auto", memory_budget="auto")
    assert a2.counts["keep_plan_reused"] == 1 and a2.counts["gathers_kept"] == 2  # its first plan
    assert next(b for k, b in SESSION.kept_gather_bytes.items() if k[0] == 1) == held


def test_auto_with_no_room_after_the_reserve_reshards_without_a_warning(monkeypatch, caplog):
    """The graph fits the default budget but not with the optimizer reserve on top:
    every gather resharded, noted, not reported as an infeasible budget."""
    from graphcomp.analysis import memory

    gm = _joint_like([8, 8], [True, True])
    groups = sf.gather_groups(gm, memory.backward_nodes(gm))
    lo = memory.estimate(gm, set().union(*(g.roots() for g in groups))).peak_bytes
    monkeypatch.setattr(memory, "resolve_budget", lambda b, g: lo)
    with caplog.at_level(logging.WARNING, logger="graphcomp.passes.schedule_free"):
        gm, rec = run_pass("schedule_free", gm, code_id=3, reshard_after_forward="auto", memory_budget="auto")
    assert rec.counts["gathers_kept"] == 0 and "budget_infeasible" not in rec.counts
    assert any("no room to keep gathers" in n for n in rec.notes) and not caplog.records


def test_remat_plans_under_the_same_room_as_schedule_free(monkeypatch):
    """Under the default budget, remat (which plans first) subtracts the optimizer
    reserve too: its budget is the room schedule_free keeps gathers in; under an
    explicit budget neither subtracts anything."""
    from graphcomp.analysis import memory

    gm = _joint_like([8, 8], [True, True])
    groups = sf.gather_groups(gm, memory.backward_nodes(gm))
    reserve = sf.optimizer_reserve(groups)
    budget = 10**7
    monkeypatch.setattr(memory, "resolve_budget", lambda b, g: budget if b in ("auto", budget) else int(b))
    _, rec = run_pass("remat", gm, code_id=11, memory_budget="auto")
    assert rec.counts["budget_bytes"] == budget - reserve and rec.counts["optimizer_reserve_bytes"] == reserve
    _, rec = run_pass("remat", _joint_like([8, 8], [True, True]), code_id=12, memory_budget=budget)
    assert rec.counts["budget_bytes"] == budget and "optimizer_reserve_bytes" not in rec.counts


def _joint_with_activation():
    """A joint-shaped graph with one large forward activation the backward reads
    (tanh's output, 64 KiB) and one small gathered weight (1 KiB) the backward reads."""

    def f(x, tangents_1, shard):
        w = gather(shard, 2, "g", shape=(16, 16))
        h = x @ w.t()
        a = torch.tanh(h)
        s = a.sum()
        big = torch.ones(16 * 4096) * s  # the forward peak, while `a` is live when saved (256 KiB)
        loss = s + big.sum()
        g = tangents_1 * a  # backward: reads the activation
        return loss, g @ w

    gm = trace(f, torch.randn(1024, 16), torch.randn(1024, 16), torch.randn(8, 16))
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    phs[1]._rename("tangents_1")
    gm.recompile()
    return gm


def test_user_checkpointing_is_freed_in_the_keep_estimate():
    """schedule_free's estimates count what the partitioner recomputes as tagged (a
    user checkpoint region): the activation it frees makes room for the gather
    under a budget that does not fit both."""
    gm = _joint_with_activation()
    bwd = memory.backward_nodes(gm)
    (group,) = gather_groups(gm, bwd)
    decided = sf.decided_nodes([group], bwd)
    assert memory.tagged_recompute(gm, exclude=decided) == []
    P = _compat.checkpoint_policy()
    region = [n for n in gm.graph.nodes if n.op == "call_function" and n not in bwd and n not in decided
              and n.target in (torch.ops.aten.mm.default, torch.ops.aten.tanh.default)]
    assert len(region) == 2
    for n in [*region, group.coll]:  # the region spans the gather: schedule_free still decides it
        n.meta["recompute"], n.meta["ac_graph_id"] = P.PREFER_RECOMPUTE, 1
    rec = memory.tagged_recompute(gm, exclude=decided)
    assert rec == region
    resh = group.roots()
    saved = memory.estimate(gm, resh, bwd).peak_bytes
    freed = memory.estimate(gm, resh, bwd, recompute=rec).peak_bytes
    kept_freed = memory.estimate(gm, set(), bwd, recompute=rec).peak_bytes
    assert freed < saved and kept_freed <= saved, (freed, kept_freed, saved)
    kept, _, reason = choose_kept(gm, [group], saved)  # as if the region's activations were saved
    kept_r, est, reason_r = choose_kept(gm, [group], saved, recompute=rec)
    assert reason is None and reason_r is None and est.peak_bytes <= saved
    assert kept == set() and kept_r == {0}
    gm2, recd = run_pass("schedule_free", gm, reshard_after_forward="auto", memory_budget=kept_freed)
    assert recd.counts["gathers_kept"] == 1 and recd.counts["estimated_peak_bytes"] == kept_freed


def test_auto_recompile_reuses_the_first_plan_whatever_its_shapes(monkeypatch):
    """A rank that recompiles alone for a new shape must issue its peers' gathers: the
    function's first plan is reused even where the new estimate would decide
    otherwise; a graph with other gathers decides afresh."""
    from graphcomp.analysis import memory

    g = lambda: _joint_like([8, 8], [True, True])  # noqa: E731
    _, full = run_pass("schedule_free", g(), reshard_after_forward=False)
    budget = [full.counts["estimated_peak_bytes"]]
    monkeypatch.setattr(memory, "resolve_budget", lambda b, gm: budget[0])
    _, first = run_pass("schedule_free", g(), code_id=7, reshard_after_forward="auto", memory_budget=123)
    assert first.counts["gathers_kept"] == 2
    budget[0] = 1  # (the new shapes' estimate would now keep nothing)
    gm, again = run_pass("schedule_free", g(), code_id=7, reshard_after_forward="auto", memory_budget=123)
    assert again.counts["keep_plan_reused"] == 1 and again.counts["gathers_kept"] == 2
    assert any("over the budget" in n for n in again.notes)
    assert all(n.meta["recompute"] == _compat.checkpoint_policy().MUST_SAVE for n in gm.graph.nodes if is_target(n, AG))
    budget[0] = full.counts["estimated_peak_bytes"]
    _, other = run_pass("schedule_free", _joint_like([8, 16], [True, True]), code_id=7,
                        reshard_after_forward="auto", memory_budget=123)
    assert "keep_plan_reused" not in other.counts


def test_inference_graph_is_a_noop():
    gm = trace(lambda s, x: x @ gather(s, 2, "g", shape=(4, 4)), torch.randn(2, 4), torch.randn(3, 4))
    gm, rec = run_pass("schedule_free", gm)
    assert "no backward" in rec.reason
    assert not any("recompute" in n.meta for n in gm.graph.nodes)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.sampled_from([8, 16, 64]), min_size=1, max_size=4),
    uses=st.lists(st.booleans(), min_size=4, max_size=4),
    frac=st.floats(min_value=-0.5, max_value=1.5),
)
def test_property_auto_budget(sizes, uses, frac):
    """Estimated peak <= budget whenever the budget is feasible; a recorded reason
    when it is not; the same decision for the same graph (rank determinism)."""
    gm = _joint_like(sizes, uses[: len(sizes)])
    groups = gather_groups(gm, memory.backward_nodes(gm))
    lo = memory.estimate(gm, set().union(*(g.roots() for g in groups))).peak_bytes
    hi = memory.estimate(gm).peak_bytes
    budget = max(1, int(lo + frac * (hi - lo)))
    kept, est, reason = choose_kept(gm, groups, budget)
    if budget >= lo:
        assert reason is None and est.peak_bytes <= budget
        assert memory.estimate(gm, set().union(set(), *(g.roots() for i, g in enumerate(groups) if i not in kept))).peak_bytes <= budget
    else:
        assert reason is not None and "infeasible" in reason and kept == set()
    gm2 = _joint_like(sizes, uses[: len(sizes)])
    kept2, _, _ = choose_kept(gm2, gather_groups(gm2, memory.backward_nodes(gm2)), budget)
    assert kept2 == kept


def _greedy_one_by_one(gm, groups, budget):
    """The plain greedy choose_kept implements with fewer estimates."""
    bwd = memory.backward_nodes(gm)
    roots = [g.roots() for g in groups]
    reshard, kept = set().union(*roots), set()
    for i in sorted(range(len(groups)), key=lambda i: (-sf.regather_cost_per_byte(groups[i]), i)):
        if memory.estimate(gm, reshard - roots[i], bwd).peak_bytes <= budget:
            kept.add(i)
            reshard = reshard - roots[i]
    return kept


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.sampled_from([8, 16, 64]), min_size=1, max_size=5),
    uses=st.lists(st.booleans(), min_size=5, max_size=5),
    frac=st.floats(min_value=0.0, max_value=1.0),
)
# found by CI's hypothesis run (2026-11-27): group 0 does not fit, group 1 (as large,
# its window away from group 0's peak) does; the old size rule skipped group 1
@example(sizes=[64, 64, 64, 64, 64], uses=[True, True, False, False, False], frac=0.0)
def test_property_auto_keeps_what_the_one_by_one_greedy_keeps(sizes, uses, frac):
    """Bisection of the fitting prefix and the size pruning choose what trying every
    group in turn would (with fewer estimates of the graph's peak)."""
    gm = _joint_like(sizes, uses[: len(sizes)])
    groups = gather_groups(gm, memory.backward_nodes(gm))
    lo = memory.estimate(gm, set().union(*(g.roots() for g in groups))).peak_bytes
    hi = memory.estimate(gm).peak_bytes
    budget = int(lo + frac * (hi - lo))
    kept, _, _ = choose_kept(gm, groups, budget)
    assert kept == _greedy_one_by_one(gm, groups, budget)


def test_auto_with_many_gathers_needs_few_estimates():
    """All fit: two estimates; a tight budget: a bisection, not one per gather."""
    from graphcomp.compiler.pipeline import PassRecord

    gm = _joint_like([16] * 24, [True] * 24)
    groups = gather_groups(gm, memory.backward_nodes(gm))
    hi = memory.estimate(gm).peak_bytes
    lo = memory.estimate(gm, set().union(*(g.roots() for g in groups))).peak_bytes

    def run(budget):
        from graphcomp.config import Config
        from graphcomp.compiler.pipeline import PassContext

        ctx = PassContext(config=Config(), frame_id=0, stage="joint")
        ctx.record = PassRecord(name="schedule_free", stage="joint", enabled=True)
        kept, est, _ = choose_kept(gm, groups, budget, ctx)
        return kept, est, ctx.record.counts["estimates"]

    kept, est, n = run(hi)
    assert len(kept) == 24 and n == 2
    budget = (lo + hi) // 2
    kept, est, n = run(budget)
    assert 0 < len(kept) < 24 and est.peak_bytes <= budget and n <= 2 + 6 + 2
    assert kept == _greedy_one_by_one(gm, groups, budget)


def _experts(group):
    """transformers' batched_mm experts in small: the gathered expert weights indexed
    per token (``w[ids]``: one weight copy per token), then a batched matmul; the
    gradient of ``x`` needs the indexed weights again in backward."""

    def f(x, ids, s1):
        w = _GatherParam.apply(s1, 2, (2, 3, 4), None, torch.float32, group, 1)
        sel = w[ids]  # (S, 3, 4): S / 2 times the gathered weight
        return torch.bmm(sel, x.unsqueeze(-1)).squeeze(-1)

    return f


def _expert_inputs(seed=0, tokens=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 4, generator=g, requires_grad=True)
    ids = torch.randint(0, 2, (tokens,), generator=g)
    s1 = torch.randn(2, 3, 4, generator=g, requires_grad=True)
    return x, ids, s1


def _fwd_outputs(fwd):
    out = next(n for n in fwd.graph.nodes if n.op == "output")
    return [a for a in out.args[0] if isinstance(a, torch.fx.Node)]


@pytest.mark.parametrize("reshard", [True, False])
def test_expanding_read_of_a_gathered_parameter_is_recomputed_not_saved(reshard):
    got = _compiled_matches_eager(_experts, _expert_inputs, ["schedule_free"], reshard_after_forward=reshard)
    saved_shapes = [tuple(n.meta["val"].shape) for n in _fwd_outputs(got["fwd"]) if "val" in n.meta]
    assert (32, 3, 4) not in saved_shapes, saved_shapes  # no per-token weight copy
    bwd_index = [n for n in got["bwd"].graph.nodes if is_target(n, torch.ops.aten.index.Tensor)]
    assert len(bwd_index) == 1  # the read, again, in backward
    rec = got["records"]["schedule_free"]
    assert rec.counts["expanding_reads"] == 1 and rec.counts["expanding_read_bytes"] == 32 * 3 * 4 * 4
    # a resharded parameter is gathered again for it; a kept one is saved and read again
    assert len(_gathers(got["bwd"])) == (1 if reshard else 0)


def test_small_reads_of_a_gathered_parameter_are_left_to_the_partitioner():
    """Under EXPANSION_RATIO (4 tokens of a 2-expert table: 2x) nothing is tagged."""
    with world1_group() as group:
        f = _experts(group)
        cf, got = _compile(f, ["schedule_free"], reshard_after_forward=True)
        _run(cf, _expert_inputs(tokens=4))
    assert "expanding_reads" not in got["records"]["schedule_free"].counts


def _layers_joint(rows, ckpt):
    """A joint-shaped graph of len(rows) layers: layer i gathers a weight (rows[i] x 16
    fp32 per rank, 2 ranks) and makes an activation (1024 x 16) the backward reads;
    layers in ``ckpt`` are tagged as a user checkpoint region would tag them."""
    world = 2

    def f(x, tangents_1, *shards):
        ws = [gather(s, world, "g", shape=(world * s.shape[0], 16)) for s in shards]
        h, acts = x, []
        for w in ws:
            h = torch.tanh(h @ w[:16, :16])
            acts.append(h)
        loss = h.sum()
        g = tangents_1
        for w, a in zip(reversed(ws), reversed(acts)):
            g = (g * a) @ w[:16, :16].t()  # reads the activation and the gathered weight
        return loss, g

    shards = [torch.randn(n, 16) for n in rows]
    gm = trace(f, torch.randn(1024, 16), torch.randn(1024, 16), *shards)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    phs[1]._rename("tangents_1")
    gm.recompile()
    P = _compat.checkpoint_policy()
    bwd = memory.backward_nodes(gm)
    mms = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default and n not in bwd]
    for i, mm in enumerate(mms):
        if i in ckpt:
            for n in (mm, *mm.users):  # the matmul and its tanh
                n.meta["recompute"], n.meta["ac_graph_id"] = P.PREFER_RECOMPUTE, i + 1
    gm.recompile()
    return gm


def _final_estimate(gm):
    """The estimate of the graph as the partitioner will see it: schedule_free's
    resharded gathers, every other recompute tag (user regions, remat's)."""
    bwd = memory.backward_nodes(gm)
    groups = gather_groups(gm, bwd)
    resh = set().union(set(), *(g.roots() for g in groups if g.coll.meta.get("graphcomp_reshard")))
    rec = memory.tagged_recompute(gm, exclude=sf.decided_nodes(groups, bwd))
    return memory.estimate(gm, resh, bwd, recompute=rec).peak_bytes


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(st.sampled_from([8, 64, 512]), min_size=2, max_size=4),
    ckpt=st.sets(st.integers(0, 3)),
    mode=st.sampled_from(["auto", "respect_user"]),
    frac=st.floats(min_value=0.0, max_value=1.3),
)
def test_property_remat_then_schedule_free_meet_the_budget(rows, ckpt, mode, frac):
    """remat (gathers modelled re-gathered) then schedule_free (gathers kept in the
    room left): when neither reports the budget infeasible, the graph as finally
    tagged is estimated under the budget; the same graph gets the same tags."""
    lo_gm = _layers_joint(rows, ckpt)
    groups = gather_groups(lo_gm, memory.backward_nodes(lo_gm))
    everything = set().union(*(g.roots() for g in groups))
    lo = int(0.9 * memory.estimate(lo_gm, everything).peak_bytes)  # (gathers resharded, activations saved)
    hi = memory.estimate(lo_gm).peak_bytes  # everything kept
    budget = max(1, int(lo + frac * (hi - lo)))
    import graphcomp

    tags = []
    for _ in range(2):
        graphcomp.reset()  # (a plan kept from an earlier example would be reused: a recompile's rule)
        gm = _layers_joint(rows, ckpt)
        gm, r = run_pass("remat", gm, remat=mode, memory_budget=budget)
        gm, s = run_pass("schedule_free", gm, memory_budget=budget)
        feasible = "budget_infeasible" not in r.counts and "budget_infeasible" not in s.counts
        if feasible:
            assert _final_estimate(gm) <= budget, (r.counts, s.counts)
        event(f"feasible={feasible}, gathers kept {s.counts.get('gathers_kept')} of {len(groups)}, "
              f"recomputed {r.counts.get('recomputed')}")
        tags.append([(n.name, str(n.meta.get("recompute"))) for n in gm.graph.nodes])
    assert tags[0] == tags[1]
