"""Codegen of a split stage graph: compile each piece, wrap it in a runner, run the glue.

``compile_pieces(split_plan, stage_inputs, cfg, compile_piece)`` takes the
:class:`~graphcomp.compiler.plan.SplitPlan` ``partition_graph`` produced (its glue graph calls
``piece_<i>`` submodules; the cudagraphs pass put a runner plan on each captured
:class:`~graphcomp.compiler.plan.Piece`) and returns a boxed callable (``fn(list) -> outputs``)
for AOTAutograd:

* every piece's output is normalised to a tuple (2.11's ``split_module`` has no
  ``tuple_return``; ``compile_fx_inner`` needs a tuple);
* example inputs come from the pieces' placeholder ``meta['val']`` fakes;
* ``compile_piece(piece_gm, example_inputs, static_idxs)`` compiles it (Inductor
  with ``cudagraphs=BoxedBool(False)``, or the FX graph as is);
* with ``Config.compile_regions``, a piece ``partition_graph`` divided into regions
  (``node.meta[REGION_META]``) is split at them and each region compiled apart
  (identical regions once: :func:`region_key`); the piece's callable runs them through
  their own glue, and the piece is captured as one graph (:func:`_compile_composed`);
* ``cudagraph`` pieces are wrapped in :class:`CudaGraphRunner`, ``eager`` pieces in
  :class:`EagerPiece`; :func:`run_glue` runs the glue graph in the original order,
  boxed: each piece gets a list it consumes, and the glue drops every value at its
  last use before the call that uses it last, so a piece that frees an input
  (Inductor does, after its last read) really frees it (the backward's saved
  activations, inside its capture too).
"""

from __future__ import annotations

import hashlib
import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from graphcomp.analysis import graph_utils
from graphcomp.compiler.plan import SplitPlan, StageInputs
from graphcomp.session import SESSION
from graphcomp.runtime.manager import RUNTIME
from graphcomp.runtime.runner import CudaGraphRunner, EagerPiece

FORWARD_COPY_BELOW = 1 << 20
"""Visible forward outputs of at most this many bytes (the loss, metrics) are always
copied out of the CUDA-graph pool; larger ones (the logits a Hugging Face model
returns, tensors handed across a graph break) follow ``Config.copy_outputs`` as
gradients do: with ``"auto"`` they are copied only once one is seen still held at a
later replay (copying them always would copy a language model's logits, often
hundreds of MB, every step)."""

log = logging.getLogger(__name__)


class _PieceModule(nn.Module):
    def __init__(self, impl: Any, single: bool):
        super().__init__()
        self.impl = impl
        self.single = single

    def forward(self, *args: Any) -> Any:
        out = self.impl(*args)
        return out[0] if self.single else out


def normalize_output(piece: fx.GraphModule) -> bool:
    """Make ``piece`` return a tuple; True when it returned a single value."""
    out = next(n for n in piece.graph.nodes if n.op == "output")
    val = out.args[0]
    if isinstance(val, (tuple, list)):
        if isinstance(val, list):
            out.args = (tuple(val),)
            piece.recompile()
        return False
    out.args = ((val,),)
    piece.recompile()
    return True


def piece_example_inputs(piece: fx.GraphModule) -> list[Any]:
    vals = []
    for n in piece.graph.nodes:
        if n.op != "placeholder":
            continue
        if "val" not in n.meta:
            raise NotImplementedError(
                f"graphcomp: piece input {n.name!r} has no meta['val'] (not yet supported: split graphs need fake values)"
            )
        vals.append(n.meta["val"])
    return vals


def _glue_static_idxs(split: fx.GraphModule, static_idxs: list[int]) -> dict[str, list[int]]:
    phs = [n for n in split.graph.nodes if n.op == "placeholder"]
    static = {phs[i] for i in static_idxs if 0 <= i < len(phs)}
    out = {}
    for n in split.graph.nodes:
        if n.op == "call_module":
            out[str(n.target)] = [i for i, a in enumerate(n.args) if a in static]
    return out


