"""Test helpers for sharded models: a model's gradients as full tensors."""

from __future__ import annotations

import torch


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (those that have one) as a full tensor of the
    parameter's logical shape: a sharded model's padded ``Shard(0)`` gradients gathered
    and trimmed (``graphcomp.shard``), an unsharded model's copied."""
    from graphcomp.sharding.shard import is_sharded, shard_info

    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if is_sharded(model):
            mod, _, attr = name.rpartition(".")
            info = shard_info(model.get_submodule(mod), attr)
            out[name] = p.grad.full_tensor().narrow(0, 0, info.rows).reshape(info.shape).clone()
        else:
            out[name] = p.grad.detach().clone()
    return out
