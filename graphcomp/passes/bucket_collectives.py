"""bucket_collectives (joint / inference): one collective per bucket of small ones.

All-gathers. Walking the graph in order, consecutive parameter gathers with the
same group and dtype are packed greedily until their gathered bytes would pass
``Config.bucket_bytes``::

    s_i -> [convert(bf16)] -> all_gather -> wait -> users_i      (for each i)

becomes, placed at the first gather of the bucket::

    pack_cast([s_0..s_k], bf16) -> all_gather -> wait -> unpack_gathered
        -> getitem i -> view(orig shape) -> users_i

``graphcomp::pack_cast`` casts and copies every shard into the send buffer in
one pass (it absorbs the converts that ``fuse_allgather_downcast`` inserted, and
plain views of the shard), so a bucket gathers the fused narrow dtype too.
The flat form is what the joint passes (``remat``, ``schedule_free``) and
``schedule_prefetch`` match; after them ``zero_copy_buckets`` turns each bucket
into a grouped collective with one buffer per member (no copy-out, no pack).

Reduce-scatters. Consecutive gradient reduce-scatters (same group, dtype and
reduce op) are packed the same way, up to ``Config.reduce_bucket_bytes`` of input
(``bucket_bytes`` when it is ``None``), and issued where the last gradient of the
bucket is ready::

    pack_for_reduce_scatter([g_0..g_k]) -> reduce_scatter -> wait
        -> split_with_sizes -> getitem i -> view(orig shape) -> users_i

Only graphcomp's own collectives are candidates: tensor-parallel ones (on a group
``shard(mesh=...)`` did not shard over, ``graph_utils.is_foreign_collective``) are
skipped, neither bucketed nor breaking a run (they sit between the parameter
gathers, which read only shards, and the gradient reduce-scatters, whose results
only leave the graph). A bucket is one group by construction (the key).

Buckets depend only on the graph and the config (order and byte sizes), never on
timing or memory, so every rank makes the same buckets and issues the same
collectives in the same order. No-op when there are fewer than two collectives
of a kind, or ``bucket_bytes`` is smaller than any two of them together.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from graphcomp.analysis import graph_utils as gu
from graphcomp.ops.collectives import OPS
from graphcomp.compiler.pipeline import PassContext, PassResult, register_pass

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional

# pure ops between a shard placeholder and its gather that pack_cast can absorb
_ABSORB = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default,
           prims.convert_element_type.default}


@dataclass
class _Item:
    coll: fx.Node
    wait: fx.Node
    src: fx.Node  # the collective's input
    nbytes: int
    numel: int  # input numel (gather: shard numel; reduce-scatter: full numel)
    key: tuple


@dataclass
class _Bucket:
    items: list[_Item] = field(default_factory=list)
    nbytes: int = 0


def _nbytes_numel(node: fx.Node) -> tuple[int, int] | None:
    v = gu.tensor_meta(node)
    if not isinstance(v, torch.Tensor):
        return None
    b = gu.nbytes(v)
    return (b, int(v.numel())) if b >= 0 else None


def _items(gm: fx.GraphModule, target: object, kind: str, ctx: PassContext) -> list[_Item | None]:
    """Candidate collectives in graph order; None marks one that breaks a bucket run."""
    out: list[_Item | None] = []
    for n in gm.graph.nodes:
        if not gu.is_target(n, target) or gu.is_foreign_collective(n):
            continue
        wait = gu.single_wait(n)
        src = n.args[0]
        sizes = _nbytes_numel(n if kind == "all_gather" else src) if isinstance(src, fx.Node) else None
        in_sizes = _nbytes_numel(src) if isinstance(src, fx.Node) else None
        if wait is None or sizes is None or in_sizes is None:
            ctx.count(f"{kind}:unbucketable")
            out.append(None)
            continue
        src_val = gu.tensor_meta(src)
        if kind == "all_gather":
            key = (n.args[1], n.args[2], src_val.dtype, src_val.device)  # world, group, dtype, device
        else:
            key = (n.args[1], n.args[2], n.args[3], src_val.dtype, src_val.device)  # op, world, group, ...
        out.append(_Item(n, wait, src, sizes[0], in_sizes[1], key))
    return out


def _plan(items: list[_Item | None], limit: int) -> list[_Bucket]:
    buckets: list[_Bucket] = []
    cur = _Bucket()
    for it in items:
        if it is None or (cur.items and (it.key != cur.items[0].key or cur.nbytes + it.nbytes > limit)):
            if len(cur.items) > 1:
                buckets.append(cur)
            cur = _Bucket()
        if it is not None:
            cur.items.append(it)
            cur.nbytes += it.nbytes
    if len(cur.items) > 1:
        buckets.append(cur)
    return buckets


def _absorb(src: fx.Node) -> fx.Node:
    """Walk back through single-user views/converts of the same numel: pack_cast
    flattens and casts anyway, so it can read the root directly."""
    root = src
    numel = _nbytes_numel(src)
    while (
        root.op == "call_function"
        and root.target in _ABSORB
        and isinstance(root.args[0], fx.Node)
        and len(root.users) == 1
        and _nbytes_numel(root.args[0]) is not None
        and numel is not None
        and _nbytes_numel(root.args[0])[1] == numel[1]  # type: ignore[index]
    ):
        root = root.args[0]
    return root


def _erase_dead(g: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase now-unused absorbed views/converts (each once: erasing an FX node
    twice relinks the list around stale neighbours and corrupts the graph)."""
    for n in nodes:
        if n.op == "call_function" and not n.users and n.target in _ABSORB and not getattr(n, "_erased", False):
            a = n.args[0]
            g.erase_node(n)
            if isinstance(a, fx.Node):
                _erase_dead(g, [a])


