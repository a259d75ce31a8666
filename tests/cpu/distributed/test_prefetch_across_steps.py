"""Cross-step prefetch (``prefetch_across_steps`` + ``graphcomp.optim.capture(prefetch=True)``):
the pass on a hand-built forward graph (exact nodes, order, eager marks, what it
leaves alone), and training on 2 gloo ranks bitwise equal to the prefetch off, with
the counters saying what each step took, missed or discarded (a write to the table
between the optimizer step and the forward, gradient accumulation, an evaluation
forward in between)."""

import pytest
import torch

import graphcomp
from _graphs import gather, trace

c10d = torch.ops._c10d_functional
PG = torch.ops.graphcomp.prefetched_gather.default


class _Provider:  # a live "optimizer step that prefetches" for the pass's check
    pass


@pytest.fixture
def provider(monkeypatch):
    from graphcomp.sharding.prefetch import PREFETCH

    p = _Provider()
    PREFETCH.providers.add(p)
    yield p
    PREFETCH.providers.discard(p)


def _run(gm, static_idxs, **options):
    from graphcomp.config import Config
    from graphcomp.compiler.pipeline import PassContext, PassRecord, get_pass
    from graphcomp.compiler.plan import FramePlan, StageInputs

    frame = FramePlan()
    frame.inputs["fwd"] = StageInputs(static_idxs=tuple(static_idxs))
    ctx = PassContext(config=Config.from_options(options), frame_id=0, stage="fwd", frame=frame)
    ctx.record = PassRecord(name="prefetch_across_steps", stage="fwd", enabled=True)
    res = get_pass("prefetch_across_steps").fn(gm, ctx)
    gm = res.gm
    gm.graph.lint()
    gm.recompile()
    ctx.record.changed = res.changed
    return gm, ctx.record


def _forward_like():
    """A forward as the passes leave it: a layer's gather issued first, then the table's
    (cast to bf16 before the wire), its lookup with ids computed from the tokens, and
    the layer's matmul."""

    def f(table, w, tokens):
        wg = gather(w.to(torch.bfloat16), 2, "g")
        tg = gather(table.to(torch.bfloat16), 2, "g", rows=10, shape=(10, 4))
        ids = tokens.clamp(0, 9)
        x = torch.nn.functional.embedding(ids, tg)
        return x @ wg.t()

    return trace(f, torch.randn(5, 4), torch.randn(3, 4), torch.randint(0, 10, (2, 3)))


def test_table_gather_becomes_the_prefetched_op_at_the_top(provider):
    gm, rec = _run(_forward_like(), static_idxs=(0, 1))
    nodes = [n for n in gm.graph.nodes if n.op != "placeholder"]
    (pg,) = [n for n in nodes if n.target is PG]
    assert nodes[0] is pg and pg.args[0].name == "table_1" and pg.args[1:] == (torch.bfloat16, 2, "g")
    ags = [n for n in nodes if n.target is c10d.all_gather_into_tensor.default]
    assert len(ags) == 1  # the layer's gather stays
    emb = next(n for n in nodes if n.target is torch.ops.aten.embedding.default)
    eager = [n for n in nodes if n.meta.get("graphcomp_eager")]
    assert eager[0] is pg and emb in eager and nodes.index(emb) < nodes.index(ags[0])
    assert all(nodes.index(n) < nodes.index(ags[0]) for n in eager)  # one eager run at the top
    assert tuple(pg.meta["val"].shape) == (10, 4) and pg.meta["val"].dtype == torch.bfloat16
    assert rec.counts == {"skipped:not_only_looked_up": 1}  # the layer's weight: read by a matmul
    assert rec.changed


def test_tied_table_is_left_alone(provider):
    def f(table, tokens):
        tg = gather(table, 2, "g", rows=10, shape=(10, 4))
        x = torch.nn.functional.embedding(tokens, tg)
        return x @ tg.t()  # a tied head reads the gathered table too

    gm, rec = _run(trace(f, torch.randn(5, 4), torch.randint(0, 10, (2, 3))), static_idxs=(0,))
    assert not any(n.target is PG for n in gm.graph.nodes)
    assert rec.counts == {"skipped:not_only_looked_up": 1} and not rec.changed


def test_no_prefetching_optimizer_or_require_means_no_rewrite(provider):
    from graphcomp.sharding.prefetch import PREFETCH

    gm, rec = _run(_forward_like(), static_idxs=(0, 1), cudagraphs="require")
    assert not any(n.target is PG for n in gm.graph.nodes) and "require" in rec.reason
    PREFETCH.providers.discard(provider)
    gm, rec = _run(_forward_like(), static_idxs=(0, 1))
    assert not any(n.target is PG for n in gm.graph.nodes) and "graphcomp.optim.capture" in rec.reason


def test_gather_of_a_non_static_input_is_left_alone(provider):
    gm, rec = _run(_forward_like(), static_idxs=())
    assert not any(n.target is PG for n in gm.graph.nodes)
    assert rec.counts == {"skipped:not_a_shard_gather": 2}


def test_capture_validates_prefetch():
    import graphcomp

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="prefetch must be True or False"):
        graphcomp.optim.capture(opt, prefetch="yes")


# ------------------------------------------------------------------ training, 2 ranks
STEPS = 6


