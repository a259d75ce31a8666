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
