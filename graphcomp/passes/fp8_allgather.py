"""fp8_allgather (joint): cast the shard to FP8, gather FP8 bytes.

Matches a gathered weight whose every use is graphcomp's FP8 cast (a
``graphcomp.fp8`` linear layer's: the nodes of ``scaling.quantize_weight``, annotated
``graphcomp_fp8``)::

    shard -> [convert(bf16)] -> all_gather -> wait -> [slice/view] -> w
    w -> amax -> scale -> clamp(w * scale) -> to(fp8) -> w8      1/scale -> w_inv

and moves the cast in front of the gather, so that the collective moves one byte per
value (a quarter of fp32's bytes, half of bf16's) and the cast touches 1/world of the
weight. A scale that reads more than one row (tensorwise; a rowwise weight's
per-column scale for the backward) needs every rank's rows: each rank takes its
shard's amax, and every such amax of the graph crosses one all-reduce (MAX) per group,
at the top of the graph::

    shards -> amax each -> cat -> all_reduce(max) -> wait -> split -> scale, 1/scale -> w_inv
    shard -> clamp(shard * scale) -> to(fp8) -> bytes -> all_gather -> wait -> slice -> as fp8 -> w8

A row's scale is its owner's (dim-0 sharding keeps rows whole): no all-reduce; the
shard's rows are cast with their own scales and each row's inverse scale travels
beside its bytes (4 bytes per row)::

    shard -> quantize rows -> [fp8 bytes | scale bytes] -> all_gather -> wait -> slice
        -> (w8, w_inv)

The values are bitwise those of the cast after the gather (amax is exact; the rest is
elementwise or row-local), computed by the same functions (``graphcomp.fp8.scaling``).
The bytes travel as ``uint8`` (gloo has no FP8 type; the bucket ops copy bytes);
``graph_utils.collectives`` reports the FP8 dtype (``graphcomp_fp8`` on the gather).
Runs before ``bucket_collectives`` (FP8 gathers bucket together) and ``schedule_free``:
the cast is marked part of its gather's input chain (``graph_utils.GATHER_PRE``), so
it moves with a prefetched gather and is recomputed with a re-gather; a backward that
reads the FP8 weight (tensorwise: ``grad_x``) re-gathers FP8 bytes. Where a weight
has two casts (rowwise: rows for the forward, columns for the backward), it is
gathered once per cast, each in FP8.

No-op when the graph holds no annotated FP8 cast (no FP8 layer; a torch without
``torch.fx.traceback.annotate``) or no parameter gather (world size 1). Skipped per
weight, counted by reason: the weight is not gathered, is gathered on a
tensor-parallel group (``graph_utils.is_foreign_collective``), is read by anything but
its FP8 casts, is not 2-D, or its gather's shard or views are not the plain ones
``graphcomp.shard`` traces.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from graphcomp import _compat
from graphcomp.analysis import graph_utils as gu
from graphcomp.compiler.pipeline import PassContext, PassResult, register_pass
from graphcomp.fp8 import scaling
from graphcomp.fp8.scaling import ANNOTATION, Cast

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default}


@dataclass
class _Cast:
    cast: Cast
    data: fx.Node | None = None
    scale: fx.Node | None = None
    region: set[fx.Node] = field(default_factory=set)
    local_amax: fx.Node | None = None  # a global cast's shard amax (flattened), at the top


@dataclass
class _Weight:
    w: fx.Node
    casts: dict[str, _Cast] = field(default_factory=dict)
    ag: fx.Node | None = None
    wait: fx.Node | None = None
    chain: list[fx.Node] = field(default_factory=list)  # wait (excl.) -> w (incl.): views and casts
    src_chain: list[fx.Node] = field(default_factory=list)  # shard placeholder -> the gather's input

    @property
    def group(self) -> str:
        return self.ag.args[2]  # type: ignore[union-attr,return-value]


def _mark(n: fx.Node) -> str | None:
    v = _compat.fx_annotations(n).get(ANNOTATION)
    return v if isinstance(v, str) else None


def _casts(gm: fx.GraphModule) -> tuple[dict[fx.Node, _Weight], list[str]]:
    """Every annotated FP8 weight cast, by the (graph) weight it reads; and the reasons
    of those whose weight could not be told."""
    weights: dict[fx.Node, _Weight] = {}
    bad: list[str] = []
    for n in gm.graph.nodes:
        m = _mark(n)
        if m is None or not m.endswith(("/data", "/scale")) or any(_mark(u) == m for u in n.users):
            continue  # (an output is the last node of its mark)
        key, role = m.rsplit("/", 1)
        region, ext, stack = set(), set(), list(n.all_input_nodes)
        while stack:
            a = stack.pop()
            if a in region or a in ext:
                continue
            if _mark(a) is not None:
                region.add(a)
                stack.extend(a.all_input_nodes)
            elif isinstance(gu.tensor_meta(a), torch.Tensor):
                ext.add(a)
        if len(ext) != 1:
            bad.append("cast_reads_other_values")
            continue
        (w,) = ext
        wt = weights.setdefault(w, _Weight(w))
        c = wt.casts.setdefault(key, _Cast(Cast.parse(key)))
        setattr(c, role, n)
        c.region |= region
    return weights, bad


def _find_gather(wt: _Weight) -> str | None:
    """Fill ``wt``'s gather, wait and view/cast chain, or say why not."""
    chain, n = [], wt.w
    while n.op == "call_function" and isinstance(n.args[0] if n.args else None, fx.Node) and (
            gu.dtype_cast(n) is not None or n.target in gu.VIEW_OPS):
        chain.append(n)
        n = n.args[0]
    if not gu.is_target(n, c10d.wait_tensor.default) or not gu.is_target(n.args[0], c10d.all_gather_into_tensor.default):
        return "not_gathered"
    ag = n.args[0]
    if gu.is_foreign_collective(ag):
        return "tensor_parallel"
    wt.ag, wt.wait, wt.chain = ag, n, list(reversed(chain))
    for v in wt.chain:
        if v.target is aten.slice.Tensor:
            dim, start = (list(v.args[1:3]) + [0, None])[:2]
            step = v.args[4] if len(v.args) > 4 else 1
            if dim != 0 or start not in (0, None) or step != 1:
                return "view_chain"
        elif gu.dtype_cast(v) is None and v.target not in _VIEWS:
            return "view_chain"
    full, w = gu.tensor_meta(ag), gu.tensor_meta(wt.w)
    if not isinstance(full, torch.Tensor) or not isinstance(w, torch.Tensor) or full.dim() != 2 or w.dim() != 2:
        return "not_2d"
    if any(not isinstance(d, int) for d in (*full.shape, *w.shape)):
        return "symbolic_shape"
    if w.shape[1] != full.shape[1] or w.shape[0] > full.shape[0]:
        return "view_chain"
    # the gathered value is read by its FP8 casts only, and only their outputs leave them
    if any(c.data is None or c.scale is None for c in wt.casts.values()):
        return "incomplete_cast"
    region = {u for c in wt.casts.values() for u in c.region}
    outs = {o for c in wt.casts.values() for o in (c.data, c.scale)}
    for v in [n, *wt.chain]:
        if any(u not in region and u not in outs and u not in wt.chain for u in v.users):
            return "used_beside_fp8"
    if any(u not in region and u not in outs for r in region for u in r.users):
        return "used_beside_fp8"
    src = ag.args[0]
    sc, s = [src], src
    while s.op != "placeholder":
        if not (s.op == "call_function" and s.args and isinstance(s.args[0], fx.Node)
                and (gu.dtype_cast(s) is not None or s.target in gu.VIEW_OPS)):
            return "shard_chain"
        s = s.args[0]
        sc.append(s)
    wt.src_chain = list(reversed(sc))
    return None


