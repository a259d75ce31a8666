"""Read-only analyses of aten-level FX graphs: op counts, collectives, bytes."""

from __future__ import annotations

import collections
import os
import re
from collections.abc import Callable
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
    "prefetched_gather": "all_gather",  # graphcomp::, waits for itself (graphcomp.sharding.prefetch)
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



def collective_kind(node: fx.Node) -> str | None:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    if node.target.namespace not in ("_c10d_functional", "graphcomp"):
        return None
    return COLLECTIVE_OPS.get(node.target._schema.name.split("::")[-1])


def collective_group(node: fx.Node) -> str | None:
    """The process-group name a functional collective runs on (its ``group_name``
    argument), or None for any other node."""
    if collective_kind(node) is None:
        return None
    schema = node.target._schema  # type: ignore[union-attr]
    for i, arg in enumerate(schema.arguments):
        if arg.name == "group_name":
            v = node.args[i] if i < len(node.args) else node.kwargs.get("group_name")
            return v if isinstance(v, str) else getattr(v, "group_name", None)
    return None


def is_gradient_reduce_scatter(node: fx.Node) -> bool:
    """A reduce-scatter of graphcomp's (a sharded parameter's gradient), not tensor parallel's."""
    return is_target(node, c10d.reduce_scatter_tensor.default) and not is_foreign_collective(node)


def gradient_reduce_scatters(gm: fx.GraphModule) -> list[fx.Node]:
    """graphcomp's gradient reduce-scatters in ``gm``, in graph order."""
    return [n for n in gm.graph.nodes if is_gradient_reduce_scatter(n)]


FP8_WIRE = "graphcomp_fp8"
"""Node meta key on an all-gather that moves FP8 values as their bytes (``uint8``: gloo
has no FP8 type, and the bucket ops copy bytes): the FP8 dtype's name, which
:func:`collectives` reports as the gather's dtype (pass ``fp8_allgather``)."""

GATHER_PRE = "graphcomp_gather_pre"
"""Node meta key: True on a pure op of a gather's input chain that the chain
matchers (``schedule_free``, ``schedule_prefetch``) would not recognise by its op
alone (the scaled cast of a shard to FP8, ``fp8_allgather``): it moves, is freed and
is recomputed with its gather."""

GATHER_POST = "graphcomp_gather_post"
"""Node meta key: True on a pure op after a gather's wait that unpacks the gathered
value (the FP8 bytes and their scales, ``fp8_allgather``): part of the gathered value
for ``schedule_free`` and ``schedule_prefetch``."""

FOREIGN = "graphcomp_foreign"
"""Node meta key: True on a collective that is not graphcomp's (see :func:`mark_foreign`)."""


def mark_foreign(gm: fx.GraphModule, is_foreign_group: Callable[[str | None], bool]) -> int:
    """Mark every collective of ``gm`` whose group ``is_foreign_group`` says is not
    graphcomp's (``PassContext.env.is_foreign_group``: once ``shard(mesh=...)`` sharded a
    model beside tensor parallelism, any group but those it shards over; the token
    exchange groups of ``shard(embedding="exchange")``). The pipeline marks each stage
    graph before its passes; collectives the passes create are graphcomp's. Returns
    how many are foreign."""
    n_foreign = 0
    for n in gm.graph.nodes:
        if collective_kind(n) is not None:
            foreign = bool(is_foreign_group(collective_group(n)))
            n.meta[FOREIGN] = foreign
            n_foreign += foreign
    return n_foreign


def is_foreign_collective(node: fx.Node) -> bool:
    """True for a collective marked not graphcomp's (:func:`mark_foreign`): tensor
    parallel's collectives beside ``shard(mesh=...)``, token exchanges. The passes leave
    those alone: no fusing, bucketing, freeing or moving. An unmarked node (a hand-built
    graph, a collective a pass created) is graphcomp's."""
    return bool(node.meta.get(FOREIGN, False))


def attr_value(gm: torch.nn.Module, target: str) -> Any:
    """The module attribute a ``get_attr`` node reads (``target`` may be dotted)."""
    v: Any = gm
    for atom in target.split("."):
        v = getattr(v, atom)
    return v


