"""A static memory model of an FX graph: tensor sizes and lifetimes -> peak bytes.

Model (deterministic: it reads only the graph, so every rank computes the same):

* sizes come from ``node.meta['val']`` (fake tensors; a tuple/list output counts
  the sum of its tensors); symbolic or missing sizes count 0;
* a value is allocated by its producer and freed after its last user, in graph
  order; a view (an op whose schema says its output aliases an input, e.g.
  ``view``, ``slice``, ``t``, ``wait_tensor``) and a ``getitem`` share the storage
  of their base, which is counted once and lives until the last user of any alias;
* graph inputs (placeholders) are live throughout, unless ``persistent`` names
  the ones that are (parameters, shards, buffers): then every other input (saved
  activations, tangents, user inputs) is freed after its last use, as
  AOTAutograd's boxed calling convention lets the compiled graph do; values
  returned by the graph live until its end;
* a collective's input stays live until the collective's ``wait_tensor`` (the
  communication reads it until then), unless ``inputs_until_wait=False``: then
  until its last use, the collective itself (what the caching allocator counts as
  allocated: the communication stream keeps the block from reuse until it is done,
  but it is no longer "allocated").

* an op that allocates scratch memory inside itself (graphcomp's chunked loss ops,
  ``graphcomp/ops/loss.py``) holds it while it runs, on top of its inputs and
  outputs (:func:`workspace_bytes`);

* ``fused=True`` models what Inductor allocates instead of what the FX graph
  names: a pointwise value whose every user is a pointwise op or a reduction (and
  that is not returned) is computed inside its consumers' kernel and never
  allocated; its inputs stay live until the kernel that reads them (the last
  materialized consumer); and a pointwise kernel writes its output in place of a
  same-sized input buffer whose last read it is (Inductor's in-place buffer reuse).

``estimate(gm)`` gives the peak and the node where it occurs. For the joint
graph, ``reshard=`` models ``schedule_free``: the listed storages are freed after
their last forward use and allocated again just before their first backward use
(the partitioner recomputes them there). ``recompute=`` models ``remat``'s tags:
recomputed nodes are freed the same way, and their inputs are read again where the
backward recomputes them. :class:`Lifetimes` holds the part that does not depend
on either, for planners that try many recompute sets.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.fx as fx

from graphcomp.analysis import graph_utils as gu


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak of one graph: bytes live at the peak, where it occurs."""

    peak_bytes: int
    peak_node: str  # the node whose execution reaches the peak ("" for an empty graph)
    peak_index: int  # its position in graph order
    inputs_bytes: int  # placeholders (live throughout)
    num_nodes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def value_bytes(node: fx.Node) -> int:
    """Bytes of the node's output(s) from ``meta['val']`` (0 if unknown)."""
    return sum(max(gu.nbytes(t), 0) for t in gu.tensor_values(gu.tensor_meta(node)))


@dataclass(frozen=True)
class Workspace:
    """Scratch memory of one op, live only while it runs (a key of ``intervals``)."""

    node: fx.Node

    @property
    def name(self) -> str:
        return f"{self.node.name}:workspace"

    op = "workspace"


def workspace_bytes(node: fx.Node) -> int:
    """Bytes ``node``'s op allocates inside itself beyond its outputs (0 for any op
    but graphcomp's chunked loss ops, or when sizes are symbolic)."""
    t = node.target
    if node.op != "call_function" or getattr(t, "namespace", None) != "graphcomp":
        return 0
    from graphcomp.ops import loss as loss_ops

    vals = [gu.tensor_meta(a) if isinstance(a, fx.Node) else None for a in node.args]
    return loss_ops.workspace_bytes(t, node.args, vals)


def is_alias(node: fx.Node) -> bool:
    """True when ``node``'s output shares storage with its first input."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem or node.target is torch.ops._c10d_functional.wait_tensor.default:
        return True  # wait_tensor returns its (in-flight) input
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        rets = t._schema.returns
        if rets and rets[0].alias_info is not None and not rets[0].alias_info.is_write:
            return bool(node.args) and isinstance(node.args[0], fx.Node)
    return False


def storage_root(node: fx.Node, _cache: dict[fx.Node, fx.Node] | None = None) -> fx.Node:
    """The node that allocated the storage ``node``'s value lives in."""
    n = node
    while is_alias(n):
        n = n.args[0]  # type: ignore[assignment]
    return n


