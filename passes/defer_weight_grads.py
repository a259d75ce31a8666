"""defer_weight_grads (bwd): compute the last reduce-scatter's inputs first.

The backward's last gradient is usually its largest: a language model's input
embedding (W2: a 1 GB fp32 table gradient) is reduce-scattered after everything
else, so nothing overlaps that collective and the step waits for all of it (2.1 ms
per step on W2, 2 H100s). Its inputs, though, need only the data-gradient chain
(the ``dX`` of every block down to the embedding's output); the weight gradients
of the blocks below it (``dW = dY^T X``) feed only their own reduce-scatters. This
pass moves the compute that the last reduce-scatter does not depend on, and that
sits just before it, to after it::

    ... dX_0  dW_0  RS(bucket 0)  emb_bwd  RS(emb)           (the RS(emb) uncovered)

becomes::

    ... dX_0  emb_bwd  RS(emb)  dW_0  RS(bucket 0)           (dW_0 runs under RS(emb))

so ``schedule_prefetch`` (next) issues the large collective while the deferred
matmuls run, and what is left uncovered at the end is the smaller collective of
the deferred gradients.

How much moves: nodes are taken from the end backwards (every node between the
cut and the last reduce-scatter that is not one of its ancestors; what a moved
node's users need moves with it, so the order stays topological) until the
modelled compute time of what moved reaches the modelled time of the last
reduce-scatter and of the reduce-scatters that move with it (they now run after
it): input bytes times ``(W - 1) / W`` over ``COLLECTIVE_BYTES_PER_S``; matmuls at
``MATMUL_FLOPS_PER_S`` (the harness's measured H200 rate), other ops by ``remat``'s
cost model. At 6416b1c (matmuls at remat's 400 TFLOP/s, half the real rate) W2 on 2
H200s deferred about half of what covers the table gradient: exposed communication
3.4 -> 2.9% of the step, 138.3 -> 137.7 ms. The cut never passes a node with side effects
(a mutation, a random op) or a tensor-parallel collective. Under ``memory_budget`` the
new order is kept only if the static memory estimate stays under the budget (the
deferred matmuls keep their inputs a little longer). Moves nodes only; the
decision depends on the graph and the config alone, so every rank issues its
collectives in the same order. No-op in a graph without graphcomp's
reduce-scatters, or when everything before the last one is its ancestor.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphcomp import _compat, memory
from graphcomp import graph_utils as gu
from graphcomp.pipeline import PassContext, PassResult, register_pass

from .remat import recompute_seconds

c10d = torch.ops._c10d_functional

COLLECTIVE_BYTES_PER_S = 250e9  # bus bandwidth of the cost model (W2's table gradient: 1.05 GB in 2.1 ms on 2 GPUs)
MATMUL_FLOPS_PER_S = 790e12  # bf16 matmul rate the benchmark harness measures on an H200 (787 TFLOP/s)


def compute_seconds(node: fx.Node) -> float:
    """Modelled seconds of ``node``: a matmul's flops at the measured bf16 rate (remat's
    cost model uses half that, which is right for choosing what to recompute but
    would cover a collective with half the compute it needs), anything else by
    remat's model (bytes moved, launch)."""
    flops = _compat.node_flops(node)
    if flops:
        return flops / MATMUL_FLOPS_PER_S
    return recompute_seconds(node)[0]


def _last_reduce_scatter(gm: fx.GraphModule) -> fx.Node | None:
    last = None
    for n in gm.graph.nodes:
        if gu.is_target(n, c10d.reduce_scatter_tensor.default) and not gu.is_foreign_collective(n):
            last = n
    return last


def collective_seconds(in_bytes: int, world: int) -> float:
    """Modelled seconds of a reduce-scatter of ``in_bytes`` over ``world`` ranks (ring)."""
    return in_bytes * (world - 1) / world / COLLECTIVE_BYTES_PER_S


def _in_bytes(rs: fx.Node) -> int:
    src = rs.args[0]
    return memory.value_bytes(src) if isinstance(src, fx.Node) else 0


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _pinned(n: fx.Node) -> bool:
    """A node the cut does not pass: side effects, randomness, a foreign collective."""
    if n.op != "call_function":
        return True
    if gu.collective_kind(n) is not None and gu.is_foreign_collective(n):
        return True
    if _compat.is_mutating(n):
        return True
    t = n.target
    if isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags:
        return True
    return n.is_impure() and gu.collective_kind(n) is None and not gu.is_target(n, c10d.wait_tensor.default)


