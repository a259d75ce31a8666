"""schedule_prefetch on hand-built fwd/bwd-like graphs (exact positions) and on
random graphs (hypothesis: semantics, rank determinism, memory budget)."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _graphs import gather, reduce_scatter, run_pass, trace, world1_group

from graphcomp.analysis import memory
from graphcomp.analysis.graph_utils import is_target
from graphcomp.passes.schedule_free import is_post_op

c10d = torch.ops._c10d_functional
AG, RS, WAIT = c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default, c10d.wait_tensor.default
W_BYTES = 8 * 8 * 4  # one gathered weight


def _layers(n, world=2, group="g"):
    """n layers ``x = tanh(x @ w_i)``: 2 compute nodes (mm, tanh) per layer."""

    def f(x, *shards):
        for s in shards:
            x = torch.tanh(x @ gather(s, world, group, shape=(8, 8)))
        return x

    return trace(f, torch.randn(2, 8), *[torch.randn(8 // world, 8) for _ in range(n)])


def _is_compute(n):
    return n.op == "call_function" and not (is_target(n, AG, RS, WAIT) or is_post_op(n))


def _ahead(gm):
    """For each gather: compute nodes between it and its wait, in graph order."""
    nodes = list(gm.graph.nodes)
    out = []
    for i, n in enumerate(nodes):
        if is_target(n, AG):
            w = next(iter(n.users))
            out.append(sum(_is_compute(m) for m in nodes[i + 1 : nodes.index(w)]))
    return out


def _waits_right_before_first_use(gm):
    nodes = list(gm.graph.nodes)
    for i, n in enumerate(nodes):
        if is_target(n, WAIT) and is_target(n.args[0], AG):
            j = i + 1
            while is_post_op(nodes[j]) or is_target(nodes[j], AG):  # the next gather may be issued here
                j += 1
            chain = {n} | {m for m in nodes[i + 1 : j]}
            assert any(a in chain for a in nodes[j].all_input_nodes), f"{n.name} is not right before its first use"


def test_one_gather_in_flight_moves_each_gather_one_layer_ahead():
    gm, rec = run_pass("schedule_prefetch", _layers(4), stage="fwd", prefetch_bytes=W_BYTES)
    assert _ahead(gm) == [0, 2, 2, 2]  # gather k is issued as soon as gather k-1 was waited
    assert rec.counts["max_inflight_bytes"] == W_BYTES
    _waits_right_before_first_use(gm)


def test_two_gathers_in_flight():
    gm, rec = run_pass("schedule_prefetch", _layers(4), stage="fwd", prefetch_bytes=2 * W_BYTES)
    assert _ahead(gm) == [0, 2, 4, 4]  # the first two start together at the top
    assert rec.counts["max_inflight_bytes"] == 2 * W_BYTES


def test_zero_prefetch_keeps_every_gather_at_its_use():
    gm, rec = run_pass("schedule_prefetch", _layers(3), stage="fwd", prefetch_bytes=0)
    assert _ahead(gm) == [0, 0, 0]
    assert rec.counts["oversized_gathers"] == 0
    _waits_right_before_first_use(gm)


def test_gathers_larger_than_the_cap_move_one_at_a_time():
    """Every gather is larger than the cap: each is issued when the one before was
    waited (alone in flight), as with a cap of exactly one gather."""
    gm, rec = run_pass("schedule_prefetch", _layers(3), stage="fwd", prefetch_bytes=W_BYTES - 1)
    assert _ahead(gm) == [0, 2, 2]
    assert rec.counts["oversized_gathers"] == 3 and rec.counts["max_inflight_bytes"] == W_BYTES
    _waits_right_before_first_use(gm)


def _layers_then_head(n, world=2, group="g"):
    """n small layers ``x = tanh(x @ w_i)`` then a large "LM head" gather (8 x 64)."""

    def f(x, *shards):
        *ws, head = shards
        for s in ws:
            x = torch.tanh(x @ gather(s, world, group, shape=(8, 8)))
        return x @ gather(head, world, group, shape=(8, 64))

    shards = [torch.randn(8 // world, 8) for _ in range(n)] + [torch.randn(8 // world, 64)]
    return trace(f, torch.randn(2, 8), *shards)


def test_oversized_head_gather_overlaps_the_last_layer():
    """The LM-head table (8x larger than the cap) was left at its use: 1 ms exposed per
    step at W2 (2 H200s). It now starts when the last layer's gather is waited, so it
    overlaps that layer's compute, and nothing else is in flight meanwhile."""
    head_bytes = 8 * 64 * 4
    gm, rec = run_pass("schedule_prefetch", _layers_then_head(3), stage="fwd", prefetch_bytes=W_BYTES)
    assert _ahead(gm) == [0, 2, 2, 2]
    assert rec.counts["oversized_gathers"] == 1
    assert rec.counts["max_inflight_bytes"] == head_bytes
    _waits_right_before_first_use(gm)
    # with a budget that leaves no room for the head's buffer before its use, it stays
    gm0 = _layers_then_head(3)
    peak0 = memory.estimate(gm0).peak_bytes
    gm, rec = run_pass("schedule_prefetch", gm0, stage="fwd", prefetch_bytes=W_BYTES, memory_budget=peak0)
    assert memory.estimate(gm).peak_bytes <= peak0


