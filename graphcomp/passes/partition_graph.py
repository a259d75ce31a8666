"""partition_graph (fwd / bwd): cut the stage graph where CUDA graphs cannot go.

Matches every node of a stage graph that a CUDA graph cannot capture, and records
why (a frozen :class:`SplitReason` per cut node)::

    kind              what
    cpu               a CPU tensor in or out of the node (CPU op)
    host_sync         an op that reads device data on the host (``.item()``,
                      ``_local_scalar_dense``, any op tagged ``data_dependent_output``)
    data_dependent    an op whose output shape depends on data (``nonzero``, ...;
                      tag ``dynamic_output_shape``)
    device_copy       a copy between devices (``_to_copy(device=...)``, ``copy_``)
    cudagraph_unsafe  an op tagged ``torch.Tag.cudagraph_unsafe``
    unbacked_shape    an output with an unbacked (data-dependent) symbolic size
    user_split_op     the op is named in ``Config.split_ops``
    rng               an RNG op that is not graph-safe (explicit ``generator=``,
                      RNG state get/set)
    collective_pair   a collective and its wait would land in different pieces
    too_small         a capturable run shorter than ``Config.min_piece_nodes``
    prefetched        a node a pass marked eager (``node.meta["graphcomp_eager"]``):
                      ``prefetch_across_steps``' gather, which decides on the host,
                      and the table lookups that read it

With ``Config.compile_regions`` (Inductor codegen) the pieces are divided into
compile regions (:mod:`graphcomp.passes.regions`: where the cuts go and why);
``compile_regions="auto"`` (the default) keeps the regions only in captured pieces
of a graph with static shapes that cuts into at least ``Config.region_auto_min``
regions (a deep model); other graphs compile whole.

Rewrites the graph with ``split_module(keep_original_order=True)`` into a
top-level glue graph calling ``piece_0 .. piece_N`` (original node order kept);
consecutive nodes with the same mode (``cudagraph`` / ``eager``) form one piece.
A collective and its wait always stay in one piece (or both run eagerly). The result
is a :class:`graphcomp.compiler.plan.SplitPlan` (the split graph, the graph it was split from,
a :class:`~graphcomp.compiler.plan.Piece` per piece with its mode and reason, and every
:class:`~graphcomp.compiler.plan.SplitReason`) stored as ``ctx.frame.splits[<stage>]``: the
cudagraphs pass adds its runner plan to the pieces, the codegen
(``graphcomp.compiler.codegen``) compiles them, and summaries render its rows.

No-op (nothing split, numerics untouched) when the graph holds no CUDA tensors
(all CPU runs and CI) or ``Config.cudagraphs == "off"`` or the cudagraphs pass is
disabled, unless ``Config.compile_regions=True`` asks for regions.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from graphcomp import _compat
from graphcomp.analysis import graph_utils
from graphcomp.compiler.pipeline import PassContext, PassResult, register_pass
from graphcomp.passes.regions import REGION_META, compute_nodes, region_cuts_and_free, waits_of
from graphcomp.compiler.plan import EAGER_META, REASON_KINDS, Piece, SplitPlan, SplitReason  # noqa: F401 (REASON_KINDS, SplitReason: re-exported)

log = logging.getLogger(__name__)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


# host syncs that are not tagged data_dependent_output in every torch version
_HOST_SYNC_NAMES = {"_local_scalar_dense", "item", "is_nonzero", "equal", "allclose", "_assert_scalar"}
_COPY_NAMES = {"_to_copy", "copy_", "copy", "_copy_from", "_copy_from_and_resize", "to", "_to_cpu", "pin_memory"}
_RNG_STATE_NAMES = {"get_rng_state", "set_rng_state", "seed", "manual_seed", "initial_seed"}


def _short_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def _matches_split_op(node: fx.Node, split_ops: Sequence[str]) -> str | None:
    if not split_ops:
        return None
    full = graph_utils.op_name(node)  # e.g. aten.nonzero.default
    short = _short_name(node.target)
    packet = ".".join(full.split(".")[:2])
    for s in split_ops:
        s2 = s.replace("::", ".").removeprefix("torch.ops.")
        if s2 in (full, packet, short):
            return s
    return None


# custom ops of other libraries known to synchronize with the host inside (a capture
# of them fails: cut around them up front rather than at capture time)
_KNOWN_HOST_SYNC_OPS = {
    "transformers::grouped_mm_fallback": "reads its group offsets on the host (.tolist()) inside the op",
}


def _shape_depends_on_data(node: fx.Node) -> bool:
    """An op tagged ``dynamic_output_shape`` *may* produce a data-dependent shape
    (``aten.index.Tensor`` with a boolean mask does; with integer index tensors it
    does not). Decide from the traced output: only unbacked sizes (``u0``...) are
    data-dependent; an output without traced values is assumed to be."""
    vals = graph_utils.tensor_values(node.meta.get("val"))
    if not vals:
        return True
    return any(_is_unbacked(t) for t in vals)


def _is_unbacked(t: torch.Tensor) -> str | None:
    syms = []
    for s in list(t.shape) + list(t.stride()):
        if isinstance(s, torch.SymInt):
            syms.extend(str(x) for x in s.node.expr.free_symbols)
    bad = [s for s in syms if s.startswith("u")]
    return ", ".join(sorted(set(bad))) if bad else None


def uncapturable_reason(node: fx.Node, split_ops: Sequence[str] = ()) -> SplitReason | None:
    """The per-node capturability predicate: None when ``node`` can be captured in
    a CUDA graph, else the reason. Placeholders and the output never cut."""
    if node.op in ("placeholder", "output", "get_attr"):
        return None
    name = node.name
    opn = graph_utils.op_name(node)
    target = node.target
    asked = node.meta.get(EAGER_META)
    if asked:
        return SplitReason(name, "prefetched", f"{opn}: {asked}")
    hit = _matches_split_op(node, split_ops)
    if hit is not None:
        return SplitReason(name, "user_split_op", f"{opn} matches Config.split_ops entry {hit!r}")
    if isinstance(target, torch._ops.OpOverload):
        tags = set(getattr(target, "tags", ()))
        if hasattr(torch.Tag, "cudagraph_unsafe") and torch.Tag.cudagraph_unsafe in tags:
            return SplitReason(name, "cudagraph_unsafe", f"{opn} is tagged cudagraph_unsafe")
        short = _short_name(target)
        if torch.Tag.data_dependent_output in tags or short in _HOST_SYNC_NAMES:
            return SplitReason(name, "host_sync", f"{opn} reads device data on the host (a sync)")
        if torch.Tag.dynamic_output_shape in tags and _shape_depends_on_data(node):
            return SplitReason(name, "data_dependent", f"{opn} has a data-dependent output shape")
        known = _KNOWN_HOST_SYNC_OPS.get(f"{target.namespace}::{short}")
        if known:
            return SplitReason(name, "host_sync", f"{opn} {known}")
        if short in _RNG_STATE_NAMES:
            return SplitReason(name, "rng", f"{opn} reads or sets RNG state on the host")
        if torch.Tag.nondeterministic_seeded in tags and node.kwargs.get("generator") is not None:
            return SplitReason(name, "rng", f"{opn} uses an explicit generator (not registered with the graph)")
    # devices: copies between devices, then CPU tensors anywhere
    out_t = graph_utils.tensor_values(node.meta.get("val"))
    in_t = [t for a in node.all_input_nodes for t in graph_utils.tensor_values(a.meta.get("val"))]
    devs_in = {t.device.type for t in in_t}
    devs_out = {t.device.type for t in out_t}
    copy_op = _short_name(target) in _COPY_NAMES
    if copy_op and ((devs_in and devs_out and devs_in != devs_out) or len(devs_in | devs_out) > 1):
        return SplitReason(name, "device_copy", f"{opn} moves data between {sorted(devs_in)} and {sorted(devs_out)}")
    if "cpu" in devs_in | devs_out and not _reads_only_host_constants(node, devs_out):
        which = "output" if "cpu" in devs_out else "input"
        return SplitReason(name, "cpu", f"{opn} has a CPU tensor {which}")
    for t in out_t:
        u = _is_unbacked(t)
        if u:
            return SplitReason(name, "unbacked_shape", f"{opn} output has unbacked size {u}")
    # a scalar (SymInt) node is capturable: scalar inputs of a captured piece are
    # part of its shape signature (one capture per value), and keeping scalar
    # arithmetic inside the piece hands it plain symbols Inductor can bind
    return None


has_cuda_tensors = graph_utils.has_cuda_tensors


def _host_scalar(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dim() == 0


def _reads_only_host_constants(node: fx.Node, devs_out: set[str]) -> bool:
    """A device op whose only CPU inputs are 0-dim tensor constants (``get_attr``,
    e.g. the ``0`` that DTensor's vocab-parallel embedding writes under its mask, as
    folded by :func:`fold_host_constants`). The kernel takes such a value as a scalar
    at launch, so a capture bakes it in; that is right on every replay because the
    constant never changes (the graph module holds it)."""
    if "cpu" in devs_out or _short_name(node.target) in _COPY_NAMES:
        return False
    cpu_in = [a for a in node.all_input_nodes
              if any(t.device.type == "cpu" for t in graph_utils.tensor_values(a.meta.get("val")))]
    return bool(cpu_in) and all(a.op == "get_attr" and _host_scalar(a.meta.get("val")) for a in cpu_in)


def _users_device(node: fx.Node) -> torch.device | None:
    """The one non-CPU device every user of ``node`` computes on (each user an op
    whose tensor outputs all live there, not a device copy), else None."""
    devs: set[torch.device] = set()
    for u in node.users:
        if u.op != "call_function" or _short_name(u.target) in _COPY_NAMES:
            return None
        outs = graph_utils.tensor_values(u.meta.get("val"))
        if not outs:
            return None
        devs.update(t.device for t in outs)
    if len(devs) != 1 or next(iter(devs)).type == "cpu":
        return None
    return next(iter(devs))


def fold_host_constants(gm: fx.GraphModule, to_users_device: bool = True) -> list[str]:
    """Evaluate, once, every node whose value is a 0-dim CPU tensor computed from
    constants only (``lift_fresh_copy`` of a lifted ``torch.tensor(0)``, a CPU
    ``full([], v)``), and read the result as a tensor constant (``get_attr``) instead.
    Left in place, such a node is a CPU op and would cut the graph into an eager
    piece on every call (DTensor's vocab-parallel embedding makes such nodes);
    folded, its device consumers read a constant (:func:`_reads_only_host_constants`).
    Random, mutating and uninitialized (``empty*``) ops are never folded.

    Where the constant lives depends on who runs the graph (``to_users_device``):

    * Inductor (True): a folded value whose users all compute on one device is
      stored on that device. Inductor copies a host constant into a device buffer
      at run time (``buf.copy_(const)``, a pageable host-to-device copy that fails
      under capture).
    * eager FX code (False): it stays on the host. Eager kernels read a 0-dim host
      tensor as a launch scalar, and some read a 0-dim *device* tensor with
      ``.item()``, a device-to-host sync that fails under capture (``index_put``
      with a boolean mask becomes ``masked_fill_(mask, value.item())``).

    Returns the names of the folded nodes."""
    folded: list[str] = []
    values: dict[fx.Node, torch.Tensor] = {}
    for n in list(gm.graph.nodes):
        if n.op == "get_attr":
            v = graph_utils.attr_value(gm, n.target)
            if _host_scalar(v):
                values[n] = v
            continue
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        if not _host_scalar(n.meta.get("val")) or any(a not in values for a in n.all_input_nodes):
            continue
        tags = set(getattr(n.target, "tags", ()))
        if (torch.Tag.nondeterministic_seeded in tags or n.target._schema.is_mutable
                or _short_name(n.target).startswith("empty")):
            continue
        inputs = n.all_input_nodes
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: values[a])
        try:
            with _compat.real_tensors():  # the compile's fake mode is active here
                v = n.target(*args, **kwargs)
                v = v.detach().clone() if _host_scalar(v) else v
        except Exception as e:  # noqa: BLE001 - not foldable here: the node stays (and cuts the graph)
            log.debug("graphcomp: host constant %s not folded: %s", n.name, e)
            continue
        if not _host_scalar(v):
            continue
        dev = _users_device(n) if to_users_device else None
        if dev is not None:  # Inductor would copy a host constant in at run time: not capturable
            try:
                with _compat.real_tensors():  # (the compile's fake mode would refuse a real tensor)
                    v = v.to(dev)
            except Exception as e:  # noqa: BLE001 - stays a host constant, read as a launch scalar
                log.debug("graphcomp: host constant %s stays on the host (%s): %s", n.name, dev, e)
                dev = None
        attr = f"_graphcomp_host_const_{len(folded)}"
        while hasattr(gm, attr):
            attr += "_"
        gm.register_buffer(attr, v, persistent=False)
        with gm.graph.inserting_before(n):
            c = gm.graph.get_attr(attr)
        c.meta.update(n.meta)
        if dev is not None and isinstance(n.meta.get("val"), torch.Tensor):
            c.meta["val"] = n.meta["val"].to(dev)  # (a fake tensor moves within its own fake mode)
        n.replace_all_uses_with(c)
        gm.graph.erase_node(n)
        for a in inputs:  # a constant read only by the folded node
            if not a.users and a.op == "get_attr":
                gm.graph.erase_node(a)
        if dev is None:
            values[c] = v
        folded.append(n.name)
    if folded:
        gm.recompile()
    return folded


def plan_pieces(
    gm: fx.GraphModule,
    split_ops: Sequence[str] = (),
    min_piece_nodes: int = 1,
    predicate: Callable[[fx.Node], SplitReason | None] | None = None,
    region_min_nodes: int | None = None,
    capture: bool = True,
) -> tuple[dict[fx.Node, int], list[dict[str, Any]], list[SplitReason]]:
    """Assign every non-placeholder node a piece id. Returns (node -> piece,
    plan rows ``{piece, mode, nodes, reason}``, reasons). ``predicate`` overrides the
    capturability test (tests). ``region_min_nodes`` divides the pieces into regions
    (:func:`region_cuts`): with ``capture`` each node's region index within its piece
    goes to ``node.meta[REGION_META]`` and the row's ``regions`` counts them (the
    pieces stay whole); with ``capture=False`` every region is an eager piece."""
    if not capture:
        predicate = lambda n: None  # noqa: E731 (every piece is eager below; no per-node reasons)
    pred = predicate or (lambda n: uncapturable_reason(n, split_ops))
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    reason: dict[fx.Node, SplitReason] = {}
    for n in nodes:
        r = pred(n)
        if r is not None:
            reason[n] = r
    # getitem follows its source (a multi-output node and its getitems stay together)
    for n in nodes:
        if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            src = n.args[0]
            if src in reason and n not in reason:
                reason[n] = SplitReason(n.name, reason[src].kind, f"getitem of {src.name}: {reason[src].detail}")
    # a collective and its wait: same mode, and no cut in between
    pos = {n: i for i, n in enumerate(nodes)}
    for n in nodes:
        if graph_utils.collective_kind(n) is None:
            continue
        waits = waits_of(n)
        if not waits:
            continue
        last = max(pos[w] for w in waits)
        span = nodes[pos[n]: last + 1]
        group = [n] + waits + [g for g in n.users if g.op == "call_function" and g.target is operator.getitem]
        if any(m in reason for m in span):
            why = next(reason[m] for m in span if m in reason)
            for m in group:
                if m not in reason:
                    reason[m] = SplitReason(
                        m.name, "collective_pair",
                        f"collective {n.name} and its wait must share a piece; {why.node} ({why.kind}) cuts between them",
                    )
    # contiguous runs
    runs: list[list[Any]] = []  # [mode, [nodes]]
    for n in nodes:
        mode = "eager" if n in reason else "cudagraph"
        if runs and runs[-1][0] == mode:
            runs[-1][1].append(n)
        else:
            runs.append([mode, [n]])
    # runs too small to pay for capture join their eager neighbours
    for r in runs:
        if r[0] == "cudagraph" and compute_nodes(r[1]) < min_piece_nodes and len(runs) > 1:
            r[0] = "eager"
            for m in r[1]:
                reason[m] = SplitReason(
                    m.name, "too_small",
                    f"capturable run of {compute_nodes(r[1])} node(s) < min_piece_nodes={min_piece_nodes}",
                )
    merged: list[list[Any]] = []
    for r in runs:
        if merged and merged[-1][0] == r[0]:
            merged[-1][1].extend(r[1])
        else:
            merged.append([r[0], list(r[1])])
    for _, ns in merged:
        for m in ns:
            m.meta.pop(REGION_META, None)
    spans = [[(0, len(ns))] for _, ns in merged]  # per piece: its regions' (start, end)
    in_flight = [0] * len(merged)  # per piece: cuts that leave a collective in flight
    if region_min_nodes is not None:
        for k, (_, ns) in enumerate(merged):
            cuts, free = region_cuts_and_free(ns, region_min_nodes, in_flight_ok=capture)
            in_flight[k] = sum(1 for p in cuts if not free[p])
            bounds = [0, *cuts, len(ns)]
            spans[k] = list(zip(bounds, bounds[1:]))
    if not capture:  # every region an eager piece
        merged = [["eager", ns[a:b]] for (_, ns), sp in zip(merged, spans) for a, b in sp]
        spans = [[(0, len(ns))] for _, ns in merged]
        in_flight = [0] * len(merged)  # (cuts between eager pieces never leave a collective in flight)
    else:  # a unit of compilation inside the piece, which is captured whole
        for (_, ns), sp in zip(merged, spans):
            if len(sp) > 1:
                for j, (a, b) in enumerate(sp):
                    for m in ns[a:b]:
                        m.meta[REGION_META] = j
    assign: dict[fx.Node, int] = {}
    rows: list[dict[str, Any]] = []
    for i, (mode, ns) in enumerate(merged):
        for m in ns:
            assign[m] = i
        rs = [reason[m] for m in ns if m in reason]
        if mode == "eager":
            kinds = sorted({r.kind for r in rs})
            first = rs[0] if rs else None
            why = f"{','.join(kinds)}: {first.node}: {first.detail}" if first else ""
            if not capture:
                why = "not captured (no CUDA tensors, or cudagraphs off): a compile region"
        else:
            why = ""
        rows.append({"piece": i, "mode": mode, "nodes": len(ns), "reason": why, "regions": len(spans[i]),
                     "region_cuts_in_flight": in_flight[i]})
    return assign, rows, sorted(reason.values(), key=lambda r: pos.get(_find(gm, r.node), 0))


def _find(gm: fx.GraphModule, name: str) -> fx.Node | None:
    for n in gm.graph.nodes:
        if n.name == name:
            return n
    return None


def split_graph(gm: fx.GraphModule, assign: dict[fx.Node, int]) -> PassResult:
    """``split_module(keep_original_order=True)`` by ``assign``; submodules are
    ``piece_<i>``. Node metadata of the original graph is kept."""
    from torch.fx.passes.split_module import split_module

    name_to_piece = {n.name: p for n, p in assign.items()}

    def cb(node: fx.Node) -> int:
        return name_to_piece[node.name]

    with _compat.lazy_graph_modules():  # code generated once, when first run or read
        split = split_module(gm, None, cb, keep_original_order=True, keep_original_node_name=True)
    # a torch whose split_module builds plain GraphModules whatever the setting
    # (2.11): lazy from here on, so the recompiles below and after later passes only
    # mark the code stale (each would regenerate the glue and every piece)
    split = _compat.lazy_graph_module(split)
    # split_module names submodules submod_<i>; rename to piece_<i>
    for n in split.graph.nodes:
        if n.op == "call_module" and str(n.target).startswith("submod_"):
            new = "piece_" + str(n.target)[len("submod_"):]
            setattr(split, new, _compat.lazy_graph_module(getattr(split, n.target)))
            delattr(split, n.target)
            n.target = new
    # carry meta['val'] onto the glue graph's placeholders / piece outputs where names match
    orig = {n.name: n for n in gm.graph.nodes}
    for n in split.graph.nodes:
        if n.op == "placeholder" and n.name in orig:
            n.meta.update(orig[n.name].meta)
    for name, sub in split.named_children():
        for n in sub.graph.nodes:
            if n.name in orig and "val" not in n.meta:
                n.meta.update(orig[n.name].meta)
    split.recompile()
    return split


@register_pass("partition_graph", stages=("fwd", "bwd"))
def partition_graph(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Cut the stage graph at nodes CUDA graphs cannot capture (see module docstring)."""
    cfg = ctx.config
    mode = getattr(cfg, "cudagraphs", "off")
    regions = cfg.region_min_nodes if (cfg.compile_regions is not False and cfg.codegen == "inductor") else None
    eager_regions = regions if cfg.compile_regions is True else None  # "auto" only regions captured pieces
    if mode == "off" or not cfg.pass_enabled("cudagraphs"):
        if eager_regions is not None:
            return _split(gm, ctx, eager_regions, capture=False)
        return ctx.unchanged(gm, "cudagraphs off (Config.cudagraphs='off' or the cudagraphs pass is disabled): no split")
    if not has_cuda_tensors(gm):
        if mode == "require":
            from graphcomp.errors import CudaGraphsRequired

            raise CudaGraphsRequired(
                f"graphcomp: Config.cudagraphs='require' but the {ctx.stage} graph of frame {ctx.frame_id} has no "
                f"CUDA tensor (a CPU model or CPU inputs): nothing in it can be captured. Move the model and its "
                f"inputs to a CUDA device, or use cudagraphs='auto' (captures what it can) or 'off'."
            )
        if eager_regions is not None:
            return _split(gm, ctx, eager_regions, capture=False)
        return ctx.unchanged(gm, "no CUDA tensors in the graph: nothing to capture, no split")
    folded = fold_host_constants(gm, to_users_device=cfg.codegen == "inductor")
    if folded:
        ctx.count("host_constants_folded", len(folded))
        log.info("graphcomp %s: folded %d host constant(s) (%s) into tensor constants", ctx.stage, len(folded),
                 ", ".join(folded))
    return _split(gm, ctx, regions, capture=True)


