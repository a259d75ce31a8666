"""Token exchange for sharded embeddings (``graphcomp.shard(model, embedding="exchange")``).

A sharded ``nn.Embedding`` is normally gathered whole on use, like any parameter:
every rank receives the full ``[vocab, dim]`` table (in ``param_dtype``) before the
lookup, and its gradient, a dense ``[vocab, dim]`` tensor in ``reduce_dtype``, is
reduce-scattered back. For a language model's input embedding that is the largest
gather of the forward, issued first (nothing to overlap it with), and the largest
reduce-scatter of the backward, issued last (nothing to overlap it with either): at
W2 (vocabulary 128256 x 2048) 1.0-1.3 ms and 2.1 ms of each step on 2 H100s, the
two largest pieces of communication no compute covers.

With ``embedding="exchange"`` the ranks exchange tokens and rows instead of the
table, inside compiled graphs (rank ``r`` holds rows ``r*c .. r*c+c-1``)::

    forward   ids [T] -> all_gather -> [W*T] -> rows this rank holds (others 0)
              -> [W*T, dim] (param_dtype) -> reduce_scatter(sum) -> [T, dim]
    backward  grad [T, dim] -> to(reduce_dtype) -> all_gather -> [W*T, dim]
              -> index_add into this rank's [c, dim] (its own ids only) -> / W

Every output row is one rank's row plus zeros, so the forward is exactly the
gathered lookup. The gradient is the same sum in another order (each row's
contributions are added on the rank that holds it, in ``reduce_dtype``) and
``padding_idx`` rows get none, as with ``F.embedding``. The bytes on the wire are
activation-sized: ``W*T*dim`` instead of ``vocab*dim`` (W2, 8192 tokens per rank:
67 MB of rows and 134 MB of fp32 gradients against a 525 MB table and a 1 GB
gradient).

When it applies: the module's class uses ``nn.Embedding.forward`` (a subclass that
overrides it is gathered as before), ``max_norm`` is None, ``sparse`` and
``scale_grad_by_freq`` are off, the weight is not tied to another module's
parameter, the sharding is 1-D, and the call is being compiled (``torch.compile``:
graphcomp's rank-agreement check compares the exchanged byte counts before the
first step, so ranks whose token shapes differ fail with ``RankDivergence`` instead
of exchanging mismatched buffers). Eager calls gather the table: the exchange
needs every rank to look up the same number of tokens, which eager code cannot
check without a collective. ``shard`` logs which embeddings exchange.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import _compat

__all__ = ["EMBEDDING_MODES", "applies", "lookup"]

EMBEDDING_MODES = ("gather", "exchange")


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
    """See the module docstring (plain arguments: Dynamo traces them as constants)."""

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
        g = grad.reshape(-1, dim).to(ctx.reduce_dtype).contiguous()
        all_g = _compat.funcol_all_gather(g, ctx.group_name, ctx.world_size)  # [W*T, dim]
        all_g = torch.where(mine.unsqueeze(-1), all_g, 0)
        gl = all_g.new_zeros(ctx.chunk, dim).index_add(0, idx, all_g) / ctx.world_size
        return None, gl.to(ctx.orig_dtype), None, None, None, None, None, None, None


def lookup(mod: nn.Embedding, ids: torch.Tensor, rank: int, group_name: str) -> torch.Tensor:
    """``mod(ids)`` by token exchange over ``group_name`` (the exchange group: the same
    ranks as the weight's, see ``graphcomp.sharding._exchange_group``)."""
    from .shard_layout import _INFO_ATTR, _dtensor_cls

    param = mod._parameters["weight"]
    info = mod.__dict__[_INFO_ATTR]["weight"]
    local = param.to_local() if isinstance(param, _dtensor_cls()) else param
    return _Exchange.apply(ids, local, rank, info.chunk, info.param_dtype, info.reduce_dtype, group_name,
                           info.world_size, mod.padding_idx)
