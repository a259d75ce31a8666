"""Static-input classification for the pieces of a split stage graph (pure FX, CPU-testable).

Each input of a captured piece is one of::

    param         a graph input the compiler marked static in the forward
                  (parameters / shards, buffers: AOT's static_input_indices)
    saved         a backward graph input saved by the forward (static_input_idxs of bwd)
    piece_output  an output of another captured piece (lives in the shared pool)
    copy          anything else: copied into the runner's static buffer before replay
    scalar        a non-tensor input (int/float/SymInt): part of the shape signature

Only ``copy`` inputs cost a copy per replay. ``param`` addresses are checked on the
first replay (every replay with ``check_static_inputs="always"``); ``saved`` and
``piece_output`` addresses on every replay (cheap; a mismatch runs that call
eagerly instead of reading a stale address).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from graphcomp.analysis import graph_utils


def _is_tensor_node(n: Any) -> bool:
    if not isinstance(n, fx.Node):
        return False
    v = n.meta.get("val")
    if v is None:
        return True  # unknown: treat as a tensor (copying is always safe)
    return isinstance(v, torch.Tensor)


def _producer(n: fx.Node) -> fx.Node | None:
    """The call_module node a glue value comes from (directly or through getitem)."""
    if n.op == "call_module":
        return n
    if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node):
        if n.args[0].op == "call_module":
            return n.args[0]
    return None


def classify_static_inputs(
    split: fx.GraphModule,
    static_idxs: Sequence[int],
    captured: set[str],
    stage: str,
) -> dict[str, list[str]]:
    """piece name -> kind per input (in the call's argument order), for every
    piece in ``captured``. ``static_idxs`` are indices into the glue graph's
    placeholders (the stage graph's inputs)."""
    placeholders = [n for n in split.graph.nodes if n.op == "placeholder"]
    static = {placeholders[i] for i in static_idxs if 0 <= i < len(placeholders)}
    label = "saved" if stage == "bwd" else "param"
    out: dict[str, list[str]] = {}
    for n in split.graph.nodes:
        if n.op != "call_module" or n.target not in captured:
            continue
        kinds = []
        for a in n.args:
            if not isinstance(a, fx.Node):
                kinds.append("scalar")
            elif a.op == "get_attr":
                # a constant held by the split module: its address never changes
                v = graph_utils.attr_value(split, str(a.target))
                kinds.append("param" if isinstance(v, torch.Tensor) else "scalar")
            elif not _is_tensor_node(a):
                kinds.append("scalar")
            elif a in static:
                kinds.append(label)
            else:
                p = _producer(a)
                kinds.append("piece_output" if p is not None and p.target in captured else "copy")
        out[str(n.target)] = kinds
    return out


def output_users(split: fx.GraphModule, user_visible: Sequence[int] | None) -> dict[str, set[int]]:
    """piece name -> indices of its outputs that reach the stage graph's output at a
    user-visible position (``user_visible`` = output positions; None = all). Those
    are cloned out of the pool after replay."""
    out_node = next(n for n in split.graph.nodes if n.op == "output")
    rets = out_node.args[0]
    rets = list(rets) if isinstance(rets, (list, tuple)) else [rets]
    vis = set(range(len(rets))) if user_visible is None else set(user_visible)
    res: dict[str, set[int]] = {}
    for i, r in enumerate(rets):
        if i not in vis or not isinstance(r, fx.Node):
            continue
        if r.op == "call_module":
            res.setdefault(str(r.target), set()).add(0)
        elif r.op == "call_function" and r.target is operator.getitem and isinstance(r.args[0], fx.Node) and r.args[0].op == "call_module":
            res.setdefault(str(r.args[0].target), set()).add(int(r.args[1]))
    return res


# ------------------------------------------------------------ static buffers
def span(t: torch.Tensor) -> int:
    """Elements of storage a view covers, from its first element to its last
    (``storage_offset`` excluded): 0 for an empty tensor. Larger than ``numel`` for
    views with gaps; smaller for overlapping ones (a stride-0 ``expand``)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def memory_of(t: torch.Tensor) -> torch.Tensor:
    """The storage range ``t`` covers, as a flat contiguous 1-D tensor (a view)."""
    return t.as_strided((span(t),), (1,), t.storage_offset())


def static_buffer(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A static input buffer for ``a``: ``(view, base)``. ``view`` has ``a``'s shape
    and strides over a new flat ``base`` of ``span(a)`` elements, so every layout is
    reproduced exactly: expanded (stride 0), overlapping, non-contiguous, a view with
    an offset, zero-size. Copying ``memory_of(a)`` into ``base`` refreshes it (one
    contiguous copy of what the piece can read; ``view.copy_(a)`` would be
    rejected for an overlapping ``view``)."""
    base = torch.empty((span(a),), dtype=a.dtype, device=a.device)
    view = base.as_strided(tuple(a.shape), tuple(a.stride()), 0)
    base.copy_(memory_of(a))
    return view, base