_REDUCTIONS = {
    "sum", "mean", "amax", "amin", "max", "min", "prod", "var", "var_mean", "std", "std_mean",
    "argmax", "argmin", "any", "all", "logsumexp",
}
_POINTWISE_EXTRA = {"convert_element_type", "_to_copy", "clone", "where", "fill"}


def _base_name(node: fx.Node) -> str | None:
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return None
    return t.overloadpacket.__name__


def is_pointwise(node: fx.Node) -> bool:
    """An elementwise op Inductor fuses into its neighbours' kernels."""
    name = _base_name(node)
    if name is None:
        return False
    if name in _POINTWISE_EXTRA:
        if name == "_to_copy":  # a dtype cast only (no device / layout change)
            return set(node.kwargs) <= {"dtype", "memory_format"}
        return True
    return torch.Tag.pointwise in node.target.tags  # type: ignore[union-attr]


def is_reduction(node: fx.Node) -> bool:
    return _base_name(node) in _REDUCTIONS


def fuses_away(node: fx.Node) -> bool:
    """True when Inductor computes ``node`` inside its consumers' kernels: a pointwise
    value read only by pointwise ops and reductions, not returned, not viewed."""
    if not is_pointwise(node) or not node.users:
        return False
    return all(u.op == "call_function" and (is_pointwise(u) or is_reduction(u)) for u in node.users)


# ops Inductor runs as extern kernels (cuBLAS, cuDNN / flash attention): their outputs
# are written to memory whatever the graph around them, so no fusion with their
# consumers is lost at a cut after one. Ops outside aten and prims (collectives,
# custom ops) are fallback kernels, the same.
_EXTERN = {
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm", "convolution", "convolution_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward",
    "_efficient_attention_forward", "_efficient_attention_backward",
}


def makes_own_buffer(node: fx.Node) -> bool:
    """True when the storage of ``node``'s value is an extern kernel's output (a
    matmul, attention, a collective or a custom op), not a kernel Inductor generates
    and could fuse with the value's consumers (``partition_graph``'s cut cost)."""
    root = storage_root(node)
    t = root.target
    if root.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return False
    return t.namespace not in ("aten", "prims") or t.overloadpacket.__name__ in _EXTERN


def backward_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes of a joint graph that depend on a tangent (the backward part)."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if n.name.startswith("tangents"):
                out.add(n)
        elif n.op != "output" and any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def partitioner_saves(node: fx.Node) -> bool:
    """A recompute-tagged node the partitioner saves anyway: the output of one user
    checkpoint region read by a recomputed node of a later region
    (``cleanup_recompute_tags``, torch 2.11 and 2.13)."""
    from graphcomp import _compat

    gid = node.meta.get("ac_graph_id")
    return gid is not None and any(
        _compat.must_recompute(u) and u.meta.get("ac_graph_id", gid) > gid for u in node.users)


def tagged_recompute(gm: fx.GraphModule, exclude: Iterable[fx.Node] = ()) -> list[fx.Node]:
    """The nodes the partitioner will recompute as the graph is tagged now (the
    user's ``torch.utils.checkpoint`` regions, ``remat``'s tags), less those it
    saves anyway and ``exclude`` (nodes a later pass decides), in graph order: the
    ``recompute=`` of :func:`estimate` for a planner that runs after them."""
    from graphcomp import _compat

    skip = set(exclude)
    return [n for n in gm.graph.nodes if n not in skip and _compat.must_recompute(n) and not partitioner_saves(n)]


