"""The dynamo-stage pass embedding_exchange on hand-built graphs (exact op counts):
``F.embedding(ids, graphcomp::gather_table(local, ...))`` becomes
``exchange_lookup(ids, local, ...)`` per lookup, the gather erased; what it leaves
to the table gather, by reason. The end-to-end behaviour (2 gloo ranks, agreement
through the store) is ``test_embedding_exchange.py``; on NCCL with CUDA graphs, the GPU
test ``exchange2``."""

import torch
import torch.fx as fx
from torch.nn import functional as F

from _graphs import counts, run_pass

from graphcomp.sharding.embedding_exchange import exchange_lookup
from graphcomp.session import SESSION

TABLE = "graphcomp.gather_table.default"


def _graph(agree, token_counts, other_reader=False):
    """Dynamo-like: one sharded table (8 x 4 over 2 ranks, chunk 4), one lookup per entry
    of ``token_counts`` (None: ids without a static shape in their meta)."""
    g = fx.Graph()
    local = g.placeholder("local")
    local.meta["example_value"] = torch.zeros(4, 4)
    table = g.call_function(torch.ops.graphcomp.gather_table.default,
                            (local, 8, [8, 4], None, torch.float32, "g", 2, "xg", 0, 4, agree))
    outs = []
    for i, n in enumerate(token_counts):
        ids = g.placeholder(f"ids{i}")
        if n is not None:
            ids.meta["example_value"] = torch.zeros(n, dtype=torch.long)
        outs.append(g.call_function(F.embedding, (ids, table, 1 if i == 0 else None)))
    if other_reader:
        outs.append(g.call_method("sum", (table,)))
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g)


def _exchanges(gm):
    return [n for n in gm.graph.nodes if n.target is exchange_lookup]


def test_exchange_mode_rewrites_every_lookup_and_erases_the_gather():
    gm, rec = run_pass("embedding_exchange", _graph(False, [6, None]), stage="dynamo")
    ex = _exchanges(gm)
    assert len(ex) == 2 and counts(gm).get(TABLE, 0) == 0
    assert not [n for n in gm.graph.nodes if n.target is F.embedding]
    # (ids, local, rank, chunk, param_dtype, reduce_dtype, exchange group, world, padding_idx)
    assert [a for a in ex[0].args[2:]] == [0, 4, None, torch.float32, "xg", 2, 1]
    assert ex[1].args[-1] is None
    assert not any(k.startswith("skipped:") for k in rec.counts), rec.counts


def test_auto_without_a_dynamo_frame_or_agreement_keeps_the_gather():
    gm, rec = run_pass("embedding_exchange", _graph(True, [6, 6]), stage="dynamo")
    assert not _exchanges(gm) and counts(gm)[TABLE] == 1
    assert rec.counts == {"skipped:no_agreement": 2}, rec.counts
    gm, rec = run_pass("embedding_exchange", _graph(True, [6]), stage="dynamo", code_id=10**6 + 1,
                       rank_agreement=False)
    assert not _exchanges(gm) and rec.counts == {"skipped:no_agreement": 1}, rec.counts


def test_auto_first_compile_exchanges_static_counts_and_records_the_plan():
    # no process group here: the agreement keeps this rank's own list (one rank)
    code = 10**6 + 2
    SESSION.plans.pop("exchange", None)
    gm, rec = run_pass("embedding_exchange", _graph(True, [6, None]), stage="dynamo", code_id=code)
    assert len(_exchanges(gm)) == 1 and counts(gm)[TABLE] == 1  # the symbolic lookup still reads it
    assert rec.counts == {"skipped:symbolic_tokens": 1}, rec.counts
    epoch = SESSION.agree_seq.get("epoch", 0)
    assert SESSION.plans["exchange"][(epoch, code)] == frozenset({("xg", 6)})
    # a recompile of the same function: only the agreed count exchanges
    gm, rec = run_pass("embedding_exchange", _graph(True, [6, 8]), stage="dynamo", code_id=code)
    assert len(_exchanges(gm)) == 1 and rec.counts == {"skipped:not_agreed": 1}, rec.counts
    SESSION.plans.pop("exchange", None)


def test_a_table_with_another_reader_is_left_alone():
    gm, rec = run_pass("embedding_exchange", _graph(False, [6], other_reader=True), stage="dynamo")
    assert not _exchanges(gm) and counts(gm)[TABLE] == 1
    assert rec.counts == {"skipped:other_reader": 1}, rec.counts
