"""prefetch_across_steps (fwd): the table gather of a lookup, prefetched by the previous optimizer step.

Matches, in a forward graph, a parameter gather whose value is only looked up
(an input embedding's table)::

    P (shard placeholder) -> [view ...] -> [convert(dtype)] -> all_gather -> wait
        -> [slice / view ...] -> embedding(., ids) ...

and rewrites it to::

    prefetched_gather(P, dtype, W, group) -> [slice / view ...] -> embedding(., ids)

placed at the top of the graph (with the lookups and whatever computes their ids),
every node of it marked eager (``node.meta["graphcomp_eager"]``), so that
``partition_graph`` runs them as one eager piece ahead of the captured rest. At run
time ``graphcomp::prefetched_gather`` (``graphcomp/sharding/prefetch.py``) takes the gather that
``graphcomp.optim.capture``'s step issued after updating that shard, while it updated
the others, or gathers itself (first step; the shard written since). The values are
the same either way: the same all-gather of the same shard.

Applies only while a ``graphcomp.optim.capture`` step with ``prefetch=True`` exists
(something must issue the prefetch; without it the rewrite would only add an eager
piece), and not with ``cudagraphs="require"`` (the eager piece would raise). A
gathered table with another use (a tied LM head reads it in a matmul) is left alone:
the lookups alone make the eager piece cheap (their output, the activations, is what
the captured piece copies in). The decision depends only on the graph and on whether a
prefetching optimizer exists, so every rank makes the same one.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphcomp.analysis import graph_utils as gu
from graphcomp.compiler.pipeline import PassContext, PassResult, register_pass
from graphcomp.compiler.plan import EAGER_META

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

LOOKUPS = (aten.embedding.default,)
WHY = "prefetch_across_steps: the gathered table comes from the previous optimizer step (host decision)"


def _source(ag: fx.Node, static: set[fx.Node]) -> tuple[fx.Node, torch.dtype | None, list[fx.Node]] | None:
    """(shard placeholder, cast dtype or None, the nodes between) of a gather's input."""
    chain: list[fx.Node] = []
    x = ag.args[0]
    dtype = None
    if isinstance(x, fx.Node) and gu.dtype_cast(x) is not None and len(x.users) == 1:
        dtype = gu.dtype_cast(x)
        chain.append(x)
        x = x.args[0]
    while isinstance(x, fx.Node) and x.op == "call_function" and x.target in gu.VIEW_OPS and len(x.users) == 1:
        chain.append(x)
        x = x.args[0]
    if not isinstance(x, fx.Node) or x not in static:
        return None
    shard, out = gu.tensor_meta(x), gu.tensor_meta(ag.args[0])
    if not isinstance(shard, torch.Tensor) or not isinstance(out, torch.Tensor) or tuple(shard.shape) != tuple(out.shape):
        return None  # (a view that reshapes the shard: not the form the op gathers)
    return x, dtype, chain


def _lookups(wait: fx.Node) -> list[fx.Node] | None:
    """The views and lookups reading the gathered value, if that is all that reads it."""
    out: list[fx.Node] = []
    todo = list(wait.users)
    while todo:
        u = todo.pop()
        if u.op == "call_function" and u.target in gu.VIEW_OPS:
            out.append(u)
            todo.extend(u.users)
        elif u.op == "call_function" and u.target in LOOKUPS and u.args[0] in (wait, *out) and \
                all(a is not wait and a not in out for a in u.args[1:]):
            out.append(u)
        else:
            return None
    return out if any(u.target in LOOKUPS for u in out) else None


def _ancestors(nodes: list[fx.Node], stop: set[fx.Node]) -> set[fx.Node] | None:
    """Every non-placeholder node ``nodes`` need (through ``stop``), or None when one is
    a collective, a wait or impure (not movable to the top)."""
    seen: set[fx.Node] = set()
    todo = [a for n in nodes for a in n.all_input_nodes]
    while todo:
        a = todo.pop()
        if a in seen or a in stop or a.op == "placeholder":
            continue
        if gu.collective_kind(a) is not None or gu.is_target(a, c10d.wait_tensor.default) or a.is_impure():
            return None
        seen.add(a)
        todo.extend(a.all_input_nodes)
    return seen


@register_pass("prefetch_across_steps", stages=("fwd",), after=("schedule_prefetch",), before=("zero_copy_buckets",))
def prefetch_across_steps(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    if not ctx.env.cross_step_prefetch:
        return ctx.unchanged(gm, "no graphcomp.optim.capture step with prefetch=True exists to issue the gather")
    if ctx.config.cudagraphs == "require":
        return ctx.unchanged(gm, "cudagraphs='require': the prefetched gather runs eagerly, which 'require' forbids")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    static = {placeholders[i] for i in ctx.frame.stage_inputs("fwd").static_idxs if i < len(placeholders)}
    g = gm.graph
    front = placeholders[-1] if placeholders else None
    done = 0
    for ag in [n for n in g.nodes if gu.is_target(n, c10d.all_gather_into_tensor.default)]:
        if gu.is_foreign_collective(ag):
            continue
        wait = gu.single_wait(ag)
        src = _source(ag, static) if wait is not None else None
        if src is None:
            ctx.count("skipped:not_a_shard_gather")
            continue
        shard, dtype, chain = src
        reads = _lookups(wait)
        if reads is None:
            ctx.count("skipped:not_only_looked_up")
            continue
        pos = {n: i for i, n in enumerate(g.nodes)}
        deps = _ancestors([r for r in reads if r.target in LOOKUPS], stop={wait, *reads})
        if deps is None:
            ctx.count("skipped:lookup_ids_not_movable")
            continue
        world, group = ag.args[1], ag.args[2]
        anchor = front if front is not None else next(iter(g.nodes))
        with g.inserting_after(anchor):
            pg = g.call_function(torch.ops.graphcomp.prefetched_gather.default, (shard, dtype, world, group))
        pg.meta.update({k: v for k, v in wait.meta.items() if k in ("val", "tensor_meta", "stack_trace")})
        pg.meta[EAGER_META] = WHY
        wait.replace_all_uses_with(pg)
        g.erase_node(wait)
        g.erase_node(ag)
        for n in chain:  # (cast first, then the views back to the shard)
            if not n.users:
                g.erase_node(n)
        # the lookups (and what computes their ids) right after it, in their order
        last = pg
        for n in sorted([*deps, *reads], key=pos.__getitem__):
            last.append(n)
            n.meta[EAGER_META] = WHY
            last = n
        front = last
        done += 1
    if not done:
        return ctx.unchanged(gm, "no parameter gather whose value is only looked up (an input embedding's table)")
    ctx.counter("gathers_prefetched_across_steps", done)
    ctx.note(f"{done} table gather(s) taken from the previous optimizer step's prefetch (graphcomp::prefetched_gather), "
             f"run eagerly with their lookups at the top of the graph")
    return ctx.changed(gm)
