"""remat on AOTAutograd joint graphs: exact decisions under a budget, the
partitioner obeying them, infeasible budgets, determinism, a hypothesis test of
the policy, and end-to-end numerics with torch.utils.checkpoint regions under
remat="auto" and "respect_user" (bitwise against the unrewritten run on CPU)."""

import logging

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from _graphs import run_pass

import graphcomp
from graphcomp import _compat
from graphcomp.analysis import memory
from graphcomp.passes.remat import backward_region, candidates, plan

aten = torch.ops.aten
N = 256  # rows: activations (N x width fp32) dominate the weights


def _mlp(acts):
    def f(x, *ws):
        h = x
        for w, a in zip(ws, acts):
            h = a(h @ w)
        return h.sum()

    return f


def _weights(widths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(a, b, generator=g, requires_grad=True) for a, b in zip(widths, widths[1:])]


def _compile(f, options=None, joint_passes=("remat",)):
    """aot_function with our joint passes before the min-cut partitioner; returns the
    compiled fn and a dict that gets the joint/fwd/bwd graphs and the pass record."""
    from functorch.compile import aot_function, make_boxed_func

    got = {}

    def partition(joint, joint_inputs, **kw):
        got["untagged"] = {n.name for n in joint.graph.nodes if "recompute" not in n.meta}
        for name in joint_passes:
            if options is not None:
                joint, got["record"] = run_pass(name, joint, **options)
        got["joint"] = joint
        got["fwd"], got["bwd"] = _compat.min_cut_partition(joint, joint_inputs, **kw)
        return got["fwd"], got["bwd"]

    def nop(gm, _):
        return make_boxed_func(gm.forward)

    return aot_function(f, fw_compiler=nop, bw_compiler=nop, partition_fn=partition), got


def _joint(acts, widths, seed=0):
    """The joint graph of an MLP (x: N x widths[0])."""
    got = {}

    def grab(joint, joint_inputs, **kw):
        got["joint"] = joint
        return _compat.min_cut_partition(joint, joint_inputs, **kw)

    from functorch.compile import aot_function, make_boxed_func

    f = aot_function(_mlp(acts), fw_compiler=lambda g, _: make_boxed_func(g.forward),
                     bw_compiler=lambda g, _: make_boxed_func(g.forward), partition_fn=grab)
    x = torch.randn(N, widths[0], generator=torch.Generator().manual_seed(seed))
    f(x, *_weights(widths, seed)).backward()
    return got["joint"]


def _saved(fwd):
    """Names of the forward graph's outputs saved for backward (all but the loss)."""
    out = next(n for n in fwd.graph.nodes if n.op == "output")
    return {a.name for a in out.args[0][1:] if isinstance(a, torch.fx.Node)}


ACTS = [torch.relu, torch.tanh, torch.relu, lambda h: h]
WIDTHS = [16, 64, 64, 64, 16]


def _recompute_tagged(gm):
    return sorted(n.name for n in gm.graph.nodes if _compat.must_recompute(n))


def test_candidates_are_saved_activations_with_their_producers():
    gm = _joint(ACTS, WIDTHS)
    cs = candidates(gm, backward_region(gm), "respect_user")
    assert [c.node.name for c in cs] == ["relu", "tanh", "relu_1"]
    relu = cs[0]
    assert relu.nbytes == N * 64 * 4
    # relu is recomputed from mm (which the backward does not read): both go, with relu's views
    assert {g.name for g in relu.group} >= {"mm", "relu"}
    assert relu.flops == 2 * N * 16 * 64  # mm's flops (relu: none in flop_counter)


def test_budget_decides_exactly():
    gm = _joint(ACTS, WIDTHS)
    peak = memory.estimate(gm).peak_bytes
    # at the peak: nothing to do
    p = plan(gm, peak, "respect_user")
    assert p.chosen == [] and p.infeasible is None and p.after.peak_bytes == peak
    # one activation less: relu (cheapest per byte: its producer mm is the smallest matmul)
    p = plan(gm, peak - 40_000, "respect_user")
    assert [c.node.name for c in p.chosen] == ["relu"] and p.infeasible is None
    assert p.after.peak_bytes == 339_976 <= peak - 40_000  # the peak moves to tanh_backward
    # below what recomputation can reach: infeasible, the least memory found is kept
    p = plan(gm, 1000, "respect_user")
    assert p.infeasible is not None and "infeasible" in p.infeasible
    assert [c.node.name for c in p.chosen] == ["relu"] and p.after.peak_bytes < peak


