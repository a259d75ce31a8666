"""defer_weight_grads on hand-built backward graphs: what moves, where it stops, no-ops, semantics."""

import types

import pytest
import torch

from _graphs import c10d, reduce_scatter, run_pass, trace, world1_group

import graphcomp.passes.defer_weight_grads as dwg
from graphcomp.analysis import cost_model

aten = torch.ops.aten
RS = c10d.reduce_scatter_tensor.default


def _backward(n_blocks=3, h=4096, tokens=16384, vocab=32768, world=2, group="g", mutate=False):
    """A transformer backward in miniature: per block a weight gradient (dY^T X, its own
    reduce-scatter) and a data gradient (dY W); then the embedding's table gradient,
    reduce-scattered last."""

    def f(dy, idx, *xw):
        g = dy
        outs = []
        for b in range(n_blocks):
            x, w = xw[2 * b], xw[2 * b + 1]
            dw = g.t() @ x
            if mutate and b == n_blocks - 1:
                dw.mul_(0.5)  # a mutation in the last block: the cut may not pass it
            g = g @ w
            outs.append(reduce_scatter(dw, world, group))
        table = aten.embedding_dense_backward(g, idx, vocab, -1, False)
        outs.append(reduce_scatter(table, world, group))
        return outs

    args = [torch.randn(tokens, h), torch.randint(0, vocab, (tokens,))]
    for _ in range(n_blocks):
        args += [torch.randn(tokens, h), torch.randn(h, h)]
    return f, args


def _order(gm):
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def _mms(gm):
    return [n for n in gm.graph.nodes if n.target is aten.mm.default]


def _rss(gm):
    return [n for n in gm.graph.nodes if n.target is RS]


def test_weight_gradients_before_the_table_gradient_move_after_its_reduce_scatter():
    f, args = _backward()
    gm = trace(f, *args)
    mms = _mms(gm)  # per block: dW then dX
    dws, dxs = mms[0::2], mms[1::2]
    last = _rss(gm)[-1]
    # modelled at world 2: the table gradient's reduce-scatter (512 MiB) 1.07 ms, a block's
    # (64 MiB) 0.13 ms, a dW (550 GFLOP at 790 TFLOP/s) 0.70 ms: block 2's dW and RS move
    # (0.70 < 1.07 + 0.13), then block 1's (1.40 >= 1.07 + 2 x 0.13)
    gm, rec = run_pass("defer_weight_grads", gm, stage="bwd")
    o = _order(gm)
    assert o[last] < o[dws[2]] and o[last] < o[dws[1]]  # the last two blocks' dW deferred
    assert o[dws[0]] < o[last]  # the first block's stays: enough was moved
    assert all(o[dx] < o[last] for dx in dxs)  # the data-gradient chain feeds the table gradient
    rss = _rss(gm)
    assert rss[-1] is not last and rss[0] is not last and o[rss[0]] < o[last]  # block 2's and 1's RS moved with them
    # 2 x (dW's transpose, dW, its reduce-scatter, its wait): whole units, ending right after block 0's
    # reduce-scatter (its wait, read after it, stays with it)
    assert rec.counts["weight_grad_nodes_deferred"] == 8 and rec.counts["reduce_scatters_deferred"] == 2
    assert not rec.reason


def test_more_bandwidth_moves_less():
    f, args = _backward()
    gm = trace(f, *args)
    dws, last = _mms(gm)[0::2], _rss(gm)[-1]
    gm, rec = run_pass("defer_weight_grads", gm, stage="bwd", collective_bytes_per_s=10e12)  # modelled short
    o = _order(gm)
    assert o[dws[2]] > o[last] and o[dws[1]] < o[last]  # one dW is enough
    assert rec.counts["weight_grad_nodes_deferred"] == 4 and rec.counts["reduce_scatters_deferred"] == 1


def test_the_cut_stops_at_a_mutation():
    f, args = _backward(mutate=True)
    gm, rec = run_pass("defer_weight_grads", trace(f, *args), stage="bwd")
    assert "side effects" in rec.reason  # the last dW is mutated in place: nothing may pass


@pytest.mark.parametrize("case", ["no_rs", "world1", "all_ancestors"])
def test_no_ops(case):
    if case == "no_rs":
        gm = trace(lambda a, b: (a @ b).sum(), torch.randn(8, 8), torch.randn(8, 8))
        why = "no reduce-scatter"
    elif case == "world1":
        f, args = _backward(world=1)  # a reduce-scatter over one rank moves no bytes: nothing to cover
        gm = trace(f, *args)
        why = "moves no bytes"
    else:
        gm = trace(lambda a: reduce_scatter(a.t() @ a * 2, 2, "g"), torch.randn(4096, 4096))
        why = "every node before the last reduce-scatter"
    before = [n.name for n in gm.graph.nodes]
    gm, rec = run_pass("defer_weight_grads", gm, stage="bwd")
    assert why in rec.reason
    assert [n.name for n in gm.graph.nodes] == before


def test_order_is_restored_when_the_estimate_passes_the_budget(monkeypatch):
    peaks = iter([200, 100])  # after the move, then the original order
    monkeypatch.setattr(dwg.memory, "estimate", lambda gm: types.SimpleNamespace(peak_bytes=next(peaks)))
    monkeypatch.setattr(dwg.memory, "resolve_budget", lambda b, gm: 150)
    f, args = _backward()
    gm = trace(f, *args)
    before = [n.name for n in gm.graph.nodes]
    gm, rec = run_pass("defer_weight_grads", gm, stage="bwd")
    assert "memory_budget=150" in rec.reason
    assert [n.name for n in gm.graph.nodes] == before