class _Emit:
    """Nodes added to ``gm``: single ops (their fake values evaluated), or a function of
    ``graphcomp.fp8.scaling`` traced onto nodes, with the decompositions the graph was
    traced with (Inductor's for Inductor codegen: it meets no op it knows only decomposed)."""

    def __init__(self, gm: fx.GraphModule, decomps: dict | None) -> None:
        self.gm, self.decomps = gm, decomps

    def node(self, target: Any, args: tuple, meta: dict[str, Any] | None = None) -> fx.Node:
        n = self.gm.graph.call_function(target, args)
        gu.fake_eval(self.gm, n)
        n.meta.update(meta or {})
        return n

    def inline(self, fn: Callable[..., tuple], args: list[fx.Node], before: fx.Node,
               meta: dict[str, Any] | None = None) -> tuple[fx.Node, ...]:
        """``fn(*args)`` traced on the args' fake values and copied in before ``before``;
        returns its output nodes. ``meta``: set on every node copied in."""
        from torch.fx.experimental.proxy_tensor import make_fx

        def traced(*xs: torch.Tensor) -> tuple:
            return fn(*xs)

        mode = gu.fake_mode_of(self.gm)
        with mode if mode is not None else contextlib.nullcontext():  # (constants made inside are fake too)
            sub = make_fx(traced, decomposition_table=self.decomps, tracing_mode="real")(
                *[a.meta["val"] for a in args])
        g = self.gm.graph
        val_map: dict[fx.Node, fx.Node] = dict(zip([n for n in sub.graph.nodes if n.op == "placeholder"], args))
        with g.inserting_before(before):
            outs = g.graph_copy(sub.graph, val_map)
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        for n in [val_map[n] for n in sub.graph.nodes if n.op == "call_function"]:
            if n.target in (aten.detach.default, aten.alias.default):  # (make_fx's, around views: identities)
                n.replace_all_uses_with(n.args[0])
                outs = [n.args[0] if o is n else o for o in outs]
                g.erase_node(n)
                continue
            n.meta.update(meta or {})
        return tuple(outs)


