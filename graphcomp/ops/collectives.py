"""``graphcomp::`` custom ops used by the collective passes.

Each op has a schema (inferred from the type hints), a real implementation that
runs on CPU (gloo) and CUDA (NCCL) tensors, and a fake implementation so Dynamo,
AOTAutograd and Inductor can trace them. All return freshly allocated tensors
(no aliasing), so Inductor's buffer reuse can never free a live input early;
views of their outputs are taken with ordinary aten view ops in the graph.

Bucket layout. A bucket packs the shards ``s_0..s_k`` (numels ``n_i``, total
``L``) into one flat send buffer. After ``all_gather_into_tensor`` the buffer is
``[W * L]``: rank ``r``'s segment ``[r*L, (r+1)*L)`` holds its shards back to
back. ``unpack_gathered`` copies parameter ``i`` out as ``[W * n_i]``, rank-major,
which is exactly the output of an unbucketed gather of ``s_i``.

For reduce-scatter the inverse: ``pack_for_reduce_scatter`` lays gradient ``g_i``
(``[W * n_i]`` elements, rank-major) into ``[W, L]`` so that after
``reduce_scatter_tensor`` rank ``r`` holds ``[L]`` = its rows of every gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _numels(ts: list[Tensor]) -> list[int]:
    return [t.numel() for t in ts]


@torch.library.custom_op("graphcomp::pack_cast", mutates_args=())
def pack_cast(shards: list[Tensor], dtype: torch.dtype) -> Tensor:
    """Flatten, cast and copy ``shards`` into one new 1-D buffer of ``dtype``:
    one read of each shard, one write of the buffer."""
    total = sum(_numels(shards))
    out = torch.empty(total, dtype=dtype, device=shards[0].device)
    dst, src, off = [], [], 0
    for s in shards:
        n = s.numel()
        dst.append(out[off : off + n])
        src.append(s.reshape(-1))
        off += n
    # one multi-tensor kernel on CUDA (the fast path casts too), instead of a copy
    # kernel per shard: hundreds per step, each a launch even inside a CUDA graph
    torch._foreach_copy_(dst, src)
    return out


@pack_cast.register_fake
def _pack_cast_fake(shards: list[Tensor], dtype: torch.dtype) -> Tensor:
    return shards[0].new_empty(sum(_numels(shards)), dtype=dtype)


@torch.library.custom_op("graphcomp::unpack_gathered", mutates_args=())
def unpack_gathered(gathered: Tensor, world_size: int, numels: list[int]) -> list[Tensor]:
    """``[W * L]`` gathered bucket -> one ``[W * n_i]`` rank-major tensor per shard."""
    total = sum(numels)
    g = gathered.view(world_size, total)
    outs = [gathered.new_empty(world_size * n) for n in numels]
    torch.split_with_sizes_copy(g, numels, dim=1, out=[o.view(world_size, n) for o, n in zip(outs, numels)])
    return outs


@unpack_gathered.register_fake
def _unpack_gathered_fake(gathered: Tensor, world_size: int, numels: list[int]) -> list[Tensor]:
    return [gathered.new_empty(world_size * n) for n in numels]


@torch.library.custom_op("graphcomp::pack_for_reduce_scatter", mutates_args=())
def pack_for_reduce_scatter(grads: list[Tensor], world_size: int, dtype: torch.dtype) -> Tensor:
    """Cast and interleave full-size gradients into a ``[W * L]`` reduce-scatter
    input whose rank-``r`` segment holds rank ``r``'s rows of every gradient."""
    numels = [g.numel() // world_size for g in grads]
    total = sum(numels)
    out = torch.empty(world_size * total, dtype=dtype, device=grads[0].device)
    o = out.view(world_size, total)
    if all(g.dtype == dtype for g in grads):
        # one batched concatenation kernel instead of a strided copy per gradient
        torch.cat([g.reshape(world_size, n) for g, n in zip(grads, numels)], dim=1, out=o)
        return out
    off = 0
    for g, n in zip(grads, numels):
        o[:, off : off + n].copy_(g.reshape(world_size, n))
        off += n
    return out


@pack_for_reduce_scatter.register_fake
def _pack_rs_fake(grads: list[Tensor], world_size: int, dtype: torch.dtype) -> Tensor:
    return grads[0].new_empty(sum(_numels(grads)), dtype=dtype)


OPS = {
    "pack_cast": torch.ops.graphcomp.pack_cast.default,
    "unpack_gathered": torch.ops.graphcomp.unpack_gathered.default,
    "pack_for_reduce_scatter": torch.ops.graphcomp.pack_for_reduce_scatter.default,
}
