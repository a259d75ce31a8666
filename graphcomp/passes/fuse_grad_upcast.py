"""fuse_grad_upcast (joint, CUDA): the weight gradient's matmul writes the reduce dtype.

A sharded parameter gathered in bf16 (``param_dtype``, autocast) gets its gradient
from a bf16 matmul, which the backward then upcasts to the reduce dtype (fp32)
for the reduce-scatter: a separate kernel per gradient that reads the bf16 gradient
and writes it again in fp32. This pass matches::

    mm(a, b) [bf16] -> [t / view ...] -> convert(fp32) -> [view / pad ...] -> reduce_scatter

(a graphcomp gradient reduce-scatter, walked back through pure views, padding and
copies to the upcast, then through pure views to a matmul whose only use it is)
and rewrites it to::

    mm.dtype(a, b, fp32) -> [t / view ...] -> [view / pad ...] -> reduce_scatter

``aten::mm.dtype`` is cuBLAS's bf16 x bf16 -> fp32 product: the same fp32
accumulation, stored without rounding to bf16 first. The gradient is therefore the
matmul's fp32 result, not its bf16 rounding upcast: more precise (it is what
Megatron-LM's gradient-accumulation fusion stores into its fp32 main gradient), and
not bitwise the unfused graph's or FSDP2's ``reduce_dtype=float32`` gradients.
The trade: the matmul writes twice the bytes of its bf16 output, and the cast
kernel, which read the bf16 gradient and wrote it again in fp32, is gone (fewer
bytes moved in all, one launch fewer per gradient); the error against an fp64
reference shrinks by orders of magnitude (``tests/gpu/test_grad_upcast_gpu.py``).

The input embedding's table gradient gets the same treatment::

    embedding_dense_backward(g [bf16]) -> [view ...] -> convert(fp32) -> reduce_scatter

becomes ``embedding_dense_backward(convert(g, fp32))``: the op accumulates in fp32
either way (CUDA's kernel and Inductor's decomposition); unfused, it rounds the
``[vocab, dim]`` sums to bf16 for the upcast to copy back to fp32. Fused, the fp32
sums are the reduce-scatter's input: one ``[vocab, dim]`` bf16 buffer and one fp32
copy fewer at the end of the backward, and a gradient without the bf16 rounding
(more precise; not bitwise the pass off).

CUDA only (``aten::mm.dtype`` has no CPU kernel): no-op on other graphs. Skipped
and counted: an upcast whose input is not a single-use matmul (a sum of two
contributions, a bias gradient's reduction), inputs not bf16/fp16, or views whose
strides would differ from the upcast's output. Tensor-parallel reduce-scatters
(``graph_utils.is_foreign_collective``) are never matched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from graphcomp import _compat
from graphcomp.analysis import graph_utils as gu
from graphcomp.compiler.pipeline import PassContext, PassResult, register_pass

aten = torch.ops.aten

NARROW = (torch.bfloat16, torch.float16)
VIEWS = gu.VIEW_OPS | {aten.t.default, aten.transpose.int, aten.permute.default}
# pure ops between the upcast and the reduce-scatter (the gradient's reshape and pad)
BETWEEN = VIEWS | {aten.constant_pad_nd.default, aten.clone.default, aten.contiguous.default}


def _device_ok(node: fx.Node) -> bool:
    """Whether ``aten::mm.dtype`` runs where ``node``'s value lives (CUDA)."""
    v = gu.tensor_meta(node)
    return isinstance(v, torch.Tensor) and v.device.type == "cuda"


def _upcast_before(rs: fx.Node) -> fx.Node | None:
    node = rs.args[0]
    while isinstance(node, fx.Node) and gu.dtype_cast(node) is None:
        if node.op != "call_function" or node.target not in BETWEEN or not isinstance(node.args[0], fx.Node):
            return None
        node = node.args[0]
    return node if isinstance(node, fx.Node) else None


