"""Compile regions: where a stage graph's pieces are cut into regions the codegen
compiles apart (``Config.compile_regions``; used by ``partition_graph``).

With ``Config.compile_regions`` (Inductor codegen) the pieces are divided into
*regions* (:func:`region_cuts`). Anchors come first: after a collective's wait, at a
point where no collective is in flight and no multi-output node is separated from
its getitems, once the region since the last cut holds ``Config.region_min_nodes``
compute nodes. In a sharded transformer every block's gather (forward) or
reduce-scatter (backward) gives one such point per block. Each cut then moves from
its anchor to the nearby point the fewest bytes of values cross (inside a captured
piece a collective may be in flight across it, its wait in the next region), so the
regions are the blocks, cut where little is live, and the codegen compiles each
distinct region once (``graphcomp.compiler.codegen``). Where
pieces are captured, a region is a unit of compilation only: each node carries its
region's index within its piece (``node.meta[REGION_META]``), the codegen compiles
the regions apart and runs them in order inside the piece, and the piece is still
captured as one CUDA graph (one graph per region would make ``cudaGraphLaunch``
block the host once about ten are queued). Where nothing is captured (CPU
graphs, ``cudagraphs="off"``) the regions are eager pieces, each Inductor-compiled.
``compile_regions="auto"`` (the default) keeps the regions only in captured pieces
of a graph with static shapes that cuts into at least ``Config.region_auto_min``
regions (a deep model); other graphs compile whole.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import torch.fx as fx

from graphcomp.analysis import graph_utils
from graphcomp.analysis import memory

c10d = torch.ops._c10d_functional


REGION_META = "graphcomp_region"
"""``node.meta`` key: the index of the node's compile region within its piece
(``compile_regions`` with captured pieces; see the module docstring)."""


def waits_of(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if graph_utils.is_target(u, c10d.wait_tensor.default)] + [
        w for g in node.users if g.op == "call_function" and g.target is operator.getitem
        for w in g.users if graph_utils.is_target(w, c10d.wait_tensor.default)
    ]


def is_compute(m: fx.Node) -> bool:
    """A node that counts toward a piece's size (a ``getitem`` does not)."""
    return not (m.op == "call_function" and m.target is operator.getitem)


def compute_nodes(ns: Sequence[fx.Node]) -> int:
    return sum(1 for m in ns if is_compute(m))


def region_cuts(nodes: Sequence[fx.Node], min_nodes: int, in_flight_ok: bool = False) -> list[int]:
    """Positions ``p`` (a cut before ``nodes[p]``) that split ``nodes`` into regions.

    First the anchors: a position is a candidate when it follows a collective's wait
    (the first position after the wait that qualifies) and cuts no span between a
    collective and its last wait, nor between a node and its last ``getitem``.
    Candidates are taken in order once the region since the previous cut holds at
    least ``min_nodes`` compute nodes; a last region smaller than that joins the one
    before. In a sharded transformer that gives one anchor per block.

    Then each anchor moves to the position around it (between the midpoints to its
    neighbouring anchors, leaving at least ``min_nodes // 2`` compute nodes on either
    side) that the fewest bytes of Inductor-made values cross (:func:`crossing_bytes`):
    such a value is written to memory by one region and read back by the next, and
    the fusion Inductor would have made of its producer and consumers is lost. On a
    tie, a point right after an extern kernel (a matmul: its output is in memory
    anyway, and its pointwise consumers fuse in the next region as they would have),
    then the nearest to the anchor. The anchor itself, the first point after a
    wait with nothing in flight, often sits mid-block, where a block's intermediates
    are live (in a block's backward, the SwiGLU recomputation cut from its gradient,
    which then writes and reads back activation-sized values). With ``in_flight_ok``
    (regions compiled apart inside one captured piece) a cut may leave a collective
    in flight, its wait in a later region; otherwise positions keep the anchors'
    rule. A multi-output node and its getitems are never cut apart. Identical blocks
    give anchors at the same offset in every block, and so the same moved cuts: the
    regions stay identical."""
    return region_cuts_and_free(nodes, min_nodes, in_flight_ok)[0]


