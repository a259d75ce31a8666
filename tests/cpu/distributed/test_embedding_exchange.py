"""graphcomp.shard(model, embedding="exchange"): compiled embedding lookups exchange
tokens and rows instead of gathering the table (graphcomp.sharding.embedding_exchange).

Two gloo ranks: the tiny Llama trained 3 AdamW steps with the table gathered and
with the exchange (fp32: the forward and the first gradients are the same numbers;
bf16: the losses agree to bf16 noise), the table's gather gone from the compiled
graphs, padding_idx rows without gradient, tied and overridden embeddings left to
the table gather, eager calls unchanged, and ranks that look up different numbers
of tokens failing with RankDivergence instead of exchanging mismatched buffers.

``embedding="auto"`` (the default): gloo groups gather; with gloo admitted
(``AUTO_BACKENDS``), ranks that look up the same number of tokens exchange, ranks
that differ at the first compile gather (no error), a recompile for a count the
first compile did not agree gathers on every rank, symbolic counts gather."""

import time

import pytest
import torch
from torch import nn


def _train(rank, world, mode, pdt, steps=3, codegen="inductor"):
    import graphcomp
    from graphcomp.models import Llama, synthetic_batch

    torch._dynamo.reset()
    graphcomp.reset()
    torch.manual_seed(0)
    m = Llama("tiny")
    graphcomp.shard(m, param_dtype=pdt, embedding=mode)
    cm = torch.compile(m, backend="graphcomp", options={"codegen": codegen})
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses, grad0 = [], None
    for step in range(steps):
        tok, tgt = synthetic_batch(m.cfg, 2, 16, seed=step + 10 * rank)
        loss = cm(tok, tgt)
        loss.backward()
        if step == 0:
            grad0 = {n: p.grad.to_local().clone() for n, p in m.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = {n: p.to_local().detach().clone() for n, p in m.named_parameters()}
    foreign = [(st, c["kind"], c["dtype"]) for f in graphcomp.session.SESSION.frames
               for st, d in f.stages.items() for c in d.get("collectives", []) if c.get("foreign")]
    return {"losses": losses, "grad0": grad0, "params": params, "counters": dict(graphcomp.counters),
            "exchange": m.tok_emb.__dict__.get("_graphcomp_exchange") is not None, "foreign": foreign}


@pytest.fixture(scope="module")
def ranks2(shared_ranks2):
    return shared_ranks2.view(timeout=300)


def test_fp32_exchange_matches_the_table_gather(ranks2):
    # eager codegen: the exchange is a graph rewrite, the same under either codegen
    # (Inductor runs it in the regional-compilation test below, and on GPUs in
    # exchange2); two Inductor compiles less in CI
    gather = ranks2.run(_train, "gather", None, 3, "eager")
    exch = ranks2.run_once(_train, "exchange", None, 3, "eager")  # (also read by the "auto" test below)
    table_bytes = 2 * 66 * 32 * 4  # the tiny Llama's embedding gathered: 2 shards of 66 rows, fp32
    for g, x in zip(gather, exch):
        assert x["exchange"] and not g["exchange"]
        assert x["losses"][0] == g["losses"][0]  # the forward is the same numbers
        assert x["losses"] == pytest.approx(g["losses"], rel=1e-6)
        for n in g["grad0"]:  # the table's gradient: the same sum in another order
            torch.testing.assert_close(x["grad0"][n], g["grad0"][n], rtol=1e-6, atol=1e-9)
        for n in g["params"]:
            torch.testing.assert_close(x["params"][n], g["params"][n], rtol=1e-5, atol=1e-7)
        # the table is gone from the parameter gathers: the forward's bucket and the
        # backward's re-gather of it (the exchange's own collectives are not counted)
        gathered = g["counters"]["bytes_gathered:float32"] - x["counters"]["bytes_gathered:float32"]
        assert gathered == 2 * table_bytes, (g["counters"], x["counters"])


def test_bf16_exchange_trains_as_the_table_gather(ranks2):
    # eager codegen: what bf16 changes is the exchange's collectives and rows, not the
    # codegen (Inductor: the regional-compilation test below); Inductor's C++ compile
    # of both bf16 runs cost about a minute of CI with a cold cache
    gather = ranks2.run(_train, "gather", torch.bfloat16, 3, "eager")
    exch = ranks2.run(_train, "exchange", torch.bfloat16, 3, "eager")
    for g, x in zip(gather, exch):
        # the lookup's rows are the same bf16 numbers; the table's gradient is summed
        # in another order (the exchange's embedding_dense_backward, in fp32)
        assert x["losses"] == pytest.approx(g["losses"], rel=2e-3)
        # the exchange's collectives: ids, bf16 rows; the backward gathers the bf16 output
        # gradients (upcast after the gather, exact: half the bytes of fp32)
        assert sorted(f for f in set(x["foreign"]) if f[0] != "joint") == [
            ("bwd", "all_gather", "bfloat16"), ("fwd", "all_gather", "int64"),
            ("fwd", "reduce_scatter", "bfloat16")], x["foreign"]
        torch.testing.assert_close(x["grad0"]["tok_emb.weight"], g["grad0"]["tok_emb.weight"], rtol=2e-2, atol=2e-3)


class _PadTied(nn.Module):
    """An embedding with padding_idx=1 (exchange), a tied embedding/head pair and an
    embedding subclass overriding forward (both gathered)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(13, 8, padding_idx=1)
        self.tied = nn.Embedding(13, 8)
        self.head = nn.Linear(8, 13, bias=False)
        self.head.weight = self.tied.weight
        self.scaled = _Scaled(13, 8)

    def forward(self, ids):
        return (self.head(self.emb(ids) + self.tied(ids)) + self.scaled(ids).sum(-1, keepdim=True)).square().mean()


class _Scaled(nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) * 2.0


def _pad_tied(rank, world):
    import graphcomp

    torch._dynamo.reset()
    graphcomp.reset()
    torch.manual_seed(0)
    m = _PadTied()
    graphcomp.shard(m, embedding="exchange")
    ids = torch.tensor([[1, 3, 1, 11], [0, 1, 7, 7]]) + rank  # padding_idx 1 on rank 0 (twice) and rank 1
    eager = m(ids)
    cm = torch.compile(m, backend="graphcomp")
    loss = cm(ids)
    loss.backward()
    pad_grad = m.emb._parameters["weight"].grad.to_local()[1] if rank == 0 else None
    return {"eager": eager.item(), "compiled": loss.item(),
            "exchange": {k: getattr(m, k).__dict__.get("_graphcomp_exchange") is not None
                         for k in ("emb", "tied", "scaled")},
            "pad_grad_zero": None if pad_grad is None else bool((pad_grad == 0).all()),
            "emb_grad_nonzero": bool(m.emb._parameters["weight"].grad.to_local().abs().sum() > 0)}


def test_padding_tied_overridden_and_eager(ranks2):
    for rank, r in enumerate(ranks2.run(_pad_tied)):
        assert r["exchange"] == {"emb": True, "tied": False, "scaled": False}, r
        assert r["compiled"] == pytest.approx(r["eager"], rel=1e-6)  # eager calls gather the table
        assert r["emb_grad_nonzero"]
        if rank == 0:
            assert r["pad_grad_zero"]  # padding_idx gets no gradient, as with F.embedding


def _uneven(rank, world):
    import graphcomp
    from graphcomp.errors import RankDivergence
    from graphcomp.models import Llama, synthetic_batch

    torch._dynamo.reset()
    graphcomp.reset()
    torch.manual_seed(0)
    m = Llama("tiny")
    graphcomp.shard(m, embedding="exchange")
    cm = torch.compile(m, backend="graphcomp", options={"codegen": "eager"})
    tok, tgt = synthetic_batch(m.cfg, 2, 16 if rank == 0 else 8, seed=rank)
    t0 = time.monotonic()
    try:
        cm(tok, tgt).backward()
    except Exception as e:  # noqa: BLE001 - Dynamo wraps backend errors: find ours
        inner = e
        while inner is not None and not isinstance(inner, RankDivergence):
            inner = getattr(inner, "inner_exception", None) or inner.__cause__
        return {"ours": inner is not None, "error": str(inner or e)[:400], "seconds": time.monotonic() - t0}
    return {"ours": False, "error": None, "seconds": time.monotonic() - t0}


def test_ranks_with_different_token_counts_raise_instead_of_exchanging(ranks2):
    out = ranks2.run(_uneven, timeout=200)
    for r in out:
        assert r["ours"], r
        assert r["seconds"] < 120, r


def test_bad_mode_names_the_valid_ones():
    import graphcomp

    with pytest.raises(ValueError, match=r"embedding='table'; valid: 'auto', 'gather', 'exchange'"):
        graphcomp.shard(nn.Embedding(4, 2), embedding="table")


def _auto(rank, world, seqs, admit_gloo=True, dynamic=None, options=None):
    """The tiny Llama under ``embedding="auto"`` (eager codegen, fp32), one step per
    entry of ``seqs`` (this rank's sequence length at that step: ``seqs[i][rank]``).
    ``admit_gloo``: gloo in ``AUTO_BACKENDS`` for this run only (the ranks are reused)."""
    from graphcomp.sharding import embedding_exchange

    saved = embedding_exchange.AUTO_BACKENDS
    if admit_gloo:
        embedding_exchange.AUTO_BACKENDS = ("nccl", "gloo")
    try:
        return _auto_run(rank, seqs, dynamic, options)
    finally:
        embedding_exchange.AUTO_BACKENDS = saved


def _auto_run(rank, seqs, dynamic, options):
    import graphcomp
    from graphcomp.models import Llama, synthetic_batch

    torch._dynamo.reset()
    graphcomp.reset()
    torch.manual_seed(0)
    m = Llama("tiny")
    graphcomp.shard(m)  # embedding="auto"
    cm = torch.compile(m, backend="graphcomp", dynamic=dynamic, options={"codegen": "eager", **(options or {})})
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses, exchanged, skipped = [], [], []
    for step, lens in enumerate(seqs):
        before = graphcomp.counters["embedding_lookups_exchanged"]
        tok, tgt = synthetic_batch(m.cfg, 2, lens[rank], seed=step + 10 * rank)
        loss = cm(tok, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        exchanged.append(graphcomp.counters["embedding_lookups_exchanged"] - before)
    for f in graphcomp.session.SESSION.frames:
        for stage in f.stages.values():
            for p in stage.get("passes", []):
                if p["name"] == "embedding_exchange":
                    skipped.append({k: v for k, v in p.get("counts", {}).items() if k.startswith("skipped:")})
    params = {n: p.to_local().detach().clone() for n, p in m.named_parameters()}
    return {"losses": losses, "exchanged": exchanged, "skipped": skipped, "params": params,
            "regions": graphcomp.counters["regions"],
            "may_exchange": m.tok_emb.__dict__.get("_graphcomp_exchange") is not None}


def test_auto_gathers_on_gloo(ranks2):
    for r in ranks2.run(_auto, [(16, 16)], False):
        assert not r["may_exchange"] and r["exchanged"] == [0], r


def test_auto_exchanges_when_the_ranks_agree(ranks2):
    # (the runs the fp32 test above and the regional test below read too)
    auto = ranks2.run_once(_auto, [(16, 16)] * 3)
    exch = ranks2.run_once(_train, "exchange", None, 3, "eager")
    for a, x in zip(auto, exch):
        assert a["may_exchange"] and a["exchanged"] == [1, 0, 0], a["skipped"]  # compiled once, exchanging
        assert a["losses"] == x["losses"]  # the same graph as embedding="exchange": bitwise
        for n in x["params"]:
            assert torch.equal(a["params"][n], x["params"][n]), n


def test_auto_gathers_when_the_ranks_differ_and_for_counts_not_agreed(ranks2):
    # step 1: 16 vs 8 tokens per sequence at the first compile (no error: the table gather);
    # step 2: equal counts, a recompile (new shapes; on rank 1 Dynamo's automatic dynamic
    # may make it symbolic): never agreed at the first compile, so gathered
    auto = ranks2.run(_auto, [(16, 8), (12, 12)])
    gather = ranks2.run(_auto, [(16, 8), (12, 12)], False)
    for a, g in zip(auto, gather):
        assert a["exchanged"] == [0, 0], a
        assert a["losses"] == g["losses"]  # the table gather's numbers, bitwise
        for n in g["params"]:
            assert torch.equal(a["params"][n], g["params"][n]), n
        counts = {}
        for d in a["skipped"]:
            for k, v in d.items():
                counts[k] = counts.get(k, 0) + v
        assert counts.get("skipped:ranks_differ", 0) == 1, a["skipped"]
        assert counts.get("skipped:not_agreed", 0) + counts.get("skipped:symbolic_tokens", 0) == 1, a["skipped"]


def test_auto_recompile_reuses_the_agreed_count_and_symbolic_gathers(ranks2):
    # agreed at 16; a step at 8 recompiles and gathers; back at 16 the first graph runs
    for r in ranks2.run(_auto, [(16, 16), (8, 8), (16, 16)]):
        assert r["exchanged"] == [1, 0, 0], r
    for r in ranks2.run(_auto, [(16, 16)], True, True):  # dynamic=True: symbolic token counts
        assert r["exchanged"] == [0], r
        assert any(d.get("skipped:symbolic_tokens") for d in r["skipped"]), r["skipped"]


def test_auto_exchanges_under_regional_compilation(ranks2):
    # compile_regions cuts the graph after the dynamo-stage passes: the exchange is in
    # the first region; the whole graph's exchange numbers (eager codegen) to fp32 rounding
    ind = {"codegen": "inductor", "prefetch_bytes": 2048}  # (regions are Inductor pieces)
    reg = ranks2.run(_auto, [(16, 16)] * 3, True, None, {**ind, "compile_regions": True, "region_min_nodes": 8})
    whole = ranks2.run_once(_auto, [(16, 16)] * 3)  # (eager codegen: one Inductor compile less)
    for r, w in zip(reg, whole):
        assert r["exchanged"] == [1, 0, 0] and r["regions"] > 1, (r["skipped"], r["regions"])
        assert w["exchanged"] == [1, 0, 0] and w["regions"] == 0, (w["skipped"], w["regions"])
        assert r["losses"] == pytest.approx(w["losses"], rel=1e-5)
