"""cudagraphs (fwd / bwd, always last): plan a CUDA-graph runner for each capturable piece.

Matches a stage graph that ``partition_graph`` split into ``piece_0 .. piece_N``::

    glue: x -> piece_0 (cudagraph) -> piece_1 (eager: .item()) -> piece_2 (cudagraph) -> out

For every ``cudagraph`` piece of the stage's :class:`~graphcomp.compiler.plan.SplitPlan`
(``ctx.frame.splits[stage]``) it classifies each input
(``graphcomp.runtime.static``): ``param`` / ``saved`` / ``piece_output`` stay where
they are (static addresses, checked), ``copy`` inputs get a static buffer, ``scalar``
inputs join the shape signature; and it decides which outputs are cloned out of the
pool (user-visible forward outputs, all backward outputs = gradients). Both go onto
the :class:`~graphcomp.compiler.plan.Piece` (``input_kinds``, ``clone_outputs``); the codegen
(``graphcomp.compiler.codegen``) compiles each piece and wraps it in a
``CudaGraphRunner``. The graph itself is not rewritten.

``Config.cudagraphs="require"`` turns any eager piece into an error naming the
reasons. No-op when the graph was not split (no CUDA tensors, cudagraphs off).
"""

from __future__ import annotations

import logging

import torch.fx as fx

from graphcomp.errors import CudaGraphsRequired
from graphcomp.compiler.pipeline import PassContext, PassResult, register_pass
from graphcomp.compiler.plan import SplitPlan
from graphcomp.runtime.static import classify_static_inputs, output_users

log = logging.getLogger(__name__)

__all__ = ["CudaGraphsRequired", "cudagraphs", "plan_runners"]


def plan_runners(split: SplitPlan, static_idxs: list[int], user_visible: list[int] | None) -> None:
    """Set ``input_kinds`` and ``clone_outputs`` on every captured piece of ``split``."""
    gm = split.split
    captured = {p.name for p in split.captured()}
    kinds = classify_static_inputs(gm, static_idxs, captured, split.stage)
    clones = output_users(gm, None if split.stage == "bwd" else user_visible)
    for p in split.captured():
        p.input_kinds = list(kinds.get(p.name, []))
        p.clone_outputs = frozenset(clones.get(p.name, set()))


@register_pass("cudagraphs", stages=("fwd", "bwd"), last=True, after=("partition_graph",))
def cudagraphs(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Plan CUDA-graph runners for the capturable pieces (see module docstring)."""
    cfg = ctx.config
    if cfg.cudagraphs == "off":
        return ctx.unchanged(gm, "Config.cudagraphs='off'")
    split = ctx.frame.split_of(gm, ctx.stage)
    if split is None:
        return ctx.unchanged(gm, "graph not split by partition_graph (no CUDA tensors, or partition_graph disabled): "
                                 "nothing to capture")
    eager = [p for p in split.pieces if not p.captured]
    if cfg.cudagraphs == "require" and eager:
        why = "; ".join(f"{p.name}: {p.reason}" for p in eager)
        raise CudaGraphsRequired(
            f"graphcomp: Config.cudagraphs='require' but {len(eager)} piece(s) of the {ctx.stage} graph cannot be "
            f"captured: {why}. Remove those ops from the compiled region, or use cudagraphs='auto'."
        )
    inputs = ctx.frame.stage_inputs(ctx.stage)
    plan_runners(split, list(inputs.static_idxs),
                 None if inputs.user_visible is None else list(inputs.user_visible))
    runners = split.captured()
    ctx.count("runners", len(runners))
    ctx.count("eager_pieces", len(eager))
    ctx.count("copy_inputs", sum(p.input_kinds.count("copy") for p in runners))
    # the plan lives on the pieces (ctx.frame.splits), not in the graph
    return ctx.changed(gm, f"runner plan for {len(runners)} piece(s)")
