"""Private torch APIs of rematerialization: activation-checkpoint tags and flop
formulas (re-exported from ``graphcomp._compat``; the same rules apply: torch 2.11
and 2.13, version notes with each adapter, nothing of graphcomp imported).

* ``node.meta["recompute"]`` (a ``CheckpointPolicy``) is what AOTAutograd's min-cut
  partitioner reads; ``node.meta["ac_graph_id"]`` is set only by the
  ``tag_activation_checkpoint`` higher-order op, i.e. by user
  ``torch.utils.checkpoint`` regions traced by Dynamo (one id per region).
* ``torch.utils.flop_counter.flop_registry``: op overload packet -> formula over
  shapes (matmuls, convolutions, attention); its keyword ``out_val`` is the output.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx


def checkpoint_policy() -> Any:
    """``torch.utils.checkpoint.CheckpointPolicy`` (same enum in 2.11 and 2.13).

    The min-cut partitioner reads ``node.meta["recompute"]``: MUST_RECOMPUTE (and
    PREFER_RECOMPUTE) force a recompute in backward, MUST_SAVE bans it. Its
    ``force_save_collectives`` tags every ``_c10d_functional`` node MUST_SAVE unless
    it is already tagged recompute (identical in both versions), so a collective
    is re-gathered in backward only when we tag it before partitioning."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy


def must_recompute(node: fx.Node) -> bool:
    """The partitioner's own test (``partitioners.must_recompute``, 2.11 and 2.13):
    tagged MUST_RECOMPUTE or PREFER_RECOMPUTE."""
    P = checkpoint_policy()
    return node.meta.get("recompute") in (P.MUST_RECOMPUTE, P.PREFER_RECOMPUTE)


def is_user_checkpoint(node: fx.Node) -> bool:
    """True for a node traced inside a user ``torch.utils.checkpoint`` region and
    tagged to be recomputed (``ac_graph_id`` is set by the checkpoint HOP only;
    graphcomp's own tags never carry one)."""
    return "ac_graph_id" in node.meta and must_recompute(node)


def clear_recompute(node: fx.Node) -> None:
    """Drop a node's recompute tag (the partitioner then decides it as untagged)."""
    node.meta.pop("recompute", None)


_SEEDED_OK_WITHOUT_DROPOUT = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                              "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
                              "_efficient_attention_forward")


def recompute_is_deterministic(node: fx.Node) -> bool:
    """Whether running ``node``'s op again gives the same values: not an op tagged
    ``nondeterministic_seeded`` (random), except attention kernels (seeded only for
    dropout) called with ``dropout_p == 0``."""
    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded not in t.tags:
        return True
    if t.overloadpacket.__name__ not in _SEEDED_OK_WITHOUT_DROPOUT:
        return False
    for i, a in enumerate(t._schema.arguments):
        if a.name == "dropout_p":
            v = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", a.default_value)
            return isinstance(v, (int, float)) and v == 0
    return False


def is_mutating(node: fx.Node) -> bool:
    """The op writes one of its inputs (schema alias info with ``is_write``)."""
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable


def node_flops(node: fx.Node) -> int:
    """Floating-point operations of ``node`` by ``torch.utils.flop_counter``'s
    formulas (matmul, convolution, attention families), from the fake values in
    ``meta['val']``; 0 for ops it has no formula for (elementwise ops, reductions)
    or when a shape is symbolic."""
    from torch.utils.flop_counter import flop_registry

    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return 0
    f = flop_registry.get(t.overloadpacket)
    if f is None:
        return 0

    def val(a: Any) -> Any:
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    args = torch.utils._pytree.tree_map(val, node.args)
    kwargs = torch.utils._pytree.tree_map(val, dict(node.kwargs))
    try:
        return int(f(*args, **kwargs, out_val=node.meta.get("val")))
    except (TypeError, ValueError, RuntimeError, AttributeError):
        return 0  # symbolic sizes, or a formula that cannot read these args


def allow_side_effects_under_checkpoint() -> bool:
    """Let Dynamo trace Python side effects inside ``torch.utils.checkpoint``
    regions instead of graph-breaking at every one: graphcomp's gather-scope hooks
    write the open scope (``SESSION.scopes``) when a module's forward starts and
    remove it when it ends, and without this flag that write makes every
    checkpointed block of a sharded model a graph break. ``torch._dynamo.config.
    skip_fwd_side_effects_in_bwd_under_checkpoint`` (2.11 and 2.13) applies such
    side effects once, after the forward, and does not replay them during the
    backward's recomputation (eager checkpointing replays them; the scope's are
    balanced inside the region, so nothing is left to replay). Returns whether the
    flag exists (False: checkpointed blocks keep graph-breaking)."""
    import torch._dynamo.config as dynamo_config

    name = "skip_fwd_side_effects_in_bwd_under_checkpoint"
    if not hasattr(dynamo_config, name):
        return False
    setattr(dynamo_config, name, True)
    return True
