"""Gather on use: the collectives that turn a padded local shard into the logical
parameter and its gradient back into the shard's (``gather`` differentiable,
``gather_local`` / ``reduce_grad`` the two halves for eager gather scopes). See
``graphcomp.sharding.shard``'s docstring for the graph they trace to."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from graphcomp import _compat
from graphcomp.sharding import mesh as mesh_sharding
from graphcomp import env as _env
from graphcomp.errors import ShardedModelError
from graphcomp.sharding.layout import ShardInfo, _dtensor_cls

__all__ = ["gather", "gather_local", "reduce_grad"]


def _debug_agree(kind: str, group_name: str, t: torch.Tensor) -> None:
    """``GRAPHCOMP_DEBUG=1``, eager code only: every member of the group is about to
    issue the same collective (``graphcomp.compiler.agreement.check_eager``)."""
    if torch.compiler.is_compiling() or not _env.debug() or type(t) not in (torch.Tensor, torch.nn.Parameter):
        return  # (traced: fake / functional tensors have other types; compiled graphs agree at compile time)
    from graphcomp.compiler import agreement

    agreement.check_eager(kind, group_name, t.dtype, tuple(t.shape))


def gather_local(local: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """The logical parameter from a padded local shard (an all-gather over the
    group, then narrow, reshape, cast to ``param_dtype``); not differentiable."""
    if info.world_size > 1:
        return _gather_full(local, info.rows, info.shape, info.param_dtype, info.group_name, info.world_size)
    return _to_logical(local, info.rows, info.shape, info.param_dtype)


def reduce_grad(grad: torch.Tensor, info: ShardInfo, local_shape: tuple[int, ...]) -> torch.Tensor:
    """The local shard's gradient from the gradient of the logical parameter:
    cast to ``reduce_dtype``, pad, reduce-scatter (sum) over the group, / W, cast
    back to the parameter's dtype (no collective at world size 1)."""
    return _reduce_full(grad, info.rows, tuple(local_shape[1:]), local_shape[0] * info.world_size,
                        info.reduce_dtype, info.orig_dtype, info.group_name, info.world_size,
                        collective=info.world_size > 1)


def _reduce_full(grad: torch.Tensor, rows: int, row_shape: tuple[int, ...], padded_rows: int,
                 reduce_dtype: torch.dtype, orig_dtype: torch.dtype, group_name: str, world_size: int,
                 collective: bool = True) -> torch.Tensor:
    """Cast to ``reduce_dtype``, pad to ``padded_rows``, reduce-scatter (sum), / W, cast
    back: the one reduce of a gather's gradient (eager scopes and the gather op's
    backward). ``collective=False`` skips the reduce-scatter (world size 1 in eager
    scopes; traced gathers always issue it, so hand-built graphs count it)."""
    g = grad.to(reduce_dtype).reshape(rows, *row_shape)
    pad = padded_rows - rows
    g = F.pad(g, (0, 0) * len(row_shape) + (0, pad)) if pad else g.contiguous()
    if collective:
        _debug_agree("reduce_scatter", group_name, g)
        g = _compat.funcol_reduce_scatter_sum(g, group_name, world_size) / world_size
    return g.to(orig_dtype)


def _gather_full(local: torch.Tensor, rows: int, shape: Sequence[int], param_dtype: torch.dtype | None,
                 group_name: str, world_size: int) -> torch.Tensor:
    """The forward of a gather: all-gather, narrow, reshape, cast."""
    _debug_agree("all_gather", group_name, local)
    full = _compat.funcol_all_gather(local.contiguous(), group_name, world_size)
    return _to_logical(full, rows, shape, param_dtype)


def _to_logical(full: torch.Tensor, rows: int, shape: Sequence[int], param_dtype: torch.dtype | None) -> torch.Tensor:
    """The logical parameter from its padded rows: narrow, reshape, cast to ``param_dtype``."""
    out = full.narrow(0, 0, rows).reshape(shape)
    return out if param_dtype is None else out.to(param_dtype)


def _save_for_reduce(ctx: Any, local: torch.Tensor, rows: int, reduce_dtype: torch.dtype, group_name: str,
                     world_size: int) -> None:
    ctx.rows, ctx.group_name, ctx.world_size = rows, group_name, world_size
    ctx.reduce_dtype, ctx.orig_dtype = reduce_dtype, local.dtype
    ctx.padded_rows = local.shape[0] * world_size
    ctx.row_shape = tuple(local.shape[1:])