def compile_pieces(
    plan: SplitPlan,
    inputs: StageInputs,
    cfg: Any,
    compile_piece: Callable[[fx.GraphModule, list[Any], list[int]], Callable[[list[Any]], Any]],
    report_strides: bool = False,
    frame_id: int | None = None,
    code: int | None = None,
) -> Callable[[list[Any]], Any]:
    """Compile every piece of ``plan.split`` and return a boxed callable for the stage
    (``code``: Dynamo's id of the function the frame compiles, see
    ``CudaGraphRunner.follows_data``)."""
    split, stage = plan.split, plan.stage
    prefix = f"frame{frame_id}/{stage}" if frame_id is not None else stage
    glue_static = _glue_static_idxs(split, list(inputs.static_idxs))
    piece_strides: dict[str, list[Any]] = {}
    calls = {str(n.target): n for n in split.graph.nodes if n.op == "call_module"}
    # regions share compiled functions: each region an eager piece (compile_regions=True,
    # no capture), or pieces partition_graph divided into regions (True or "auto")
    regional = getattr(cfg, "compile_regions", False) is True or any(p.regions > 1 for p in plan.pieces)
    reuse: dict[str, tuple[Any, list[Any]]] | None = {} if regional else None
    same_code: dict[str, tuple[str, list[str]]] = {}  # code -> (first region with it, its key parts)
    for piece in plan.pieces:
        name = piece.name
        sub = getattr(split, name)
        if not isinstance(sub, fx.GraphModule):
            continue
        single = normalize_output(sub)
        ex = piece_example_inputs(sub)
        kinds = piece.input_kinds if piece.captured else None
        if kinds is not None:
            sidx = [i for i, k in enumerate(kinds) if k not in ("copy", "scalar")]
        else:
            sidx = glue_static.get(name, [])
        regions = _region_assign(sub) if reuse is not None else {}
        composed = None
        if regions:
            composed = _compile_composed(f"{prefix}/{name}", sub, sidx, regions, compile_piece, report_strides,
                                         reuse, same_code, auto=getattr(cfg, "compile_regions", False) == "auto")
        if composed is not None:
            compiled, strides = composed
        elif regions:  # "auto" found too little reuse: the piece compiles whole
            compiled, strides = _compile_one(compile_piece, sub, ex, sidx, report_strides)
        else:
            compiled, strides = _compile_reusing(f"{prefix}/{name}", sub, ex, sidx, compile_piece, report_strides,
                                                 reuse, same_code)
        piece_strides[name] = strides
        node = calls.get(name)
        names = [a.name if isinstance(a, fx.Node) else repr(a) for a in (node.args if node is not None else ())]
        if kinds is not None and RUNTIME.device.available():
            impl: Any = CudaGraphRunner(
                f"{prefix}/{name}", compiled, kinds,
                clone_outputs=set(piece.clone_outputs),
                # visible outputs are handed out of the pool per Config.copy_outputs, except
                # the forward's small ones (the loss: often kept for logging), always copied
                copy_outputs=cfg.copy_outputs,
                copy_below=FORWARD_COPY_BELOW if stage != "bwd" else 0,
                max_captures=cfg.max_captures,
                check_static_inputs=cfg.check_static_inputs,
                on_address_change=cfg.on_address_change,
                input_names=names,
                stats=piece.stats,
                require=cfg.cudagraphs == "require",
                dynamic=graph_utils.has_symbolic_shapes(ex),
                code=code,
                mutated_inputs=graph_utils.mutated_placeholders(sub),
            )
        else:
            impl = EagerPiece(f"{prefix}/{name}", compiled)
        setattr(split, name, _PieceModule(impl, single))
    split.recompile()
    if report_strides:
        _report_output_strides(split, piece_strides)
    return run_glue(split)


