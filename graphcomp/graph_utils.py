"""Read-only analyses of aten-level FX graphs: op counts, collectives, bytes."""

from __future__ import annotations

import collections
from typing import Any

import torch
import torch.fx as fx

# functional collectives that start communication (their result is waited on by
# _c10d_functional.wait_tensor)
COLLECTIVE_OPS = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


def op_name(node: fx.Node) -> str:
    """A stable short name for a node's target, e.g. ``aten.mm.default``."""
    if node.op in ("call_function", "call_method"):
        t = node.target
        if isinstance(t, torch._ops.OpOverload):
            return f"{t.namespace}.{t._schema.name.split('::')[-1]}.{t._overloadname}"
        if isinstance(t, torch._ops.OpOverloadPacket):
            return f"{t._qualified_op_name.replace('::', '.')}"
        return getattr(t, "__name__", str(t))
    if node.op == "call_module":
        return f"call_module:{node.target}"
    return node.op


def op_counts(gm: fx.GraphModule) -> collections.Counter:
    return collections.Counter(op_name(n) for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module"))


def count_diff(before: collections.Counter, after: collections.Counter) -> dict[str, int]:
    keys = set(before) | set(after)
    return {k: after[k] - before[k] for k in sorted(keys) if after[k] != before[k]}


def is_op(node: fx.Node, packet: Any) -> bool:
    """True when ``node`` calls ``packet`` (an OpOverloadPacket) or one of its overloads."""
    if node.op != "call_function":
        return False
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t.overloadpacket is packet
    return t is packet


def collective_kind(node: fx.Node) -> str | None:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    if node.target.namespace not in ("_c10d_functional", "graphcomp"):
        return None
    return COLLECTIVE_OPS.get(node.target._schema.name.split("::")[-1])


def tensor_meta(node: fx.Node) -> Any:
    return node.meta.get("val", node.meta.get("tensor_meta"))


def _vals(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for x in v if isinstance(x, torch.Tensor)]
    return []


def nbytes(t: torch.Tensor) -> int:
    try:
        return int(t.numel()) * t.element_size()
    except Exception:  # symbolic sizes: unknown
        return -1


def collectives(gm: fx.GraphModule) -> list[dict[str, Any]]:
    """Every collective in the graph with its kind, dtype, bytes on the wire
    (output bytes for gathers, input bytes for reductions) and bucket id."""
    out = []
    for n in gm.graph.nodes:
        kind = collective_kind(n)
        if kind is None:
            continue
        outs = _vals(tensor_meta(n))
        ins = [a for a in n.all_input_nodes if _vals(tensor_meta(a))]
        src = outs if kind == "all_gather" else [t for a in ins for t in _vals(tensor_meta(a))]
        dtype = str(src[0].dtype).replace("torch.", "") if src else "?"
        out.append(
            {
                "node": n.name,
                "op": op_name(n),
                "kind": kind,
                "dtype": dtype,
                "bytes": sum(max(nbytes(t), 0) for t in src),
                "bucket": n.meta.get("graphcomp_bucket"),
                "params": n.meta.get("graphcomp_params"),
            }
        )
    return out


def collective_bytes_by_dtype(colls: list[dict[str, Any]], kind: str | None = None) -> dict[str, int]:
    acc: dict[str, int] = collections.defaultdict(int)
    for c in colls:
        if kind is None or c["kind"] == kind:
            acc[c["dtype"]] += c["bytes"]
    return dict(acc)