def _reduce_to_shard(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The backward of a gather (:func:`_reduce_full` with what ``_save_for_reduce``
    kept), then ``None`` for the six non-tensor arguments."""
    g = _reduce_full(grad, ctx.rows, ctx.row_shape, ctx.padded_rows, ctx.reduce_dtype, ctx.orig_dtype,
                     ctx.group_name, ctx.world_size)
    return g, None, None, None, None, None, None


class _GatherParam(torch.autograd.Function):
    """All-gather a padded local shard into the logical parameter; the backward
    reduce-scatters the gradient (averaged over ranks) back to the shard. The same
    computation as :func:`gather_shard`, as an autograd.Function (hand-built graphs
    in the tests use it)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, local: torch.Tensor, rows: int, shape: tuple[int, ...], param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype, group_name: str, world_size: int,
    ) -> torch.Tensor:
        _save_for_reduce(ctx, local, rows, reduce_dtype, group_name, world_size)
        return _gather_full(local, rows, shape, param_dtype, group_name, world_size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return _reduce_to_shard(ctx, grad)


@torch.library.custom_op("graphcomp::gather_shard", mutates_args=())
def gather_shard(local: torch.Tensor, rows: int, shape: list[int], param_dtype: torch.dtype | None,
                 reduce_dtype: torch.dtype, group_name: str, world_size: int) -> torch.Tensor:
    """A sharded parameter's gather as one op. Dynamo records it as one node instead
    of speculating ``_GatherParam``'s forward and backward at every parameter access
    (hundreds in a deep model, in its checkpoint regions too), a large share of
    Dynamo's tracing time for such a model. AOTAutograd decomposes it
    (:data:`DECOMPOSITIONS`, passed by the backend to both codegens) into the same
    collectives and views, and its autograd formula is ``_GatherParam``'s, so the
    joint graph is the one the autograd.Function traced to. A ``torch.library`` op and
    not a ``torch.compiler.allow_in_graph`` function: a frame calling the latter loses
    Dynamo's graph-break fallback when the backend fails."""
    return _gather_full(local, rows, shape, param_dtype, group_name, world_size)


@gather_shard.register_fake
def _gather_shard_fake(local, rows, shape, param_dtype, reduce_dtype, group_name, world_size):  # noqa: ANN001
    return local.new_empty(shape, dtype=param_dtype or local.dtype)


def _gather_shard_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    local, rows, _shape, _param_dtype, reduce_dtype, group_name, world_size = inputs
    _save_for_reduce(ctx, local, rows, reduce_dtype, group_name, world_size)


gather_shard.register_autograd(_reduce_to_shard, setup_context=_gather_shard_setup)


def _gather_shard_decomposition(local, rows, shape, param_dtype, reduce_dtype, group_name, world_size):  # noqa: ANN001
    return _gather_full(local, rows, shape, param_dtype, group_name, world_size)


# what AOTAutograd decomposes (both codegens): gather_shard into its collectives and views
DECOMPOSITIONS = {torch.ops.graphcomp.gather_shard.default: _gather_shard_decomposition}


def shard_changed(param: torch.Tensor, info: ShardInfo) -> Exception:
    """The error for a shard whose shape is no longer the one ``shard`` gave it
    (``param.data = <another tensor>`` replaces the DTensor's shape, not its local
    shard: the new values would be ignored and the backward would fail)."""
    return ShardedModelError(
        f"sharded parameter {info.fqn!r} was changed after graphcomp.shard: its shard has shape "
        f"{tuple(param.shape)}, expected {info.padded_shape} (logical shape {info.shape}). Assigning "
        f"param.data (or a new Parameter) does not reach the shard; load new values with "
        f"model.load_state_dict(...), or copy_ into module._parameters[name].to_local() under torch.no_grad(); "
        f"to change a parameter's shape, change the model before graphcomp.shard")


def gather(param: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """The full (logical-shape) value of a sharded parameter, cast to
    ``info.param_dtype``; differentiable (the gradient is reduce-scattered to the
    shard in ``info.reduce_dtype`` and averaged over ranks)."""
    is_dtensor = isinstance(param, _dtensor_cls())
    if is_dtensor and info.tp is None and tuple(param.shape) != info.padded_shape:
        raise shard_changed(param, info)
    local = param.to_local() if is_dtensor else param
    if info.world_size == 1:
        out = _to_logical(local, info.rows, info.shape, info.param_dtype)
    else:
        out = gather_shard(
            local, info.rows, list(info.shape), info.param_dtype, info.reduce_dtype, info.group_name, info.world_size
        )
    return out if info.tp is None else mesh_sharding.for_module(out, info)