def recompute_points(nodes: list[fx.Node], idx: dict[fx.Node, int], recompute: Iterable[fx.Node],
                     bwd: set[fx.Node]) -> dict[fx.Node, int]:
    """Forward node recomputed in backward -> the position (a backward node's) where
    its value is needed again: its first backward user, or the earliest point where a
    recomputed user of it is needed (chains are recomputed together)."""
    out: dict[fx.Node, int] = {}
    for n in sorted((n for n in set(recompute) if n not in bwd), key=idx.__getitem__, reverse=True):
        ps = [idx[u] for u in n.users if u in bwd] + [out[u] for u in n.users if u in out]
        if ps:
            out[n] = min(ps)
    return out


class Lifetimes:
    """The part of :func:`intervals` that does not depend on ``reshard`` /
    ``recompute``, computed once per graph, so that a planner trying many
    recompute sets (``graphcomp/passes/remat.py``) re-derives only the storages a set
    touches (:meth:`live_of`). Same arguments as :func:`intervals`."""

    def __init__(self, gm: fx.GraphModule, bwd: set[fx.Node] | None = None,
                 persistent: Iterable[fx.Node] | None = None, inputs_until_wait: bool = True, fused: bool = False):
        self.gm, self._bwd, self.fused = gm, bwd, fused
        nodes = self.nodes = list(gm.graph.nodes)
        idx = self.idx = {n: i for i, n in enumerate(nodes)}
        end = self.end = len(nodes) - 1
        roots: dict[fx.Node, fx.Node] = {}
        for n in nodes:
            roots[n] = roots[n.args[0]] if is_alias(n) and n.args[0] in roots else n  # type: ignore[index]
        self.roots = roots
        # where a value is read: at its user, or (fused) where that user's kernel runs
        away = self.away = {n for n in nodes if fused and fuses_away(n)}
        runs_at: dict[fx.Node, int] = {}
        for n in reversed(nodes):
            runs_at[n] = max((runs_at[u] for u in n.users), default=idx[n]) if n in away else idx[n]
        size: dict[fx.Node, int] = {}
        uses: dict[fx.Node, list[int]] = {}
        for n in nodes:
            if n.op == "output":
                continue
            r = roots[n]
            if r is n:
                size[r] = 0 if n in away else value_bytes(n)
                uses.setdefault(r, [])
            for u in n.users:
                if roots.get(u) is r and u is not r:
                    continue  # an alias of r: its own users count (a view is not a use)
                uses[r].append(end if u.op == "output" else runs_at[u])
        # a collective's input buffer is in use until the collective is waited on
        for n in nodes if inputs_until_wait else ():
            if n.target is torch.ops._c10d_functional.wait_tensor.default and isinstance(n.args[0], fx.Node):
                for a in n.args[0].all_input_nodes:
                    if a in roots and a.op != "output":
                        uses[roots[a]].append(idx[n])
        self.size, self.uses = size, uses
        self.keep = None if persistent is None else set(persistent)
        self.workspaces = [(Workspace(n), idx[n], ws) for n in nodes if (ws := workspace_bytes(n)) > 0]

    @property
    def bwd(self) -> set[fx.Node]:
        if self._bwd is None:
            self._bwd = backward_nodes(self.gm)
        return self._bwd

    def points(self, recompute: Iterable[fx.Node]) -> dict[fx.Node, int]:
        """:func:`recompute_points` of this graph."""
        recompute = list(recompute)
        return recompute_points(self.nodes, self.idx, recompute, self.bwd) if recompute else {}

    def extra_uses(self, points: dict[fx.Node, int]) -> dict[fx.Node, list[int]]:
        """Storage root -> where recomputed nodes read it again."""
        out: dict[fx.Node, list[int]] = {}
        for n, p in points.items():  # a recomputed node reads its inputs again where it is recomputed
            for a in n.all_input_nodes:
                if a in self.roots and a.op != "output":
                    out.setdefault(self.roots[a], []).append(p)
        return out

    def live_of(self, r: fx.Node, us: list[int], reshard: set[fx.Node], points: dict[fx.Node, int],
                inplace: dict[fx.Node, int] | None = None) -> list[tuple[int, int]]:
        """Live intervals of storage root ``r`` read at positions ``us``."""
        nodes, idx = self.nodes, self.idx
        start = 0 if r.op == "placeholder" else idx[r]
        whole = r.op == "placeholder" and (self.keep is None or r in self.keep)
        last = self.end if whole else max(us, default=start)
        if r in reshard:
            bwd = self.bwd
            fw = [u for u in us if nodes[u] not in bwd and nodes[u].op != "output"]
            bw = [u for u in us if nodes[u] in bwd or nodes[u].op == "output"]
            if bw and fw:
                first_bw = min(bw)
                return [(start, max(fw)), (max(first_bw - 1, max(fw) + 1), max(bw))]
            if bw and r in points:  # read by the backward only: computed there, not in forward
                return [(max(min(bw) - 1, start), max(bw))]
        if inplace and r in inplace and last == inplace[r]:
            last -= 1  # the kernel at `last` writes its output into this buffer
        return [(start, max(last, start))]

    def intervals(self, reshard: Iterable[fx.Node] = (), recompute: Iterable[fx.Node] = ()
                  ) -> tuple[list[fx.Node], dict[fx.Node, list[tuple[int, int]]], dict[fx.Node, int]]:
        """See :func:`intervals`."""
        points = self.points(recompute)
        extra = self.extra_uses(points)
        uses = {r: us + extra[r] if r in extra else us for r, us in self.uses.items()}
        size = dict(self.size)
        inplace = _inplace_reuse(self.nodes, self.idx, self.roots, uses, size, self.away) if self.fused else {}
        reshard = set(reshard) | {self.roots[n] for n in points}
        if reshard and not self.bwd:
            reshard = set()
        live: dict[fx.Node, list[tuple[int, int]]] = {}
        for r, us in uses.items():
            live[r] = self.live_of(r, us, reshard, points, inplace)
        for key, i, ws in self.workspaces:
            live[key], size[key] = [(i, i)], ws  # type: ignore[index]
        return self.nodes, live, size


