"""schedule_free (joint): free gathered parameters after forward, re-gather in backward.

Matches every parameter gather of the joint graph (plain, fused, FP8 or bucketed)::

    shard -> [convert | FP8 cast | pack_cast] -> all_gather -> wait -> [slice/view/cast/
        unpack_gathered/getitem ...] -> first compute users

and tags the whole group (the pure input chain, the collective, its wait and the
pure view/unpack/getitem/cast nodes up to the first compute users) with
``node.meta["recompute"]``, which the min-cut partitioner obeys:

* ``MUST_RECOMPUTE`` (reshard): the forward graph keeps no gathered parameter
  for backward (it saves the shard, a graph input, instead), and the backward
  graph re-gathers it, placed by the partitioner just before its first backward
  use. The re-gather is the same group, so a fused downcast re-gathers the
  narrow dtype and a bucket re-gathers as one bucket.
* ``MUST_SAVE`` (keep): the gathered value is saved for backward (what the
  partitioner does to collectives anyway: ``force_save_collectives``).

Which groups are resharded follows ``Config.reshard_after_forward``: ``True`` all,
``False`` none, ``"except_last"`` all but the group the backward reads first (its
first backward node's; the last block's bucket), ``"auto"`` (the default): start
from all resharded and keep groups in order of re-gather cost per byte held
(one collective of the cost model, ``graphcomp.analysis.cost_model``: latency plus
wire bytes over the bus bandwidth, per byte held; small, latency-bound gathers first;
ties in graph order) while the static memory model
(``graphcomp.analysis.memory``) of the joint graph stays under ``Config.memory_budget``.
The estimate counts what the partitioner recomputes as the graph is tagged (the
user's checkpoint regions, ``remat``'s plan: ``memory.tagged_recompute``) as freed,
not saved: ``remat`` plans before this pass, with every gather re-gathered, so the
activations it saves come first and gathers are kept in the room left (its module
docstring says why). Under the default budget (``"auto"``: 0.9 of a CUDA device's memory) less
``OPTIMIZER_STATE_FACTOR`` times the gathered shards' bytes, room for the
optimizer state that lives outside the graph, and less the gathered bytes other
compiled functions keep (``ctx.env.kept_gather_bytes``: the frames of a step with
graph breaks hold theirs at the same time). The plan is decided at a function's
first compile and reused by its recompiles (``ctx.env.prior_plan`` / ``keep_plan``, per function
and its gathers' sizes: the graphs of a function split at a graph break, or a
recompile with other gathers, decide apart): a rank that recompiles alone for a new input shape
must issue the gathers its peers' graphs issue, and an estimate of its new shapes
could decide otherwise near the budget. At the first compile the ranks keep the
intersection of what each one's estimate keeps (``ctx.env.agree_kept``, through
the store), so ranks whose first inputs differ in shape agree too. Without a budget (the CPU default)
"auto" reshards everything. An infeasible budget (over it even with everything
resharded) logs a warning, is recorded, and reshards everything. A kept gather
costs its gathered bytes from the forward to the backward and saves the
backward's re-gather (its NCCL kernel, which shares the SMs with the backward's
matmuls, and its cast and unpack copies): faster steps for a higher peak
(``benchmarks/results/README.md`` has the measurements). No tag uses
``ac_graph_id``: the partitioner's ``cleanup_recompute_tags`` compares ids only
between tagged nodes that both have one, so untagged ids change nothing (same
code in torch 2.11 and 2.13).

Expanding reads. A gathered parameter read by an op that makes a value many times
its size (``aten.index`` / ``index_select`` / ``embedding`` with the parameter as
the table: transformers' ``batched_mm`` experts build ``gate_up_proj[expert_ids]``,
one copy of an expert's weight per token and top-k slot) is a value the
partitioner would otherwise save for backward (its backward user, a ``bmm``, cannot
fuse it) -- hundreds of MiB per layer held from forward to backward, per-layer
compiled FSDP2 included. When the read's output is at least ``EXPANSION_RATIO``
times the gathered value, the read and its pure views are tagged
``MUST_RECOMPUTE``: the backward gathers again from the (re-gathered or kept)
parameter, the forward saves the small index tensor instead. Cost: one more gather
kernel per read in backward, and a re-gather of that parameter if nothing else in
backward needed it (the ratio keeps that cheaper than the bytes saved: an embedding
table is never that small next to its output). Counted as ``expanding_reads``.

Tensor-parallel all-gathers (activations, on a group ``shard(mesh=...)`` did not
shard over: ``graph_utils.is_foreign_collective``) are not parameter gathers: never
tagged, so the partitioner treats them as any other collective.

No-op when the graph has no all-gather, or (inference) no backward.
"""