def has_symbolic_shapes(example_inputs: Any) -> bool:
    """True when traced inputs have symbolic sizes or scalars (Dynamo compiled the
    frame with dynamic shapes): its shapes may follow the data."""
    for v in example_inputs:
        if isinstance(v, (torch.SymInt, torch.SymFloat)):
            return True
        if isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in (*v.shape, *v.stride())):
            return True
    return False


def tensor_meta(node: fx.Node) -> Any:
    return node.meta.get("val", node.meta.get("tensor_meta"))


def tensor_values(v: Any) -> list[torch.Tensor]:
    """The tensors in a node value (a tensor, or a list/tuple of values)."""
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
    (output bytes for gathers, input bytes for reductions), its group and ``foreign``
    (on a group graphcomp did not shard over: tensor parallel), and what the passes
    decided about it: bucket id and parameters (bucket_collectives), the dtype of a
    fused downcast (fuse_allgather_downcast), whether it is resharded after forward
    (schedule_free) and how many nodes ahead of its first use it was issued
    (schedule_prefetch); None where a pass did not touch it. In a split graph,
    ``piece`` names the piece that holds it."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_module":  # a piece of a split graph (partition_graph)
            sub = gm.get_submodule(str(n.target))
            if isinstance(sub, fx.GraphModule):
                out.extend(dict(c, piece=str(n.target)) for c in collectives(sub))
            continue
        kind = collective_kind(n)
        if kind is None:
            continue
        outs = tensor_values(tensor_meta(n))
        ins = [a for a in n.all_input_nodes if tensor_values(tensor_meta(a))]
        src = outs if kind == "all_gather" else [t for a in ins for t in tensor_values(tensor_meta(a))]
        dtype = str(src[0].dtype).replace("torch.", "") if src else "?"
        dtype = n.meta.get(FP8_WIRE, dtype)  # FP8 bytes gathered as uint8 (fp8_allgather)
        out.append(
            {
                "node": n.name,
                "op": op_name(n),
                "kind": kind,
                "dtype": dtype,
                "bytes": sum(max(nbytes(t), 0) for t in src),
                "bucket": n.meta.get("graphcomp_bucket"),
                "params": n.meta.get("graphcomp_params"),
                "fused_downcast": n.meta.get("graphcomp_fused_downcast"),
                "resharded": n.meta.get("graphcomp_reshard"),
                "prefetch_ahead": n.meta.get("graphcomp_prefetch_ahead"),
                "group": collective_group(n),
                "foreign": is_foreign_collective(n),
                "source": source_line(n),
            }
        )
    return out


_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in ([^\n]+)\n(?:[ \t]+([^\n]*))?')
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# graphcomp's own gather code (every gather's stack ends there): not the source
_GATHER_FILES = frozenset(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), f)
    for f in ("sharding/shard.py", "sharding/gather.py", "sharding/layout.py", "sharding/gather_scope.py",
              "sharding/mesh.py", "_compat/__init__.py")
)


def user_frame(frames: list[tuple[str, int, str]]) -> str | None:
    """The innermost of ``frames`` ((file, line, code), outermost first) outside
    torch and graphcomp's gather code, as ``file:line (code)``; the innermost frame
    when every one is ours; None for no frame."""
    for f, line, code in reversed(frames):
        path = os.path.abspath(f)
        if not path.startswith(_TORCH_DIR) and path not in _GATHER_FILES:
            return f"{f}:{line} ({code.strip()})" if code else f"{f}:{line}"
    if frames:
        f, line, code = frames[-1]
        return f"{f}:{line} ({code.strip()})" if code else f"{f}:{line}"
    return None


def source_line(node: fx.Node) -> str | None:
    """Where user code issued ``node``: the innermost frame of its
    ``meta['stack_trace']`` outside torch and graphcomp's gather code (the model line
    that read a sharded parameter, for a gather), as ``file:line (code)``; None when
    the node has no stack trace (e.g. a bucket a pass created: see its
    ``graphcomp_params``)."""
    st = node.meta.get("stack_trace")
    if not st:
        return None
    return user_frame([(f, int(line), code) for f, line, _fn, code in _FRAME_RE.findall(st)])