def intervals(
    gm: fx.GraphModule, reshard: Iterable[fx.Node] = (), bwd: set[fx.Node] | None = None,
    persistent: Iterable[fx.Node] | None = None, inputs_until_wait: bool = True, fused: bool = False,
    recompute: Iterable[fx.Node] = (),
) -> tuple[list[fx.Node], dict[fx.Node, list[tuple[int, int]]], dict[fx.Node, int]]:
    """(nodes in order, storage root -> live intervals [start, end] inclusive, root -> bytes).

    ``recompute``: forward nodes the partitioner recomputes in backward (what
    ``graphcomp/passes/remat.py`` tags): like ``reshard`` for their storages (freed after the
    last forward use, allocated again just before the backward needs them; not
    allocated in forward at all when only the backward reads them), and each of
    their inputs is read again where they are recomputed (it must be live there)."""
    return Lifetimes(gm, bwd, persistent, inputs_until_wait, fused).intervals(reshard, recompute)


def _inplace_reuse(nodes: list[fx.Node], idx: dict[fx.Node, int], roots: dict[fx.Node, fx.Node],
                   uses: dict[fx.Node, list[int]], size: dict[fx.Node, int], away: set[fx.Node]) -> dict[fx.Node, int]:
    """Buffers an Inductor pointwise kernel overwrites with its output: root -> the
    kernel's position. A kernel (a materialized pointwise node) reads the buffers of
    its inputs, through the producers fused into it; one of them that is not a
    graph input, has the output's size and is last read by this kernel is reused."""
    out: dict[fx.Node, int] = {}
    taken: set[fx.Node] = set()
    for n in nodes:
        if n.op != "call_function" or n in away or not is_pointwise(n) or roots[n] is not n or not size.get(n):
            continue
        reads, todo, seen = [], list(n.all_input_nodes), set()
        while todo:
            a = todo.pop()
            if a in seen:
                continue
            seen.add(a)
            if a in away:
                todo.extend(a.all_input_nodes)
            else:
                reads.append(roots[a])
        i = idx[n]
        for r in reads:
            if (r.op != "placeholder" and r not in taken and size.get(r) == size[n]
                    and max(uses.get(r) or [-1]) == i and not any(u.op == "output" for u in r.users)):
                out[r] = i
                taken.add(r)
                break
    return out