def plan(gm: fx.GraphModule) -> tuple[fx.Node | None, list[fx.Node], float, float, str]:
    """(last reduce-scatter, nodes to move after it in graph order, their modelled
    seconds, the collective's modelled seconds, why nothing moves or "")."""
    rs = _last_reduce_scatter(gm)
    if rs is None:
        return None, [], 0.0, 0.0, "no reduce-scatter of graphcomp's in the graph"
    world = int(rs.args[2])
    target = collective_seconds(_in_bytes(rs), world)
    if target <= 0:
        return rs, [], 0.0, 0.0, f"the last reduce-scatter moves no bytes (world {world}): nothing to cover"
    anc = _ancestors(rs)
    nodes = list(gm.graph.nodes)
    pos = nodes.index(rs)
    moved: list[fx.Node] = []
    seconds = 0.0
    stop = None
    for n in reversed(nodes[:pos]):
        if n in anc or n.op in ("placeholder", "get_attr"):  # inputs stay where they are
            continue
        if _pinned(n):
            stop = n
            break
        moved.append(n)
        if gu.is_target(n, c10d.reduce_scatter_tensor.default):  # it now runs after rs: cover it too
            target += collective_seconds(_in_bytes(n), world)
        elif gu.collective_kind(n) is None and n.target is not c10d.wait_tensor.default:
            seconds += compute_seconds(n)
        if seconds >= target:
            break
    moved.reverse()
    if seconds == 0.0:  # nothing, or only collectives: moving them alone overlaps nothing
        if stop is not None:
            return rs, [], 0.0, target, f"{stop.name} ({gu.op_name(stop)}: side effects) ends the cut before any compute"
        return rs, [], 0.0, target, "every node before the last reduce-scatter is one of its inputs"
    return rs, moved, seconds, target, ""


def _reorder(gm: fx.GraphModule, rs: fx.Node, moved: list[fx.Node]) -> None:
    """Put ``moved`` (in their order) right after ``rs``'s wait: no other collective is
    issued while ``rs`` is waited in place (gloo graphs, which ``schedule_prefetch``
    leaves so); right after ``rs`` instead when a node between the two reads a moved
    one."""
    wait = gu.single_wait(rs)
    anchor = rs
    if wait is not None:
        taken = set(moved)
        between, n = [], rs.next
        while n is not wait and n.op != "output":
            between.append(n)
            n = n.next
        if n is wait and not any(a in taken for b in between for a in b.all_input_nodes):
            anchor = wait
    for n in moved:
        anchor.append(n)
        anchor = n


@register_pass("defer_weight_grads", stages=("bwd",), before=("schedule_prefetch",))
def defer_weight_grads(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    rs, moved, seconds, target, why = plan(gm)
    if why:
        return ctx.unchanged(gm, why)
    original = list(gm.graph.nodes)
    budget = memory.resolve_budget(ctx.config.memory_budget, gm)
    _reorder(gm, rs, moved)
    gm.graph.lint()
    if budget is not None:
        after = memory.estimate(gm)  # one estimate in the common case (under the budget)
        if after.peak_bytes > budget:
            _restore(gm, original)
            before = memory.estimate(gm)
            if after.peak_bytes > before.peak_bytes:
                return ctx.unchanged(gm, f"deferring {len(moved)} nodes would raise the estimated peak to "
                                         f"{after.peak_bytes} bytes, over memory_budget={budget}")
            _reorder(gm, rs, moved)  # over the budget either way, and no higher: keep it
    ctx.count("weight_grad_nodes_deferred", len(moved))
    ctx.counter("weight_grad_nodes_deferred", len(moved))
    ctx.note(f"{len(moved)} nodes ({seconds * 1e3:.2f} ms modelled) after {rs.name} "
             f"({target * 1e3:.2f} ms modelled)")
    return ctx.changed(gm)


def _restore(gm: fx.GraphModule, original: list[fx.Node]) -> None:
    anchor = original[0]
    for n in original[1:]:
        anchor.append(n)
        anchor = n