def _key_parts(sub: fx.GraphModule, ex: list[Any], sidx: list[int]) -> list[str] | str:
    """:func:`region_key_parts`, or why the region is not reusable."""
    try:
        return region_key_parts(sub, ex, sidx)
    except NotReusable as e:
        return str(e)


def _compile_reusing(name: str, sub: fx.GraphModule, ex: list[Any], sidx: list[int], compile_piece: Any,
                     report: bool, reuse: dict[str, tuple[Any, list[Any]]] | None,
                     same_code: dict[str, tuple[str, list[str]]],
                     parts: list[str] | str | None = None) -> tuple[Any, list[Any]]:
    """Compile ``sub`` (a piece, or a region of one), or with ``compile_regions``
    (``reuse`` not None) take the function compiled for an identical region
    (``parts``: its key parts if already computed)."""
    key = None
    if reuse is not None:
        if parts is None:
            parts = _key_parts(sub, ex, sidx)
        key = None if isinstance(parts, str) else _hash_parts(parts)
        _note_region(name, parts, key, reuse, same_code)
        if key is not None and key in reuse:
            SESSION.counters.add("regions_reused")
            return reuse[key]
    compiled, strides = _compile_one(compile_piece, sub, ex, sidx, report)
    if reuse is not None:
        SESSION.counters.add("regions_compiled")
        if key is not None:
            reuse[key] = (compiled, strides)
    return compiled, strides


def _region_assign(sub: fx.GraphModule) -> dict[fx.Node, int]:
    """node -> region index, for a piece ``partition_graph`` divided into more than one
    compile region (``REGION_META``); empty otherwise."""
    from graphcomp.passes.regions import REGION_META

    body = [n for n in sub.graph.nodes if n.op not in ("placeholder", "output")]
    if any(REGION_META not in n.meta for n in body):
        return {}  # a node partition_graph did not tag (none expected): compile the piece whole
    assign = {n: n.meta[REGION_META] for n in body}
    return assign if len(set(assign.values())) > 1 else {}


class _RegionCall:
    """A compiled region inside a composed piece: ``call(list) -> tuple``."""

    def __init__(self, fn: Callable[[list[Any]], Any]):
        self.fn = fn

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        return self.call(list(args))

    def call(self, args: list[Any]) -> tuple[Any, ...]:
        return tuple(self.fn(args))


def _regions_to_compile(parts: list[list[str] | str], reuse: dict[str, Any]) -> int:
    """How many of the regions with these key parts would be compiled: each region
    not reusable, and the first of each key not compiled already (in ``reuse``)."""
    keys = set(reuse)
    fresh = 0
    for p in parts:
        if isinstance(p, str):
            fresh += 1
            continue
        k = _hash_parts(p)
        if k not in keys:
            keys.add(k)
            fresh += 1
    return fresh


def _compile_composed(name: str, sub: fx.GraphModule, sidx: list[int], assign: dict[fx.Node, int],
                      compile_piece: Any, report: bool, reuse: dict[str, tuple[Any, list[Any]]],
                      same_code: dict[str, tuple[str, list[str]]],
                      auto: bool = False) -> tuple[Callable[[list[Any]], Any], list[Any]] | None:
    """A piece compiled region by region (``compile_regions`` on a captured piece):
    ``sub`` split at its regions, each region compiled (or reused), and a boxed
    callable running them in order through their own glue, which the piece's runner
    captures as one CUDA graph. Returns it and the piece's output strides; with
    ``auto`` (``compile_regions="auto"``) None, compiling nothing, when more than
    half of the regions would be compiled (too little reuse to pay for the fusions
    lost at the cuts): the caller compiles the piece whole."""
    from graphcomp.passes.partition_graph import split_graph

    inner = split_graph(sub, assign)
    static = _glue_static_idxs(inner, sidx)
    regions = [(rname, r) for rname, r in inner.named_children() if isinstance(r, fx.GraphModule)]
    singles = {rname: normalize_output(r) for rname, r in regions}
    examples = {rname: piece_example_inputs(r) for rname, r in regions}
    parts = {rname: _key_parts(r, examples[rname], static.get(rname, [])) for rname, r in regions}
    if auto:
        fresh = _regions_to_compile(list(parts.values()), reuse)
        if 2 * fresh > len(regions):
            SESSION.counters.add("region_pieces_compiled_whole")
            log.info("graphcomp %s: compile_regions='auto' compiles the piece whole: %d of its %d regions would "
                     "be compiled (at most half may be for regions to pay)", name, fresh, len(regions))
            return None
    strides: dict[str, list[Any]] = {}
    for rname, region in regions:
        fn, strides[rname] = _compile_reusing(f"{name}/region_{rname.split('_')[-1]}", region, examples[rname],
                                              static.get(rname, []), compile_piece, report, reuse, same_code,
                                              parts[rname])
        setattr(inner, rname, _PieceModule(_RegionCall(fn), singles[rname]))
    inner.recompile()
    return run_glue(inner), (_output_strides(inner, strides) if report else [])


