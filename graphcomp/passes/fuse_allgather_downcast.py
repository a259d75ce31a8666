"""fuse_allgather_downcast (joint / inference): cast the shard, gather half the bytes.

Matches a parameter gather whose gathered value is only ever cast to a narrower
floating dtype (by autocast, by ``shard(param_dtype=...)`` or by an explicit
``.to()``)::

    shard -> all_gather -> wait -> [slice/view ...] -> convert(bf16) -> users

and rewrites it to::

    shard -> convert(bf16) -> all_gather -> wait -> [slice/view ...] -> users

so the collective moves the narrow dtype and the cast touches 1/world of the
data. It runs on the joint graph, before partitioning, so a gather the
partitioner recomputes in backward (re-gather) is the fused one too, and so does
the bucketing pass that runs after it (it packs the cast into the send buffer).
The backward of the cast (grad -> fp32 before the reduce-scatter) is untouched.

No-op when: the graph has no all-gather (world size 1, unsharded model); or each
gathered value is used in its own dtype (no cast), cast to a wider dtype, cast to
several dtypes, or also used uncast. Each skipped gather is counted by reason.
Tensor-parallel all-gathers (on a group ``shard(mesh=...)`` did not shard over,
``graph_utils.is_foreign_collective``) are never matched: only graphcomp's
parameter gathers are.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphcomp.analysis import graph_utils as gu
from graphcomp.compiler.pipeline import PassContext, PassResult, register_pass

prims = torch.ops.prims


@register_pass("fuse_allgather_downcast", stages=("joint",))
def fuse_allgather_downcast(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    ags = gu.gathers(gm)
    if not ags:
        return ctx.unchanged(gm, "no all_gather_into_tensor in the graph (unsharded model or world size 1)")
    fused = ctx.rewrite_each(ags, lambda ag: _try_fuse(gm, ag, ctx))
    ctx.counter("gathers_fused", fused)
    if fused == 0:
        return ctx.unchanged(gm, f"none of the {len(ags)} gathers is followed only by a downcast")
    return ctx.changed(gm)


def _try_fuse(gm: fx.GraphModule, ag: fx.Node, ctx: PassContext) -> str | None:
    wait = gu.single_wait(ag)
    if wait is None:
        return "no_single_wait"
    chain = gu.view_chain(wait)
    end = chain[-1]
    users = list(end.users)
    if not users:
        return "unused"
    dtypes = {gu.dtype_cast(u) for u in users}
    if None in dtypes:
        return "used_uncast"
    if len(dtypes) != 1:
        return "several_dtypes"
    (dtype,) = dtypes
    src = gu.tensor_meta(ag.args[0])
    src_dtype = src.dtype if isinstance(src, torch.Tensor) else None
    if src_dtype is None:
        return "unknown_dtype"
    if not (dtype.is_floating_point and src_dtype.is_floating_point) or dtype.itemsize >= src_dtype.itemsize:
        return "not_narrower"

    g = gm.graph
    x = ag.args[0]
    with g.inserting_before(ag):
        xc = g.call_function(prims.convert_element_type.default, (x, dtype))
    if isinstance(src, torch.Tensor):
        gu.set_val(xc, gu.with_dtype(src, dtype))
    xc.meta["graphcomp_fused_downcast"] = True
    ag.args = (xc, *ag.args[1:])
    for n in (ag, *chain):
        gu.retype(n, dtype)
    for u in users:
        u.replace_all_uses_with(end)
        g.erase_node(u)
    out = gu.tensor_meta(ag)
    if isinstance(out, torch.Tensor):
        saved = out.numel() * (src_dtype.itemsize - dtype.itemsize)
        ctx.count("bytes_saved", saved)
    ctx.count("gathers_fused")
    ag.meta["graphcomp_fused_downcast"] = str(dtype).replace("torch.", "")
    return None