def _train(rank, world, cfg):
    import torch.distributed as dist

    import graphcomp
    from graphcomp.models import Llama, synthetic_batch

    torch._dynamo.reset()
    graphcomp.reset()
    torch.manual_seed(0)
    m = Llama("tiny")
    graphcomp.shard(m, param_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    step_fn = graphcomp.optim.capture(opt, max_norm=1.0, prefetch=cfg["prefetch"])
    cm = torch.compile(m, backend="graphcomp", options={"codegen": "eager", "bucket_bytes": 8192})  # (the table alone)
    losses, taken = [], []
    for step in range(STEPS):
        micro = 2 if step == 2 else 1  # step 2: two micro-batches (the second forward finds none)
        for k in range(micro):
            tok, tgt = synthetic_batch(m.cfg, 2, 16, seed=100 * step + 10 * rank + k)
            loss = cm(tok, tgt) / micro
            loss.backward()
        step_fn()
        opt.zero_grad(set_to_none=True)
        if step == 3:  # every rank writes the table after the step: the prefetch is stale
            with torch.no_grad():
                dict(m.named_parameters())["tok_emb.weight"].mul_(0.5)  # (the shard, not a gathered view)
        if step == 4:  # an evaluation forward in between (no_grad: an inference graph)
            with torch.no_grad():
                cm(tok, tgt)
        losses.append(loss.detach().clone())
        taken.append(graphcomp.counters["prefetches_taken"])
    graphcomp.runtime.teardown()
    dist.barrier()
    from graphcomp import _compat

    params = [_compat.dtensor_local(p).detach().clone() for p in m.parameters()]
    return losses, params, dict(graphcomp.counters), taken


@pytest.fixture(scope="module")
def ranks2(shared_ranks2):
    return shared_ranks2.view(timeout=300)


def test_prefetch_trains_bitwise_like_the_gather_it_replaces(ranks2):
    on = ranks2.run(_train, {"prefetch": True})
    off = ranks2.run(_train, {"prefetch": False})
    for (l_on, p_on, c_on, taken), (l_off, p_off, c_off, _) in zip(on, off):
        assert all(torch.equal(a, b) for a, b in zip(l_on, l_off)), ([float(a) for a in l_on], [float(a) for a in l_off], c_on, taken)
        assert all(torch.equal(a, b) for a, b in zip(p_on, p_off))
        assert c_on["gathers_prefetched_across_steps"] >= 1
        assert c_off.get("gathers_prefetched_across_steps", 0) == 0 and c_off.get("prefetches_issued", 0) == 0
        # issued after every step (the table shard has a gradient every step)
        assert c_on["prefetches_issued"] == STEPS
        # step 0: nothing issued yet; step 2's second micro-batch; step 4: the table was
        # written after step 3 -> discarded. The rest took the prefetch (steps 1, 2a, 3, 5).
        assert c_on["prefetch_misses"] == 2 and c_on.get("prefetches_discarded") == 1, (c_on, taken)
        assert c_on["prefetches_taken"] == 4, (c_on, taken)
        assert taken == [0, 1, 2, 3, 3, 4]


# ------------------------------------------------- the prefetch state, one process
def test_take_uses_a_valid_prefetch_and_discards_the_rest():
    """``PREFETCH`` on a real world-1 gloo group: a miss registers the gather; an issued
    gather is taken (the shard's values); one is discarded when the shard was written
    since (its own version, or its DTensor-style owner's), when a whole step is being
    captured, or when the next step's supersedes it; release() drops what is in flight."""
    from _graphs import world1_group

    from graphcomp.sharding.prefetch import PREFETCH
    from graphcomp.runtime import capture
    from graphcomp.runtime.manager import RUNTIME

    with world1_group() as group:
        graphcomp.reset()
        shard = torch.nn.Parameter(torch.randn(4, 2))
        c = graphcomp.counters
        assert PREFETCH.take(shard, torch.bfloat16, 1, group) is None and c["prefetch_misses"] == 1
        assert PREFETCH.shards_for([torch.zeros(1), shard]) == [shard]

        def issued_then_taken():
            assert PREFETCH.issue([shard]) == 1
            return PREFETCH.take(shard, torch.bfloat16, 1, group)

        got = issued_then_taken()
        assert torch.equal(got, shard.detach().bfloat16()) and c["prefetches_taken"] == 1
        PREFETCH.issue([shard])
        with torch.no_grad():
            shard.add_(1.0)  # written after the step
        assert PREFETCH.take(shard, torch.bfloat16, 1, group) is None and c["prefetches_discarded"] == 1
        PREFETCH.issue([shard])
        rec = capture.Recording("step", graph=None, pool=None)  # graphcomp.capture_step capturing: gather in its graph
        RUNTIME.recordings.append(rec)
        try:
            assert PREFETCH.take(shard, torch.bfloat16, 1, group) is None and c["prefetches_discarded"] == 2
        finally:
            RUNTIME.recordings.remove(rec)
        PREFETCH.issue([shard])
        PREFETCH.issue([shard])  # never taken: superseded
        assert c["prefetches_discarded"] == 3
        assert PREFETCH.take(shard, torch.float32, 1, group) is None  # another gather of it
        assert c["prefetches_discarded"] == 4
        # a parameter that is gone (replaced, its model deleted): its gather is dropped at
        # the next issue, whoever issues it
        other = torch.nn.Parameter(torch.randn(2, 2))
        PREFETCH.take(other, None, 1, group)
        PREFETCH.issue([other])
        assert len(PREFETCH.slots) == 1
        del other
        PREFETCH.issue([shard])
        assert len(PREFETCH.slots) == 1 and c["prefetches_discarded"] == 5 and len(PREFETCH.recipes) == 1
        PREFETCH.release(final=True)
        assert not PREFETCH.slots and not PREFETCH.recipes and not PREFETCH.enabled()
        graphcomp.reset()
