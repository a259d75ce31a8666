"""The layout of one sharded parameter (:class:`ShardInfo`) and the pure helpers
that map between its logical rows and a rank's padded local shard. A leaf module:
``sharding``, ``shard_gather`` and ``mesh_sharding`` all build on it (see
``graphcomp.sharding.shard``'s docstring for the layout itself)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["ShardInfo"]

_INFO_ATTR = "_graphcomp_shard_info"


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """What graphcomp knows about one sharded parameter (identical on every rank)."""

    fqn: str
    """Name of the parameter in the model passed to ``shard()`` (first name, if tied)."""
    shape: tuple[int, ...]
    """Logical (unsharded) shape."""
    rows: int
    """N: logical size of dim 0 (1 for a 0-dim parameter)."""
    chunk: int
    """c = max(1, ceil(N / world_size)): dim-0 size of every rank's local shard."""
    orig_dtype: torch.dtype
    """dtype of the parameter (and of its shard and gradient)."""
    param_dtype: torch.dtype | None
    """dtype the gathered parameter is cast to, or None (no cast)."""
    reduce_dtype: torch.dtype
    """dtype of the gradient reduce-scatter."""
    group_name: str
    world_size: int
    tp: Any = None
    """2-D sharding (``shard(mesh=...)``): the tensor-parallel view module code sees
    (a ``graphcomp.sharding.mesh.TPLayout``; ``shape`` is then the tp-local shape),
    or None (a plain parameter)."""
    mesh_dim: int = 0
    """The dimension of the parameter's device mesh that is sharded here (2-D: the
    dp dimension's index in the parameter's 2-D mesh)."""

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    @property
    def padded_shape(self) -> tuple[int, ...]:
        return (self.world_size * self.chunk, *self.row_shape)

    def local_rows(self, rank: int) -> int:
        """Logical rows held by ``rank`` (the rest of its shard is padding)."""
        return min(self.chunk, max(0, self.rows - rank * self.chunk))


def _dtensor_cls() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def _row_slice(full: torch.Tensor, info: ShardInfo, rank: int) -> torch.Tensor:
    x = full.reshape(1) if full.dim() == 0 else full
    n = info.local_rows(rank)
    return x.narrow(0, min(rank * info.chunk, x.shape[0]), n)


def _padded_local(rows: torch.Tensor, info: ShardInfo, like: torch.Tensor) -> torch.Tensor:
    local = torch.zeros((info.chunk, *info.row_shape), dtype=like.dtype, device=like.device)
    if rows.shape[0]:
        local[: rows.shape[0]].copy_(rows.reshape(rows.shape[0], *info.row_shape))
    return local