def timeline(gm: fx.GraphModule, reshard: Iterable[fx.Node] = (), bwd: set[fx.Node] | None = None,
             **kw: Any) -> list[int]:
    """Bytes live while each node (graph order) runs (``kw``: see :func:`intervals`)."""
    return _timeline_from(*intervals(gm, reshard, bwd, **kw))


def _timeline_from(nodes: list[fx.Node], live: dict[fx.Node, list[tuple[int, int]]],
                   size: dict[fx.Node, int]) -> list[int]:
    delta = [0] * (len(nodes) + 1)
    for r, ivs in live.items():
        for s, e in ivs:
            delta[s] += size[r]
            delta[e + 1] -= size[r]
    out, acc = [], 0
    for i in range(len(nodes)):
        acc += delta[i]
        out.append(acc)
    return out


def estimate(gm: fx.GraphModule, reshard: Iterable[fx.Node] = (), bwd: set[fx.Node] | None = None,
             **kw: Any) -> MemoryEstimate:
    """Estimated peak bytes of ``gm`` in its current order (see module docstring;
    ``kw``: ``persistent``, ``inputs_until_wait``, ``recompute`` of :func:`intervals`)."""
    return _estimate_from(*intervals(gm, reshard, bwd, **kw))


def _estimate_from(nodes: list[fx.Node], live: dict[fx.Node, list[tuple[int, int]]],
                   size: dict[fx.Node, int]) -> MemoryEstimate:
    tl = _timeline_from(nodes, live, size)
    inputs = sum(value_bytes(n) for n in nodes if n.op == "placeholder")
    if not tl:
        return MemoryEstimate(0, "", -1, 0, 0)
    i = max(range(len(tl)), key=lambda k: (tl[k], -k))
    return MemoryEstimate(int(tl[i]), nodes[i].name, i, int(inputs), len(nodes))


def graph_device(gm: fx.GraphModule) -> torch.device | None:
    for n in gm.graph.nodes:
        for t in gu.tensor_values(gu.tensor_meta(n)):
            return t.device
    return None


def resolve_budget(budget: int | float | str | None, gm: fx.GraphModule) -> int | None:
    """``Config.memory_budget`` in bytes for ``gm``'s device. A float is a fraction
    of CUDA device memory; on any other device it is a ValueError (CPU memory is
    shared with everything else on the host: give bytes). ``"auto"`` is
    ``config.AUTO_BUDGET_FRACTION`` of CUDA device memory, and no budget (None) on
    any other device."""
    if budget is None or isinstance(budget, int):
        return budget_bytes(budget, None)
    from graphcomp import _compat

    dev = graph_device(gm)
    return budget_bytes(budget, _compat.device_memory_bytes(dev) if dev is not None else None, dev)


def budget_bytes(budget: int | float | str | None, total: int | None, device: Any = None) -> int | None:
    """``Config.memory_budget`` in bytes on a device of ``total`` bytes (None: not a
    CUDA device, where a fraction is a ValueError and ``"auto"`` is no budget)."""
    if budget is None:
        return None
    if budget == "auto":
        from graphcomp.config import AUTO_BUDGET_FRACTION

        return None if total is None else int(AUTO_BUDGET_FRACTION * total)
    if isinstance(budget, float):
        if total is None:
            raise ValueError(
                f"Config.memory_budget={budget!r} is a fraction of device memory, which graphcomp only defines "
                f"for CUDA devices; this graph is on {device}: give the budget in bytes (an int)"
            )
        return int(budget * total)
    return int(budget)


def persistent_inputs(gm: fx.GraphModule, stage: str, fw_static_idxs: Iterable[int] | None) -> set[fx.Node] | None:
    """The placeholders of a stage graph that outlive it: the forward's static
    inputs (AOTAutograd's parameters and buffers) by position; in the backward, the
    ones AOTAutograd names after those forward inputs (``primals_<i+1>``). None when
    the static inputs are unknown (hand-built graphs): every input then counts as
    live throughout."""
    if fw_static_idxs is None:
        return None
    static = set(fw_static_idxs)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if stage == "bwd":
        names = {f"primals_{i + 1}" for i in static}
        return {n for n in phs if n.name in names}
    return {n for i, n in enumerate(phs) if i in static}


