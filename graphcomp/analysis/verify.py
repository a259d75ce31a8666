"""The collective verifier: after every pass, check against the graph before it that
no parameter lost a gather and no gradient lost (or gained) its reduce-scatter.

What it compares (an :class:`Inventory` of each graph, aten stages only)::

    gathers   (shard placeholder, group) -> how many all-gathers read it
              (a bucket reads several shards: each counts once)
    wire      shard placeholder -> dtypes it crosses the wire in
    reduces   (graph output #i, group) -> how many reduce-scatters flow into it
              (a bucket flows into several gradients: each counts once)
    rs dtype  graph output #i -> dtypes its reduce-scatters run in

Rules: a shard gathered on a group before a pass is still gathered on it after
(a pass may merge two gathers of one shard, e.g. a tied weight read twice, into one
bucket or one gather: the count may drop, never to zero; a shard not gathered
before is not gathered after); likewise a gradient reduce-scattered before is
still reduce-scattered after, on the same group, never more often (a tied weight's
two gradient contributions may share one bucket: its count drops from 2 to 1), and a
gradient that had none gets none. (The verifier counts collectives a value passes
through, not the contributions inside one bucket: one of a tied weight's two
contributions lost inside a bucket is for the numerics tests to catch); a shard crosses the wire in a dtype it crossed in before, or in the dtype it
was cast to right after its gather (the fused downcast of
``fuse_allgather_downcast``; the FP8 cast of ``fp8_allgather``, whose bytes travel as
``uint8`` and count as FP8, and whose row- and column-scaled gathers of one shard
count as one gather of it); a gradient's reduce-scatter dtype is unchanged. A
violation raises :class:`graphcomp.errors.CollectiveVerifyError` naming the pass,
the stage and the shard or gradient. The shard behind a gather is found by walking
its inputs back to placeholders, the gradient behind a reduce-scatter by walking
its users forward to the graph's outputs, so fused and bucketed forms count like
plain ones. Split graphs (after ``partition_graph``) are not inventoried: that
pass moves nodes into pieces and changes no collective.

Cost: ``Config.verify_collectives`` (on by default) -- see the README's
"Distributed safety" section for the measurement.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from graphcomp.analysis import graph_utils
from graphcomp.errors import CollectiveVerifyError

STAGES = ("joint", "fwd", "bwd", "inference")


@dataclass
class Inventory:
    gathers: collections.Counter = field(default_factory=collections.Counter)
    wire: dict[str, set[str]] = field(default_factory=dict)
    cast_after: dict[str, set[str]] = field(default_factory=dict)
    reduces: collections.Counter = field(default_factory=collections.Counter)
    rs_dtypes: dict[int, set[str]] = field(default_factory=dict)
    outputs: dict[int, str] = field(default_factory=dict)  # output # -> the node it returns (messages)


def _dtype(node: fx.Node) -> str | None:
    ts = graph_utils.tensor_values(graph_utils.tensor_meta(node))
    return str(ts[0].dtype).replace("torch.", "") if ts else None


def _shards_behind(node: fx.Node) -> dict[str, str | None]:
    """The placeholders a gather reads, each with the FP8 dtype it crosses the wire in
    when its path passes a shard's FP8 cast (``graph_utils.FP8_WIRE`` on the send
    buffer, ``fp8_allgather``), else None. The walk stops at other collectives' waits
    (an FP8 scale's amax all-reduce reads every shard; it gathers none of them)."""
    out: dict[str, str | None] = {}
    seen: set[tuple[fx.Node, str | None]] = set()
    stack: list[tuple[fx.Node, str | None]] = [(a, node.meta.get(graph_utils.FP8_WIRE)) for a in node.all_input_nodes]
    while stack:
        n, fp8 = stack.pop()
        if (n, fp8) in seen:
            continue
        seen.add((n, fp8))
        fp8 = n.meta.get(graph_utils.FP8_WIRE, fp8) if n.op == "call_function" else fp8
        if n.op == "placeholder":
            if n.name not in out or fp8 is None:
                out[n.name] = fp8
        elif not (graph_utils.is_target(n, graph_utils.c10d.wait_tensor.default)
                  or graph_utils.collective_kind(n) is not None):
            stack.extend((a, fp8) for a in n.all_input_nodes)
    return out


def _fp8_cast_dtype(users: list[fx.Node]) -> str | None:
    """The FP8 dtype ``users`` cast to, when every one is an annotated FP8 weight cast
    (``graphcomp.fp8.scaling.quantize_weight``), else None."""
    from graphcomp import _compat
    from graphcomp.fp8.scaling import ANNOTATION, Cast

    dts = set()
    for u in users:
        mark = _compat.fx_annotations(u).get(ANNOTATION)
        if not isinstance(mark, str):
            return None
        dts.add(str(Cast.parse(mark.rsplit("/", 1)[0] if "/" in mark else mark).dtype).replace("torch.", ""))
    return dts.pop() if len(dts) == 1 else None


def _cast_after(gather: fx.Node) -> set[str]:
    """The dtypes the gather's (waited, viewed) value is cast to right after it, when
    every user casts: one plain dtype, graphcomp's FP8 weight cast, or both (a cast to
    ``param_dtype``, then the FP8 cast)."""
    wait = graph_utils.single_wait(gather)
    if wait is None:
        return set()
    end = graph_utils.view_chain(wait)[-1]
    users = list(end.users)
    if not users:
        return set()
    fp8 = _fp8_cast_dtype(users)
    if fp8 is not None:
        return {fp8}
    casts = {graph_utils.dtype_cast(u) for u in users}
    if len(casts) == 1 and None not in casts:
        out = {str(casts.pop()).replace("torch.", "")}
        fp8 = _fp8_cast_dtype([v for u in users for v in u.users])
        return out | ({fp8} if fp8 else set())
    return set()


def inventory(gm: fx.GraphModule) -> Inventory | None:
    """The graph's inventory, or None for a split graph (pieces as submodules)."""
    nodes = list(gm.graph.nodes)
    if any(n.op == "call_module" for n in nodes):
        return None
    inv = Inventory()
    out_node = next((n for n in reversed(nodes) if n.op == "output"), None)
    outs: list[Any] = []
    if out_node is not None:
        a = out_node.args[0]
        outs = list(a) if isinstance(a, (list, tuple)) else [a]
    pos: dict[fx.Node, list[int]] = collections.defaultdict(list)
    for i, o in enumerate(outs):
        if isinstance(o, fx.Node):
            pos[o].append(i)
            inv.outputs[i] = o.name
    fp8_counted: set[tuple[str, str | None]] = set()
    for n in nodes:
        kind = graph_utils.collective_kind(n)
        if kind is None or graph_utils.is_foreign_collective(n):
            continue
        group = graph_utils.collective_group(n)
        if kind == "all_gather":
            dt = _dtype(n)
            cast = _cast_after(n)
            for p, fp8 in _shards_behind(n).items():
                if fp8 is None or (p, group) not in fp8_counted:
                    inv.gathers[(p, group)] += 1
                if fp8 is not None:  # a shard's FP8 casts (rows, columns) count as one gather of it
                    fp8_counted.add((p, group))
                inv.wire.setdefault(p, set()).add(fp8 or str(dt))
                if cast:
                    inv.cast_after.setdefault(p, set()).update(cast)
        elif kind == "reduce_scatter":
            src = [a for a in n.all_input_nodes if graph_utils.tensor_values(graph_utils.tensor_meta(a))]
            dt = _dtype(src[0]) if src else None
            seen: set[fx.Node] = set()
            stack = list(n.users)
            hit: set[int] = set()
            while stack:
                u = stack.pop()
                if u in seen or u.op == "output":
                    continue
                seen.add(u)
                hit.update(pos.get(u, ()))
                stack.extend(u.users)
            for i in sorted(hit):
                inv.reduces[(i, group)] += 1
                inv.rs_dtypes.setdefault(i, set()).add(str(dt))
    return inv


def check(before: Inventory, after: Inventory, pass_name: str, stage: str, frame_id: int) -> None:
    """Raise CollectiveVerifyError when ``after`` breaks a rule against ``before``."""
    where = f"graphcomp: pass {pass_name!r} broke the collectives of the {stage} graph of frame {frame_id}"
    tail = (" (graphcomp bug in that pass: disable it with Config.passes={%r: False} and report it; "
            "Config.verify_collectives=False skips this check)" % pass_name)
    for key in sorted(set(before.gathers) | set(after.gathers), key=str):
        b, a = before.gathers[key], after.gathers[key]
        if (a > 0) != (b > 0) or a > b:
            p, g = key
            raise CollectiveVerifyError(
                f"{where}: shard {p!r} is all-gathered {a} time(s) on group {g!r}, {b} before the pass "
                f"(every parameter gathered before must stay gathered, on its group; a pass may merge a "
                f"shard's gathers, not add or drop them all){tail}")
    for p, dts in sorted(after.wire.items()):
        ok = before.wire.get(p, set()) | before.cast_after.get(p, set())
        bad = sorted(dts - ok)
        if bad:
            raise CollectiveVerifyError(
                f"{where}: shard {p!r} is gathered in {bad}, but before the pass it crossed the wire in "
                f"{sorted(before.wire.get(p, set()))} (allowed: that, or the dtype it was cast to right after "
                f"the gather: {sorted(before.cast_after.get(p, set()))}){tail}")
    for key in sorted(set(before.reduces) | set(after.reduces), key=str):
        b, a = before.reduces[key], after.reduces[key]
        if (a > 0) != (b > 0) or a > b:
            i, g = key
            name = after.outputs.get(i) or before.outputs.get(i)
            raise CollectiveVerifyError(
                f"{where}: gradient output #{i} ({name}) is reduce-scattered {a} time(s) on group {g!r}, {b} "
                f"before the pass (every gradient reduce-scattered before must stay reduce-scattered, on its group, "
                f"never more often){tail}")
    for i, dts in sorted(after.rs_dtypes.items()):
        if dts != before.rs_dtypes.get(i, dts):
            raise CollectiveVerifyError(
                f"{where}: gradient output #{i} ({after.outputs.get(i)}) is reduce-scattered in {sorted(dts)}, "
                f"{sorted(before.rs_dtypes[i])} before the pass{tail}")


def enabled(cfg: Any, stage: str) -> bool:
    mode = cfg.verify_collectives
    return stage in STAGES and (mode is True or (mode == "debug" and cfg.debug))
