"""schedule_prefetch (fwd / bwd): issue gathers early, wait late; reduce-scatters ASAP.

Moves nodes only; never changes what is computed. The graph is split into the
compute sequence ``B`` (every node that is not part of a collective group, in
its original order) and the collective groups:

* gather group: the pure input chain (convert / pack_cast / views of the shard,
  used only by the gather), ``all_gather``, its ``wait`` and the pure
  view/unpack/getitem/cast nodes after it (``schedule_free.is_post_op``)::

      B0  B1  B2  B3 [pack_cast -> all_gather -> wait -> unpack -> view] B4(use)

  becomes, when the byte caps allow the gather to start before B1::

      B0 [pack_cast -> all_gather]  B1  B2  B3 [wait -> unpack -> view] B4(use)

  The wait and the post chain sit just before the first compute use. Gathers
  are issued in their original order; each as early as allowed by (a) its
  inputs, (b) the previous gather's issue point, (c) ``Config.prefetch_bytes``:
  the gathered bytes in flight (issued, not yet waited) never pass it but for one
  gather larger than the cap on its own (then at most that gather plus half the
  cap), and (d)
  ``Config.memory_budget``: the static memory model's live bytes plus the
  prefetched buffer stay under the budget. A single gather larger than the cap
  (an embedding or LM-head table) moves only while the other gathers in flight
  hold at most half the cap: it overlaps the compute before its use, as one
  buffer, and a small gather still in flight (the final norm's weight, issued
  with the last block's) does not hold it at its use; 0 still disables
  prefetching.
* reduce-scatter group: the pure input chain (cast, pad, pack_for_reduce_scatter,
  views), ``reduce_scatter`` and its ``wait``: the collective is issued right
  after its last compute input, behind any gather issued at that point (the
  collectives of one group run in issue order: a reduce-scatter ready at the top of
  a backward, e.g. the LM head's gradient the chunked loss made in the forward,
  would otherwise hold up the gather the first compute waits for); the wait (and what depends on it: the ``/ W``,
  the cast, the split) is placed as late as possible, before the graph output or
  the first node that needs it, with at most ``prefetch_bytes`` of
  reduce-scatter inputs in flight (the oldest is waited just before a new one
  would pass the cap: an input buffer stays allocated until its wait), not
  counting one that is larger than the cap on its own (the LM head's gradient:
  waited as soon as the next small one is ready, it would stall the backward's top
  for most of its length).

Under a budget the schedule is checked against the full memory estimate (the
plan's model leaves out moved reduce-scatters and post chains). If the configured
cap's schedule is over, the pass keeps the largest of the cap's halvings whose
schedule passes, found by bisection (record count ``schedules_tried``), then tries
no prefetch, then no prefetch with reduce-scatters in place, then keeps the
original order.

Tensor-parallel collectives (on a group ``shard(mesh=...)`` did not shard over,
``graph_utils.is_foreign_collective``) are not groups: they stay in ``B``, in their
traced order, with their waits where they were.

The new order is a priority topological sort, so it is always valid, and the
priorities depend only on the graph and the config: every rank issues the same
collectives in the same order. No-op when the graph has no collective.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from graphcomp.analysis import memory
from graphcomp.analysis import graph_utils as gu
from graphcomp.ops.collectives import OPS
from graphcomp.compiler.pipeline import PassContext, PassResult, register_pass

from graphcomp.passes.schedule_free import PRE_OPS, is_post_op, is_pre_op

log = logging.getLogger(__name__)
aten = torch.ops.aten
c10d = torch.ops._c10d_functional

RS_PRE_OPS = PRE_OPS | {aten.constant_pad_nd.default, OPS["pack_for_reduce_scatter"]}


@dataclass
class _Group:
    kind: str  # "ag" | "rs"
    coll: fx.Node
    wait: fx.Node
    pre: list[fx.Node] = field(default_factory=list)
    post: list[fx.Node] = field(default_factory=list)
    nbytes: int = 0
    in_bytes: int = 0  # reduce-scatter: bytes of its input buffer


def _exclusive_pre(coll: fx.Node, ops: set, idx: dict[fx.Node, int], taken: set[fx.Node]) -> list[fx.Node]:
    """Pure ancestors of ``coll`` all of whose users are ``coll`` or already in the chain."""
    chain: set[fx.Node] = set()
    cand: set[fx.Node] = set()
    stack = list(coll.all_input_nodes)
    while stack:
        a = stack.pop()
        if a in cand or not is_pre_op(a, ops) or a in taken:
            continue
        cand.add(a)
        stack.extend(a.all_input_nodes)
    for a in sorted(cand, key=lambda n: -idx[n]):
        if all(u is coll or u in chain for u in a.users):
            chain.add(a)
    return sorted(chain, key=idx.__getitem__)


def _post(wait: fx.Node, idx: dict[fx.Node, int]) -> list[fx.Node]:
    out: set[fx.Node] = set()
    stack = list(wait.users)
    while stack:
        u = stack.pop()
        if u in out or not is_post_op(u):
            continue
        if any(a is not wait and a not in out for a in u.all_input_nodes):
            continue
        out.add(u)
        stack.extend(u.users)
    return sorted(out, key=idx.__getitem__)


def _groups(gm: fx.GraphModule, idx: dict[fx.Node, int]) -> list[_Group]:
    groups: list[_Group] = []
    taken: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if gu.is_target(n, c10d.all_gather_into_tensor.default):
            kind, ops = "ag", PRE_OPS
        elif gu.is_target(n, c10d.reduce_scatter_tensor.default):
            kind, ops = "rs", RS_PRE_OPS
        else:
            continue
        if gu.is_foreign_collective(n):
            continue
        wait = gu.single_wait(n)
        if wait is None:
            continue
        g = _Group(kind, n, wait)
        g.pre = _exclusive_pre(n, ops, idx, taken)
        if kind == "ag":
            g.post = [p for p in _post(wait, idx) if p not in taken]
        g.nbytes = memory.value_bytes(n)
        taken.update(g.pre, g.post, (n, wait))
        groups.append(g)
    return groups


def plan(gm: fx.GraphModule, prefetch_bytes: int, budget: int | None, move_rs: bool = True
         ) -> tuple[dict[fx.Node, tuple], dict]:
    """Priority keys for every node plus statistics (see module docstring)."""
    nodes = list(gm.graph.nodes)
    idx = {n: i for i, n in enumerate(nodes)}
    groups = _groups(gm, idx)
    moved: set[fx.Node] = set()
    for g in groups:
        moved.update(g.pre, g.post, (g.coll, g.wait))
    B = [n for n in nodes if n not in moved and n.op not in ("placeholder", "output")]
    bpos = {n: q for q, n in enumerate(B)}
    # B position before which each original node ran (for "original issue point")
    before_b, q = {}, 0
    for n in nodes:
        before_b[n] = q
        if n in bpos:
            q += 1
    nb = len(B)
    live = memory.timeline(gm) if budget is not None else None
    live_b = [live[idx[b]] for b in B] if live is not None else None
    inflight = [0] * (nb + 1)
    extra = [0] * (nb + 1)  # bytes the prefetch adds to the memory model
    keys: dict[fx.Node, tuple] = {}
    stats = {"gathers": 0, "gathers_moved": 0, "compute_ahead_total": 0, "max_inflight_bytes": 0,
             "limited_by_bytes": 0, "limited_by_budget": 0, "oversized_gathers": 0, "reduce_scatters": 0,
             "rs_hoisted": 0, "rs_waited_early": 0}
    prev_issue = 0
    for gi, g in enumerate(groups):
        if g.kind != "ag":
            continue
        stats["gathers"] += 1
        users = [u for m in (g.coll, g.wait, *g.post) for u in m.users if u in bpos]
        use = min((bpos[u] for u in users), default=nb)
        ready = max((bpos[a] + 1 for m in (*g.pre, g.coll) for a in m.all_input_nodes if a in bpos), default=0)
        lo = max(ready, prev_issue)
        orig = before_b[g.coll]
        p = use
        # a gather larger than the cap on its own (an embedding or LM-head table) moves
        # while the other gathers in flight hold at most half the cap (the final norm's
        # small weight, prefetched with the last block, must not pin the LM head to its
        # use): it overlaps the compute before its use instead of
        # waiting there, and one such buffer is the most prefetch adds
        alone = 0 < prefetch_bytes < g.nbytes
        if alone:
            stats["oversized_gathers"] += 1
        while p > lo:
            q2 = p - 1
            if (inflight[q2] > prefetch_bytes // 2) if alone else (inflight[q2] + g.nbytes > prefetch_bytes):
                stats["limited_by_bytes"] += 1
                break
            if live_b is not None and q2 < orig and live_b[q2] + extra[q2] + g.nbytes > budget:  # type: ignore[operator]
                stats["limited_by_budget"] += 1
                break
            p = q2
        p = min(p, use)
        for q2 in range(p, use):
            inflight[q2] += g.nbytes
            if q2 < orig:
                extra[q2] += g.nbytes
        prev_issue = p
        g.coll.meta["graphcomp_prefetch_ahead"] = use - p
        if use - p > 0:
            stats["gathers_moved"] += 1
            stats["compute_ahead_total"] += use - p
        # at one slot: earlier gathers' waits first, then issues, then the compute node
        for n in (*g.pre, g.coll):
            keys[n] = (p, 1, gi, idx[n])
        for n in (g.wait, *g.post):
            keys[n] = (use, 0, gi, idx[n])
    stats["max_inflight_bytes"] = max(inflight, default=0)
    for q2, b in enumerate(B):
        keys[b] = (q2, 2, 0, idx[b])
    for g in groups:  # collective groups left where they are (rs with move_rs=False)
        for n in (*g.pre, g.coll, g.wait, *g.post):
            keys.setdefault(n, (before_b[n], 1, 0, idx[n]))
    # reduce-scatters: issue right after the last compute input; wait as late as
    # possible, but keep at most prefetch_bytes of their inputs in flight (an
    # input buffer stays allocated until its wait): the oldest pending ones are
    # waited just before a new one would pass the cap
    rs_groups = []
    for gi, g in enumerate(groups):
        if g.kind != "rs" or not move_rs:
            continue
        stats["reduce_scatters"] += 1
        ready = max((bpos[a] for m in (*g.pre, g.coll) for a in m.all_input_nodes if a in bpos), default=-1)
        if ready + 1 < before_b[g.coll]:
            stats["rs_hoisted"] += 1
        g.in_bytes = memory.value_bytes(g.coll.args[0]) if isinstance(g.coll.args[0], fx.Node) else 0
        rs_groups.append((ready, gi, g))
    pending: list[tuple[int, int, _Group]] = []
    pending_bytes = 0

    def over_cap(nbytes: int) -> bool:
        # one pending reduce-scatter larger than the cap on its own (the LM head's or
        # the embedding's gradient) is not counted while the others hold at most the
        # cap: waiting it as soon as the next one is ready would stall the compute for
        # most of its length (the final norm's small gradient is ready right after the
        # LM head's, at the backward's top)
        big = max((og.in_bytes for _, _, og in pending if og.in_bytes > prefetch_bytes), default=0)
        return pending_bytes - big + nbytes > prefetch_bytes

    for ready, gi, g in sorted(rs_groups, key=lambda t: (t[0], t[1])):
        nbytes = g.in_bytes
        while pending and over_cap(nbytes):
            # the oldest counted one first (waiting the uncounted one frees nothing the cap sees)
            k = next((i for i, (_, _, og) in enumerate(pending) if og.in_bytes <= prefetch_bytes), 0)
            _, ogi, og = pending.pop(k)
            pending_bytes -= og.in_bytes
            keys[og.wait] = (ready, 3, ogi, idx[og.wait])
            stats["rs_waited_early"] += 1
        # issued before the compute node after its last input, behind the gathers
        # issued there: collectives of one group run in issue order, and a gather is
        # awaited by the next compute while a reduce-scatter is awaited at the end
        for n in (*g.pre, g.coll):
            keys[n] = (ready + 1, 1, len(groups) + gi, idx[n])
        pending.append((ready, gi, g))
        pending_bytes += nbytes
    for _, gi, g in pending:
        keys[g.wait] = (nb, 0, gi, idx[g.wait])
    for n in nodes:
        if n.op == "placeholder":
            keys[n] = (-1, 0, 0, idx[n])
        elif n.op == "output":
            keys[n] = (nb + 1, 0, 0, idx[n])
    return keys, stats


reorder = gu.priority_topo_sort


# schedule first, then cut pieces (partition_graph keeps the original node order, so
# a piece boundary never splits the order this pass chose)
@register_pass("schedule_prefetch", stages=("fwd", "bwd"), before=("partition_graph",))
def schedule_prefetch(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    if not any(gu.collective_kind(n) in ("all_gather", "reduce_scatter") and not gu.is_foreign_collective(n)
               for n in gm.graph.nodes):
        return ctx.unchanged(gm, "no all_gather / reduce_scatter of graphcomp's in the graph (tensor-parallel "
                                 "ones stay in place)")
    if not ctx.frame.prefetch_cpu_graphs and not gu.has_cuda_tensors(gm):
        # CPU (gloo): two collectives of one group running at once on gloo's worker
        # threads can corrupt memory or hang inside gloo (docs/heap-corruption.md).
        # graphcomp.shard puts CPU parameters on a group with one worker thread
        # (graphcomp.sharding.gloo_groups): there collectives run one at a time, and prefetching
        # is safe. Any other group: collectives stay waited in place, unless
        # FramePlan.prefetch_cpu_graphs=True opts in.
        groups = {gu.collective_group(n) for n in gm.graph.nodes if gu.collective_kind(n) is not None}
        unsafe = sorted(str(g) for g in groups if not ctx.env.is_serial_group(str(g)))
        if unsafe:
            return ctx.unchanged(gm, f"CPU graph (gloo) with collectives on group(s) {', '.join(unsafe)}, which may "
                                     f"run several at once on gloo's worker threads (memory corruption or a hang "
                                     f"inside gloo: docs/heap-corruption.md): collectives stay waited in place")
    budget = memory.resolve_budget(ctx.config.memory_budget, gm)
    original = {n: (i,) for i, n in enumerate(gm.graph.nodes)}
    before = memory.estimate(gm)
    limit = None if budget is None else max(budget, before.peak_bytes)
    tried = 0

    def attempt(cap: int, move_rs: bool) -> tuple[bool, dict[str, int], memory.MemoryEstimate]:
        """Plan with ``cap``, reorder, estimate: kept when the real estimate of the new
        order passes the budget (the plan's model is approximate: moved reduce-scatters
        and post chains are not in it), else the original order is put back."""
        nonlocal tried
        tried += 1
        keys, st = plan(gm, cap, budget, move_rs)
        reorder(gm, keys)
        est = memory.estimate(gm)
        ok = limit is None or est.peak_bytes <= limit
        if not ok:
            reorder(gm, original)
        return ok, st, est

    # the configured cap; over the budget, the largest of its halvings that passes,
    # found by bisection (a smaller cap holds fewer bytes in flight, so passing is
    # taken as monotone in the cap: one plan and one estimate per try, where trying
    # every halving in turn multiplies the pass's time on a deep model; the pick is
    # verified either way),
    # then no prefetch with reduce-scatters moved, then none at all, then the original order
    caps = [ctx.config.prefetch_bytes]
    while caps[-1] // 2 > 0:
        caps.append(caps[-1] // 2)
    chosen = None
    ok, stats, after = attempt(caps[0], True)
    if ok:
        chosen = (caps[0], True)
    elif budget is not None:
        lo, hi = 1, len(caps)  # caps[hi:] unknown-or-passing; find the first index that passes
        best = None
        while lo < hi:
            mid = (lo + hi) // 2
            ok, st, est = attempt(caps[mid], True)
            if ok:
                reorder(gm, original)
                best, hi = mid, mid
            else:
                lo = mid + 1
        for cap, move_rs in ([(caps[best], True)] if best is not None else []) + [(0, True), (0, False)]:
            ok, stats, after = attempt(cap, move_rs)
            if ok:
                chosen = (cap, move_rs)
                break
    ctx.count("schedules_tried", tried)
    if chosen is None:
        after = before
        ctx.note(f"no schedule kept the estimated peak under memory_budget={budget}: original order kept")
        ctx.count("budget_fallback_original_order")
    elif chosen != (caps[0], True):
        ctx.note(f"memory_budget={budget}: prefetch cap lowered to {chosen[0]} bytes"
                 + ("" if chosen[1] else ", reduce-scatters left in place"))
    changed = [n for n in gm.graph.nodes] != list(original)
    if chosen is not None:
        for k, v in stats.items():
            ctx.count(k, v)
    ctx.count("estimated_peak_bytes_before", before.peak_bytes)
    ctx.count("estimated_peak_bytes_after", after.peak_bytes)
    if budget is not None and before.peak_bytes > budget:
        msg = (f"estimated peak {before.peak_bytes} bytes (at {before.peak_node}) is over memory_budget={budget} "
               f"bytes before any prefetch (infeasible here); the schedule was kept from raising it")
        ctx.note(msg)
        log.warning("graphcomp schedule_prefetch (frame %s %s): %s", ctx.frame_id, ctx.stage, msg)
    if not changed:
        return ctx.unchanged(gm, "every collective already sits at its scheduled place (caps reached or nothing "
                                 "to overlap)")
    return ctx.changed(gm)