def run_glue(split: fx.GraphModule) -> Callable[[list[Any]], Any]:
    """A boxed callable that runs the glue graph of ``split`` (placeholders, piece
    calls, getitems, the output) without keeping any value past its last use.

    A ``getitem`` of a piece's output tuple is not a step of its own: the piece's
    step unpacks the tuple straight into the values its getitems name (unused
    getitems are skipped), and the tuple itself is kept only while a node other
    than those getitems reads it (the glue runs before every replay: its Python per
    call is the host's)."""
    nodes = list(split.graph.nodes)
    absorbed: dict[fx.Node, list[tuple[fx.Node, int]]] = {}  # piece node -> [(getitem node, index)]
    skip: set[fx.Node] = set()
    for n in nodes:
        if (n.op == "call_function" and n.target is operator.getitem and not n.kwargs
                and isinstance(n.args[0], fx.Node) and n.args[0].op == "call_module" and isinstance(n.args[1], int)
                and not getattr(split, str(n.args[0].target)).single):
            skip.add(n)
            if n.users:
                absorbed.setdefault(n.args[0], []).append((n, n.args[1]))
    last: dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        if n in skip:
            continue
        for a in n.all_input_nodes:
            last[a] = i
    steps: list[tuple[str, fx.Node, Any, list[fx.Node], Any]] = []
    for i, n in enumerate(nodes):
        if n in skip:
            continue
        dead = [a for a in n.all_input_nodes if last[a] == i]  # (all_input_nodes has no repeats)
        if n.op == "call_module":
            mod = getattr(split, str(n.target))
            # (the tuple itself is kept only for a reader other than its getitems)
            steps.append(("piece", n, mod, dead, (absorbed.get(n, []), n in last)))
        elif n.op == "call_function":
            steps.append(("fn", n, n.target, dead, None))
        elif n.op == "get_attr":
            # a tensor constant split_module hoisted out of the piece that reads it
            steps.append(("attr", n, graph_utils.attr_value(split, str(n.target)), dead, None))
        elif n.op == "output":
            steps.append(("out", n, None, dead, None))
        elif n.op != "placeholder":
            raise NotImplementedError(f"graphcomp: glue graph node {n.format_node()} ({n.op}) is not supported")
    placeholders = [n for n in nodes if n.op == "placeholder"]
    unused = [p for p in placeholders if p not in last]
    map_arg = fx.node.map_arg

    def run(args: list[Any]) -> Any:
        env: dict[fx.Node, Any] = dict(zip(placeholders, args))
        args.clear()
        for p in unused:
            del env[p]
        for kind, n, target, dead, extra in steps:
            if kind == "piece":
                vals = list(map_arg(n.args, env.__getitem__))
                for d in dead:
                    del env[d]
                res = target.impl.call(vals)
                if target.single:
                    env[n] = res[0]
                else:
                    unpack, keep = extra
                    for g, k in unpack:
                        env[g] = res[k]
                    if keep:
                        env[n] = res
                del res, vals  # (no local may keep a value past its last use)
            elif kind == "fn":
                a = map_arg(n.args, env.__getitem__)
                kw = map_arg(n.kwargs, env.__getitem__)
                for d in dead:
                    del env[d]
                env[n] = target(*a, **kw)
                del a, kw
            elif kind == "attr":
                env[n] = target
            else:
                return map_arg(n.args[0], env.__getitem__)
        raise AssertionError("graphcomp: glue graph without an output node")

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _note_region(name: str, parts: list[str] | str, key: str | None, reuse: dict[str, Any],
                 same_code: dict[str, tuple[str, list[str]]]) -> None:
    """Log why a region is compiled again (``compile_regions``): not reusable at all,
    or the same code as an earlier region with another constant or input layout.
    ``parts`` is the key's parts, or why the region is not reusable."""
    if isinstance(parts, str):
        SESSION.counters.add("regions_not_reusable")
        log.info("graphcomp %s: compile region not reusable: %s", name, parts)
        return
    if key in reuse:
        return
    first = same_code.setdefault(parts[0], (name, parts))
    if first[0] != name:
        diff = next((i for i, (a, b) in enumerate(zip(first[1], parts)) if a != b), None)
        what = "the number of constants or inputs" if diff is None else f"key part {diff}: {first[1][diff][:200]!r} vs {parts[diff][:200]!r}"
        log.info("graphcomp %s: same code as compile region %s but compiled again: %s", name, first[0], what)
        return
    # another code: name the first line that differs from an earlier region of as many lines
    lines = parts[0].splitlines()
    twin = same_code.setdefault(f"lines:{len(lines)}", (name, parts))
    if twin[0] != name:
        other = twin[1][0].splitlines()
        k = next((i for i, (a, b) in enumerate(zip(other, lines)) if a != b), None)
        if k is not None:
            log.info("graphcomp %s: compiled again; its code has as many lines as compile region %s and first "
                     "differs at line %d: %r vs %r", name, twin[0], k, other[k].strip()[:200], lines[k].strip()[:200])