def _replace_members(gm: fx.GraphModule, b: _Bucket, parts: fx.Node, anchor: fx.Node) -> None:
    """Point each member's users at ``view(parts[i], original shape)``, then erase
    the members. Every node is created before any is erased: inserting next to an
    erased node would link through its stale pointers."""
    g = gm.graph
    views = []
    for i, it in enumerate(b.items):
        shape = list(gu.tensor_meta(it.coll).shape)
        with g.inserting_before(anchor):
            part = g.call_function(operator.getitem, (parts, i))
            view = g.call_function(aten.view.default, (part, shape))
        gu.fake_eval(gm, part)
        gu.fake_eval(gm, view)
        views.append(view)
    for it, view in zip(b.items, views):
        it.wait.replace_all_uses_with(view)
        g.erase_node(it.wait)
        g.erase_node(it.coll)


def _bucket_gathers(gm: fx.GraphModule, b: _Bucket, bid: str) -> fx.Node:
    g = gm.graph
    first = b.items[0]
    world, group = first.coll.args[1], first.coll.args[2]
    dtype = gu.tensor_meta(first.src).dtype
    roots = [_absorb(it.src) for it in b.items]
    trace = first.coll.meta.get("stack_trace")  # the bucket is issued where its first member was
    with g.inserting_before(first.coll):
        flat = g.call_function(OPS["pack_cast"], (roots, dtype))
        ag = g.call_function(c10d.all_gather_into_tensor.default, (flat, world, group))
        wait = g.call_function(c10d.wait_tensor.default, (ag,))
        parts = g.call_function(OPS["unpack_gathered"], (wait, world, [it.numel for it in b.items]))
    for n in (flat, ag, wait, parts):
        gu.fake_eval(gm, n)
    _replace_members(gm, b, parts, anchor=first.coll)
    _erase_dead(g, [it.src for it in b.items])
    ag.meta["graphcomp_bucket"] = bid
    ag.meta["graphcomp_params"] = [r.name for r in roots]
    fp8 = {it.coll.meta.get(gu.FP8_WIRE) for it in b.items}
    if len(fp8) == 1 and None not in fp8:  # FP8 bytes of every member (fp8_allgather)
        ag.meta[gu.FP8_WIRE] = fp8.pop()
    if trace:
        ag.meta["stack_trace"] = trace
    return flat


def _bucket_reduce_scatters(gm: fx.GraphModule, b: _Bucket, bid: str) -> fx.Node:
    g = gm.graph
    last = b.items[-1]
    op, world, group = last.coll.args[1], last.coll.args[2], last.coll.args[3]
    dtype = gu.tensor_meta(last.src).dtype
    trace = last.coll.meta.get("stack_trace")  # the bucket is issued where its last member was
    with g.inserting_before(last.coll):
        packed = g.call_function(OPS["pack_for_reduce_scatter"], ([it.src for it in b.items], world, dtype))
        rs = g.call_function(c10d.reduce_scatter_tensor.default, (packed, op, world, group))
        wait = g.call_function(c10d.wait_tensor.default, (rs,))
        split = g.call_function(aten.split_with_sizes.default, (wait, [it.numel // world for it in b.items]))
    for n in (packed, rs, wait, split):
        gu.fake_eval(gm, n)
    _replace_members(gm, b, split, anchor=last.coll)
    rs.meta["graphcomp_bucket"] = bid
    rs.meta["graphcomp_params"] = [it.src.name for it in b.items]
    if trace:
        rs.meta["stack_trace"] = trace
    return packed


@register_pass("bucket_collectives", stages=("joint",), after=("fuse_allgather_downcast",))
def bucket_collectives(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    limit = ctx.config.bucket_bytes
    rs_limit = limit if ctx.config.reduce_bucket_bytes is None else ctx.config.reduce_bucket_bytes
    ag_buckets = _plan(_items(gm, c10d.all_gather_into_tensor.default, "all_gather", ctx), limit)
    rs_buckets = _plan(_items(gm, c10d.reduce_scatter_tensor.default, "reduce_scatter", ctx), rs_limit)
    if not ag_buckets and not rs_buckets:
        return ctx.unchanged(gm, "no two consecutive compatible collectives fit in "
                                 f"bucket_bytes={limit} (gathers) / {rs_limit} (reduce-scatters)")
    hoist = set()
    for i, b in enumerate(ag_buckets):
        hoist.add(_bucket_gathers(gm, b, f"{ctx.stage}:ag{i}"))
        ctx.count("all_gather_buckets")
        ctx.count("all_gathers_bucketed", len(b.items))
        ctx.note(f"ag{i}: {len(b.items)} gathers, {b.nbytes} bytes")
    for i, b in enumerate(rs_buckets):
        _bucket_reduce_scatters(gm, b, f"{ctx.stage}:rs{i}")
        ctx.count("reduce_scatter_buckets")
        ctx.count("reduce_scatters_bucketed", len(b.items))
        ctx.note(f"rs{i}: {len(b.items)} reduce-scatters, {b.nbytes} bytes")
    # a gather bucket sits at its first user; its shard inputs (and their views)
    # may have been defined later: pull them up. Reduce-scatter buckets sit at their
    # last input; the users of earlier members move down after it.
    gu.stable_topo_sort(gm, hoist=hoist)
    ctx.counter("collective_buckets", len(ag_buckets) + len(rs_buckets))
    return ctx.changed(gm)