def test_partitioner_obeys_the_tags():
    x = torch.randn(N, 16)
    ws = _weights(WIDTHS)
    ref_f, ref = _compile(_mlp(ACTS), options=None)
    ref_f(x, *ws).backward()
    ref_grads = [w.grad.clone() for w in ws]
    for w in ws:
        w.grad = None
    peak = memory.estimate(ref["joint"]).peak_bytes
    f, got = _compile(_mlp(ACTS), options={"memory_budget": peak - 40_000})
    f(x, *ws).backward()
    rec = got["record"]
    assert rec.counts["recomputed"] == 1 and rec.counts["recomputed_bytes"] == N * 64 * 4
    assert rec.counts["estimated_peak_after"] <= peak - 40_000 < rec.counts["estimated_peak_before"]
    assert "relu" in _saved(ref["fwd"]) and "relu" not in _saved(got["fwd"])
    ops = [n.target for n in got["bwd"].graph.nodes]
    assert aten.relu.default in ops and aten.mm.default in ops  # recomputed in backward
    for w, g in zip(ws, ref_grads):
        torch.testing.assert_close(w.grad, g, rtol=0, atol=0)


def test_infeasible_budget_warns_and_counts(caplog):
    gm = _joint(ACTS, WIDTHS)
    with caplog.at_level(logging.WARNING, logger="graphcomp.passes.remat"):
        gm, rec = run_pass("remat", gm, memory_budget=1000)
    assert rec.counts["budget_infeasible"] == 1 and rec.counts["recomputed"] == 1
    assert any("infeasible" in r.message for r in caplog.records)
    assert "relu" in _recompute_tagged(gm)


def test_noop_cases():
    gm = _joint(ACTS, WIDTHS)
    gm, rec = run_pass("remat", gm)  # memory_budget="auto" on a CPU graph: no budget
    assert "no memory budget" in rec.reason and _recompute_tagged(gm) == []
    gm, rec = run_pass("remat", gm, memory_budget=10**9)
    assert "nothing to recompute" in rec.reason and _recompute_tagged(gm) == []
    from _graphs import trace

    inf = trace(lambda x, w: torch.relu(x @ w), torch.randn(4, 4), torch.randn(4, 4))
    inf, rec = run_pass("remat", inf, memory_budget=1)
    assert "no backward" in rec.reason


def test_plan_is_deterministic():
    plans = []
    for _ in range(2):  # two traces: different node objects, same graph
        gm = _joint(ACTS, WIDTHS)
        p = plan(gm, memory.estimate(gm).peak_bytes - 40_000, "respect_user")
        plans.append([(c.node.name, [g.name for g in c.group]) for c in p.chosen])
    assert plans[0] == plans[1] and plans[0]


def test_config_validation():
    with pytest.raises(ValueError, match="remat.*valid values.*respect_user.*auto"):
        graphcomp.Config.from_options({"remat": "always"})
    with pytest.raises(ValueError, match="memory_budget"):
        graphcomp.Config.from_options({"memory_budget": "half"})
    assert graphcomp.Config().memory_budget == "auto" and graphcomp.Config().remat == "respect_user"


# ----------------------------------------------------------------- hypothesis
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    widths=st.lists(st.sampled_from([8, 16, 32, 64]), min_size=3, max_size=6),
    act_ids=st.lists(st.integers(0, 3), min_size=5, max_size=5),
    frac=st.floats(0.6, 1.05),
)
def test_policy_properties(widths, act_ids, frac):
    """Budget respected when the plan says feasible; never worse than the graph as
    tagged; nothing recomputed when it fits; the same plan from two traces; and the
    partitioned graph computes the same gradients bitwise."""
    table = [torch.relu, torch.tanh, torch.sigmoid, lambda h: h * 2]
    acts = [table[i] for i in act_ids[: len(widths) - 1]]
    gm = _joint(acts, widths)
    peak = memory.estimate(gm).peak_bytes
    budget = max(1, int(peak * frac))
    p = plan(gm, budget, "respect_user")
    event(f"recomputed: {bool(p.chosen)}, feasible: {p.infeasible is None}")
    assert p.after.peak_bytes <= p.before.peak_bytes
    if budget >= peak:
        assert p.chosen == []
    if p.infeasible is None:
        assert p.after.peak_bytes <= budget
    # the plan's estimate is the memory model of the tags it would write
    tagged = [g for c in p.chosen for g in c.group]
    assert memory.estimate(gm, bwd=backward_region(gm), recompute=tagged).peak_bytes == p.after.peak_bytes
    p2 = plan(_joint(acts, widths), budget, "respect_user")
    assert [c.node.name for c in p2.chosen] == [c.node.name for c in p.chosen]
    # semantics: tags applied and partitioned: same gradients as the untagged run
    x = torch.randn(N, widths[0], generator=torch.Generator().manual_seed(1))
    grads = []
    for opts in (None, {"memory_budget": budget}):
        ws = _weights(widths, seed=2)
        f, _ = _compile(_mlp(acts), options=opts)
        f(x, *ws).backward()
        grads.append([w.grad for w in ws])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------------ end to end: torch.compile + checkpoint
