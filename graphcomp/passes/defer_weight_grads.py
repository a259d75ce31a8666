"""defer_weight_grads (bwd): compute the last reduce-scatter's inputs first.

The backward's last gradient is usually its largest: a language model's input
embedding (a table-sized fp32 gradient) is reduce-scattered after everything else,
so nothing overlaps that collective and the step waits for all of it. Its inputs,
though, need only the data-gradient chain (the ``dX`` of every block down to the
embedding's output); the weight gradients of the blocks below it (``dW = dY^T X``)
feed only their own reduce-scatters. This pass moves the compute that the last
reduce-scatter does not depend on, and that sits just before it, to after it::

    ... dX_0  dW_0  RS(bucket 0)  emb_bwd  RS(emb)           (the RS(emb) uncovered)

becomes::

    ... dX_0  emb_bwd  RS(emb)  dW_0  RS(bucket 0)           (dW_0 runs under RS(emb))

so ``schedule_prefetch`` (next) issues the large collective while the deferred
matmuls run, and what is left uncovered at the end is the smaller collective of
the deferred gradients.

How much moves: nodes are taken from the end backwards (every node between the
cut and the last reduce-scatter that is not one of its ancestors; what a moved
node's users need moves with it, so the order stays topological) until the modelled
compute time of what moved reaches the modelled time of the last reduce-scatter and
of the reduce-scatters that move with it (they now run after it): input bytes times
``(W - 1) / W`` over the bus bandwidth; matmuls at the matmul rate, other ops one
kernel each (launch, bytes moved): ``graphcomp.analysis.cost_model``, the row of the
compile's device. The cut is made in
whole units, each ending at one reduce-scatter (the cut ends right after the
``k + 1``-th reduce-scatter before the last one, so ``k`` of them move); never past a
node with side effects (a mutation, a random op) or a tensor-parallel collective. ``k``
is the one decision that depends on shapes (through the compute model): a function's
first compile agrees on the smallest ``k`` of all ranks (``ctx.env.agree_kept``,
in the store, as ``schedule_free``'s keep plan) and its recompiles reuse it
(``ctx.env.prior_plan`` / ``keep_plan``), so ranks whose inputs differ in shape, and a rank
recompiling alone, issue their reduce-scatters in the same order. Modelling matmuls
slower than they run (``remat``'s conservative rate) would defer too little, each
seeming to cover more than it does; on a GPU slower than the model the pass defers
more than the collective needs (a little more memory). Under ``memory_budget`` a
rank's own ``k`` drops to 0 before the agreement when its order would raise the
static memory estimate over the budget (the deferred matmuls keep their inputs a
little longer). Moves nodes only; a wait whose collective stays is not moved. No-op
in a graph without graphcomp's reduce-scatters, or when everything before the last
one is its ancestor.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from graphcomp import _compat
from graphcomp.analysis import memory
from graphcomp.analysis import graph_utils as gu
from graphcomp.compiler.pipeline import PassContext, PassResult, register_pass

from graphcomp.analysis import cost_model
from graphcomp.analysis.cost_model import DeviceCosts
from graphcomp.passes.remat import recompute_seconds

c10d = torch.ops._c10d_functional

def compute_seconds(node: fx.Node, costs: DeviceCosts = cost_model.REFERENCE) -> float:
    """Modelled seconds of ``node``: a matmul's flops at the cost model's matmul rate,
    anything else one kernel (launch, bytes moved)."""
    flops = _compat.node_flops(node)
    if flops:
        return costs.matmul_seconds(flops)
    return recompute_seconds(node, costs)[0]


_is_rs = gu.is_gradient_reduce_scatter


def _last_reduce_scatter(gm: fx.GraphModule) -> fx.Node | None:
    return next((n for n in reversed(gm.graph.nodes) if _is_rs(n)), None)


def collective_seconds(in_bytes: int, world: int, costs: DeviceCosts = cost_model.REFERENCE) -> float:
    """Modelled seconds of a reduce-scatter of ``in_bytes`` over ``world`` ranks (ring)
    at the cost model's bus bandwidth (``Config.collective_bytes_per_s`` overrides it)."""
    return costs.ring_seconds(in_bytes, world)


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