def _auto_regions_refused(gm: fx.GraphModule, rows: list[dict[str, Any]], cfg: Any) -> str | None:
    """Why ``compile_regions="auto"`` compiles this stage graph whole (None: it
    takes the regions ``plan_pieces`` cut): too few regions for the reuse to pay, or
    symbolic shapes (regions with them are never reused)."""
    total = sum(r["regions"] for r in rows)
    if total < cfg.region_auto_min:
        return f"{total} region(s) < region_auto_min={cfg.region_auto_min}"
    vals = [p.meta.get("val") for p in gm.graph.nodes if p.op == "placeholder"]
    if graph_utils.has_symbolic_shapes([v for v in vals if v is not None]):
        return "symbolic shapes (such regions are never reused)"
    return None


def _split(gm: fx.GraphModule, ctx: PassContext, regions: int | None, capture: bool) -> PassResult:
    cfg = ctx.config
    assign, rows, reasons = plan_pieces(gm, cfg.split_ops, cfg.min_piece_nodes, region_min_nodes=regions,
                                        capture=capture)
    if regions is not None and cfg.compile_regions == "auto":
        refused = _auto_regions_refused(gm, rows, cfg)
        if refused is not None:
            log.info("graphcomp %s: compile_regions='auto' compiles the graph whole: %s", ctx.stage, refused)
            ctx.note(f"compile_regions='auto': whole graph ({refused})")
            regions = None
            assign, rows, reasons = plan_pieces(gm, cfg.split_ops, cfg.min_piece_nodes, capture=capture)
    if regions is not None:
        total = sum(r["regions"] for r in rows)
        ctx.count("regions", total)
        ctx.counter("regions", total)
        flying = sum(r["region_cuts_in_flight"] for r in rows)
        if flying:
            ctx.count("region_cuts_in_flight", flying)
            ctx.counter("region_cuts_in_flight", flying)
        log.info("graphcomp %s: %d compile region(s) of >= %d compute nodes in %d piece(s) (Config.compile_regions=%r); "
                 "cuts where the fewest bytes cross, %d of them with a collective in flight (waited in the next region)",
                 ctx.stage, total, regions, len(rows), cfg.compile_regions, flying)
    for r in reasons:
        ctx.count(f"cut:{r.kind}")
    n_cg = sum(1 for r in rows if r["mode"] == "cudagraph")
    ctx.count("pieces", len(rows))
    ctx.count("pieces_cudagraph", n_cg)
    if not assign:
        return ctx.unchanged(gm, "empty graph: nothing to capture")
    if not capture and len(rows) < 2:
        return ctx.unchanged(gm, "nothing captured and one compile region: no split")
    split = split_graph(gm, assign)
    pieces = [Piece(index=r["piece"], mode=r["mode"], nodes=r["nodes"], reason=r["reason"], regions=r["regions"])
              for r in rows]
    ctx.frame.splits[ctx.stage] = SplitPlan(ctx.stage, split, gm, pieces, reasons)
    for p in pieces:
        if not p.captured and capture:
            ctx.note(f"{p.name} eager ({p.nodes} nodes): {p.reason}")
            log.info("graphcomp %s %s runs eagerly: %s", ctx.stage, p.name, p.reason)
    return ctx.changed(split)