def region_cuts_and_free(nodes: Sequence[fx.Node], min_nodes: int, in_flight_ok: bool) -> tuple[list[int], list[bool]]:
    """:func:`region_cuts`, and per position whether no collective is in flight across it."""
    anchors, free, tied = _anchor_cuts(nodes, min_nodes)
    if not anchors:
        return anchors, free
    cost = crossing_bytes(nodes)
    ok = [not tied[p] and (in_flight_ok or free[p]) for p in range(len(nodes) + 1)]
    compute = [0]
    for m in nodes:
        compute.append(compute[-1] + is_compute(m))
    bounds = [0, *anchors, len(nodes)]
    half = max(1, min_nodes // 2)  # a moved cut leaves at least this many compute nodes on either side
    cuts: list[int] = []
    for k in range(1, len(bounds) - 1):
        a = bounds[k]
        lo = max((bounds[k - 1] + a) // 2 + 1, cuts[-1] + 1 if cuts else 1)
        hi = (a + bounds[k + 1]) // 2
        prev = compute[cuts[-1]] if cuts else 0
        best = min((p for p in range(lo, hi + 1) if ok[p] and compute[p] - prev >= half
                    and compute[len(nodes)] - compute[p] >= half),
                   key=lambda p: (cost[p], not memory.makes_own_buffer(nodes[p - 1]), abs(p - a), p), default=a)
        cuts.append(best)
    return cuts, free


def crossing_bytes(nodes: Sequence[fx.Node]) -> list[int]:
    """``cost[p]``: the bytes of the values made by ``nodes[:p]`` that ``nodes[p:]``
    read, counting only values an Inductor-generated kernel makes (an extern
    kernel's output is written to memory whatever the cut: ``memory.makes_own_buffer``).
    Sizes come from the nodes' fake values; a value of unknown size counts 0."""
    pos = {n: i for i, n in enumerate(nodes)}
    diff = [0] * (len(nodes) + 2)
    for n in nodes:
        last = max((pos[u] for u in n.users if u in pos), default=-1)
        if last > pos[n] and not memory.makes_own_buffer(n):
            b = sum(max(graph_utils.nbytes(t), 0) for t in graph_utils.tensor_values(graph_utils.tensor_meta(n)))
            diff[pos[n] + 1] += b
            diff[last + 1] -= b
    cost, run = [], 0
    for p in range(len(nodes) + 1):
        run += diff[p]
        cost.append(run)
    return cost


def _anchor_cuts(nodes: Sequence[fx.Node], min_nodes: int) -> tuple[list[int], list[bool], list[bool]]:
    """The anchor cuts of :func:`region_cuts`, and per position whether no collective
    is in flight across it (``free``) and whether it cuts a node from its getitems
    (``tied``)."""
    pos = {n: i for i, n in enumerate(nodes)}
    blocked = [0] * (len(nodes) + 2)  # difference arrays over positions
    getitems = [0] * (len(nodes) + 2)
    waits: list[int] = []
    for n in nodes:
        ends: list[int] = []
        if graph_utils.collective_kind(n) is not None:
            ends = [pos[w] for w in waits_of(n) if w in pos]
        items = [pos[u] for u in n.users if u in pos and u.op == "call_function" and u.target is operator.getitem]
        ends += items
        if ends and max(ends) > pos[n]:
            blocked[pos[n] + 1] += 1
            blocked[max(ends) + 1] -= 1
        if items and max(items) > pos[n]:
            getitems[pos[n] + 1] += 1
            getitems[max(items) + 1] -= 1
        if graph_utils.is_target(n, c10d.wait_tensor.default):
            waits.append(pos[n])
    free, tied, run, run_g = [], [], 0, 0
    for p in range(len(nodes) + 1):
        run += blocked[p]
        run_g += getitems[p]
        free.append(run == 0)
        tied.append(run_g != 0)
    cuts: list[int] = []
    last, count = 0, [0]
    for m in nodes:
        count.append(count[-1] + is_compute(m))
    # waits come in order, so candidates never go back: one taken is `last`, one
    # rejected stays too small from any later `last`
    for w in waits:
        p = w + 1
        while p < len(nodes) and not free[p]:
            p += 1
        if p >= len(nodes):
            continue
        if p > last and count[p] - count[last] >= min_nodes:
            cuts.append(p)
            last = p
    if cuts and count[len(nodes)] - count[cuts[-1]] < min_nodes:
        cuts.pop()
    return cuts, free, tied
