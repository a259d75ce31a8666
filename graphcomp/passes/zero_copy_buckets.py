"""zero_copy_buckets (fwd / bwd): buckets as grouped collectives, no copy-out, no pack.

A flat bucket (``bucket_collectives``) moves its members through one buffer, and
costs a copy on each side of the wire: the gathered buffer is rank-major (rank
``r``'s segment holds its rows of every member), so each parameter is copied out
of it (``unpack_gathered``, a ``split_with_sizes_copy`` kernel); and each
gradient is copied into the reduce-scatter's rank-major input
(``pack_for_reduce_scatter``, a ``cat``). No view of one rank-major buffer is a
parameter: a member's rows are ``W`` strided runs, one per rank. This pass keeps
each bucket one collective launch and drops both copies by giving every member
its own buffer: the bucket becomes NCCL's grouped form of the same collective
(``all_gather_into_tensor_coalesced`` / ``reduce_scatter_tensor_coalesced``:
one ``ncclGroupStart/End``, one kernel), whose outputs are the gathered
parameters themselves (``[W * n_i]``, rank-major per member: the full padded
parameter) and whose inputs are the gradients themselves::

    pack_cast -> all_gather -> wait -> unpack_gathered -> getitem i -> users_i

becomes::

    pack_cast -> split_with_sizes (views) -> all_gather_coalesced -> getitem i
        ... -> wait_i -> users_i

(the send buffer stays: ``pack_cast`` casts every shard in one multi-tensor kernel
and the members are views of it), and::

    pack_for_reduce_scatter([g_i]) -> reduce_scatter -> wait -> split -> getitem i

becomes::

    reduce_scatter_coalesced([g_i]) -> getitem i ... -> wait_i

Placement is kept: the grouped collective sits where ``schedule_prefetch`` issued
the bucket, every member's wait where the bucket's wait was. The values are the
same bytes (a gather copies, a reduction sums the same operands per element), so
results are bitwise those of the flat bucket. Memory: the gathered ``[W * L]``
buffer and the ``[W * L]`` reduce-scatter input are not allocated beside the
members (the estimate of ``graphcomp.analysis.memory`` still counts the flat form: it
runs on the joint graph, before this pass, and stays an upper bound). Time: the
copy kernels of every bucket leave the step; the collective is still one launch.

Runs after ``schedule_prefetch`` on the partitioned graphs, so the passes that
match a bucket's one-wait shape (``schedule_free``, ``schedule_prefetch``,
``remat``, the memory model) are unchanged. Skipped, with a count, where the flat
form is still needed: the gathered buffer read by anything but its unpack (the
partitioner saved the whole bucket for the backward: the backward unpacks it), a
reduce-scatter whose pack casts (members of another dtype) or whose member is not
contiguous (a grouped collective reads each input as laid out). CPU graphs (gloo)
stay flat unless ``FramePlan.zero_copy_cpu_graphs`` is set: gloo has no grouped
reduce-scatter and runs one collective per member, each bound by per-call latency
(slower than the flat bucket). Tensor-parallel
collectives (``graph_utils.is_foreign_collective``) are never buckets. No-op
without buckets.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from graphcomp.analysis import graph_utils as gu
from graphcomp.ops.collectives import OPS
from graphcomp.compiler.pipeline import PassContext, PassResult, register_pass

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

_META_KEYS = ("graphcomp_bucket", "graphcomp_params", "graphcomp_fused_downcast", "graphcomp_reshard",
              "graphcomp_prefetch_ahead", gu.FP8_WIRE, "stack_trace")


def _getitems(node: fx.Node) -> list[fx.Node] | None:
    """The users of a list-valued node, when every one is ``getitem(node, int)``."""
    users = list(node.users)
    if not users or any(u.op != "call_function" or u.target is not operator.getitem
                        or not isinstance(u.args[1], int) for u in users):
        return None
    return users


def _contiguous(node: fx.Node) -> bool:
    v = gu.tensor_meta(node)
    return isinstance(v, torch.Tensor) and v.is_contiguous()


def _copy_meta(src: fx.Node, dst: fx.Node) -> None:
    for k in _META_KEYS:
        if k in src.meta:
            dst.meta[k] = src.meta[k]
    dst.meta["graphcomp_zero_copy"] = True


def _items(gm: fx.GraphModule, src: fx.Node, n: int, before: fx.Node) -> list[fx.Node]:
    """``getitem(src, i)`` for ``i < n``, inserted before ``before``; each takes its
    value from ``src``'s list (no fake run: a bucket may have hundreds of members)."""
    g = gm.graph
    with g.inserting_before(before):
        items = [g.call_function(operator.getitem, (src, i)) for i in range(n)]
    vals = src.meta.get("val")
    for i, it in enumerate(items):
        if isinstance(vals, (list, tuple)):
            gu.set_val(it, vals[i])
        else:
            gu.fake_eval(gm, it)
    return items