class _Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class _Net(torch.nn.Module):
    """Blocks listed in ``ckpt`` run under torch.utils.checkpoint."""

    def __init__(self, d=16, n=4, ckpt=(0, 1, 2, 3)):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(d) for _ in range(n))
        self.ckpt = set(ckpt)

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False) if i in self.ckpt else b(x)
        return (x * x).mean()


def _train(options, ckpt, steps=3):
    torch._dynamo.reset()
    graphcomp.reset()
    torch.manual_seed(0)
    m = _Net(ckpt=ckpt)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    cm = torch.compile(m, backend="graphcomp", options=options)
    losses = []
    for step in range(steps):
        x = torch.randn(128, 16, generator=torch.Generator().manual_seed(step))
        loss = cm(x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    (rec,) = [p for f in graphcomp.frame_summaries() for p in f["stages"]["joint"]["passes"] if p["name"] == "remat"]
    return losses, {k: v.detach().clone() for k, v in m.state_dict().items()}, rec, dict(graphcomp.counters)


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
@pytest.mark.parametrize("mode,ckpt", [("auto", (0, 1, 2, 3)), ("respect_user", (1, 3))])
def test_end_to_end_bitwise(codegen, mode, ckpt):
    """Losses and parameters bitwise equal to the unrewritten run (remat off), with
    a budget that fits everything (auto: the user's regions are saved) and a tight
    one (activations recomputed to fit)."""
    base = {"codegen": codegen, "remat": mode}
    ref_losses, ref_params, _, _ = _train({**base, "passes": {"remat": False}}, ckpt)
    _, _, rec, _ = _train({**base, "memory_budget": 10**9}, ckpt)
    before, after = rec["counts"]["estimated_peak_before"], rec["counts"]["estimated_peak_after"]
    if mode == "auto":  # every user region saved: more memory, no recompute
        assert rec["changed"] and rec["counts"]["user_kept"] > 0 and rec["counts"]["recomputed"] == 0
        assert after > before
        tight = (before + after) // 2
    else:
        assert not rec["changed"] and rec["counts"]["user_recomputed"] > 0
        # the budget has room for what the user's regions recompute: the record says so
        assert rec["counts"]["room_under_budget_bytes"] == 10**9 - before
        assert rec["counts"]["user_recomputed_bytes"] > 0
        assert any("remat='auto' would save" in n for n in rec["notes"]), rec["notes"]
        tight = before - 16 * 128 * 4  # one block's worth of activations under the graph as tagged
    losses, params, rec, counters = _train({**base, "memory_budget": tight}, ckpt)
    assert rec["changed"] and rec["counts"]["recomputed"] > 0, rec
    assert rec["counts"]["estimated_peak_after"] <= tight, rec
    assert counters["activations_recomputed"] == rec["counts"]["recomputed"]
    if mode == "auto":
        assert counters["user_checkpoint_saved"] == rec["counts"]["user_kept"] > 0
    assert torch.equal(torch.stack(losses), torch.stack(ref_losses))
    for k in ref_params:
        assert torch.equal(params[k], ref_params[k]), k


# ----------------------------------------- end to end: 2 gloo ranks, sharded + checkpoint
def _sgd_steps(cm, opt, batches):
    """One training step of ``cm`` per argument tuple of ``batches``; the losses summed
    over the ranks."""
    import torch.distributed as dist

    losses = []
    for args in batches:
        loss = cm(*args)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total)
    return losses