def _pack_rows(s: torch.Tensor, cast: Cast) -> tuple[torch.Tensor]:
    """A shard's rows cast with their own scales, each row's inverse scale appended as bytes."""
    data, inv = scaling.quantize(s, cast)
    return (torch.cat([data.view(torch.uint8), inv.view(torch.uint8)], dim=1),)


def _unpack_rows(g: torch.Tensor, rows: int, cols: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = g[:rows]
    return g[:, :cols].contiguous().view(dtype), g[:, cols:].contiguous().view(torch.float32)


def _gather(em: _Emit, wt: _Weight, c: _Cast, send: fx.Node) -> fx.Node:
    """``send`` (FP8 bytes, or bytes and scales) all-gathered where ``wt``'s gather was;
    returns the new wait, placed where the old wait was."""
    g, ag = em.gm.graph, wt.ag
    dname = str(c.cast.dtype).replace("torch.", "")
    send.meta[gu.FP8_WIRE] = dname  # (the verifier: this shard crosses the wire as FP8)
    meta = {gu.FP8_WIRE: dname}
    if ag.meta.get("stack_trace"):
        meta["stack_trace"] = ag.meta["stack_trace"]  # (rank agreement names the model line)
    with g.inserting_before(ag):
        nag = em.node(c10d.all_gather_into_tensor.default, (send, ag.args[1], ag.args[2]), meta)
    with g.inserting_before(wt.wait):
        return em.node(c10d.wait_tensor.default, (nag,))


def _as_read(em: _Emit, wt: _Weight, shard: fx.Node, before: fx.Node) -> fx.Node:
    """``shard`` (the gather's input) cast as the weight is read after the gather (the
    dtype casts between the gather and the weight, e.g. to ``param_dtype`` when
    ``fuse_allgather_downcast`` is off): casts commute with the gather's views."""
    for v in wt.chain:
        dt = gu.dtype_cast(v)
        if dt is not None:
            with em.gm.graph.inserting_before(before):
                shard = em.node(torch.ops.prims.convert_element_type.default, (shard, dt), {gu.GATHER_PRE: True})
    return shard


def _shard_at_top(em: _Emit, wt: _Weight, top: fx.Node) -> fx.Node:
    """The shard as the weight is read, recomputed from the placeholder at the top of
    the graph (the amax reads it there; Inductor fuses the casts into the reduction)."""
    val_map = {wt.src_chain[0]: wt.src_chain[0]}
    node = wt.src_chain[0]
    for n in wt.src_chain[1:]:
        with em.gm.graph.inserting_before(top):
            node = em.gm.graph.node_copy(n, lambda a: val_map[a])
        val_map[n] = node
    return _as_read(em, wt, node, top)


def _rewrite_rows(em: _Emit, wt: _Weight, c: _Cast) -> int:
    """A per-row cast: on the shard, its scales beside its bytes. Returns the wire bytes."""
    cast, src = c.cast, _as_read(em, wt, wt.ag.args[0], wt.ag)
    rows, cols = gu.tensor_meta(wt.w).shape
    (packed,) = em.inline(lambda s: _pack_rows(s, cast), [src], wt.ag, {gu.GATHER_PRE: True})
    nw = _gather(em, wt, c, packed)
    data, inv = em.inline(lambda x: _unpack_rows(x, rows, cols, cast.dtype), [nw], wt.wait, {gu.GATHER_POST: True})
    c.data.replace_all_uses_with(data)
    c.scale.replace_all_uses_with(inv)
    return gu.nbytes(gu.tensor_meta(nw))


def _rewrite_global(em: _Emit, wt: _Weight, c: _Cast, scale: fx.Node, inv: fx.Node) -> int:
    """A cast whose scale read every row: the agreed scale applied to the shard."""
    cast, src = c.cast, _as_read(em, wt, wt.ag.args[0], wt.ag)
    rows = gu.tensor_meta(wt.w).shape[0]
    (q,) = em.inline(lambda s, sc: (scaling.to_fp8(scaling.scaled(s, sc), cast).view(torch.uint8),),
                     [src, scale], wt.ag, {gu.GATHER_PRE: True})
    nw = _gather(em, wt, c, q)
    with em.gm.graph.inserting_before(wt.wait):
        data = em.node(aten.view.dtype, (em.node(aten.slice.Tensor, (nw, 0, 0, rows)), cast.dtype))
    c.data.replace_all_uses_with(data)
    c.scale.replace_all_uses_with(inv)
    return gu.nbytes(gu.tensor_meta(nw))


def _agree_amaxes(em: _Emit, top: fx.Node, casts: list[_Cast], group: str) -> list[tuple[fx.Node, fx.Node]]:
    """One all-reduce (MAX) of every shard amax in ``casts`` (one group), at the top;
    returns each cast's (scale, inverse scale), computed after it."""
    sizes = [int(gu.tensor_meta(c.local_amax).numel()) for c in casts]
    with em.gm.graph.inserting_before(top):
        flat = em.node(aten.cat.default, ([c.local_amax for c in casts],)) if len(casts) > 1 else casts[0].local_amax
        w = em.node(c10d.wait_tensor.default, (em.node(c10d.all_reduce.default, (flat, "max", group)),))
        parts = em.node(aten.split_with_sizes.default, (w, sizes))
        got = [em.node(operator.getitem, (parts, i)) for i in range(len(casts))]
    out = []
    for c, part, n in zip(casts, got, sizes):
        shape = (1, n) if c.cast.axis == "col" else ()

        def scales(x: torch.Tensor, cast: Cast = c.cast, shape: tuple = shape) -> tuple[torch.Tensor, torch.Tensor]:
            s = scaling.amax_to_scale(x.reshape(shape), cast)
            return s, s.reciprocal()

        out.append(em.inline(scales, [part], top))
    return out


def _erase_dead(gm: fx.GraphModule, cands: set[fx.Node]) -> None:
    order = [n for n in reversed(gm.graph.nodes) if n in cands]
    for n in order:  # (users come later in the graph: reversed order erases them first)
        if not n.users:
            gm.graph.erase_node(n)


@register_pass("fp8_allgather", stages=("joint",), after=("fuse_allgather_downcast",), before=("bucket_collectives",))
def fp8_allgather(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    weights, bad = _casts(gm)
    for why in bad:
        ctx.count(f"skipped:{why}")
    if not weights:
        return ctx.unchanged(gm, "no FP8 weight cast in the graph (no graphcomp.fp8 layer, or a torch that does not "
                                 "annotate graphs)")
    if not gu.gathers(gm):
        ctx.count("skipped:not_gathered", len(weights))
        return ctx.unchanged(gm, "the FP8 weights are not gathered (world size 1 or an unsharded model)")
    ok: list[_Weight] = []
    for wt in weights.values():
        why = _find_gather(wt)
        if why is None:
            ok.append(wt)
        else:
            ctx.count(f"skipped:{why}")
    if not ok:
        return ctx.unchanged(gm, f"none of the {len(weights)} FP8 weights can be cast before its gather "
                                 "(see the skipped:* counts)")
    em = _Emit(gm, _compat.inductor_decompositions() if ctx.config.codegen == "inductor" else None)
    top = next(n for n in gm.graph.nodes if n.op != "placeholder")
    wire = 0
    pending: dict[str, list[tuple[_Weight, _Cast]]] = {}
    for wt in ok:  # first the shards' amaxes and their all-reduce, at the top
        src_top = None
        for _, c in sorted(wt.casts.items()):
            if c.cast.global_rows:
                src_top = src_top or _shard_at_top(em, wt, top)
                cast = c.cast
                (c.local_amax,) = em.inline(lambda s: (scaling.amax(s, cast).reshape(-1),), [src_top], top)
                pending.setdefault(wt.group, []).append((wt, c))
    for group, items in pending.items():
        got = _agree_amaxes(em, top, [c for _, c in items], group)
        for (wt, c), (scale, inv) in zip(items, got):
            wire += _rewrite_global(em, wt, c, scale, inv)
        ctx.note(f"amax all-reduce on group {group}: {len(items)} casts")
    for wt in ok:
        for _, c in sorted(wt.casts.items()):
            if not c.cast.global_rows:
                wire += _rewrite_rows(em, wt, c)
    n_casts = sum(len(wt.casts) for wt in ok)
    before = sum(gu.nbytes(gu.tensor_meta(wt.ag)) for wt in ok)
    dead: set[fx.Node] = set()
    for wt in ok:
        dead |= {wt.ag, wt.wait, *wt.chain, wt.w}
        for c in wt.casts.values():
            dead |= c.region | {c.data, c.scale}
    _erase_dead(gm, dead)
    ctx.count("weights_fp8", len(ok))
    ctx.count("gathers_fp8", n_casts)
    ctx.count("amax_all_reduces", len(pending))
    ctx.count("wire_bytes_before", before)
    ctx.count("wire_bytes_after", wire)
    ctx.counter("fp8_gathers", n_casts)
    ctx.counter("fp8_amax_all_reduces", len(pending))
    return ctx.changed(gm)