def test_reduce_scatter_ready_at_the_top_goes_behind_the_first_gather():
    """A backward whose first collective-ready value is a gradient made in the forward
    (the chunked loss's LM-head gradient): its reduce-scatter is issued behind the
    gather the first compute waits for (one group runs its collectives in issue
    order: on 2 H200s at W2 the 2 ms reduce-scatter held that gather up)."""

    def f(x, head_grad, w_shard):
        r = reduce_scatter(head_grad, 2, "g")
        y = torch.tanh(x @ gather(w_shard, 2, "g", shape=(8, 8)))
        return y, r / 2

    gm = trace(f, torch.randn(2, 8), torch.randn(8, 8), torch.randn(4, 8))
    gm, rec = run_pass("schedule_prefetch", gm, stage="bwd")
    nodes = list(gm.graph.nodes)
    ag = next(n for n in nodes if is_target(n, AG))
    rs = next(n for n in nodes if is_target(n, RS))
    mm = next(n for n in nodes if n.target is torch.ops.aten.mm.default)
    assert nodes.index(ag) < nodes.index(rs) < nodes.index(mm)  # issued at the top, behind the gather
    assert nodes.index(next(iter(rs.users))) > nodes.index(mm)  # and waited at the end


def test_memory_budget_bounds_prefetch():
    gm0 = _layers(4)
    peak0 = memory.estimate(gm0).peak_bytes
    gm, rec = run_pass("schedule_prefetch", gm0, stage="fwd", prefetch_bytes=10**9, memory_budget=peak0)
    assert rec.counts["limited_by_budget"] > 0 or rec.counts["max_inflight_bytes"] <= W_BYTES
    assert memory.estimate(gm).peak_bytes <= peak0
    free, _ = run_pass("schedule_prefetch", _layers(4), stage="fwd", prefetch_bytes=10**9)
    assert sum(_ahead(free)) > sum(_ahead(gm))


def test_reduce_scatter_issued_at_input_and_waited_last():
    def f(x, g1, g2):
        r1 = reduce_scatter(g1 * 2, 2, "g")  # ready early
        y = x
        for _ in range(3):
            y = torch.tanh(y @ y)
        r2 = reduce_scatter(g2 * y.sum(), 2, "g")
        return y, r1 / 2, r2 / 2

    gm = trace(f, torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4))
    gm, rec = run_pass("schedule_prefetch", gm, stage="bwd")
    names = [n for n in gm.graph.nodes]
    rs = [n for n in names if is_target(n, RS)]
    waits = [next(iter(r.users)) for r in rs]
    assert names.index(rs[0]) == names.index(rs[0].args[0]) + 1  # right after its input (mul)
    out = names[-1]
    # both waits (and the divisions they feed) come after all other compute
    last_compute = max(i for i, n in enumerate(names) if n.target in (torch.ops.aten.tanh.default, torch.ops.aten.mm.default))
    assert all(names.index(w) > last_compute for w in waits)
    assert out.op == "output"