from __future__ import annotations

import hashlib
import logging
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from graphcomp import _compat
from graphcomp.analysis import cost_model, memory
from graphcomp.analysis.cost_model import DeviceCosts
from graphcomp.analysis import graph_utils as gu
from graphcomp.ops.collectives import OPS
from graphcomp.compiler.pipeline import PassContext, PassResult, register_pass

log = logging.getLogger(__name__)
aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional

EXPANSION_RATIO = 8  # an expanding read's output / the gathered value's bytes, at least
EXPANDING_OPS = {aten.index.Tensor, aten.index_select.default, aten.embedding.default}
OPTIMIZER_STATE_FACTOR = 2  # "auto" under the default budget: room for Adam's moments, x the shards' bytes

# pure ops allowed in a gather's input chain (between the shard and the collective)
PRE_OPS = {prims.convert_element_type.default, aten._to_copy.default, aten.clone.default,
           aten.contiguous.default, OPS["pack_cast"]} | gu.VIEW_OPS


@dataclass
class GatherGroup:
    """One parameter (or bucket) gather: the nodes schedule_free tags."""

    coll: fx.Node
    wait: fx.Node | None
    pre: list[fx.Node] = field(default_factory=list)
    post: list[fx.Node] = field(default_factory=list)  # wait's pure descendants, graph order
    wire_bytes: int = 0
    held_bytes: int = 0

    @property
    def nodes(self) -> list[fx.Node]:
        return [*self.pre, self.coll, *self.values]

    @property
    def values(self) -> list[fx.Node]:
        """The gathered value as the graph reads it: the wait and its pure views/casts."""
        return [*([self.wait] if self.wait is not None else []), *self.post]

    def roots(self) -> set[fx.Node]:
        """Storages the gathered parameter occupies (collective output, unpack/cast outputs)."""
        return {memory.storage_root(n) for n in [self.coll, *self.post]}


def is_post_op(node: fx.Node) -> bool:
    """Ops that only reinterpret, unpack or cast a gathered value (no compute worth a name)."""
    if node.op != "call_function":
        return False
    return (
        memory.is_alias(node)
        or node.target is operator.getitem
        or node.target is OPS["unpack_gathered"]
        or gu.dtype_cast(node) is not None
        or bool(node.meta.get(gu.GATHER_POST))
    )


def is_pre_op(node: fx.Node, ops: set = PRE_OPS) -> bool:
    """A pure op that may sit in a gather's input chain: one of ``ops``, or an op a pass
    marked so (``graph_utils.GATHER_PRE``: an FP8 cast of the shard)."""
    return node.op == "call_function" and (node.target in ops or bool(node.meta.get(gu.GATHER_PRE)))


def _pre_chain(coll: fx.Node) -> list[fx.Node]:
    out: list[fx.Node] = []
    stack = [a for a in coll.all_input_nodes]
    seen: set[fx.Node] = set()
    while stack:
        a = stack.pop()
        if a in seen or not is_pre_op(a):
            continue
        seen.add(a)
        out.append(a)
        stack.extend(a.all_input_nodes)
    return out


def _post_chain(wait: fx.Node) -> list[fx.Node]:
    out: list[fx.Node] = []
    stack = list(wait.users)
    seen: set[fx.Node] = set()
    while stack:
        u = stack.pop()
        if u in seen or not is_post_op(u):
            continue
        if any(a is not wait and a not in seen for a in u.all_input_nodes):
            continue  # mixes in another value: compute, stop here
        seen.add(u)
        out.append(u)
        stack.extend(u.users)
    return out


