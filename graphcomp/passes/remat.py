"""remat (joint): memory-budgeted rematerialization of saved activations.

Decides, per activation the backward reads (a forward value with a backward user),
whether the forward saves it or the backward recomputes it, so that the estimated
peak of the joint graph stays under ``Config.memory_budget`` and the time spent
recomputing is smallest. It rewrites no code: it tags ``node.meta["recompute"]``,
which AOTAutograd's min-cut partitioner obeys::

    x -> mm -> relu -> mm_1 -> ...        relu.meta["recompute"] = MUST_RECOMPUTE
              \\-> (saved) -> threshold_backward   becomes
    x -> mm -> relu -> mm_1 -> ...   (relu not saved: the backward runs relu(mm) again
                                      before threshold_backward, from the saved mm)

**Before schedule_free: activations first, gathered parameters in the room left.**
This pass runs before ``schedule_free`` and plans with that pass's least-memory
choice for the parameter gathers (under ``reshard_after_forward="auto"`` or
``True``: every gather re-gathered in the backward; ``False`` / ``"except_last"``:
the gathers those keep), then ``schedule_free`` keeps gathers in the room the plan
leaves. Both are ways to spend the same memory, and per byte a saved activation is
worth more: recomputing it is compute on the backward's critical path (a whole
block's forward is about a third of its step), while a re-gather is a collective
that runs beside the backward's matmuls plus a cast and an unpack. The gathers'
nodes (and their expanding reads) are ``schedule_free``'s to tag: never candidates
here, never cleared. Under the default budget (``memory_budget="auto"``) the
plan's budget is the same room ``schedule_free`` plans in: 0.9 of the device less
room for the optimizer state and the gathers other compiled functions keep
(``schedule_free.reserved_bytes``).

**What is a candidate.** A forward node that owns its storage (views, ``getitem``
and ``wait_tensor`` follow their base and are tagged with it), is read by the
backward (directly or through its views; "the backward" is ``backward_region``:
the tangent-dependent nodes and the tangent-free ones only they read), is not
returned by the graph, has a
deterministic aten/prims op (no random op; attention kernels only without
dropout), writes no input, and is no collective. Nodes already tagged stay as
they are (selective-checkpoint ``MUST_SAVE``), except
user ``torch.utils.checkpoint`` regions under ``Config.remat="auto"``: their nodes
become candidates like any other, and a user-region node the plan saves loses its
tag and its ``ac_graph_id`` (so the partitioner's region-boundary rule does not
override the plan). Under ``"respect_user"`` they stay recomputed as written.

**Cost model** (the same on every rank: it reads only shapes and the config).
Recomputing ``n`` costs one kernel of the cost model (``graphcomp.analysis.cost_model``:
launch, then the slower of ``flops`` at the matmul rate and ``io_bytes`` at the memory
bandwidth of the compile's device): flops from ``torch.utils.flop_counter``'s formulas (matmuls,
attention, convolutions), io bytes its inputs plus its output (what an elementwise
op moves). Recomputing it frees its bytes between its last forward use and the
point the backward needs it again, but keeps its inputs live until then (the
memory model charges that: ``memory.intervals(recompute=...)``).

**Policy: greedy by bytes freed per recompute-second.** Minimising recompute time
subject to the peak bound is a knapsack (with interactions: a recomputed value
keeps its inputs alive); ranking by value-per-cost is the classic greedy for it,
within one item of optimal when items are small next to the budget, which
activations are next to a device's memory. Start from the plan with every
candidate saved; while the estimated peak is over the budget, take the best-ranked
untried candidate whose saved interval covers the current peak position, and keep
it if the peak (or the memory at that position, on a plateau) drops. Then prune:
in worst-ranked-first order, drop any chosen recompute the budget no longer needs.
Each candidate is tried at most once, so the pass ends after O(candidates) trials;
a trial re-derives only the storages it touches plus one prefix sum over the
graph, not a walk of it. Ties go to graph order, and sets of nodes are iterated
only for order-free sums and closures: every rank computes the same plan.

Under ``remat="auto"`` with user checkpoint regions the pass plans from two
starting points and keeps the better: (a) every activation saved, then the greedy
above over all candidates (user-region ones included); (b) the user's
checkpointing (plus the greedy over the other candidates if it is over budget),
then user-region activations saved one by one, costliest to recompute per byte
first, while the estimate stays under the budget. Of the plans that meet the
budget it takes the one with less modelled recompute time; if neither does, the
one with the lower peak (ties: the user's), so "auto" never plans a higher peak
than the user's checkpointing. (a) alone can end above the user's plan: one
recompute at a time, it cannot find a whole block recomputed from its input.

If the budget cannot be met (over it with every candidate that helps
recomputed), the pass keeps those recomputes (least memory it found), logs a
warning, records the reason and counts ``memory_budget_infeasible``.

No-op when there is no backward (inference), no budget (``memory_budget=None``,
or ``"auto"`` on a CPU graph), or when the graph as tagged is under the budget and
no user region is a candidate (``"respect_user"``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.fx as fx

from graphcomp import _compat
from graphcomp.analysis import memory
from graphcomp.analysis import graph_utils as gu
from graphcomp.analysis import cost_model
from graphcomp.analysis.cost_model import DeviceCosts
from graphcomp.passes import schedule_free
from graphcomp.compiler.pipeline import PassContext, PassResult, register_pass

log = logging.getLogger(__name__)

MAX_NOTES = 20  # decisions listed by name in the pass record


@dataclass(frozen=True, eq=False)
class Candidate:
    """A saved activation that could be recomputed: its node, the forward aliases
    tagged with it, its bytes, its modelled recompute time, where it is free of
    memory when recomputed (``lo..hi``, graph positions) and whether it sits in a
    user checkpoint region."""

    node: fx.Node
    group: tuple[fx.Node, ...]
    aliases: tuple[fx.Node, ...]
    nbytes: int
    seconds: float
    flops: int
    index: int
    lo: int
    hi: int
    user: bool

    @property
    def ratio(self) -> float:
        return self.nbytes / self.seconds


@dataclass
class RematPlan:
    """What :func:`plan` decided. ``chosen``: the candidates the backward recomputes
    (graph order; under ``"auto"`` including the user-region ones still
    recomputed); ``tag``: the nodes to tag MUST_RECOMPUTE; ``clear``: user-region
    nodes whose tags are dropped (saved); the estimates with the tags as on entry
    and as planned; why the budget is infeasible (None if it is met); and where the
    plan started (``"saved"``: every activation saved; ``"user"``: the user's
    checkpointing)."""

    candidates: list[Candidate]
    chosen: list[Candidate]
    tag: list[fx.Node]
    clear: list[fx.Node]
    before: memory.MemoryEstimate
    after: memory.MemoryEstimate
    infeasible: str | None = None
    start: str = "saved"

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.chosen)


def recompute_seconds(node: fx.Node, costs: DeviceCosts = cost_model.REFERENCE) -> tuple[float, int]:
    """(modelled seconds to recompute ``node``, its flops): one kernel of the cost model."""
    flops = _compat.node_flops(node)
    io = memory.value_bytes(node) + sum(memory.value_bytes(a) for a in node.all_input_nodes)
    return costs.op_seconds(flops, io), flops


def _aliases(node: fx.Node, bwd: set[fx.Node]) -> list[fx.Node]:
    """``node`` and the forward views of it (transitively), graph order of discovery."""
    out, todo = [node], [node]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in bwd and u not in out and memory.is_alias(u) and u.args and u.args[0] is n:
                out.append(u)
                todo.append(u)
    return out


def _recomputable_op(node: fx.Node) -> bool:
    t = node.target
    if not isinstance(t, torch._ops.OpOverload) or t.namespace not in ("aten", "prims"):
        return False
    if gu.collective_kind(node) is not None or _compat.is_mutating(node):
        return False
    return _compat.recompute_is_deterministic(node)


MAX_UNIT = 32  # most nodes recomputed together for one candidate


def candidates(gm: fx.GraphModule, bwd: set[fx.Node], mode: str, exclude: set[fx.Node] | frozenset = frozenset(),
               costs: DeviceCosts = cost_model.REFERENCE) -> list[Candidate]:
    """Every candidate of the joint graph (module docstring), in graph order;
    ``exclude``: nodes another pass decides (``schedule_free``'s gathers).

    A candidate is recomputed as a unit with the producers it needs that the
    backward does not read (``x -> mm -> relu``, relu saved: recomputing relu alone
    would only trade relu's bytes for mm's, so mm is recomputed with it), up to
    inputs that stay live anyway (graph inputs, other saved activations, tagged
    nodes) or ``MAX_UNIT`` nodes."""
    nodes = list(gm.graph.nodes)
    idx = {n: i for i, n in enumerate(nodes)}

    def free_tag(g: fx.Node) -> bool:
        return "recompute" not in g.meta or (mode == "auto" and _compat.is_user_checkpoint(g))

    info: dict[fx.Node, tuple[list[fx.Node], list[fx.Node]]] = {}  # root -> (aliases, users outside them)
    for n in nodes:
        if n.op == "call_function" and n not in bwd and not memory.is_alias(n):
            group = _aliases(n, bwd)
            info[n] = (group, [u for g in group for u in g.users if u not in group])

    def saved(r: fx.Node) -> bool:
        return r in info and any(u in bwd for u in info[r][1])

    def ok(r: fx.Node) -> bool:
        return (r in info and r not in exclude and _recomputable_op(r)
                and all(free_tag(g) and g not in exclude for g in info[r][0]))

    out = []
    for n in nodes:
        if n not in info or not saved(n) or not ok(n):
            continue
        group, users = info[n]
        if any(u.op == "output" for u in users):
            continue  # returned by the graph: live to its end either way
        nbytes = memory.value_bytes(n)
        if nbytes <= 0:
            continue
        unit, todo = [n], [n]
        while todo and len(unit) < MAX_UNIT:
            m = todo.pop(0)
            for a in m.all_input_nodes:
                r = memory.storage_root(a)
                if r in unit or r.op == "placeholder" or saved(r) or not ok(r):
                    continue  # live anyway (or not recomputable: the partitioner saves it)
                if any(u.op == "output" for u in info[r][1]):
                    continue
                unit.append(r)
                todo.append(r)
        unit.sort(key=idx.__getitem__)
        fw = [idx[u] for u in users if u not in bwd]
        bw = [idx[u] for u in users if u in bwd]
        lo = max(fw) + 1 if fw else idx[n]
        cost = [recompute_seconds(m, costs) for m in unit]
        tagged = tuple(g for m in unit for g in info[m][0])
        out.append(Candidate(n, tagged, tuple(group), nbytes, sum(c[0] for c in cost), sum(c[1] for c in cost),
                             idx[n], lo, min(bw) - 2, _compat.is_user_checkpoint(n)))
    return out


def backward_region(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes the partitioner runs in the backward: those that depend on a
    tangent (``memory.backward_nodes``) and those read only by such nodes (a
    backward formula's tangent-free part, e.g. gelu's ``x * x``, or a view of a
    saved value), placed after the first tangent-dependent node. A forward value read
    by this region is saved for the backward."""
    out = memory.backward_nodes(gm)
    nodes = list(gm.graph.nodes)
    first = next((i for i, n in enumerate(nodes) if n in out and n.op != "placeholder"), len(nodes))
    for n in reversed(nodes[first:]):  # (placed in the backward part of the graph order)
        if n not in out and n.op == "call_function" and n.users and all(u in out for u in n.users):
            out.add(n)
    return out


class _Model:
    """The memory model of the joint graph under a set of recomputed nodes, kept
    incrementally. The lifetimes with nothing recomputed are computed once
    (``memory.Lifetimes``). :meth:`reset` sets a current set (one full pass);
    :meth:`trial` evaluates another set against it, re-deriving only what the
    difference touches: the nodes added or removed and their recomputed
    ancestors (whose recompute points may move), and the storages of those and of
    their inputs; :meth:`accept` makes a trial current. A trial costs one pass over
    the positions (the prefix sum), not a walk of the graph; the result is the same
    as ``memory.intervals(recompute=...)`` (tested)."""

    def __init__(self, gm: fx.GraphModule, bwd: set[fx.Node]):
        lt = self.lt = memory.Lifetimes(gm, bwd)
        nodes, live, size = lt.intervals()
        self.base_live, self.size = live, size
        self.members: dict[fx.Node, list[fx.Node]] = {}  # root -> the nodes on its storage
        self.readers: dict[fx.Node, list[fx.Node]] = {}  # root -> the nodes that take it as an input
        for n in nodes:
            self.members.setdefault(lt.roots[n], []).append(n)
            for a in n.all_input_nodes:
                self.readers.setdefault(lt.roots[a], []).append(n)
        self.inputs = sum(memory.value_bytes(n) for n in nodes if n.op == "placeholder")
        self.reset([])

    def _live(self, r: fx.Node, pts: dict[fx.Node, int]) -> list[tuple[int, int]]:
        extra = [pts[u] for u in self.readers.get(r, ()) if u in pts]
        resh = {r} if any(m in pts for m in self.members[r]) else set()
        return self.lt.live_of(r, self.lt.uses[r] + extra, resh, pts)

    def _estimate(self, delta: list[int]) -> tuple[list[int], memory.MemoryEstimate]:
        tl, acc = [], 0
        for d in delta[:-1]:
            acc += d
            tl.append(acc)
        if not tl:
            return tl, memory.MemoryEstimate(0, "", -1, 0, 0)
        peak = max(tl)
        i = tl.index(peak)
        return tl, memory.MemoryEstimate(peak, self.lt.nodes[i].name, i, self.inputs, len(tl))

    def reset(self, recompute: list[fx.Node]) -> tuple[list[int], memory.MemoryEstimate]:
        """Make ``recompute`` the current set (a full evaluation)."""
        lt = self.lt
        self.R = set(recompute)
        self.points = lt.points(self.R)
        self.live = dict(self.base_live)
        for r in {lt.roots[n] for n in self.points} | {lt.roots[a] for n in self.points for a in n.all_input_nodes}:
            self.live[r] = self._live(r, self.points)
        self.delta = [0] * (len(lt.nodes) + 1)
        for r, ivs in self.live.items():
            for s, e in ivs:
                self.delta[s] += self.size[r]
                self.delta[e + 1] -= self.size[r]
        self.state = (self.R, self.points, {}, self.delta)
        return self._estimate(self.delta)

    def trial(self, recompute: list[fx.Node]) -> tuple[list[int], memory.MemoryEstimate]:
        """Evaluate ``recompute`` against the current set (:meth:`accept` keeps it)."""
        lt, idx, bwd = self.lt, self.lt.idx, self.lt.bwd
        new = set(recompute)
        diff = self.R ^ new
        # the changed nodes and their recomputed ancestors: their recompute points may move
        z, todo = set(diff), list(diff)
        while todo:
            for a in todo.pop().all_input_nodes:
                if a in new and a not in z:
                    z.add(a)
                    todo.append(a)
        pts = {n: p for n, p in self.points.items() if n not in z}
        for n in sorted((n for n in z if n in new and n not in bwd), key=idx.__getitem__, reverse=True):
            ps = [idx[u] for u in n.users if u in bwd] + [pts[u] for u in n.users if u in pts]
            if ps:
                pts[n] = min(ps)
        affected = {lt.roots[n] for n in z} | {lt.roots[a] for n in z for a in n.all_input_nodes}
        delta = list(self.delta)
        changed = {}
        for r in affected:  # (sums: the order of the set does not matter)
            if r not in self.live:
                continue  # the output node
            ivs = self._live(r, pts)
            changed[r] = ivs
            b = self.size[r]
            for s, e in self.live[r]:
                delta[s] -= b
                delta[e + 1] += b
            for s, e in ivs:
                delta[s] += b
                delta[e + 1] -= b
        self.state = (new, pts, changed, delta)
        return self._estimate(delta)

    def accept(self) -> None:
        """Make the last :meth:`trial` the current set."""
        self.R, self.points, changed, self.delta = self.state
        self.live.update(changed)


def _add_recomputes(model: _Model, fixed: list[fx.Node], cands: list[Candidate], budget: int
                    ) -> tuple[list[Candidate], memory.MemoryEstimate, str | None]:
    """The greedy (module docstring): from ``fixed`` recomputed, add candidates
    until the estimate is under ``budget``, then prune. (chosen, estimate, reason
    the budget is infeasible or None)."""
    chosen: list[Candidate] = []

    def rset(cs: list[Candidate]) -> list[fx.Node]:
        return fixed + [g for c in cs for g in c.group]

    tl, est = model.reset(rset(chosen))
    order = sorted(cands, key=lambda c: (-c.ratio, c.index))
    tried: set[int] = set()
    infeasible = None
    while est.peak_bytes > budget:
        p = est.peak_index
        c = next((c for c in order if c.index not in tried and c.lo <= p <= c.hi), None)
        if c is None:
            infeasible = (f"memory_budget={budget} bytes is infeasible: the estimated joint peak is still "
                          f"{est.peak_bytes} bytes (at {est.peak_node}) with {len(chosen)} activations "
                          f"recomputed and no candidate left that frees memory there")
            break
        tried.add(c.index)
        t_tl, t_est = model.trial(rset(chosen + [c]))
        if t_est.peak_bytes < est.peak_bytes or (t_est.peak_bytes == est.peak_bytes and t_tl[p] < tl[p]):
            model.accept()
            chosen.append(c)
            tl, est = t_tl, t_est
    if infeasible is None:  # prune what the budget no longer needs, costliest per byte first
        for c in sorted(chosen, key=lambda c: (c.ratio, -c.index)):
            rest = [x for x in chosen if x is not c]
            t_tl, t_est = model.trial(rset(rest))
            if t_est.peak_bytes <= budget:
                model.accept()
                chosen, tl, est = rest, t_tl, t_est
    chosen.sort(key=lambda c: c.index)
    return chosen, est, infeasible


def plan(gm: fx.GraphModule, budget: int, mode: str, decided: set[fx.Node] | frozenset = frozenset(),
         resharded: list[fx.Node] | tuple = (), costs: DeviceCosts = cost_model.REFERENCE) -> RematPlan:
    """Choose the activations to recompute (module docstring: the policy).
    ``decided``: nodes ``schedule_free`` tags after this pass (gathers): never
    candidates, never cleared; ``resharded``: those of them modelled as recomputed
    (its least-memory plan: gathers re-gathered in the backward)."""
    bwd = backward_region(gm)
    model = _Model(gm, bwd)
    resh = set(resharded)
    rec = resh.union(memory.tagged_recompute(gm, exclude=decided))
    tagged = [n for n in gm.graph.nodes if n in rec]
    _, before = model.reset(tagged)
    respect = candidates(gm, bwd, "respect_user", decided, costs)
    chosen, est, infeasible = _add_recomputes(model, tagged, respect, budget)
    user_plan = RematPlan(respect, chosen, [g for c in chosen for g in c.group], [], before, est, infeasible, "user")
    users = [n for n in gm.graph.nodes if _compat.is_user_checkpoint(n) and n not in decided]
    if mode != "auto" or not users:
        return user_plan
    # "auto" (a): from every activation saved, recompute what the budget needs
    fixed = [n for n in tagged if n in resh or not _compat.is_user_checkpoint(n)]
    cands = candidates(gm, bwd, "auto", decided, costs)
    chosen, est, infeasible = _add_recomputes(model, fixed, cands, budget)
    saved_plan = RematPlan(cands, chosen, [g for c in chosen for g in c.group], users, before, est, infeasible)
    if user_plan.infeasible is None:
        # "auto" (b): from the user's checkpointing (it fits), save user-region activations while
        # the budget holds, the costliest to recompute per byte first
        rec = tagged + user_plan.tag
        user_cands = sorted((c for c in cands if c.user), key=lambda c: (c.ratio, c.index))
        saved: list[Candidate] = []
        _, est = model.reset(rec)
        for c in user_cands:
            drop = set(c.aliases)
            trial = [n for n in rec if n not in drop]
            _, t_est = model.trial(trial)
            if t_est.peak_bytes <= budget:
                model.accept()
                rec, est = trial, t_est
                saved.append(c)
        saved_ids = {c.index for c in saved}
        still = [c for c in user_cands if c.index not in saved_ids] + user_plan.chosen
        still.sort(key=lambda c: c.index)
        b_plan = RematPlan(cands, still, user_plan.tag, [g for c in saved for g in c.aliases], before, est, None,
                           "user")
        if saved_plan.infeasible is None and saved_plan.seconds <= b_plan.seconds:
            return saved_plan
        return b_plan
    if saved_plan.infeasible is None or saved_plan.after.peak_bytes < user_plan.after.peak_bytes:
        return saved_plan
    return user_plan


def _fmt(c: Candidate) -> str:
    where = ", user region" if c.user else ""
    return f"{c.node.name} ({gu.op_name(c.node)}, {c.nbytes} B, {c.seconds * 1e6:.1f} us{where})"


@register_pass("remat", stages=("joint",), after=("fuse_allgather_downcast", "bucket_collectives"))
def remat(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    if ctx.stage != "joint" or not _compat.is_joint_graph(gm):
        return ctx.unchanged(gm, "no backward in this graph (inference): nothing is saved for it")
    budget = memory.resolve_budget(ctx.config.memory_budget, gm)
    if budget is None:
        return ctx.unchanged(gm, f"no memory budget (memory_budget={ctx.config.memory_budget!r} on "
                                 f"{memory.graph_device(gm)}): every recompute tag left as it is")
    mode = ctx.config.remat
    fbwd = memory.backward_nodes(gm)
    groups = schedule_free.gather_groups(gm, fbwd)
    decided, resharded = set(), []
    if groups and ctx.config.pass_enabled("schedule_free"):
        # schedule_free decides the gathers after this pass: plan with its least-memory
        # choice (under "auto": every gather re-gathered in the backward), so that saved
        # activations come first and gathers are kept only in the room left
        decided = schedule_free.decided_nodes(groups, fbwd)
        kept = schedule_free.forced_kept(ctx.config.reshard_after_forward, gm, groups, fbwd)
        resharded = [n for i, g in enumerate(groups) if i not in kept for n in g.nodes]
        resharded += [r for g in groups for r in schedule_free.expanding_reads(g, fbwd)]
    reserve, others = schedule_free.reserved_bytes(ctx, groups) if groups else (0, 0)
    if reserve or others:  # the default budget: the room schedule_free plans under too
        ctx.count("optimizer_reserve_bytes", reserve)
        ctx.count("other_frames_kept_bytes", others)
        ctx.note(f"memory_budget='auto' ({budget} bytes) less {reserve} bytes left for optimizer state "
                 f"({schedule_free.OPTIMIZER_STATE_FACTOR}x the parameter shards) and {others} bytes other "
                 f"compiled functions keep gathered")
        budget -= reserve + others
    p = plan(gm, budget, mode, decided, resharded, ctx.env.costs)
    Policy = _compat.checkpoint_policy()
    users = [n for n in gm.graph.nodes if _compat.is_user_checkpoint(n) and n not in decided]
    cleared = set(p.clear)
    chosen_ids = {c.index for c in p.chosen}
    ctx.count("budget_bytes", budget)
    ctx.count("estimated_peak_before", p.before.peak_bytes)
    ctx.count("estimated_peak_after", p.after.peak_bytes)
    ctx.count("candidates", len(p.candidates))
    ctx.count("recomputed", len(p.chosen))
    ctx.count("recomputed_bytes", sum(c.nbytes for c in p.chosen))
    ctx.count("kept", len(p.candidates) - len(p.chosen))
    ctx.count("kept_bytes", sum(c.nbytes for c in p.candidates if c.index not in chosen_ids))
    ctx.count("recompute_flops", sum(c.flops for c in p.chosen))
    ctx.count("recompute_us", round(sum(c.seconds for c in p.chosen) * 1e6, 1))
    if mode == "auto" and users:
        ctx.count("plan_from_user_checkpointing", int(p.start == "user"))
        user_kept = [c for c in p.candidates if c.user and c.node in cleared and c.index not in chosen_ids]
        ctx.count("user_kept", len(user_kept))
        ctx.count("user_kept_bytes", sum(c.nbytes for c in user_kept))
        ctx.counter("user_checkpoint_saved", len(user_kept))
    elif users:
        recomputed = [n for n in users if not memory.is_alias(n)]
        user_bytes = sum(memory.value_bytes(n) for n in recomputed)
        ctx.count("user_recomputed", len(recomputed))
        ctx.count("user_recomputed_bytes", user_bytes)
        room = budget - p.after.peak_bytes
        if p.infeasible is None and room > 0 and user_bytes > 0:
            # the user's checkpointing recomputes activations the budget has room for:
            # say so (remat="auto" would save what fits and spend less time recomputing)
            ctx.count("room_under_budget_bytes", room)
            hint = (f"the user's activation checkpointing marks {len(recomputed)} values ({user_bytes} B) "
                    f"for recomputation while the estimated peak leaves {room} B of the budget unused: "
                    f"remat='auto' would save the checkpointed activations that fit")
            ctx.note(hint)
            log.info("graphcomp remat (frame %s): %s", ctx.frame_id, hint)
    if p.infeasible is not None:
        log.warning("graphcomp remat (frame %s): %s", ctx.frame_id, p.infeasible)
        ctx.note(p.infeasible)
        ctx.count("budget_infeasible")
        ctx.counter("memory_budget_infeasible", 1)
    for c in p.chosen[:MAX_NOTES]:
        ctx.note(f"recompute {_fmt(c)}")
    if len(p.chosen) > MAX_NOTES:
        ctx.note(f"... and {len(p.chosen) - MAX_NOTES} more recomputed")
    summary = (f"{len(p.chosen)} of {len(p.candidates)} candidate activations recomputed "
               f"({sum(c.nbytes for c in p.chosen)} B); estimated joint peak {p.before.peak_bytes} -> "
               f"{p.after.peak_bytes} B, budget {budget} B")
    log.info("graphcomp remat (frame %s, remat=%r): %s", ctx.frame_id, mode, summary)
    if not p.tag and not p.clear:
        if p.infeasible is not None:
            return ctx.unchanged(gm, "no recompute lowers the estimated peak: " + p.infeasible)
        return ctx.unchanged(gm, f"estimated joint peak {p.before.peak_bytes} B is under memory_budget={budget} B "
                                 "with the tags as they are: nothing to recompute")
    for n in p.clear:  # user regions under "auto": candidates, not orders
        _compat.clear_recompute(n)
        n.meta.pop("ac_graph_id", None)
    for n in p.tag:
        n.meta["recompute"] = Policy.MUST_RECOMPUTE
    ctx.counter("activations_recomputed", len(p.chosen))
    return ctx.changed(gm, summary)