def _train_sharded(rank, world, options, ckpt, steps=3):
    """Sharded training of _Net (each rank its half of the batch); returns losses,
    full parameters, counters and the remat records of every frame."""
    from graphcomp.sharding.shard import full_state_dict

    torch._dynamo.reset()
    graphcomp.reset()
    torch.manual_seed(0)
    m = _Net(ckpt=ckpt)
    graphcomp.shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    cm = torch.compile(m, backend="graphcomp", options=options)
    losses = _sgd_steps(cm, opt, [(torch.randn(128, 16, generator=torch.Generator().manual_seed(step))[rank::world],)
                                  for step in range(steps)])
    joint = [p for f in graphcomp.frame_summaries() for p in f["stages"].get("joint", {}).get("passes", [])]
    recs = [p for p in joint if p["name"] == "remat"]
    return losses, full_state_dict(m), dict(graphcomp.counters), recs, [p for p in joint if p["name"] == "schedule_free"]


def _sharded_runs(rank, world):
    ckpt = (0, 1, 2, 3)
    base = {"codegen": "eager", "bucket_bytes": 0}
    out = {"off": _train_sharded(rank, world, {**base, "passes": {"remat": False}}, ckpt)}
    probe = _train_sharded(rank, world, {**base, "remat": "auto", "memory_budget": 10**9}, ckpt)
    counts = probe[3][0]["counts"]
    tight = (counts["estimated_peak_before"] + counts["estimated_peak_after"]) // 2
    out["auto_fits"] = probe
    out["auto_tight"] = _train_sharded(rank, world, {**base, "remat": "auto", "memory_budget": tight}, ckpt)
    # room for every activation with the gathers re-gathered, not for the gathers too:
    # remat plans first, so the activations are saved and schedule_free keeps less
    out["auto_acts_first"] = _train_sharded(
        rank, world, {**base, "remat": "auto", "memory_budget": counts["estimated_peak_after"]}, ckpt)
    out["respect_tight"] = _train_sharded(
        rank, world, {**base, "remat": "respect_user", "memory_budget": counts["estimated_peak_before"] - 4096}, (1, 3))
    out["respect_off"] = _train_sharded(rank, world, {**base, "passes": {"remat": False}}, (1, 3))
    return out


@pytest.fixture(scope="module")
def ranks2(shared_ranks2):
    """The module's 2-rank tests share one pair of ranks (starting a pair costs seconds in CI)."""
    return shared_ranks2.view(timeout=600)


def test_sharded_2ranks_checkpoint_bitwise_and_one_frame(ranks2):
    """2 gloo ranks, graphcomp.shard + torch.utils.checkpoint on every block: one
    compiled frame (no graph break at the checkpointed blocks), and remat under
    "auto" / "respect_user" is bitwise the unrewritten run, on every rank."""
    results = ranks2.run(_sharded_runs)
    for out in results:
        for name, (losses, params, counters, recs, _) in out.items():
            assert counters["frames_compiled"] == 1, (name, counters)
            ref = out["respect_off"] if name.startswith("respect") else out["off"]
            assert torch.equal(torch.stack(losses), torch.stack(ref[0])), name
            for k in ref[1]:
                assert torch.equal(params[k], ref[1][k]), (name, k)
        assert out["auto_fits"][2]["user_checkpoint_saved"] > 0
        assert out["auto_tight"][2]["activations_recomputed"] > 0
        assert out["auto_tight"][2]["user_checkpoint_saved"] > 0
        assert out["respect_tight"][2]["activations_recomputed"] > 0
        fits, first = out["auto_fits"], out["auto_acts_first"]
        assert first[3][0]["counts"]["user_kept"] == fits[3][0]["counts"]["user_kept"] > 0
        assert first[3][0]["counts"]["recomputed"] == 0
        assert first[4][0]["counts"]["gathers_kept"] < fits[4][0]["counts"]["gathers_kept"], (first[4], fits[4])
    # the same plan on both ranks
    for name in results[0]:
        assert [r["counts"] for r in results[0][name][3]] == [r["counts"] for r in results[1][name][3]], name