def expanding_reads(g: GatherGroup, bwd: set[fx.Node]) -> list[fx.Node]:
    """Forward reads of the gathered value of ``g`` that make a value at least
    ``EXPANSION_RATIO`` times its size (the parameter as the table of an index,
    index_select or embedding), each followed by its pure view descendants."""
    out: list[fx.Node] = []
    for t in g.values:
        tb = memory.value_bytes(t)
        for u in t.users:
            if (u in bwd or u.op != "call_function" or u.target not in EXPANDING_OPS or not u.args
                    or u.args[0] is not t or memory.value_bytes(u) < EXPANSION_RATIO * max(tb, 1)):
                continue
            out.append(u)
            stack = list(u.users)
            while stack:
                v = stack.pop()
                if v in bwd or v in out or not memory.is_alias(v):
                    continue
                out.append(v)
                stack.extend(v.users)
    return out


def gather_groups(gm: fx.GraphModule, bwd: set[fx.Node] | None = None) -> list[GatherGroup]:
    """Every all-gather of the graph's forward part with its pure chains, in graph order."""
    idx = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups = []
    for n in gm.graph.nodes:
        if not gu.is_target(n, c10d.all_gather_into_tensor.default) or (bwd and n in bwd):
            continue
        if gu.is_foreign_collective(n):
            continue
        wait = gu.single_wait(n)
        g = GatherGroup(coll=n, wait=wait)
        g.pre = sorted(_pre_chain(n), key=idx.__getitem__)
        if wait is not None:
            g.post = sorted(_post_chain(wait), key=idx.__getitem__)
        g.wire_bytes = memory.value_bytes(n)
        g.held_bytes = sum(memory.value_bytes(r) for r in g.roots())
        groups.append(g)
    return groups


def first_backward_reads(gm: fx.GraphModule, groups: list[GatherGroup], bwd: set[fx.Node]) -> set[int]:
    """``reshard_after_forward="except_last"``: indices of the groups whose gathered
    value the backward reads first (every group read by that first backward node:
    usually the last block's bucket). Groups the backward never reads (an LM head
    whose gradient the chunked loss made in the forward) are not candidates."""
    idx = {n: i for i, n in enumerate(gm.graph.nodes)}
    first: dict[int, int] = {}
    for i, g in enumerate(groups):
        uses = [idx[u] for v in g.values for u in v.users if u in bwd]
        if uses:
            first[i] = min(uses)
    if not first:
        return set()
    earliest = min(first.values())
    return {i for i, f in first.items() if f == earliest}


def shard_inputs(groups: list[GatherGroup]) -> set[fx.Node]:
    """The graph inputs the groups gather from (the parameter shards)."""
    out: set[fx.Node] = set()
    for g in groups:
        for n in [*g.pre, g.coll]:
            out.update(a for a in n.all_input_nodes if a.op == "placeholder")
    return out


def optimizer_reserve(groups: list[GatherGroup]) -> int:
    """Bytes ``reshard_after_forward="auto"`` leaves free under the default budget for
    optimizer state, which lives outside the compiled graphs (and is not yet allocated
    when the first step compiles): ``OPTIMIZER_STATE_FACTOR`` times the gathered
    parameters' shards (Adam's two moments, in the shards' dtype)."""
    return OPTIMIZER_STATE_FACTOR * sum(memory.value_bytes(n) for n in shard_inputs(groups))


def resharded_roots(groups: list[GatherGroup], kept) -> set[fx.Node]:
    """The storages a plan frees after the forward: every group's but the kept ones'."""
    return set().union(set(), *(g.roots() for i, g in enumerate(groups) if i not in kept))


def decided_nodes(groups: list[GatherGroup], bwd: set[fx.Node]) -> set[fx.Node]:
    """The nodes this pass tags: every group's and the expanding reads of them.
    ``remat`` (which plans before this pass) leaves them to it."""
    return {n for g in groups for n in [*g.nodes, *expanding_reads(g, bwd)]}


def forced_kept(mode: bool | str, gm: fx.GraphModule, groups: list[GatherGroup], bwd: set[fx.Node]) -> set[int]:
    """The groups ``reshard_after_forward=mode`` keeps whatever the budget: none
    for ``True`` and ``"auto"`` (which keeps more only in the room ``remat`` leaves),
    all for ``False``, the first the backward reads for ``"except_last"``."""
    if mode == "except_last":
        return first_backward_reads(gm, groups, bwd)
    if mode is False:
        return set(range(len(groups)))
    return set()


