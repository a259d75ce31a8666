"""Token exchange for sharded embeddings (``graphcomp.shard(model, embedding=...)``).

A sharded ``nn.Embedding`` can be gathered whole on use, like any parameter:
every rank receives the full ``[vocab, dim]`` table (in ``param_dtype``) before the
lookup, and its gradient, a dense ``[vocab, dim]`` tensor in ``reduce_dtype``, is
reduce-scattered back. For a language model's input embedding that is the largest
gather of the forward, issued first (nothing to overlap it with), and the largest
reduce-scatter of the backward, issued last (nothing to overlap it with either):
the two largest pieces of communication no compute covers.

Exchanging, the ranks exchange tokens and rows instead of the table, inside
compiled graphs (rank ``r`` holds rows ``r*c .. r*c+c-1``)::

    forward   ids [T] -> all_gather -> [W*T] -> rows this rank holds (others 0)
              -> [W*T, dim] (param_dtype) -> reduce_scatter(sum) -> [T, dim]
    backward  grad [T, dim] -> all_gather -> [W*T, dim] -> to(reduce_dtype)
              -> summed into this rank's [c, dim] (its own ids only) -> / W

Every output row is one rank's row plus zeros, so the forward is exactly the
gathered lookup. The gradient is the same sum in another order (each row's
contributions are added on the rank that holds it, in ``reduce_dtype``) and
``padding_idx`` rows get none, as with ``F.embedding``. The bytes on the wire are
activation-sized: ``W*T*dim`` instead of ``vocab*dim`` (fewer bytes whenever all
ranks' tokens, ``W*T``, are fewer than the vocabulary; the output gradients cross in
the compute dtype, not as an fp32 table gradient). The output gradients are gathered
in their own dtype and upcast to ``reduce_dtype`` after the gather (exact: every
bf16 value is an fp32 value).

The exchange needs every rank to look up the same number of tokens ``T`` in the
same step. How it is chosen (``graphcomp.shard(..., embedding=)``):

* ``"auto"`` (default): a compiled lookup is traced as the table gather, through
  the op :func:`gather_table` (the same computation as ``gather_shard``, naming the
  exchange group), and the dynamo-stage pass ``embedding_exchange``
  (``graphcomp/passes/embedding_exchange.py``) turns it into the exchange where every rank's
  first compile of the function looks up the same static number of tokens (agreed
  through the store, as ``schedule_free``'s keep plan), on NCCL groups
  (:data:`AUTO_BACKENDS`). Symbolic token counts, ranks that disagree, a backend
  other than graphcomp, or the pass switched off: the table gather.
* ``"exchange"``: the pass exchanges every compiled lookup, without agreeing
  first; ranks whose token counts differ fail with ``RankDivergence`` at the
  compiled graphs' rank-agreement check instead of exchanging mismatched buffers.
* ``"gather"``: the table gather.

When it applies: the module's class uses ``nn.Embedding.forward`` (a subclass that
overrides it is gathered like any parameter), ``max_norm`` is None, ``sparse`` and
``scale_grad_by_freq`` are off, the weight is not tied to another module's
parameter, the sharding is 1-D over the whole world, and the call is being compiled.
Eager calls gather the table. ``shard`` logs which embeddings may exchange.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from graphcomp import _compat
from graphcomp.sharding import gather as shard_gather

__all__ = ["AUTO_BACKENDS", "EMBEDDING_MODES", "applies", "exchange_lookup", "gather_table", "table"]

EMBEDDING_MODES = ("auto", "gather", "exchange")
"""``graphcomp.shard(..., embedding=)``: the first is the default."""

AUTO_BACKENDS = ("nccl",)
"""Process-group backends on which ``embedding="auto"`` may exchange: where it pays
(the table gather and its gradient's reduce-scatter leave the step). On gloo a
lookup issues three collectives instead of two, each bound by per-call latency, so
``"auto"`` gathers there."""


def applies(mod: nn.Module, base: type) -> str | None:
    """None when ``mod`` (of unsharded class ``base``) can exchange tokens, else why not."""
    if not isinstance(mod, nn.Embedding):
        return "not an nn.Embedding"
    if base.forward is not nn.Embedding.forward:
        return f"{base.__qualname__} overrides forward"
    if mod.max_norm is not None:
        return "max_norm renormalizes the table in place"
    if mod.sparse or mod.scale_grad_by_freq:
        return "sparse / scale_grad_by_freq gradients"
    return None


class _Exchange(torch.autograd.Function):
    """The token exchange (see the module docstring). Called by :func:`exchange_lookup`,
    which the pass puts in Dynamo's graph: AOTAutograd traces its forward and backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        ids: torch.Tensor,
        local: torch.Tensor,
        rank: int,
        chunk: int,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype,
        group_name: str,
        world_size: int,
        padding_idx: int | None,
    ) -> torch.Tensor:
        flat = ids.reshape(-1).contiguous()
        all_ids = _compat.funcol_all_gather(flat, group_name, world_size)  # [W*T]
        loc = all_ids - rank * chunk
        mine = (loc >= 0) & (loc < chunk)
        idx = loc.clamp(0, chunk - 1)
        table = local if param_dtype is None else local.to(param_dtype)
        rows = torch.where(mine.unsqueeze(-1), torch.nn.functional.embedding(idx, table), 0)
        out = _compat.funcol_reduce_scatter_sum(rows.contiguous(), group_name, world_size)  # [T, dim]
        if padding_idx is not None:
            mine = mine & (all_ids != padding_idx)
        ctx.save_for_backward(idx, mine)
        ctx.chunk, ctx.reduce_dtype, ctx.orig_dtype = chunk, reduce_dtype, local.dtype
        ctx.group_name, ctx.world_size = group_name, world_size
        return out.view(*ids.shape, local.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        idx, mine = ctx.saved_tensors
        dim = grad.shape[-1]
        g = grad.reshape(-1, dim).contiguous()
        if not _narrower(g.dtype, ctx.reduce_dtype):
            g = g.to(ctx.reduce_dtype)  # (an upcast is exact: it is done after the gather, on half the bytes)
        all_g = _compat.funcol_all_gather(g, ctx.group_name, ctx.world_size)  # [W*T, dim]
        all_g = torch.where(mine.unsqueeze(-1), all_g.to(ctx.reduce_dtype), 0)
        # the rows' sums by the lookup's own backward kernel: on CUDA a sorted segment sum,
        # deterministic (index_add's atomics are not: runs would not repeat bitwise)
        gl = torch.ops.aten.embedding_dense_backward(all_g, idx, ctx.chunk, -1, False) / ctx.world_size
        return None, gl.to(ctx.orig_dtype), None, None, None, None, None, None, None


def _narrower(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether every value of float dtype ``a`` is exactly a value of the wider float ``b``
    (bf16 / fp16 -> fp32 / fp64, fp32 -> fp64)."""
    if not (a.is_floating_point and b.is_floating_point) or a == b:
        return False
    fa, fb = torch.finfo(a), torch.finfo(b)
    return fa.bits < fb.bits and fa.eps >= fb.eps and fa.max <= fb.max and fa.tiny >= fb.tiny


def exchange_lookup(ids: torch.Tensor, local: torch.Tensor, rank: int, chunk: int,
                    param_dtype: torch.dtype | None, reduce_dtype: torch.dtype, group_name: str, world_size: int,
                    padding_idx: int | None) -> torch.Tensor:
    """``F.embedding(ids, table)`` by token exchange over ``group_name`` (the exchange
    group: the same ranks as the weight's, see ``graphcomp.sharding.shard._exchange_group``).
    The pass ``embedding_exchange`` puts calls of it in Dynamo's graph; AOTAutograd
    traces the autograd.Function."""
    return _Exchange.apply(ids, local, rank, chunk, param_dtype, reduce_dtype, group_name, world_size, padding_idx)


@torch.library.custom_op("graphcomp::gather_table", mutates_args=())
def gather_table(local: torch.Tensor, rows: int, shape: list[int], param_dtype: torch.dtype | None,
                 reduce_dtype: torch.dtype, group_name: str, world_size: int, exchange_group: str, rank: int,
                 chunk: int, agree: bool) -> torch.Tensor:
    """An embedding table's gather that may become a token exchange: ``gather_shard``
    with the exchange's arguments (``exchange_group``, ``rank``, ``chunk``, and
    ``agree``: whether the ranks must agree on their token counts first, the
    ``"auto"`` mode). It computes, differentiates and decomposes exactly as
    ``gather_shard`` (so a graph the pass leaves alone gathers the table, under any
    backend); the pass ``embedding_exchange`` replaces the lookups that read it."""
    return shard_gather.gather_shard(local, rows, shape, param_dtype, reduce_dtype, group_name, world_size)


@gather_table.register_fake
def _gather_table_fake(local, rows, shape, param_dtype, reduce_dtype, group_name, world_size,  # noqa: ANN001
                       exchange_group, rank, chunk, agree):
    return local.new_empty(shape, dtype=param_dtype or local.dtype)


def _gather_table_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    shard_gather._gather_shard_setup(ctx, inputs[:7], output)


def _gather_table_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    # gather_shard's backward, then None for the four exchange arguments
    return (*shard_gather._reduce_to_shard(ctx, grad), None, None, None, None)


gather_table.register_autograd(_gather_table_backward, setup_context=_gather_table_setup)


def _gather_table_decomposition(local, rows, shape, param_dtype, reduce_dtype, group_name, world_size,  # noqa: ANN001
                                exchange_group, rank, chunk, agree):
    return shard_gather._gather_shard_decomposition(local, rows, shape, param_dtype, reduce_dtype, group_name,
                                                    world_size)


DECOMPOSITIONS = {torch.ops.graphcomp.gather_table.default: _gather_table_decomposition}
"""What AOTAutograd decomposes (with ``shard_gather.DECOMPOSITIONS``): a table gather
the pass left alone, into the gather's collectives and views."""


def table(mod: nn.Embedding, rank: int, group_name: str, mode: str) -> torch.Tensor:
    """``mod``'s gathered table as a compiled lookup reads it (:func:`gather_table`);
    ``mode`` is ``shard``'s ``embedding=`` (``"auto"`` or ``"exchange"``)."""
    from graphcomp.sharding.layout import _INFO_ATTR, _dtensor_cls

    param = mod._parameters["weight"]
    info = mod.__dict__[_INFO_ATTR]["weight"]
    local = param.to_local() if isinstance(param, _dtensor_cls()) else param
    return gather_table(local, info.rows, list(info.shape), info.param_dtype, info.reduce_dtype, info.group_name,
                        info.world_size, group_name, rank, info.chunk, mode == "auto")