def has_cuda_tensors(gm: fx.GraphModule) -> bool:
    """True when any node's value (``meta['val']``) is a CUDA tensor."""
    return any(t.device.type == "cuda" for n in gm.graph.nodes for t in tensor_values(n.meta.get("val")))


def collective_bytes_by_dtype(colls: list[dict[str, Any]], kind: str | None = None,
                              foreign: bool = False) -> dict[str, int]:
    """Bytes per dtype of graphcomp's collectives (``foreign=True``: of the
    tensor-parallel ones instead)."""
    acc: dict[str, int] = collections.defaultdict(int)
    for c in colls:
        if c.get("foreign", False) != foreign:
            continue
        if kind is None or c["kind"] == kind:
            acc[c["dtype"]] += c["bytes"]
    return dict(acc)


# ------------------------------------------------------------- pattern helpers
aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# ops that only reinterpret a gathered tensor (no data movement, dtype-agnostic)
VIEW_OPS = {
    aten.slice.Tensor,
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.alias.default,
    aten.squeeze.dim,
    aten.unsqueeze.default,
}


def mutated_placeholders(gm: fx.GraphModule) -> list[int]:
    """Indices of the placeholders ``gm`` writes in place: the graph input (or a view
    of it) passed as an argument its op's schema marks as written (``copy_`` of a
    functionalized input mutation: BatchNorm's running statistics and step count)."""
    index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    out: set[int] = set()
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is None or not schema.is_mutable:
            continue
        for k, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            v = n.args[k] if k < len(n.args) else n.kwargs.get(arg.name)
            for a in (v if isinstance(v, (list, tuple)) else [v]):
                while isinstance(a, fx.Node) and a.op == "call_function" and a.target in VIEW_OPS and a.args:
                    a = a.args[0]
                if isinstance(a, fx.Node) and a in index:
                    out.add(index[a])
    return sorted(out)


def is_target(node: fx.Node, *targets: Any) -> bool:
    return node.op == "call_function" and node.target in targets


def dtype_cast(node: fx.Node) -> torch.dtype | None:
    """The target dtype if ``node`` is a pure dtype conversion (same device,
    strided layout, default memory format), else None."""
    if is_target(node, torch.ops.prims.convert_element_type.default):
        return node.args[1]  # type: ignore[return-value]
    if is_target(node, aten._to_copy.default):
        kw = dict(node.kwargs)
        dtype = kw.pop("dtype", None)
        if dtype is None or len(node.args) != 1:
            return None
        src, dst = tensor_meta(node.args[0]), tensor_meta(node)
        dev = kw.pop("device", None)
        if dev is not None and src is not None and torch.device(dev) != src.device:
            return None
        if kw.pop("layout", torch.strided) != torch.strided:
            return None
        if kw.pop("memory_format", None) not in (None, torch.preserve_format, torch.contiguous_format):
            return None
        kw.pop("pin_memory", None)
        if kw or (dst is not None and not dst.is_contiguous() and src is not None and src.is_contiguous()):
            return None
        return dtype
    return None


def view_chain(start: fx.Node) -> list[fx.Node]:
    """Follow single-user VIEW_OPS from ``start``; returns [start, v1, ..., vk]."""
    chain = [start]
    node = start
    while len(node.users) == 1:
        (user,) = node.users
        if not is_target(user, *VIEW_OPS) or user.args[0] is not node:
            break
        chain.append(user)
        node = user
    return chain