TIMELINE_POINTS = 400
"""Most points of a timeline in ``summary.json`` (longer graphs keep each bucket's maximum)."""


def bucket_max(values: list[int], step: int) -> list[int]:
    """The maximum of each run of ``step`` consecutive values (the last run may be shorter)."""
    return [max(values[i:i + step]) for i in range(0, len(values), step)]


def timeline_summary(nodes: list[fx.Node], conservative: list[int], inductor: list[int],
                     points: int = TIMELINE_POINTS) -> dict[str, Any]:
    """JSON of the memory over a graph for charts (``graphcomp inspect --html``):
    ``bytes`` (the ``peak_bytes`` model) and ``bytes_inductor`` per bucket of
    ``step`` nodes in graph order (each bucket's maximum, so the peak survives),
    and the graph positions of the collectives (``[index, kind]``)."""
    step = max(1, -(-len(nodes) // points))
    colls = [[i, k] for i, n in enumerate(nodes) if (k := gu.collective_kind(n)) is not None]
    return {"num_nodes": len(nodes), "step": step, "bytes": bucket_max(conservative, step),
            "bytes_inductor": bucket_max(inductor, step), "collectives": colls}


def allocated_peak(mem: dict[str, Any], codegen: str) -> int | None:
    """From a :func:`summary`: the estimated peak ``torch.cuda.max_memory_allocated``
    would count for a graph compiled with ``codegen`` (Inductor's fusion modelled for
    ``"inductor"``, every FX value materialized otherwise); None if not estimated."""
    flat = mem.get("peak_bytes_allocated", mem.get("peak_bytes"))
    return mem.get("peak_bytes_inductor", flat) if codegen == "inductor" else flat


def summary(gm: fx.GraphModule, top: int = 5, persistent: Iterable[fx.Node] | None = None) -> dict[str, Any]:
    """JSON for ``summary.json`` / ``graphcomp inspect``: estimated peak, where it
    occurs (node, its op, position) and the largest storages live there.
    ``peak_bytes`` is the conservative figure the budget uses (collective inputs
    held until their wait); ``peak_bytes_allocated`` is what the CUDA caching
    allocator reports as allocated (``inputs_until_wait=False``) when every FX value
    is materialized (``codegen="eager"``); ``peak_bytes_inductor`` the same with
    Inductor's fusion and in-place reuse modelled (``fused=True``), with its node;
    ``timeline`` both models over the graph (:func:`timeline_summary`)."""
    try:
        nodes, live, size = intervals(gm, persistent=persistent)
        est = _estimate_from(nodes, live, size)
        alloc = estimate(gm, persistent=persistent, inputs_until_wait=False)
        ind_ivs = intervals(gm, persistent=persistent, inputs_until_wait=False, fused=True)
        ind = _estimate_from(*ind_ivs)
        line = timeline_summary(nodes, _timeline_from(nodes, live, size), _timeline_from(*ind_ivs))
    except Exception as e:  # a graph the model does not understand: say so, never fail the compile
        return {"error": f"{type(e).__name__}: {e}"}
    out = est.to_json()
    out["timeline"] = line
    out["peak_bytes_allocated"] = alloc.peak_bytes
    out["peak_bytes_inductor"] = ind.peak_bytes
    out["peak_node_inductor"] = ind.peak_node
    out["persistent_inputs"] = None if persistent is None else len(list(persistent))
    if est.peak_index >= 0:
        at = est.peak_index
        out["peak_op"] = gu.op_name(nodes[at])
        big = sorted(((size[r], r.name) for r, ivs in live.items() if size[r] and any(s <= at <= e for s, e in ivs)),
                     reverse=True)[:top]
        out["largest_live"] = [{"node": n, "bytes": b} for b, n in big]
    return out