@dataclass
class DeferPlan:
    """What :func:`plan` found: the last reduce-scatter, the nodes to move after it
    (graph order), their modelled seconds, the modelled seconds of the collectives they
    must cover, ``k`` (how many reduce-scatters move with them: the cut ends right after
    the ``k + 1``-th before it, at a node with side effects, or at the top), the number
    of reduce-scatters before it, and why nothing moves ("" when something does)."""

    rs: fx.Node | None
    moved: list[fx.Node] = field(default_factory=list)
    seconds: float = 0.0
    target: float = 0.0
    k: int = 0
    n_rs: int = 0
    why: str = ""
    structural: bool = False  # nothing to plan whatever the shapes (no agreement needed)


def plan(gm: fx.GraphModule, k: int | None = None, costs: DeviceCosts = cost_model.REFERENCE) -> DeferPlan:
    """The cut, in whole units of one reduce-scatter each: with ``k`` given (a plan
    agreed or reused), exactly ``k`` of them move; else the fewest whose compute covers
    the moved collectives by the cost model. Only ``k`` depends on shapes (through the
    compute model), so ranks and recompiles that share ``k`` cut alike."""
    rs = _last_reduce_scatter(gm)
    if rs is None:
        return DeferPlan(None, why="no reduce-scatter of graphcomp's in the graph", structural=True)
    world = int(rs.args[2])
    in_bytes = _in_bytes(rs)
    nodes = list(gm.graph.nodes)
    pos = nodes.index(rs)
    n_rs = sum(1 for n in nodes[:pos] if _is_rs(n))
    if in_bytes <= 0:
        return DeferPlan(rs, n_rs=n_rs, why="the last reduce-scatter's size is unknown (symbolic shapes): nothing is "
                                            "modelled", structural=True)
    target = collective_seconds(in_bytes, world, costs)
    if target <= 0:
        return DeferPlan(rs, n_rs=n_rs, why=f"the last reduce-scatter moves no bytes (world {world}): nothing to "
                                            "cover", structural=True)
    anc = _ancestors(rs)
    moved: list[fx.Node] = []
    seconds, passed, stop = 0.0, 0, None
    for n in reversed(nodes[:pos]):
        if n in anc or n.op in ("placeholder", "get_attr"):  # inputs stay where they are
            continue
        if _pinned(n):
            stop = n
            break
        if _is_rs(n):  # a unit boundary: the cut may end just after it
            if (passed == k) if k is not None else (seconds > 0 and seconds >= target):
                break
            passed += 1
            target += collective_seconds(_in_bytes(n), world, costs)  # it now runs after rs: cover it too
        elif gu.collective_kind(n) is None and n.target is not c10d.wait_tensor.default:
            seconds += compute_seconds(n, costs)
        moved.append(n)
    moved.reverse()
    # a wait whose collective stays where it is stays too: a collective is never left in
    # flight across the last one (gloo groups run one collective at a time)
    kept = set(moved)
    moved = [n for n in moved if not (gu.is_target(n, c10d.wait_tensor.default) and n.args[0] not in kept)]
    if passed == 0 or seconds == 0.0:  # no reduce-scatter moves, or no compute: nothing overlaps
        if stop is not None:
            why = f"{stop.name} ({gu.op_name(stop)}: side effects) ends the cut before any compute"
        elif k == 0:
            why = "the agreed plan moves nothing (k = 0)"
        elif passed == 0 and seconds > 0:
            why = "the compute after the reduce-scatter before it covers it already (modelled)"
        else:
            why = "every node before the last reduce-scatter is one of its inputs"
        return DeferPlan(rs, n_rs=n_rs, target=target, why=why)
    return DeferPlan(rs, moved, seconds, target, passed, n_rs)


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


def _plan_key(ctx: PassContext, gm: fx.GraphModule) -> tuple:
    """One plan per graph of a function: its Dynamo code id and a digest of its
    reduce-scatters' sizes (parameter sizes: equal on every rank and recompile)."""
    sig = tuple(_in_bytes(n) for n in gm.graph.nodes if _is_rs(n))
    digest = hashlib.sha1(repr(sig).encode()).hexdigest()[:16]
    return (ctx.frame.code_id if ctx.frame.code_id is not None else f"frame {ctx.frame_id}", digest)