def plan_key(ctx: PassContext, groups: list[GatherGroup]) -> tuple:
    """The key of one graph's keep plan: its function (Dynamo code id) and a digest
    of its gathers' sizes (a graph break splits one function into several graphs,
    told apart by their gathers)."""
    sig = tuple((g.wire_bytes, g.held_bytes) for g in groups)
    digest = hashlib.sha1(repr(sig).encode()).hexdigest()[:16]
    return (ctx.frame.code_id if ctx.frame.code_id is not None else f"frame {ctx.frame_id}", digest)


def reserved_bytes(ctx: PassContext, groups: list[GatherGroup]) -> tuple[int, int]:
    """(optimizer reserve, gathered bytes other compiled functions keep): what the
    default budget (``memory_budget="auto"``) leaves free for memory no joint graph
    estimate sees; (0, 0) under an explicit budget. ``remat`` and this pass plan
    under the same room."""
    if ctx.config.memory_budget != "auto":
        return 0, 0
    key = plan_key(ctx, groups)
    return optimizer_reserve(groups), sum(b for k, b in ctx.env.kept_gather_bytes.items() if k != key)


def regather_cost_per_byte(g: GatherGroup, costs: DeviceCosts = cost_model.REFERENCE) -> float:
    """Seconds of re-gathering ``g`` in the backward (one collective of the cost model)
    per byte its keeping would hold."""
    return costs.collective_seconds(g.wire_bytes) / max(g.held_bytes, 1)


def choose_kept(gm: fx.GraphModule, groups: list[GatherGroup], budget: int, ctx: PassContext | None = None,
                recompute: list[fx.Node] | tuple = ()) -> tuple[set[int], memory.MemoryEstimate, str | None]:
    """``reshard_after_forward="auto"``: indices of groups to keep, the estimate
    of the chosen plan, and the reason when the budget is infeasible.

    Groups are taken in order of re-gather cost per byte (ties in graph order) and
    each kept when the estimate with it stays under the budget. One estimate is a
    pass over the graph, and a deep model's graph has hundreds of gathers (one
    estimate per gather would take tens of seconds), so: if keeping them
    all fits, that is one estimate; else the longest prefix of the order that fits
    is found by bisection (the estimate only grows as groups are kept, so the
    one-by-one greedy keeps exactly that prefix and rejects the next group); then
    each remaining group is tried, except one read in the backward, at least as
    large as such a group that did not fit, and alive only if kept (between its last
    forward and first backward read) at the position where that group's estimate
    peaked: there it adds at least the bytes that did not fit, on top of at least
    the same memory, so it would not fit either (a gather the backward never reads
    costs nothing kept and is always tried). Skipping every larger group, wherever
    its window lies, would keep less than the greedy where a larger group's window
    misses that peak.
    ``recompute``: the nodes the partitioner recomputes as tagged (the user's
    checkpointing, ``remat``'s plan), for every estimate."""
    bwd = memory.backward_nodes(gm)
    roots = [g.roots() for g in groups]
    everything = set().union(*roots) if roots else set()

    def estimate(reshard: set[fx.Node]) -> memory.MemoryEstimate:
        return memory.estimate(gm, reshard, bwd, recompute=recompute)

    est = estimate(everything)
    if est.peak_bytes > budget:
        reason = (f"memory_budget={budget} bytes is infeasible: the estimated peak with every gathered "
                  f"parameter resharded is {est.peak_bytes} bytes (at {est.peak_node}); resharding everything")
        return set(), est, reason
    costs = ctx.env.costs.with_wire(ctx.config.collective_bytes_per_s) if ctx is not None else cost_model.REFERENCE
    order = sorted(range(len(groups)), key=lambda i: (-regather_cost_per_byte(groups[i], costs), i))

    def resharded(kept_idx) -> set[fx.Node]:
        return everything - set().union(set(), *(roots[i] for i in kept_idx))

    n_est = 1
    e = estimate(resharded(order))
    n_est += 1
    if e.peak_bytes <= budget:
        if ctx is not None:
            ctx.count("estimates", n_est)
        return set(order), e, None
    lo, hi = 0, len(order) - 1  # the longest fitting prefix has lo..hi groups (all of them: no)
    best = est
    while lo < hi:
        mid = (lo + hi + 1) // 2
        e = estimate(resharded(order[:mid]))
        n_est += 1
        if e.peak_bytes <= budget:
            lo, best = mid, e
        else:
            hi = mid - 1
    kept = set(order[:lo])
    est = best if lo else est
    read_in_bwd = [any(u in bwd for v in g.values for u in v.users) for g in groups]
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    windows = [_kept_only_window(g, pos, bwd) for g in groups]
    reshard = resharded(kept)
    # (held bytes, peak position) of each group read in the backward that did not fit: a
    # group at least as large whose kept-only window holds that position cannot fit either
    failed: list[tuple[int, int]] = []
    if read_in_bwd[order[lo]]:
        e = estimate(reshard - roots[order[lo]])  # (the bisection's first prefix that did not fit)
        n_est += 1
        failed.append((groups[order[lo]].held_bytes, e.peak_index))
    for i in order[lo + 1:]:
        w = windows[i]
        if read_in_bwd[i] and w is not None and any(
                groups[i].held_bytes >= held and w[0] < at < w[1] for held, at in failed):
            continue
        trial = reshard - roots[i]
        e = estimate(trial)
        n_est += 1
        if e.peak_bytes <= budget:
            kept.add(i)
            reshard, est = trial, e
        elif read_in_bwd[i]:
            failed.append((groups[i].held_bytes, e.peak_index))
    if ctx is not None:
        ctx.count("estimates", n_est)
    return kept, est, None