REGION_CONST_NUMEL = 64
"""Module constants a region may hold and still be reused (``compile_regions``): up
to this many elements each (the 0-dim host constants ``partition_graph`` folds into a
CUDA graph's pieces), compared by value."""


def region_key(piece: fx.GraphModule, example_inputs: list[Any], static_idxs: list[int]) -> str | None:
    """A key equal for two pieces exactly when one compiled function serves both:
    the piece's code with every node and constant renamed by position (so two
    blocks' regions, ``mm_37`` and ``mm_41``, read the same), the value, dtype and
    device of each constant, each input's shape, stride, storage offset, dtype,
    device and ``requires_grad`` (a ``torch.Generator`` input by its device only), and
    the static input indices. None (never reused)
    for a piece with symbolic shapes, submodules, or a constant that is not a
    tensor of at most ``REGION_CONST_NUMEL`` elements."""
    try:
        return _hash_parts(region_key_parts(piece, example_inputs, static_idxs))
    except NotReusable:
        return None


def _hash_parts(parts: list[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class NotReusable(Exception):
    """A region no other region may share (``compile_regions``); the message says why."""


def region_key_parts(piece: fx.GraphModule, example_inputs: list[Any], static_idxs: list[int]) -> list[str]:
    """The parts :func:`region_key` hashes: [code, constants..., inputs..., static
    indices]. Raises :class:`NotReusable` naming the node or input that rules reuse out."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    from graphcomp import _compat

    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    consts: list[str] = []
    for i, n in enumerate(piece.graph.nodes):
        if n.op == "call_module":
            raise NotReusable(f"it calls submodule {n.target!r}")
        if n.op == "output":
            g.output(fx.node.map_arg(n.args[0], env.__getitem__))
            continue
        target = n.target
        if n.op == "placeholder":
            target = f"in{i}"
        elif n.op == "get_attr":
            v = graph_utils.attr_value(piece, str(n.target))
            if not isinstance(v, torch.Tensor):
                raise NotReusable(f"constant {n.target!r} is a {type(v).__name__}, not a tensor")
            if v.numel() > REGION_CONST_NUMEL:
                raise NotReusable(f"constant {n.target!r} has {v.numel()} elements (at most {REGION_CONST_NUMEL} "
                                  "are compared by value)")
            try:
                with _compat.real_tensors():
                    vals = v.detach().cpu().flatten().tolist()
            except (RuntimeError, NotImplementedError) as e:  # no data to compare (a meta tensor)
                raise NotReusable(f"constant {n.target!r} has no value to compare ({type(e).__name__}: "
                                  f"{str(e)[:120]})") from None
            consts.append(f"C{tuple(v.shape)}{v.dtype}{v.device}{vals}")
            target = f"const{len(consts) - 1}"
        args = fx.node.map_arg(n.args, env.__getitem__)
        kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
        env[n] = g.create_node(n.op, target, args, kwargs, name=f"v{i}")
    parts = [g.python_code("self").src, *consts]
    for j, v in enumerate(example_inputs):
        if isinstance(v, torch.Tensor):
            dims = (*v.shape, *v.stride(), v.storage_offset())
            if not all(is_concrete_int(d) for d in dims):
                raise NotReusable(f"input {j} has symbolic shape, stride or offset {tuple(v.shape)}")
            parts.append(f"T{[int(d) for d in dims]}{v.dtype}{v.device}{v.requires_grad}")
        elif isinstance(v, (int, float, bool, type(None))):
            parts.append(repr(v))
        elif isinstance(v, torch.Generator):
            # an RNG state passed in at run time (AOTAutograd's graph-safe RNG inputs,
            # one per checkpointed attention on CUDA): any generator of the device serves
            parts.append(f"G{v.device}")
        else:
            raise NotReusable(f"input {j} is a {type(v).__name__}")
    parts.append(repr(sorted(static_idxs)))
    return parts


def _compile_one(compile_piece: Any, sub: fx.GraphModule, ex: list[Any], sidx: list[int], report: bool) -> tuple[Any, list[Any]]:
    if not report:
        return compile_piece(sub, ex, sidx), []
    from graphcomp import _compat

    with _compat.nested_tracing_context(_compat.detect_fake_mode(ex)) as tc:
        tc.output_strides = []
        fn = compile_piece(sub, ex, sidx)
        return fn, list(tc.output_strides or [])


def _report_output_strides(split: fx.GraphModule, piece_strides: dict[str, list[Any]]) -> None:
    from torch._guards import TracingContext

    outer = TracingContext.try_get()
    if outer is None or getattr(outer, "output_strides", None) is None:
        return
    outer.output_strides.extend(_output_strides(split, piece_strides))


def _output_strides(split: fx.GraphModule, piece_strides: dict[str, list[Any]]) -> list[Any]:
    """The strides of ``split``'s outputs: a piece's compiled strides where an output
    is a piece's (or its getitem), else the fake value's."""
    out = next(n for n in split.graph.nodes if n.op == "output")
    rets = out.args[0]
    rets = list(rets) if isinstance(rets, (list, tuple)) else [rets]
    import operator

    res: list[Any] = []
    for r in rets:
        s = None
        if isinstance(r, fx.Node):
            if r.op == "call_module":
                lst = piece_strides.get(str(r.target), [])
                s = lst[0] if lst else None
            elif r.op == "call_function" and r.target is operator.getitem and r.args[0].op == "call_module":
                lst = piece_strides.get(str(r.args[0].target), [])
                k = int(r.args[1])
                s = lst[k] if k < len(lst) else None
            if s is None:
                v = r.meta.get("val")
                if isinstance(v, torch.Tensor):
                    s = tuple(v.stride())
        res.append(s)
    return res