def _agreed_k(ctx: PassContext, gm: fx.GraphModule, p: DeferPlan) -> tuple[int, str]:
    """The ``k`` this graph must use, and a note ("" when it is this rank's own). A function's first
    compile agrees with its peers (the smallest ``k`` of all ranks: ranks whose first
    inputs differ in shape model different compute) and records it; its recompiles
    reuse it, so a rank recompiling alone for a new shape issues its reduce-scatters
    in the same order as its peers."""
    if ctx.frame.code_id is None:  # not a Dynamo frame (a hand-built graph): nothing to share
        return p.k, ""
    key = _plan_key(ctx, gm)
    prior = ctx.env.prior_plan("defer", key)
    if prior is not None:
        return prior, f"the plan of this function's first compile reused (k = {prior})"
    agreed = ctx.env.agree_kept(gu.collective_group(p.rs), str(key[0]), key[1], list(range(p.k)), p.n_rs,
                                ctx.config, plan="its defer_weight_grads plan", counted="reduce-scatters",
                                namespace="defer", about=f"moves {p.k} of its {p.n_rs} reduce-scatters "
                                                         "after the last one.")
    k = len(agreed)
    ctx.env.keep_plan("defer", key, k)
    return k, ("" if k == p.k else f"this rank's model moves {p.k} reduce-scatters, every rank's {k}: "
                                   f"moving {k} (the ranks' first inputs differ)")


def _fits(gm: fx.GraphModule, p: DeferPlan, budget: int) -> tuple[bool, int]:
    """Whether ``p``'s order keeps the estimate under ``budget`` (or no higher than the
    original order's), and the estimate; the graph is left as it was."""
    original = list(gm.graph.nodes)
    _reorder(gm, p.rs, p.moved)
    after = memory.estimate(gm).peak_bytes
    _restore(gm, original)
    if after <= budget:
        return True, after
    return after <= memory.estimate(gm).peak_bytes, after


@register_pass("defer_weight_grads", stages=("bwd",), before=("schedule_prefetch",))
def defer_weight_grads(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    costs = ctx.env.costs.with_wire(ctx.config.collective_bytes_per_s)
    p = plan(gm, costs=costs)
    if p.structural:
        return ctx.unchanged(gm, p.why)
    budget = memory.resolve_budget(ctx.config.memory_budget, gm)
    if budget is not None and p.k > 0 and not p.why:
        ok, peak = _fits(gm, p, budget)
        if not ok:  # this rank's own plan: move nothing (the agreement takes the smallest)
            ctx.note(f"moving {p.k} reduce-scatters would raise the estimated peak to {peak} bytes, over "
                     f"memory_budget={budget}: this rank plans none")
            p = DeferPlan(p.rs, n_rs=p.n_rs, why=f"deferring would raise the estimated peak to {peak} bytes, over "
                                                 f"memory_budget={budget}")
    k, note = _agreed_k(ctx, gm, p)  # k depends on shapes: every rank and recompile uses one
    if note:
        ctx.note(note)
    if k != p.k:
        p = plan(gm, k, costs=costs)
    if p.why:
        return ctx.unchanged(gm, p.why)
    _reorder(gm, p.rs, p.moved)
    gm.graph.lint()
    ctx.count("weight_grad_nodes_deferred", len(p.moved))
    ctx.count("reduce_scatters_deferred", p.k)
    ctx.counter("weight_grad_nodes_deferred", len(p.moved))
    ctx.note(f"{len(p.moved)} nodes with {p.k} reduce-scatters ({p.seconds * 1e3:.2f} ms modelled) after "
             f"{p.rs.name} ({p.target * 1e3:.2f} ms modelled)")
    return ctx.changed(gm)


def _restore(gm: fx.GraphModule, original: list[fx.Node]) -> None:
    """Put ``original`` (a topological order of the same nodes) back."""
    gu.priority_topo_sort(gm, {n: i for i, n in enumerate(original)})