def test_no_collective_is_a_noop():
    gm = trace(lambda x: torch.tanh(x) * 2, torch.randn(3))
    code = gm.code
    gm, rec = run_pass("schedule_prefetch", gm, stage="fwd")
    assert gm.code == code and "no all_gather" in rec.reason


def test_cpu_graphs_stay_in_place_by_default_and_the_knob_reorders_them():
    """CPU (gloo) graphs keep every collective waited where it was traced unless
    FramePlan.prefetch_cpu_graphs opts in (docs/heap-corruption.md); the reason says so."""
    from graphcomp.config import Config
    from graphcomp.compiler.pipeline import PassContext, PassRecord, get_pass
    from graphcomp.compiler.plan import FramePlan

    def run(frame):
        gm = _layers(4)
        ctx = PassContext(config=Config.from_options({"prefetch_bytes": W_BYTES}), frame_id=0, stage="fwd",
                          frame=frame)
        ctx.record = PassRecord(name="schedule_prefetch", stage="fwd", enabled=True)
        code = gm.code
        res = get_pass("schedule_prefetch").fn(gm, ctx)
        res.gm.recompile()
        return res, code, ctx.record

    assert FramePlan().prefetch_cpu_graphs is False
    res, code, rec = run(FramePlan())
    assert not res.changed and res.gm.code == code and _ahead(res.gm) == [0, 0, 0, 0]
    assert "CPU graph (gloo)" in rec.reason and "heap-corruption.md" in rec.reason
    res, code, _ = run(FramePlan(prefetch_cpu_graphs=True))
    assert res.changed and res.gm.code != code and _ahead(res.gm) == [0, 2, 2, 2]


def test_cpu_graphs_on_a_one_thread_gloo_group_are_prefetched():
    """A CPU graph whose collectives all run on a gloo group with one worker thread
    (what graphcomp.shard gives CPU parameters: graphcomp.sharding.gloo_groups) is scheduled as
    a CUDA graph is: there collectives run one at a time (docs/heap-corruption.md). The
    pass learns which groups are serial from its context (PassContext.env)."""
    from graphcomp.compiler.compile_env import CompileEnv
    from graphcomp.config import Config
    from graphcomp.compiler.pipeline import PassContext, PassRecord, get_pass
    from graphcomp.compiler.plan import FramePlan

    def run(serial: str):
        ctx = PassContext(config=Config.from_options({"prefetch_bytes": W_BYTES}), frame_id=0, stage="fwd",
                          frame=FramePlan(), env=CompileEnv(is_serial_group=lambda name: name == serial))
        ctx.record = PassRecord(name="schedule_prefetch", stage="fwd", enabled=True)
        res = get_pass("schedule_prefetch").fn(_layers(4), ctx)
        res.gm.recompile()
        return res, ctx

    res, _ = run("g")
    assert res.changed and _ahead(res.gm) == [0, 2, 2, 2]
    res, ctx = run("other")
    assert not res.changed and "group(s) g" in ctx.record.reason


# ------------------------------------------------------------------ properties
_OPS = st.lists(st.sampled_from(["layer", "act", "rs", "layer2"]), min_size=1, max_size=10)


def _random_graph(spec, group):
    """A graph from a spec: 'layer' gathers a new weight and applies it, 'layer2'
    reuses the previous weight (two uses), 'act' is elementwise compute, 'rs'
    reduce-scatters an intermediate (world 1: real collectives on ``group``)."""
    n_w = sum(op == "layer" for op in spec) + 1

    def f(x, *shards):
        it = iter(shards)
        w = gather(next(it), 1, group, shape=(4, 4))
        outs = []
        for op in spec:
            if op == "layer":
                w = gather(next(it), 1, group, shape=(4, 4))
                x = torch.tanh(x @ w)
            elif op == "layer2":
                x = x @ w.t() + 1
            elif op == "act":
                x = x * 1.5 - 0.25
            else:
                outs.append(reduce_scatter(x * 2, 1, group) / 3)
        return x, *outs

    g = torch.Generator().manual_seed(len(spec))
    args = [torch.randn(2, 4, generator=g)] + [torch.randn(4, 4, generator=g) for _ in range(n_w)]
    return trace(f, *args), args