def _try(gm: fx.GraphModule, rs: fx.Node) -> str | None:
    cast = _upcast_before(rs)
    if cast is None:
        return "no_upcast"
    dst = gu.dtype_cast(cast)
    views: list[fx.Node] = []
    x = cast.args[0]
    while isinstance(x, fx.Node) and x.op == "call_function" and x.target in VIEWS and len(x.users) == 1:
        views.append(x)
        x = x.args[0]
    if isinstance(x, fx.Node) and gu.is_target(x, aten.embedding_dense_backward.default) and len(x.users) == 1:
        return _embedding_grad(gm, cast, views, x, dst)
    if not isinstance(x, fx.Node) or not gu.is_target(x, aten.mm.default) or len(x.users) != 1:
        return "not_a_matmul"
    mm_val = gu.tensor_meta(x)
    if not isinstance(mm_val, torch.Tensor) or mm_val.dtype not in NARROW or dst != torch.float32:
        return "dtype"
    if not _device_ok(x):
        return "not_cuda"
    return _replace_producer(gm, cast, views, x,
                             lambda g: [g.call_function(aten.mm.dtype, (x.args[0], x.args[1], torch.float32))])


def _embedding_grad(gm: fx.GraphModule, cast: fx.Node, views: list[fx.Node], emb: fx.Node,
                    dst: torch.dtype) -> str | None:
    """``embedding_dense_backward`` on the fp32 upcast of its output gradient."""
    val = gu.tensor_meta(emb)
    if not isinstance(val, torch.Tensor) or val.dtype not in NARROW or dst != torch.float32:
        return "dtype"
    if not _device_ok(emb):
        return "not_cuda"
    def make(g: fx.Graph) -> list[fx.Node]:
        up = g.call_function(torch.ops.prims.convert_element_type.default, (emb.args[0], torch.float32))
        return [up, g.call_function(aten.embedding_dense_backward.default, (up, *emb.args[1:]), dict(emb.kwargs))]

    return _replace_producer(gm, cast, views, emb, make)


def _replace_producer(gm: fx.GraphModule, cast: fx.Node, views: list[fx.Node], old: fx.Node,
                      make: Callable[[fx.Graph], list[fx.Node]]) -> str | None:
    """Put ``make(graph)``'s nodes (the last one produces fp32 directly) and copies of
    ``views`` in place of ``old -> views -> cast``; None, or ``"strides"`` (nothing
    changed) when the result's shape, strides or dtype would differ from the cast's."""
    g = gm.graph
    with g.inserting_before(cast):
        created = make(g)
        new = created[-1]
        for v in reversed(views):
            created.append(g.call_function(v.target, (created[-1], *v.args[1:]), dict(v.kwargs)))
    for n in created:
        gu.fake_eval(gm, n)
    cur = created[-1]
    want, got = gu.tensor_meta(cast), gu.tensor_meta(cur)
    if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and (
            want.shape != got.shape or want.stride() != got.stride() or got.dtype != torch.float32):
        for n in reversed(created):
            g.erase_node(n)
        return "strides"
    for k in ("stack_trace", "seq_nr", "partitioner_tag"):
        if k in old.meta:
            new.meta[k] = old.meta[k]
    cast.replace_all_uses_with(cur)
    g.erase_node(cast)
    for v in views:
        g.erase_node(v)
    g.erase_node(old)
    return None


@register_pass("fuse_grad_upcast", stages=("joint",), after=("fuse_allgather_downcast",),
               before=("bucket_collectives",))
def fuse_grad_upcast(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    rss = gu.gradient_reduce_scatters(gm)
    if not rss:
        return ctx.unchanged(gm, "no gradient reduce-scatter in the graph")
    if not _compat.has_mm_out_dtype():
        return ctx.unchanged(gm, "this torch has no aten::mm.dtype")
    fused = ctx.rewrite_each(rss, lambda rs: _try(gm, rs))
    if not fused:
        return ctx.unchanged(gm, f"none of the {len(rss)} gradient reduce-scatters reads an upcast bf16/fp16 "
                                 f"matmul or embedding gradient on CUDA (see the skipped:* counts)")
    ctx.counter("grad_upcasts_fused", fused)
    ctx.note(f"{fused} of {len(rss)} gradient upcasts fused into their matmul (aten::mm.dtype) or embedding "
             f"gradient (computed from the fp32 output gradient)")
    return ctx.changed(gm)
