"""Eager gather scopes: outside compiled graphs, a module's shards are gathered
together when its forward starts, and reduce-scattered together once its backward
is complete, whatever its Python reads in between.

Why. Reading a sharded parameter is a collective, so every rank must read it the
same number of times, in the same order. Inside a compiled graph that holds (every
rank traces the same graph). Eager code need not: transformers' eager MoE experts
loop reads ``self.gate_up_proj[expert_idx]`` once per expert that received tokens,
so two ranks whose tokens reach different experts issue different numbers of
gathers (and, in backward, reduce-scatters in a data-dependent order): the job
hangs (NCCL) or aborts (gloo: "Received data size doesn't match"). Under a scope
the collective sequence depends only on which modules run::

    module.__call__ (eager) -> pre-hook: x', *gathered = ScopeNode(x, *shards)
                                 (one all-gather per shard, sorted by name)
        forward(x', ...): module.weight, module.weight[i], ... -> gathered (no collective)
    post-hook: the scope closes
    backward: ScopeNode runs once, after the gradients of x' and of every gathered
        tensor are complete (autograd runs a node when all its outputs' gradients
        are in): one reduce-scatter per shard (zeros for one this rank never read),
        in the same sorted order, then the gradient of x flows on

``x`` is the module's first floating-point tensor argument (the node runs in the
module's place in the backward order, which is the same on every rank because
every rank runs the same modules). Under ``torch.compile`` the hooks do nothing
while Dynamo traces them (``torch.compiler.is_compiling()`` is constant-folded to
True) and reads gather where they are traced. The hooks and the
property getters are never compiled as frames of their own (``_compat.
skip_top_level_frames``): called from eager code (a module Dynamo gave up on, an
eager loop) they run as Python. A read outside any forward of its module (user
code reading ``model.lm_head.weight``) gathers on use.

Inside a ``torch.utils.checkpoint`` region the traced pre-hook's scope write is a
Python side effect, which Dynamo refuses under a checkpoint by default (a graph
break at every checkpointed block). ``install`` turns on Dynamo's
``skip_fwd_side_effects_in_bwd_under_checkpoint`` (``_compat.
allow_side_effects_under_checkpoint``): the write is applied once, after the
forward, not replayed by the backward's recomputation, and the post-hook removes
it inside the same region anyway. For user code this means: Python side effects in
checkpointed regions of a compiled, sharded model run once, as in any compiled
code, not again during the backward as eager checkpointing would.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from graphcomp import _compat
from graphcomp.sharding.mesh import for_module
from graphcomp.session import SESSION
from graphcomp.sharding.gather import gather, gather_local, reduce_grad, shard_changed



def cached(module: nn.Module, name: str) -> torch.Tensor | None:
    """The gathered value of ``name`` in ``module``'s open scope, or None. A frame
    Dynamo compiles while a scope is open (a resume function after a graph break
    inside the module) reads the gathered tensor as a graph input instead of
    gathering again. (Scopes live in ``SESSION.scopes``, keyed by module id, not on the
    module: Dynamo marks every tensor attribute of a module a static input, and the
    CUDA-graph runner would then expect it at a fixed address.)"""
    scope = SESSION.scopes.get(id(module))
    return None if scope is None else scope.get(name)


class _ScopeNode(torch.autograd.Function):
    """forward(x, *locals) -> (x, *gathered); backward reduce-scatters every
    shard's gradient, in order, once all of them are known."""

    @staticmethod
    def forward(ctx: Any, infos: tuple[Any, ...], x: torch.Tensor | None, *locals_: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.infos, ctx.device = infos, locals_[0].device
        ctx.local_shapes = [tuple(t.shape) for t in locals_]
        gathered = [gather_local(t, info) for t, info in zip(locals_, infos)]
        return (None if x is None else x.view_as(x), *gathered)

    @staticmethod
    def backward(ctx: Any, gx: torch.Tensor | None, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        out = []
        for g, info, shape in zip(grads, ctx.infos, ctx.local_shapes):
            if g is None:  # not read on this rank: its reduce-scatter must still happen
                dt = info.param_dtype or info.orig_dtype
                g = torch.zeros(info.shape, dtype=dt, device=ctx.device)
            out.append(reduce_grad(g, info, shape))
        return (None, gx, *out)


def install(module: nn.Module, infos: dict[str, Any], exchange: bool = False) -> None:
    """Open a scope around every eager forward of ``module`` over its sharded
    parameters ``infos`` (name -> ShardInfo). ``exchange``: an embedding whose
    compiled lookups exchange tokens (``graphcomp.sharding.embedding_exchange``): traced, no
    scope (it would gather the table the exchange replaces)."""
    order = tuple(sorted(infos))
    ordered = tuple(infos[n] for n in order)
    # a shard whose .data was replaced: its wrapper shape no longer matches (1-D sharding)
    padded_shapes = tuple(torch.Size(i.padded_shape) if i.tp is None else None for i in ordered)

    # (no helper calls or comprehensions in the hooks: called from eager code, each
    # would be a frame of its own, which Dynamo compiles unless skipped recursively,
    # and in which is_compiling() is True)
    def pre_hook(mod: nn.Module, args: tuple[Any, ...]) -> Any:
        if torch.compiler.is_compiling():
            if exchange:
                return None
            # traced: the module's shards are gathered here, in the graph, in order;
            # reads take them from the scope. Traced through, that is the same gathers
            # one op earlier; after a graph break inside the module (an eager loop),
            # Dynamo hands the scope to the code that runs next, which reads instead
            # of gathering again
            scope = {}
            for n in order:
                scope[n] = gather(mod._parameters[n], infos[n])
            SESSION.scopes[id(mod)] = scope
            return None
        locals_, grad = [], False
        for n, padded in zip(order, padded_shapes):
            p = mod._parameters[n]
            if padded is not None and p.shape != padded:
                raise shard_changed(mod._parameters[n], infos[n])
            locals_.append(p.to_local() if hasattr(p, "to_local") else p)
            grad = grad or p.requires_grad
        if not (grad and torch.is_grad_enabled()):
            scope = {}
            with torch.no_grad():
                for n, t in zip(order, locals_):
                    scope[n] = for_module(gather_local(t, infos[n]), infos[n])
            SESSION.scopes[id(mod)] = scope
            return None
        k = None
        for i, a in enumerate(args):  # the node takes the module's first differentiable input
            if isinstance(a, torch.Tensor) and a.is_floating_point() and a.requires_grad and a.device == locals_[0].device:
                k = i
                break
        x = args[k] if k is not None else None
        outs = _ScopeNode.apply(ordered, x, *locals_)
        scope = {}
        for n, t in zip(order, outs[1:]):  # 2-D sharding: the TP DTensor (graphcomp.sharding.mesh)
            scope[n] = for_module(t, infos[n])
        SESSION.scopes[id(mod)] = scope
        if k is None:
            return None
        return (*args[:k], outs[0], *args[k + 1:])

    def post_hook(mod: nn.Module, args: Any, output: Any) -> None:
        SESSION.scopes.pop(id(mod), None)

    if not _SKIPPED:
        # called from eager code, these run as Python: Dynamo would otherwise compile
        # each as a tiny frame of its own, in which is_compiling() is True
        _compat.skip_top_level_frames(pre_hook, post_hook, cached)
        # the scope write/remove inside a torch.utils.checkpoint region is a side
        # effect Dynamo refuses there by default: a graph break at every block
        _compat.allow_side_effects_under_checkpoint()
        _SKIPPED.append(True)
    module.register_forward_pre_hook(pre_hook)
    module.register_forward_hook(post_hook, always_call=True)  # (an exception must not leave a stale scope)


_SKIPPED: list[bool] = []  # the hooks' code objects are marked once (every closure shares them)