def _rewire(gm: fx.GraphModule, grouped: fx.Node, wait: fx.Node, users: list[fx.Node],
            dead: tuple[fx.Node, ...]) -> None:
    """Each member of the grouped collective ``grouped`` gets its ``getitem`` right after
    it and its ``wait_tensor`` where the flat bucket's ``wait`` was; the flat form's
    per-member ``users`` (``getitem(flat result, i)``) read member ``i``'s wait
    instead, and they and the flat form's ``dead`` nodes are erased (users first)."""
    g = gm.graph
    outs = _items(gm, grouped, len(grouped.args[0]), grouped.next)
    with g.inserting_before(wait):
        waits = [g.call_function(c10d.wait_tensor.default, (o,)) for o in outs]
    for w, o in zip(waits, outs):  # a wait's value is its input's
        if "val" in o.meta:
            gu.set_val(w, o.meta["val"])
        else:
            gu.fake_eval(gm, w)
    for it in users:
        it.replace_all_uses_with(waits[it.args[1]])
        g.erase_node(it)
    for node in dead:
        g.erase_node(node)


def _gather(gm: fx.GraphModule, coll: fx.Node, ctx: PassContext) -> bool:
    flat = coll.args[0]
    wait = gu.single_wait(coll)
    if not isinstance(flat, fx.Node) or not gu.is_target(flat, OPS["pack_cast"]) or wait is None:
        return False  # not a bucket (one parameter's own gather: nothing to copy)
    users = list(wait.users)
    if len(users) != 1 or not gu.is_target(users[0], OPS["unpack_gathered"]):
        ctx.count("zero_copy:gather_buffer_read")
        return False
    unpack = users[0]
    items = _getitems(unpack)
    if items is None:
        ctx.count("zero_copy:gather_buffer_read")
        return False
    numels = list(unpack.args[2])
    world, group = coll.args[1], coll.args[2]
    g = gm.graph
    with g.inserting_before(coll):
        split = g.call_function(aten.split_with_sizes.default, (flat, numels))
    gu.fake_eval(gm, split)
    ins = _items(gm, split, len(numels), coll)
    with g.inserting_before(coll):
        new = g.call_function(c10d.all_gather_into_tensor_coalesced.default, (ins, world, group))
    gu.fake_eval(gm, new)
    _copy_meta(coll, new)
    _rewire(gm, new, wait, items, dead=(unpack, wait, coll))
    return True


def _reduce_scatter(gm: fx.GraphModule, coll: fx.Node, ctx: PassContext) -> bool:
    packed = coll.args[0]
    wait = gu.single_wait(coll)
    if not isinstance(packed, fx.Node) or not gu.is_target(packed, OPS["pack_for_reduce_scatter"]) or wait is None:
        return False
    grads, dtype = list(packed.args[0]), packed.args[2]
    users = list(wait.users)
    split = users[0] if len(users) == 1 and gu.is_target(users[0], aten.split_with_sizes.default) else None
    items = _getitems(split) if split is not None else None
    if len(packed.users) != 1 or items is None:
        ctx.count("zero_copy:reduce_scatter_buffer_read")
        return False
    vals = [gu.tensor_meta(x) for x in grads]
    if any(not isinstance(v, torch.Tensor) or v.dtype != dtype for v in vals):
        ctx.count("zero_copy:reduce_scatter_cast")
        return False
    if not all(_contiguous(x) for x in grads):
        ctx.count("zero_copy:reduce_scatter_strided")
        return False
    op, world, group = coll.args[1], coll.args[2], coll.args[3]
    g = gm.graph
    with g.inserting_before(coll):
        new = g.call_function(c10d.reduce_scatter_tensor_coalesced.default, (grads, op, world, group))
    gu.fake_eval(gm, new)
    _copy_meta(coll, new)
    _rewire(gm, new, wait, items, dead=(split, wait, coll, packed))
    return True


@register_pass("zero_copy_buckets", stages=("fwd", "bwd"), after=("schedule_prefetch",), before=("partition_graph",))
def zero_copy_buckets(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    colls = [n for n in gm.graph.nodes
             if (gu.is_target(n, c10d.all_gather_into_tensor.default) or gu.is_target(n, c10d.reduce_scatter_tensor.default))
             and not gu.is_foreign_collective(n)]
    if not colls:
        return ctx.unchanged(gm, "no all_gather / reduce_scatter of graphcomp's in the graph")
    if not ctx.frame.zero_copy_cpu_graphs and not gu.has_cuda_tensors(gm):
        return ctx.unchanged(gm, "CPU graph (gloo): gloo runs a grouped reduce-scatter as one collective per member "
                                 "(slower than the flat bucket), so buckets stay flat "
                                 "(FramePlan.zero_copy_cpu_graphs opts in)")
    done = {"ag": 0, "rs": 0}
    for n in colls:
        if gu.is_target(n, c10d.all_gather_into_tensor.default):
            done["ag"] += _gather(gm, n, ctx)
        else:
            done["rs"] += _reduce_scatter(gm, n, ctx)
    if not any(done.values()):
        return ctx.unchanged(gm, "no flat bucket to regroup (bucket_collectives made none here, or each is read "
                                 "as one buffer: see the zero_copy:* counts)")
    ctx.count("zero_copy_gather_buckets", done["ag"])
    ctx.count("zero_copy_reduce_scatter_buckets", done["rs"])
    ctx.note(f"{done['ag']} gather and {done['rs']} reduce-scatter buckets as grouped collectives (no copy-out, "
             f"no pack)")
    return ctx.changed(gm)