def test_same_values_on_a_real_group(monkeypatch):
    monkeypatch.setattr(dwg, "collective_seconds", lambda nbytes, world, costs=None: 1.0)  # move everything it may
    with world1_group() as group:
        f, args = _backward(h=16, tokens=8, vocab=32, world=1, group=group)
        gm = trace(f, *args)
        ref = gm(*args)
        first_dw, last = _mms(gm)[0], _rss(gm)[-1]
        gm, rec = run_pass("defer_weight_grads", gm, stage="bwd")
        o = _order(gm)
        assert not rec.reason and o[first_dw] > o[last]  # every dW went after the table's reduce-scatter
        for a, b in zip(gm(*args), ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_infeasible_budget_keeps_a_move_that_does_not_raise_the_estimate(monkeypatch):
    peaks = iter([200, 200])
    monkeypatch.setattr(dwg.memory, "estimate", lambda gm: types.SimpleNamespace(peak_bytes=next(peaks)))
    monkeypatch.setattr(dwg.memory, "resolve_budget", lambda b, gm: 150)
    f, args = _backward()
    gm = trace(f, *args)
    last, first_dw = _rss(gm)[-1], _mms(gm)[-2]
    gm, rec = run_pass("defer_weight_grads", gm, stage="bwd")
    o = _order(gm)
    assert not rec.reason and o[first_dw] > o[last]


def test_moved_nodes_go_after_the_wait_unless_a_node_between_reads_them():
    f, args = _backward()
    gm = trace(f, *args)
    last = _rss(gm)[-1]
    wait = next(iter(last.users))
    gm, _ = run_pass("defer_weight_grads", gm, stage="bwd")
    assert wait.next.target is aten.t.default or wait.next.target is aten.mm.default  # moved compute after the wait

    gm = trace(f, *args)
    last, dw2 = _rss(gm)[-1], _mms(gm)[-2]
    wait = next(iter(last.users))
    with gm.graph.inserting_after(last):  # a reader of a moved node between the collective and its wait
        reader = gm.graph.call_function(aten.mul.Tensor, (dw2, 2))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = ((*out.args[0], reader),)
    gm, rec = run_pass("defer_weight_grads", gm, stage="bwd")  # lints: the order stays valid
    o = _order(gm)
    assert not rec.reason and o[last] < o[dw2] < o[reader] < o[wait]


def test_symbolic_sizes_are_modelled_at_their_hints():
    """As the memory model does: a graph traced with symbolic sizes is planned at the
    sizes it was traced for (the plan a Dynamo frame then shares is a count, ``k``)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    f, args = _backward()
    gm = make_fx(f, tracing_mode="symbolic")(*args)
    gm, rec = run_pass("defer_weight_grads", gm, stage="bwd")
    assert not rec.reason and rec.counts["reduce_scatters_deferred"] == 2


@pytest.fixture
def fresh_session():
    import graphcomp

    graphcomp.reset()
    yield
    graphcomp.reset()


def test_a_functions_first_plan_is_reused_by_its_recompiles(fresh_session):
    """A Dynamo frame's backward recompiled for other shapes (fewer tokens: its compute
    model alone would move more) moves as many reduce-scatters as its first compile, so a
    rank recompiling alone issues them in its peers' order."""
    f, args = _backward()
    gm, rec = run_pass("defer_weight_grads", trace(f, *args), stage="bwd", code_id=7)
    assert rec.counts["reduce_scatters_deferred"] == 2
    f2, args2 = _backward(tokens=8192)
    _, rec_alone = run_pass("defer_weight_grads", trace(f2, *args2), stage="bwd")
    assert rec_alone.counts["reduce_scatters_deferred"] == 3  # its own model: one more unit
    gm2, rec2 = run_pass("defer_weight_grads", trace(f2, *args2), stage="bwd", code_id=7)
    assert rec2.counts["reduce_scatters_deferred"] == 2 and any("reused" in n for n in rec2.notes)


def test_ranks_move_the_fewest_any_rank_planned(fresh_session, monkeypatch):
    seen = {}

    def agree(group, function, digest, kept, n, cfg, **kw):
        seen.update(kept=kept, n=n, namespace=kw.get("namespace"))
        return [0]  # a peer's model moved one

    from graphcomp.compiler import agreement

    monkeypatch.setattr(agreement, "agree_kept", agree)  # (what ctx.env.agree_kept asks)
    f, args = _backward()
    gm, rec = run_pass("defer_weight_grads", trace(f, *args), stage="bwd", code_id=8)
    assert seen == {"kept": [0, 1], "n": 3, "namespace": "defer"}
    assert rec.counts["reduce_scatters_deferred"] == 1 and any("every rank's 1" in n for n in rec.notes)


def test_slower_modelled_wire_moves_more(monkeypatch):
    """``Config.collective_bytes_per_s`` is the wire the cover target is modelled at: a
    slower one moves at least as many reduce-scatters, and a bad value is refused."""
    from graphcomp.config import Config

    f, args = _backward()
    gm = trace(f, *args)
    fast = dwg.plan(gm, costs=cost_model.REFERENCE.with_wire(1e15))
    slow = dwg.plan(gm, costs=cost_model.REFERENCE.with_wire(1.0))
    assert slow.k > fast.k
    for bad in (0, -1.0, float("inf"), True, "fast"):
        with pytest.raises(ValueError, match="collective_bytes_per_s"):
            Config.from_options({"collective_bytes_per_s": bad})