def test_inspect_shows_the_decision(tmp_path, capsys):
    from graphcomp.tools import cli
    from graphcomp.tools.inspect_html import render_html

    _, _, probe, _ = _train({"codegen": "eager", "remat": "auto", "memory_budget": 10**9}, (0, 1, 2, 3), steps=1)
    c = probe["counts"]
    tight = (c["estimated_peak_before"] + c["estimated_peak_after"]) // 2
    _, _, rec, _ = _train({"codegen": "eager", "remat": "auto", "memory_budget": tight, "dump_dir": str(tmp_path)},
                          (0, 1, 2, 3), steps=1)
    assert cli.main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "est. peak planned" in out and "user regions" in out
    from graphcomp.tools.inspect_dumps import _fmt_bytes

    row = next(line for line in out.splitlines() if line.startswith("joint") and _fmt_bytes(tight) in line)
    assert f"{rec['counts']['recomputed']:g} ({_fmt_bytes(rec['counts']['recomputed_bytes'])})" in row
    assert f"{rec['counts']['user_kept']:g} saved" in row
    page = render_html(tmp_path)
    assert "remat: saved activations kept / recomputed" in page and _fmt_bytes(tight) in page


def test_docs_example_runs_and_prints_what_it_says(capsys):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs" / "passes.md").read_text()
    sec = text[text.index("### Example: `remat=\"auto\"` under a budget"):]
    code, printed = re.findall(r"```python\n(.*?)```.*?```\n(.*?)```", sec, re.S)[0]
    exec(compile(code, "docs/passes.md (remat example)", "exec"), {"__name__": "docs_remat"})
    assert capsys.readouterr().out == printed


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.tuples(st.booleans(), st.integers(0, 10**6)), min_size=1, max_size=12))
def test_incremental_model_matches_the_full_one(steps):
    """_Model.trial/accept (what the planner uses) gives the timeline of
    memory.intervals(recompute=...) for any sequence of adds and removes."""
    from graphcomp.passes.remat import _Model

    gm = _joint(ACTS, WIDTHS)
    bwd = backward_region(gm)
    cs = candidates(gm, bwd, "respect_user")
    model = _Model(gm, bwd)
    cur: list = []
    for add, k in steps:
        c = cs[k % len(cs)]
        new = cur + [g for g in c.group if g not in cur] if add else [g for g in cur if g not in c.group]
        tl, est = model.trial(new)
        assert tl == memory.timeline(gm, bwd=bwd, recompute=new) and est == memory.estimate(gm, bwd=bwd, recompute=new)
        if k % 3:
            model.accept()
            cur = new


def test_memory_budget_auto_is_a_fraction_of_cuda_memory(monkeypatch):
    gm = _joint(ACTS, WIDTHS)
    assert memory.resolve_budget("auto", gm) is None  # CPU: no budget
    monkeypatch.setattr(_compat, "device_memory_bytes", lambda dev: 1000)
    assert memory.resolve_budget("auto", gm) == 900  # config.AUTO_BUDGET_FRACTION


def _tag_user_regions(gm, layers):
    """Mark the forward compute of the chosen layers as a user checkpoint region
    would (PREFER_RECOMPUTE + ac_graph_id), one region per layer; layer k = the
    k-th matmul and what follows it up to the next matmul."""
    P = _compat.checkpoint_policy()
    bwd = memory.backward_nodes(gm)
    layer = -1
    for n in gm.graph.nodes:
        if n.op != "call_function" or n in bwd:
            continue
        if n.target is aten.mm.default and not any(a.op == "placeholder" and a.name.startswith("tangents")
                                                   for a in n.all_input_nodes):
            if all(a.op == "placeholder" or a.target is not aten.t.default for a in n.all_input_nodes):
                layer += 1
        if layer in layers and n.target is not aten.t.default and not n.name.startswith("sum"):
            n.meta["recompute"], n.meta["ac_graph_id"] = P.PREFER_RECOMPUTE, layer + 1


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    widths=st.lists(st.sampled_from([16, 32, 64]), min_size=3, max_size=5),
    layers=st.sets(st.integers(0, 3), min_size=1),
    frac=st.floats(0.7, 1.3),
)
def test_auto_policy_properties(widths, layers, frac):
    """remat="auto" over user regions: the budget is met when the plan says so; it
    never plans a higher peak than the user's checkpointing; it saves every
    activation when everything fits; the same plan from two traces."""
    acts = [torch.tanh] * (len(widths) - 1)
    gm = _joint(acts, widths)
    _tag_user_regions(gm, layers)
    if not any(_compat.is_user_checkpoint(n) for n in gm.graph.nodes):
        return
    user = plan(gm, 10**12, "respect_user").before.peak_bytes  # the user's checkpointing, as tagged
    budget = max(1, int(user * frac))
    p = plan(gm, budget, "auto")
    event(f"start={p.start}, feasible={p.infeasible is None}, recomputed={len(p.chosen)}")
    if p.infeasible is None:
        assert p.after.peak_bytes <= budget
    assert p.after.peak_bytes <= max(budget, user)
    all_saved = memory.estimate(gm).peak_bytes
    if budget >= all_saved:
        assert p.chosen == [] and p.tag == []
    gm2 = _joint(acts, widths)
    _tag_user_regions(gm2, layers)
    p2 = plan(gm2, budget, "auto")
    assert [n.name for n in p2.tag] == [n.name for n in p.tag]
    assert [n.name for n in p2.clear] == [n.name for n in p.clear]


