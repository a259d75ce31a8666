"""fuse_grad_upcast on a real GPU (``aten::mm.dtype`` has no CPU kernel): the fused
weight gradient is cuBLAS's fp32 product of the bf16 operands, closer to the exact
(fp64) gradient than the bf16 matmul upcast after it, and that upcast is its bf16
rounding. A hand-built backward with a real reduce-scatter (world-1 NCCL group)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

pytestmark = pytest.mark.gpu
c10d = torch.ops._c10d_functional


def _run_pass(gm):
    from graphcomp.config import Config
    from graphcomp.compiler.pipeline import PassContext, PassRecord, get_pass
    from graphcomp.compiler.plan import FramePlan

    ctx = PassContext(config=Config(), frame_id=0, stage="joint", frame=FramePlan())
    ctx.record = PassRecord(name="fuse_grad_upcast", stage="joint", enabled=True)
    out = get_pass("fuse_grad_upcast").fn(gm, ctx).gm
    out.recompile()
    return out, ctx.record


def test_fused_gradient_is_the_fp32_product(world1):
    group = world1.group_name

    def f(go, x):
        g = torch.mm(go.t(), x).t().t().to(torch.float32)
        return [c10d.wait_tensor(c10d.reduce_scatter_tensor(g, "sum", 1, group))]

    torch.manual_seed(0)
    go = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    plain = make_fx(f, tracing_mode="fake")(go, x)
    fused, rec = _run_pass(make_fx(f, tracing_mode="fake")(go, x))
    assert sum(n.target is torch.ops.aten.mm.dtype for n in fused.graph.nodes) == 1, fused.code
    assert rec.counts == {}, rec.counts
    (old,) = plain(go, x)
    (new,) = fused(go, x)
    assert new.dtype == old.dtype == torch.float32 and new.shape == old.shape == (512, 1024)
    exact = torch.mm(go.double().t(), x.double())
    err_old = (old.double() - exact).abs().mean().item()
    err_new = (new.double() - exact).abs().mean().item()
    print(f"GRAD_UPCAST mean abs error vs fp64: bf16 matmul then upcast {err_old:.3e}, fused {err_new:.3e}")
    assert err_new < err_old / 20  # fp32 accumulator kept vs rounded to bf16's 8 bits
    # the unfused gradient is the fused one rounded to bf16 (same cuBLAS accumulation)
    same = (new.to(torch.bfloat16).float() == old).float().mean().item()
    assert same > 0.99, same


def test_embedding_gradient_is_the_unrounded_fp32_sum(world1):
    """The table gradient of a bf16 embedding lookup (W2's vocabulary and token count
    scaled down) through the pass: computed from the fp32 output gradient, it is the
    unrewritten graph's fp32 sums before their bf16 rounding, so the unrewritten result
    is its bf16 rounding bitwise, and it is closer to the exact (fp64) sums."""
    group = world1.group_name

    def f(go, idx):
        w = torch.ops.aten.embedding_dense_backward(go, idx, 32000, -1, False).to(torch.float32)
        return [c10d.wait_tensor(c10d.reduce_scatter_tensor(w, "sum", 1, group))]

    torch.manual_seed(0)
    go = torch.randn(4, 2048, 512, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, 32000, (4, 2048), device="cuda")
    plain = make_fx(f, tracing_mode="fake")(go, idx)
    fused, rec = _run_pass(make_fx(f, tracing_mode="fake")(go, idx))
    embs = [n for n in fused.graph.nodes if n.target is torch.ops.aten.embedding_dense_backward.default]
    assert len(embs) == 1 and embs[0].meta["val"].dtype == torch.float32, fused.code
    new, old = fused(go, idx)[0], plain(go, idx)[0]
    exact = torch.zeros(32000, 512, dtype=torch.float64, device="cuda").index_add_(
        0, idx.flatten(), go.double().view(-1, 512))
    err_new, err_old = (new.double() - exact).abs().max().item(), (old.double() - exact).abs().max().item()
    print(f"EMBEDDING_GRAD max error vs fp64: fused {err_new:.3e}, unfused {err_old:.3e}")
    assert torch.equal(new.bfloat16().float(), old), "the unfused gradient is not the fused one's bf16 rounding"
    assert err_new < err_old / 10
