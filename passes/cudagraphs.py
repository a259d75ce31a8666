"""cudagraphs (fwd / bwd, always last): plan a CUDA-graph runner for each capturable piece.

Matches a stage graph that ``partition_graph`` split into ``piece_0 .. piece_N``::

    glue: x -> piece_0 (cudagraph) -> piece_1 (eager: .item()) -> piece_2 (cudagraph) -> out

For every ``cudagraph`` piece it classifies each input (``graphcomp.runtime.static``):
``param`` / ``saved`` / ``piece_output`` stay where they are (static addresses,
checked), ``copy`` inputs get a static buffer, ``scalar`` inputs join the shape
signature. It decides which outputs are cloned out of the pool (user-visible
forward outputs, all backward outputs = gradients). The plan goes to
``gm.meta['graphcomp_cudagraphs']``; the codegen (``backend.compile_pieces``)
compiles each piece and wraps it in a ``CudaGraphRunner``. The graph itself is
not rewritten (the record says so).

``Config.cudagraphs="require"`` turns any eager piece into an error naming the
reasons. No-op when the graph was not split (no CUDA tensors, cudagraphs off).
"""

from __future__ import annotations

import logging

import torch.fx as fx

from graphcomp.errors import CudaGraphsRequired
from graphcomp.pipeline import PassContext, register_pass
from graphcomp.runtime.static import classify_static_inputs, output_users

log = logging.getLogger(__name__)

__all__ = ["CudaGraphsRequired", "cudagraphs", "plan_runners"]


def plan_runners(gm: fx.GraphModule, stage: str, static_idxs: list[int], user_visible: list[int] | None) -> dict:
    pieces = gm.meta.get("graphcomp_pieces", {})
    captured = {name for name, r in pieces.items() if r["mode"] == "cudagraph"}
    kinds = classify_static_inputs(gm, static_idxs, captured, stage)
    clones = output_users(gm, None if stage == "bwd" else user_visible)
    return {
        name: {"input_kinds": kinds.get(name, []), "clone_outputs": sorted(clones.get(name, set()))}
        for name in sorted(captured)
    }


@register_pass("cudagraphs", stages=("fwd", "bwd"), last=True, after=("partition_graph",))
def cudagraphs(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Plan CUDA-graph runners for the capturable pieces (see module docstring)."""
    cfg = ctx.config
    if cfg.cudagraphs == "off":
        ctx.nothing("Config.cudagraphs='off'")
        return gm
    pieces = gm.meta.get("graphcomp_pieces")
    if not pieces:
        ctx.nothing("graph not split by partition_graph (no CUDA tensors, or partition_graph disabled): nothing to capture")
        return gm
    eager = {n: r for n, r in pieces.items() if r["mode"] == "eager"}
    if cfg.cudagraphs == "require" and eager:
        why = "; ".join(f"{n}: {r['reason']}" for n, r in sorted(eager.items()))
        raise CudaGraphsRequired(
            f"graphcomp: Config.cudagraphs='require' but {len(eager)} piece(s) of the {ctx.stage} graph cannot be "
            f"captured: {why}. Remove those ops from the compiled region, or use cudagraphs='auto'."
        )
    static = list(ctx.frame_data.get(f"static_input_idxs:{ctx.stage}", []))
    visible = ctx.frame_data.get(f"user_visible:{ctx.stage}")
    plan = plan_runners(gm, ctx.stage, static, visible)
    gm.meta["graphcomp_cudagraphs"] = plan
    ctx.frame_data[f"cudagraphs:{ctx.stage}"] = plan
    n_copy = sum(k.count("copy") for k in (p["input_kinds"] for p in plan.values()))
    ctx.count("runners", len(plan))
    ctx.count("eager_pieces", len(eager))
    ctx.count("copy_inputs", n_copy)
    for row in ctx.frame_data.get(f"partitions:{ctx.stage}", []):
        p = plan.get(f"piece_{row['piece']}")
        if p is not None:
            row["static_inputs"] = sum(1 for k in p["input_kinds"] if k not in ("copy", "scalar"))
            row["copy_inputs"] = p["input_kinds"].count("copy")
    ctx.nothing(f"graph unchanged: runner plan for {len(plan)} piece(s) recorded for codegen")
    return gm
