"""fuse_grad_upcast on hand-built graphs: a weight gradient's bf16 matmul + fp32
upcast before its reduce-scatter becomes one fp32-output matmul (exact op counts,
shapes, strides), other gradients are skipped by reason, CPU graphs are left alone
(aten::mm.dtype is CUDA-only: the numerics are tests/gpu/test_grad_upcast_gpu.py)."""

import pytest
import torch
import torch.nn.functional as F

from _graphs import reduce_scatter, run_pass, trace, counts

MM = "aten.mm.default"
MM_DT = "aten.mm.dtype"
TO_COPY = "aten._to_copy.default"


def _backward_like(world=2):
    """Three gradients, as AOTAutograd writes a linear layer's backward: a weight
    gradient (mm -> t -> t -> fp32 -> view -> pad -> reduce-scatter), a bias gradient
    (sum -> fp32) and a tied weight's (two matmuls summed -> fp32)."""

    def f(go, x, go2, x2):
        w = torch.mm(go.t(), x).t().t().to(torch.float32)  # [5, 8]: 5 rows, padded to 6 for world 2
        w = F.pad(w.view(5, 8), (0, 0, 0, 1))
        b = go.sum(0).to(torch.float32)
        tied = (torch.mm(go.t(), x) + torch.mm(go2.t(), x2)).to(torch.float32)
        return [reduce_scatter(w, world, "g"), reduce_scatter(b.view(-1)[:4], world, "g"),
                reduce_scatter(tied, world, "g")]

    bf = torch.bfloat16
    return trace(f, torch.randn(7, 5, dtype=bf), torch.randn(7, 8, dtype=bf), torch.randn(7, 5, dtype=bf),
                 torch.randn(7, 8, dtype=bf))


def _outputs(gm):
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return [a.meta["val"] for a in out.args[0]]


@pytest.fixture
def any_device(monkeypatch):
    from graphcomp.passes import fuse_grad_upcast

    monkeypatch.setattr(fuse_grad_upcast, "_device_ok", lambda node: True)


def test_weight_gradient_matmul_writes_fp32(any_device):
    gm = _backward_like()
    before = counts(gm)
    out_before = _outputs(gm)
    gm, rec = run_pass("fuse_grad_upcast", gm)
    c = counts(gm)
    assert c[MM_DT] == 1 and c[MM] == before[MM] - 1
    assert c[TO_COPY] == before[TO_COPY] - 1
    (mm,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.dtype]
    assert mm.args[2] == torch.float32 and mm.meta["val"].dtype == torch.float32
    assert rec.counts == {"skipped:not_a_matmul": 2}  # the bias's sum and the tied weight's sum
    out_after = _outputs(gm)
    for a, b in zip(out_before, out_after):
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)


def test_cpu_graphs_are_left_alone():
    gm = _backward_like()
    code = gm.code
    gm, rec = run_pass("fuse_grad_upcast", gm)
    assert gm.code == code and rec.counts.get("skipped:not_cuda") == 1 and "on CUDA" in rec.reason


def test_fp32_matmul_is_not_touched(any_device):
    def f(go, x):
        return [reduce_scatter(torch.mm(go.t(), x), 2, "g")]

    gm = trace(f, torch.randn(7, 4), torch.randn(7, 8))
    gm, rec = run_pass("fuse_grad_upcast", gm)
    assert counts(gm)[MM_DT] == 0 and rec.counts == {"skipped:no_upcast": 1}


def _embedding_backward_like(dtype=torch.bfloat16):
    """An input embedding's table gradient as AOTAutograd writes it: embedding_dense_backward
    of the bf16 output gradient -> fp32 -> view -> reduce-scatter."""

    def f(go, idx):
        w = torch.ops.aten.embedding_dense_backward(go, idx, 10, -1, False).to(torch.float32)
        return [reduce_scatter(w.view(10, 4), 2, "g")]

    return trace(f, torch.randn(2, 3, 4, dtype=dtype), torch.randint(0, 10, (2, 3)))


def test_embedding_gradient_is_computed_from_the_fp32_output_gradient(any_device):
    gm = _embedding_backward_like()
    before = counts(gm)
    out_before = _outputs(gm)
    gm, rec = run_pass("fuse_grad_upcast", gm)
    (emb,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.embedding_dense_backward.default]
    assert emb.meta["val"].dtype == torch.float32 and emb.args[0].meta["val"].dtype == torch.float32
    c = counts(gm)
    assert c.get(TO_COPY, 0) == before.get(TO_COPY, 0) - 1  # the [vocab, dim] upcast is gone
    assert c["prims.convert_element_type.default"] == before.get("prims.convert_element_type.default", 0) + 1
    assert rec.counts == {} and "embedding" in rec.notes[0]
    for a, b in zip(out_before, _outputs(gm)):
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)


def test_embedding_gradient_values_are_the_fp32_sums(any_device):
    """What the rewritten graph computes: the rows' sums in fp32 (the unrewritten op's
    result is rounded to bf16, after an fp32 accumulation on CUDA; CPU's kernel even
    accumulates in bf16), so it is at least as close to the exact sums."""
    torch.manual_seed(0)
    go, idx = torch.randn(4, 16, 8, dtype=torch.bfloat16), torch.randint(0, 10, (4, 16))
    exact = torch.zeros(10, 8, dtype=torch.float64).index_add_(0, idx.flatten(), go.double().view(-1, 8))
    old = torch.ops.aten.embedding_dense_backward(go, idx, 10, -1, False).float()
    new = torch.ops.aten.embedding_dense_backward(go.float(), idx, 10, -1, False)
    assert new.dtype == torch.float32
    assert torch.allclose(new.double(), exact, rtol=1e-6, atol=1e-6)
    assert (new.double() - exact).abs().max() < (old.double() - exact).abs().max()


def test_fp32_embedding_gradient_is_not_touched(any_device):
    gm, rec = run_pass("fuse_grad_upcast", _embedding_backward_like(torch.float32))
    assert rec.counts == {"skipped:no_upcast": 1}