# ------------- sharded + checkpointed attention (torch 2.13's saved-values order, worked around)
def _llama_steps(rank, world, ckpt, codegen, steps=3):
    from dataclasses import replace

    from graphcomp.models import PRESETS, Llama
    from graphcomp.sharding.shard import full_state_dict
    from benchmarks.workloads import CheckpointedBlock

    torch._dynamo.reset()
    graphcomp.reset()
    torch.manual_seed(0)
    cfg = replace(PRESETS["tiny"], n_layers=2)
    m = Llama(cfg)
    if ckpt:
        for i, b in enumerate(list(m.layers)):
            m.layers[i] = CheckpointedBlock(b)
    graphcomp.shard(m)
    cm = torch.compile(m, backend="graphcomp", options={"codegen": codegen})
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    toks = [torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(10 * s + rank))
            for s in range(steps)]
    losses = _sgd_steps(cm, opt, [(t, t) for t in toks])
    state = {k.replace("block.", ""): v for k, v in full_state_dict(m).items()}
    return torch.stack(losses), state, dict(graphcomp.counters)


def _ckpt_vs_plain(rank, world, codegen):
    return _llama_steps(rank, world, True, codegen), _llama_steps(rank, world, False, codegen)


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_sharded_checkpointed_attention_trains(ranks2, codegen):
    """Sharded parameters with torch.utils.checkpoint around attention blocks, 2 gloo
    ranks: losses and parameters bitwise those of the same model without
    checkpointing (eager codegen; Inductor: within fp32 rounding, its fusions
    differ once the forward saves less). On torch 2.13 the partitioner appends the recomputed attention's
    saved RNG state after the saved DeviceMesh, which AOTAutograd then slices among
    the tensors: the first forward failed in save_from_forward ("expected all
    tensors_saved_with_vc_check to be Tensors"); ``_compat.min_cut_partition``
    and Inductor's partitioner (``config.custom_partitioner_fn``) reorder the saved
    values (``_saved_tensors_before_opaque``)."""
    same = torch.equal if codegen == "eager" else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    for (ck_losses, ck_state, ck_counters), (losses, state, _) in ranks2.run(_ckpt_vs_plain, codegen):
        assert ck_counters["frames_compiled"] == 1, ck_counters
        assert same(ck_losses, losses), (ck_losses, losses)
        assert ck_state.keys() == state.keys()
        for k in state:
            assert same(ck_state[k], state[k]), k


def test_inspect_remat_row_names_the_room_the_users_checkpointing_leaves():
    """``graphcomp inspect``'s remat table: under ``respect_user`` a budget with room
    for what the user's regions recompute points at ``remat="auto"``; without room,
    only the count."""
    from graphcomp.tools.inspect_dumps import remat_rows

    def frame(**counts):
        c = {"budget_bytes": 2**30, "estimated_peak_before": 2**29, "estimated_peak_after": 2**29,
             "user_recomputed": 4, **counts}
        return {"stages": {"joint": {"passes": [{"name": "remat", "counts": c}]}}}

    (row,) = remat_rows(frame(user_recomputed_bytes=2**20, room_under_budget_bytes=2**29))
    assert "4 recomputed as written" in row[6] and "remat='auto' saves what fits" in row[6], row
    (row,) = remat_rows(frame())
    assert row[6] == "4 recomputed as written", row