def _collective_order(gm):
    return [(str(n.target), tuple(n.meta["val"].shape)) for n in gm.graph.nodes if is_target(n, AG, RS)]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=_OPS, cap=st.sampled_from([0, 64, 128, 200, 10**6]), budget_frac=st.sampled_from([None, 1.0, 1.3]))
def test_property_semantics_determinism_budget(spec, cap, budget_frac):
    with world1_group() as group:
        gm, args = _random_graph(spec, group)
        ref = gm(*args)
        peak0 = memory.estimate(gm).peak_bytes
        opts = {"prefetch_bytes": cap}
        if budget_frac is not None:
            opts["memory_budget"] = int(peak0 * budget_frac)
        gm, _ = run_pass("schedule_prefetch", gm, stage="fwd", **opts)
        out = gm(*args)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)  # moving nodes never changes values
        if budget_frac is not None:  # the original order is feasible: the schedule stays under the budget
            assert memory.estimate(gm).peak_bytes <= opts["memory_budget"]
        gm2, _ = _random_graph(spec, group)  # another "rank" tracing the same program
        gm2, _ = run_pass("schedule_prefetch", gm2, stage="fwd", **opts)
    assert _collective_order(gm) == _collective_order(gm2)
    assert [n.name for n in gm.graph.nodes] == [n.name for n in gm2.graph.nodes]


def test_reduce_scatter_inputs_in_flight_are_capped():
    def f(x, g1, g2):
        r1 = reduce_scatter(g1 * 2, 2, "g")
        y = torch.tanh(x @ x)
        r2 = reduce_scatter(g2 * y.sum(), 2, "g")
        return y, r1 / 2, r2 / 2

    gm = trace(f, torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4))
    gm, rec = run_pass("schedule_prefetch", gm, stage="bwd", prefetch_bytes=64)  # one 64-byte input in flight
    nodes = list(gm.graph.nodes)
    rs = [n for n in nodes if is_target(n, RS)]
    w1 = next(iter(rs[0].users))
    assert nodes.index(w1) < nodes.index(rs[1]) and rec.counts["rs_waited_early"] == 1


def test_small_gather_in_flight_does_not_hold_the_head_at_its_use():
    """W2 (2 H100s, 9d25f96): the final norm's small weight, gathered after the last
    layer's and prefetched with it, was in flight through the last layer, and the
    LM head (over the cap) moved only while nothing else was: it stayed at its use,
    1.1 ms exposed per step. Now it moves while the others in flight hold at most
    half the cap: it starts when the last layer's gather is waited (before: ahead 0)."""

    def f(x, *shards):
        *ws, norm, head = shards
        for s in ws:
            x = torch.tanh(x @ gather(s, 2, "g", shape=(8, 8)))
        x = x * gather(norm, 2, "g", shape=(8,))
        return x @ gather(head, 2, "g", shape=(8, 64))

    shards = [torch.randn(4, 8) for _ in range(3)] + [torch.randn(4), torch.randn(4, 64)]
    gm, rec = run_pass("schedule_prefetch", trace(f, torch.randn(2, 8), *shards), stage="fwd",
                       prefetch_bytes=W_BYTES)
    # layers one ahead; the norm's gather and the head's both issued when the last
    # layer's gather is waited: the head overlaps the last layer and the norm
    assert _ahead(gm) == [0, 2, 2, 2, 3]
    assert rec.counts["oversized_gathers"] == 1
    assert rec.counts["max_inflight_bytes"] == 8 * 64 * 4 + 8 * 4  # the head and the norm's weight
    _waits_right_before_first_use(gm)