def with_dtype(val: Any, dtype: torch.dtype) -> Any:
    """A (fake) tensor like ``val`` with another dtype; None passes through."""
    if not isinstance(val, torch.Tensor):
        return val
    return torch.empty_strided(val.shape, val.stride(), dtype=dtype, device=val.device) if not _is_fake(val) else _fake_like(val, dtype)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _fake_like(val: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with val.fake_mode:  # type: ignore[attr-defined]
        return torch.empty_strided(val.shape, val.stride(), dtype=dtype, device=val.device)


def set_val(node: fx.Node, val: Any) -> None:
    node.meta["val"] = val
    if isinstance(val, torch.Tensor):
        from torch.fx.passes.shape_prop import _extract_tensor_metadata

        node.meta["tensor_meta"] = _extract_tensor_metadata(val)
    else:
        node.meta.pop("tensor_meta", None)


def retype(node: fx.Node, dtype: torch.dtype) -> None:
    """Change the recorded dtype of ``node``'s value (after a rewrite)."""
    if "val" in node.meta:
        set_val(node, with_dtype(node.meta["val"], dtype))


def gathers(gm: fx.GraphModule) -> list[fx.Node]:
    """graphcomp's all-gathers (tensor-parallel ones, on foreign groups, excluded)."""
    return [
        n for n in gm.graph.nodes
        if is_target(n, c10d.all_gather_into_tensor.default) and not is_foreign_collective(n)
    ]


def single_wait(node: fx.Node) -> fx.Node | None:
    """The one ``wait_tensor`` user of a collective, or None."""
    users = list(node.users)
    if len(users) == 1 and is_target(users[0], c10d.wait_tensor.default):
        return users[0]
    return None


def fake_mode_of(gm: fx.GraphModule) -> Any:
    """The fake mode behind the graph's ``meta['val']`` tensors, or None."""
    from torch._subclasses.fake_tensor import FakeTensor

    for n in gm.graph.nodes:
        v = n.meta.get("val")
        for t in tensor_values(v):
            if isinstance(t, FakeTensor):
                return t.fake_mode
    return None


def fake_eval(gm: fx.GraphModule, node: fx.Node) -> None:
    """Set ``node.meta['val']`` by running its target on its inputs' fake values
    (no-op for graphs built without fake values, e.g. by hand in tests)."""
    mode = fake_mode_of(gm)
    if mode is None:
        return
    missing = False

    def val(a: Any) -> Any:
        nonlocal missing
        if isinstance(a, fx.Node):
            if "val" not in a.meta:
                missing = True
            return a.meta.get("val")
        return a

    args = fx.node.map_aggregate(node.args, val)
    kwargs = fx.node.map_aggregate(node.kwargs, val)
    if missing:
        return
    with mode:
        set_val(node, node.target(*args, **kwargs))  # type: ignore[operator]


def priority_topo_sort(gm: fx.GraphModule, keys: dict[fx.Node, Any]) -> bool:
    """Reorder ``gm.graph`` into a topological order that, among the nodes whose
    inputs are all placed, always places the one with the smallest ``keys[n]`` (ties:
    the current position). The output node stays last. Nodes are only moved, never
    created or erased. Returns True when the order changed."""
    import heapq

    nodes = list(gm.graph.nodes)
    idx = {n: i for i, n in enumerate(nodes)}
    indeg = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(keys[n], idx[n], n) for n in nodes if indeg[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, n = heapq.heappop(ready)
        order.append(n)
        for u in n.users:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, (keys[u], idx[u], u))
    if len(order) != len(nodes):
        raise RuntimeError("graph has a cycle (graphcomp bug)")
    out = next(n for n in nodes if n.op == "output")
    if order[-1] is not out:
        order.remove(out)
        order.append(out)
    if order == nodes:
        return False
    prev = order[0]
    if prev is not nodes[0]:
        nodes[0].prepend(prev)
    for n in order[1:]:
        if prev.next is not n:  # (moving a node next to itself is not a no-op in every torch)
            prev.append(n)
        prev = n
    return True


def stable_topo_sort(gm: fx.GraphModule, hoist: set[fx.Node] | None = None) -> None:
    """Reorder ``gm.graph`` so every node follows its inputs, moving as little as
    possible: a node keeps its place unless an input is not yet defined. Nodes in
    ``hoist`` pull their not-yet-placed ancestors up to just before themselves
    (used to place a new bucket at its first use rather than its last input)."""
    nodes = list(gm.graph.nodes)
    prio = {n: i for i, n in enumerate(nodes)}
    if hoist:
        for h in sorted(hoist, key=lambda n: -prio[n]):
            stack = list(h.all_input_nodes)
            while stack:
                a = stack.pop()
                if prio[a] > prio[h]:
                    prio[a] = prio[h]
                    stack.extend(a.all_input_nodes)
    priority_topo_sort(gm, prio)
