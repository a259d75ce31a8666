"""embedding_exchange (dynamo): a sharded embedding's lookups exchange tokens instead of gathering the table.

Matches, in Dynamo's graph, the table gather of an embedding sharded with
``graphcomp.shard(..., embedding="auto" | "exchange")`` and the lookups reading it::

    T = graphcomp::gather_table(local, rows, shape, ..., exchange_group, rank, chunk, agree)
    out_i = F.embedding(ids_i, T, padding_idx)            (every reader of T)

and rewrites each lookup to the token exchange (``graphcomp.sharding.embedding_exchange``)::

    out_i = exchange_lookup(ids_i, local, rank, chunk, param_dtype, reduce_dtype,
                            exchange_group, world_size, padding_idx)

erasing the gather. No table-sized collective is left: the forward all-gathers the
ranks' token ids and reduce-scatters the rows, the backward all-gathers the output
gradients (sizes ``W * tokens``; see ``graphcomp/sharding/embedding_exchange.py``).

The exchange needs every rank to look up the same number of tokens. A lookup with
``agree`` (``embedding="auto"``, the default) exchanges only when

* its ids have a static shape (a symbolic token count may differ between ranks at
  run time: ``skipped:symbolic_tokens``), and
* at the function's first compile every rank of the exchange group looks up the
  same number of tokens there: the ranks publish ``lookup index: token count``
  through the store and exchange the lookups all of them share
  (``ctx.env.agree_kept``, as ``schedule_free``'s keep plan; ``skipped:ranks_differ``).
  A recompile (a new shape, perhaps on one rank) reuses that plan: it exchanges a
  lookup only for a token count agreed at the first compile
  (``skipped:not_agreed``). With ``Config.rank_agreement`` off nothing is agreed and
  ``"auto"`` gathers (``skipped:no_agreement``).

Everything else keeps the table gather, which ``gather_table`` computes exactly as
``gather_shard`` does. A lookup without ``agree`` (``embedding="exchange"``) always
exchanges; ranks whose counts differ then fail at the compiled graphs' rank
agreement (``RankDivergence``). Switched off, every lookup gathers the table.
A gathered table with another reader (not a lookup of it) is left alone.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.nn import functional as F

from graphcomp.analysis import graph_utils as gu
from graphcomp.sharding.embedding_exchange import exchange_lookup
from graphcomp.compiler.pipeline import PassContext, PassResult, register_pass


def _tables(gm: fx.GraphModule) -> list[fx.Node]:
    target = torch.ops.graphcomp.gather_table.default
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def _lookups(table: fx.Node) -> list[fx.Node] | None:
    """The ``F.embedding(ids, table, padding_idx)`` calls reading ``table``, if that is all that reads it."""
    out = []
    for u in table.users:
        if u.op != "call_function" or u.target is not F.embedding or u.kwargs or len(u.args) not in (2, 3) \
                or u.args[1] is not table or u.args[0] is table:
            return None
        out.append(u)
    return out


def _tokens(lookup: fx.Node) -> int | None:
    """The static number of tokens a lookup reads (None: symbolic or unknown)."""
    ids = lookup.args[0]
    val = None
    if isinstance(ids, fx.Node):  # (Dynamo's graph: "example_value"; a traced graph: "val")
        val = ids.meta.get("example_value", gu.tensor_meta(ids))
    if not isinstance(val, torch.Tensor):
        return None
    n = 1
    for s in val.shape:
        if not isinstance(s, int):
            return None
        n *= s
    return n


def _skip(ctx: PassContext, why: str, n: int) -> None:
    if n:
        ctx.count(f"skipped:{why}", n)


def _exchange(gm: fx.GraphModule, table: fx.Node, lookup: fx.Node) -> None:
    local, _rows, _shape, pdt, rdt, _group, world, xgroup, rank, chunk, _agree = table.args
    padding_idx = lookup.args[2] if len(lookup.args) > 2 else None
    with gm.graph.inserting_before(lookup):
        new = gm.graph.call_function(exchange_lookup, (lookup.args[0], local, rank, chunk, pdt, rdt, xgroup, world,
                                                       padding_idx))
    new.meta.update(lookup.meta)
    lookup.replace_all_uses_with(new)
    gm.graph.erase_node(lookup)


@register_pass("embedding_exchange", stages=("dynamo",))
def embedding_exchange(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    tables = _tables(gm)
    if not tables:
        return ctx.unchanged(gm, "no embedding table that may exchange (shard(..., embedding='auto' | 'exchange'))")
    # (index, table, lookup, tokens) of every candidate, in graph order (the same on every rank)
    cands: list[tuple[int, fx.Node, fx.Node, int | None]] = []
    for t in tables:
        if len(t.args) != 11 or t.kwargs:  # (the op's schema has 11 arguments, passed positionally)
            _skip(ctx, "unexpected_form", 1)
            continue
        lookups = _lookups(t)
        if lookups is None:
            _skip(ctx, "other_reader", 1)
            continue
        cands.extend((len(cands), t, lk, _tokens(lk)) for lk in lookups)
    chosen: list[tuple[fx.Node, fx.Node]] = []
    agreed_here: set[tuple[str, int]] = set()  # (exchange group, token count) agreed in this compile
    by_group: dict[str, list[tuple[int, fx.Node, fx.Node, int | None]]] = {}
    for c in cands:
        if c[1].args[10]:  # agree ("auto")
            by_group.setdefault(c[1].args[7], []).append(c)
        else:
            chosen.append((c[1], c[2]))
    code = ctx.frame.code_id
    # (the agreement's epoch: after torch._dynamo.reset() Dynamo numbers functions from 0 again)
    key = None if code is None else (ctx.env.epoch, code)
    prior = ctx.env.prior_plan("exchange", key) if key is not None else None
    for xgroup, cs in sorted(by_group.items()):
        static = [c for c in cs if c[3] is not None]
        _skip(ctx, "symbolic_tokens", len(cs) - len(static))
        if not static:
            continue
        if prior is not None:
            ok = [c for c in static if (xgroup, c[3]) in prior]
            _skip(ctx, "not_agreed", len(static) - len(ok))
        elif not ctx.config.rank_agreement or key is None:
            _skip(ctx, "no_agreement", len(static))
            continue
        else:
            items = [f"{c[0]}:{c[3]}" for c in static]
            digest = f"{len(cs)} lookups of gathered tables"
            got = ctx.env.agree_kept(xgroup, str(code), digest, items, len(cs), ctx.config,
                                       plan="the token counts of its embedding lookups (embedding='auto')",
                                       counted="lookups", namespace="exchange",
                                       about=f"looks up {', '.join(items)} (lookup: tokens).")
            shared = set(got)
            ok = [c for c in static if f"{c[0]}:{c[3]}" in shared]
            _skip(ctx, "ranks_differ", len(static) - len(ok))
            agreed_here.update((xgroup, c[3]) for c in ok)
        chosen.extend((c[1], c[2]) for c in ok)
    if key is not None and prior is None and by_group:
        ctx.env.keep_plan("exchange", key, frozenset(agreed_here))
    if not chosen:
        return ctx.unchanged(gm, f"none of {len(cands)} lookups exchanges (see the skipped:* counts): "
                                 f"the tables are gathered")
    for table, lookup in chosen:
        _exchange(gm, table, lookup)
    for t in tables:
        if not t.users:
            gm.graph.erase_node(t)
    ctx.counter("embedding_lookups_exchanged", len(chosen))
    ctx.note(f"{len(chosen)} of {len(cands)} embedding lookups exchange tokens instead of gathering the table")
    return ctx.changed(gm)