def _kept_only_window(g: GatherGroup, pos: dict[fx.Node, int], bwd: set[fx.Node]) -> tuple[int, int] | None:
    """Graph positions strictly between the gathered value's last forward read and its
    first backward read: where the value is alive only if it is kept (resharded, it is
    gathered again for the backward); None if the backward does not read it."""
    vals = set(g.values)
    users = [u for v in g.values for u in v.users if u not in vals and u in pos]
    bw = [pos[u] for u in users if u in bwd]
    if not bw:
        return None
    fw = [pos[u] for u in users if u not in bwd]
    return (max(fw) if fw else pos[g.coll]), min(bw)


@register_pass("schedule_free", stages=("joint",), after=("fuse_allgather_downcast", "bucket_collectives", "remat"))
def schedule_free(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    if ctx.stage != "joint" or not _compat.is_joint_graph(gm):
        return ctx.unchanged(gm, "no backward in this graph (inference): nothing to free for")
    bwd = memory.backward_nodes(gm)
    groups = gather_groups(gm, bwd)
    if not groups:
        return ctx.unchanged(gm, "no all_gather_into_tensor in the joint graph (unsharded model or world size 1)")
    Policy = _compat.checkpoint_policy()
    mode = ctx.config.reshard_after_forward
    reason = None
    # what the partitioner recomputes as tagged (user checkpointing, remat's plan): the
    # estimates below count those activations as freed, not saved
    recompute = memory.tagged_recompute(gm, exclude=decided_nodes(groups, bwd))

    def estimate(kept: set[int]) -> memory.MemoryEstimate:
        return memory.estimate(gm, resharded_roots(groups, kept), bwd, recompute=recompute)

    if mode == "auto":
        budget = memory.resolve_budget(ctx.config.memory_budget, gm)
        if budget is None:
            kept = set()
            ctx.note("reshard_after_forward='auto' without a memory budget (the CPU default): nothing is known of "
                     "the memory left, so every gathered parameter is resharded")
            est = estimate(kept)
        else:
            default_budget = ctx.config.memory_budget == "auto"
            key = plan_key(ctx, groups)  # one plan per graph of a function
            prior = ctx.env.prior_plan("keep", key)
            if prior is not None:
                # a recompile (a new input shape, perhaps on this rank alone): the
                # function's first plan, so that every rank's graphs of it issue the
                # same gathers whatever shapes each rank compiled for
                kept = set(prior)
                est = estimate(kept)
                ctx.count("keep_plan_reused")
                ctx.note(f"reshard_after_forward='auto': the plan of this function's first compile reused "
                         f"({len(kept)} of {len(groups)} gathers kept), so ranks that recompile for different "
                         f"shapes issue the same collectives; estimated peak {est.peak_bytes} bytes"
                         + (f", over the budget of {budget}" if est.peak_bytes > budget else ""))
            else:
                reserve, others = reserved_bytes(ctx, groups)  # room for what the default budget cannot see
                kept, est, reason = choose_kept(gm, groups, budget - reserve - others, ctx, recompute)
                if reason is not None and (reserve or others) and est.peak_bytes <= budget:
                    # the graph fits the budget; only the room left for the optimizer
                    # and the other frames is short: nothing to keep, nothing to warn of
                    reason = None
                    ctx.note(f"reshard_after_forward='auto': no room to keep gathers (estimated peak "
                             f"{est.peak_bytes} bytes with every gather resharded, budget {budget} less "
                             f"{reserve + others} bytes reserved); every gather resharded")
                if ctx.frame.code_id is not None:  # (a Dynamo frame: its peers compile it too)
                    agreed = ctx.env.agree_kept(gu.collective_group(groups[0].coll), str(key[0]), key[1],
                                                sorted(kept), len(groups), ctx.config)
                    if len(agreed) != len(kept):
                        ctx.note(f"reshard_after_forward='auto': {len(kept)} gathers fit this rank's estimate, "
                                 f"{len(agreed)} every rank's: keeping those (the ranks' first inputs differ)")
                        ctx.count("keep_agreed_fewer", len(kept) - len(agreed))
                        kept = set(agreed)
                        est = estimate(kept)
                ctx.env.keep_plan("keep", key, frozenset(kept))
                if default_budget:
                    ctx.count("optimizer_reserve_bytes", reserve)
                    ctx.count("other_frames_kept_bytes", others)
                    ctx.note(f"reshard_after_forward='auto': {len(kept)} of {len(groups)} gathered parameters kept "
                             f"for the backward under memory_budget='auto' ({budget} bytes) less {reserve} bytes "
                             f"left for optimizer state ({OPTIMIZER_STATE_FACTOR}x the parameter shards) and "
                             f"{others} bytes other compiled functions keep")
            ctx.count("budget_bytes", budget)
            if default_budget:
                ctx.env.kept_gather_bytes[key] = sum(groups[i].held_bytes for i in kept)
        if reason is not None:
            log.warning("graphcomp schedule_free (frame %s): %s", ctx.frame_id, reason)
            ctx.note(reason)
            ctx.count("budget_infeasible")
            ctx.counter("memory_budget_infeasible", 1)
    else:
        if mode == "except_last":
            kept = first_backward_reads(gm, groups, bwd)
            ctx.note(f"reshard_after_forward='except_last': kept {', '.join(groups[i].coll.name for i in sorted(kept))}"
                     " (the backward reads it first)" if kept else
                     "reshard_after_forward='except_last': the backward reads no gathered parameter")
        else:
            kept = set() if mode else set(range(len(groups)))
        est = estimate(kept)
    n_tagged = 0
    for i, g in enumerate(groups):
        policy = Policy.MUST_SAVE if i in kept else Policy.MUST_RECOMPUTE
        for n in g.nodes:
            n.meta["recompute"] = policy
            n_tagged += 1
        g.coll.meta["graphcomp_reshard"] = i not in kept
    reads = [r for g in groups for r in expanding_reads(g, bwd)]
    for r in reads:
        r.meta["recompute"] = Policy.MUST_RECOMPUTE
    heads = [r for r in reads if r.target in EXPANDING_OPS]
    if heads:
        ctx.count("expanding_reads", len(heads))
        ctx.count("expanding_read_bytes", sum(memory.value_bytes(r) for r in heads))
        ctx.note(f"{len(heads)} expanding read(s) of gathered parameters recomputed in backward, not saved "
                 f"({', '.join(r.name for r in heads[:4])}{', ...' if len(heads) > 4 else ''})")
    n_resh = len(groups) - len(kept)
    ctx.count("gathers_resharded", n_resh)
    ctx.count("gathers_kept", len(kept))
    ctx.count("bytes_resharded", sum(g.held_bytes for i, g in enumerate(groups) if i not in kept))
    ctx.count("nodes_tagged", n_tagged)
    ctx.count("estimated_peak_bytes", est.peak_bytes)
    ctx.note(f"estimated joint peak {est.peak_bytes} bytes at {est.peak_node}")
    ctx.counter("gathers_resharded", n_resh)
    # the code is unchanged; the partitioner's plan (node.meta['recompute']) is what changed
    return ctx.changed(gm, f"tagged for the partitioner: {n_resh} gathers resharded, {len(kept)} kept")
