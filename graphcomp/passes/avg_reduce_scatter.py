"""avg_reduce_scatter (joint, NCCL): the gradient average inside the reduce-scatter.

A sharded parameter's gradient is summed over the ranks and divided by their number
(``graphcomp.sharding.gather._reduce_full``)::

    reduce_scatter(g, "sum", W, group) -> wait -> div(., W) -> users

The division is a kernel of its own after every reduce-scatter: it reads and writes
every gradient shard once more, one kernel per reduce-scatter on the compute stream
of the backward. This pass asks the collective for the average instead::

    reduce_scatter(g, "avg", W, group) -> wait -> users

NCCL computes ``avg`` of floating-point data by scaling each rank's contribution by
``1/W`` as it reads it (its ``PreMulSum``) and summing in the same order as ``sum``.
For a power-of-two ``W`` the scale is exact, so the result is bitwise the sum
divided by ``W`` (barring subnormal values, where the scaled contributions round):
the pass applies only then. FSDP2 reduce-scatters its fp32 gradients with
``ReduceOp.AVG`` on NCCL the same way.

Applies to graphcomp's own gradient reduce-scatters (not tensor-parallel ones,
``graph_utils.is_foreign_collective``) on an NCCL group, floating dtype, whose one
wait is used only by the division by ``W``. Gloo has no ``avg`` reduce-scatter: on
CPU runs the pass changes nothing and says so. Runs before ``bucket_collectives``,
whose buckets key on the reduce op, so averaged gradients are bucketed together.
"""

from __future__ import annotations

import numbers

import torch
import torch.fx as fx

from graphcomp import _compat
from graphcomp.analysis import graph_utils as gu
from graphcomp.compiler.pipeline import PassContext, PassResult, register_pass

aten = torch.ops.aten

# backends whose reduce-scatter computes "avg" as a pre-scaled sum (NCCL's PreMulSum)
AVG_BACKENDS = ("nccl",)


def _is_division_by(node: fx.Node, src: fx.Node, world: int) -> bool:
    if not gu.is_target(node, aten.div.Tensor, aten.div.Scalar) or node.args[0] is not src or node.kwargs:
        return False
    d = node.args[1]
    return isinstance(d, numbers.Number) and not isinstance(d, bool) and float(d) == float(world)


def _try(gm: fx.GraphModule, rs: fx.Node, backend_of) -> str | None:  # noqa: ANN001
    op, world, group = rs.args[1], rs.args[2], rs.args[3]
    if op != "sum":
        return "not_sum"
    if not isinstance(world, int) or world < 2 or world & (world - 1):
        return "world_not_power_of_two"
    val = gu.tensor_meta(rs.args[0]) if isinstance(rs.args[0], fx.Node) else None
    if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
        return "not_floating"
    backend = backend_of(group)
    if backend not in AVG_BACKENDS:
        return f"backend_{backend or 'unknown'}"
    wait = gu.single_wait(rs)
    if wait is None or len(rs.users) != 1:
        return "no_single_wait"
    users = list(wait.users)
    if len(users) != 1 or not _is_division_by(users[0], wait, world):
        return "no_division_by_world"
    div = users[0]
    rs.args = (rs.args[0], "avg", *rs.args[2:])
    div.replace_all_uses_with(wait)
    gm.graph.erase_node(div)
    return None


@register_pass("avg_reduce_scatter", stages=("joint",), after=("fuse_grad_upcast",), before=("bucket_collectives",))
def avg_reduce_scatter(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    rss = gu.gradient_reduce_scatters(gm)
    if not rss:
        return ctx.unchanged(gm, "no gradient reduce-scatter in the graph")
    done = ctx.rewrite_each(rss, lambda rs: _try(gm, rs, _compat.group_backend))
    if not done:
        return ctx.unchanged(gm, f"none of the {len(rss)} gradient reduce-scatters is a sum over a power-of-two "
                                 f"NCCL group divided by its size (see the skipped:* counts)")
    ctx.counter("reduce_scatters_averaged", done)
    ctx.note(f"{done} of {len(rss)} gradient reduce-scatters average in the collective (NCCL avg; "
             f"their division kernels removed)")
    return ctx.changed(gm)