def test_oversized_reduce_scatter_is_not_waited_when_the_next_small_one_is_ready():
    """W2 (2 H100s, 9d25f96): the LM head's gradient (over the cap on its own) was
    reduce-scattered, then the final norm's small gradient was ready, and the cap
    forced the head's wait right there: the backward's top stalled 1.8 ms per step
    for a collective it does not need until the optimizer. One oversized pending
    reduce-scatter is now not counted while the others stay under the cap: it is
    waited at the end, after every compute node."""

    def f(h, g_logits, x, w_shard):
        head_grad = g_logits.t() @ h  # [64, 8]: 4x the cap
        r_head = reduce_scatter(head_grad, 2, "g")
        norm_grad = (h * h).sum(0)  # [8]: small
        r_norm = reduce_scatter(norm_grad, 2, "g")
        y = torch.tanh(x @ gather(w_shard, 2, "g", shape=(8, 8)))
        w_grad = y.t() @ x
        r_w = reduce_scatter(w_grad, 2, "g")
        return r_head / 2, r_norm / 2, r_w / 2, y

    gm = trace(f, torch.randn(4, 8), torch.randn(4, 64), torch.randn(4, 8), torch.randn(4, 8))
    gm, rec = run_pass("schedule_prefetch", gm, stage="bwd", prefetch_bytes=8 * 8 * 4)
    nodes = list(gm.graph.nodes)
    rs = [n for n in nodes if is_target(n, RS)]
    head_wait = next(iter(rs[0].users))
    assert rs[0].args[0].meta["val"].shape == (64, 8)
    last_compute = max(i for i, n in enumerate(nodes) if _is_compute(n) and n.target in (
        torch.ops.aten.mm.default, torch.ops.aten.tanh.default))
    assert nodes.index(head_wait) > last_compute  # before: waited when the norm's was ready
    assert rec.counts["rs_waited_early"] == 1  # the norm's, when the weight's would pass the cap


def test_over_budget_the_largest_passing_cap_is_found_by_bisection(monkeypatch):
    """When the configured cap's schedule estimates over the budget, the pass keeps the
    largest halving of the cap that passes, with O(log) plans instead of one per
    halving (8 s on W3's graphs under a 70 GiB cap). The estimate is stood in: a
    schedule planned with a cap above THRESHOLD is over the budget."""
    from graphcomp.passes import schedule_prefetch as sp

    real_plan, real_estimate = sp.plan, memory.estimate
    planned = []

    def plan(gm, cap, budget, move_rs=True):
        planned.append(cap)
        return real_plan(gm, cap, budget, move_rs)

    def estimate(gm):
        est = real_estimate(gm)
        if planned and planned[-1] > THRESHOLD:  # the schedule just planned: over the budget
            est = type(est)(**{**est.__dict__, "peak_bytes": est.peak_bytes + 10**9})
        return est

    monkeypatch.setattr(sp, "plan", plan)
    monkeypatch.setattr(sp.memory, "estimate", estimate)
    cap0 = 2**20
    for THRESHOLD in (3 * W_BYTES, W_BYTES, 2**19, 1):
        planned.clear()
        gm0 = _layers(4)
        budget = real_estimate(gm0).peak_bytes + 10**6  # room for any real schedule
        gm, rec = run_pass("schedule_prefetch", gm0, stage="fwd", prefetch_bytes=cap0, memory_budget=budget)
        expect = max(c for c in (cap0 >> k for k in range(21)) if c <= THRESHOLD)
        assert planned[-1] == expect, (THRESHOLD, planned)  # the schedule kept
        assert any(f"prefetch cap lowered to {expect} bytes" in n for n in rec.notes), rec.notes
        # the first try, about log2(21) = 5 bisection steps, the final plan: not 21 halvings
        assert rec.counts["schedules_tried"] == len(planned) <= 8, planned
        assert real_estimate(gm).peak_bytes <= budget
