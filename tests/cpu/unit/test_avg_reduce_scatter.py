"""avg_reduce_scatter on hand-built graphs: a gradient's ``reduce_scatter(sum) / W``
becomes ``reduce_scatter(avg)`` on NCCL groups of a power-of-two size (exact op
counts), everything else is skipped by reason, and buckets form over the averaged
ones. The numerics (bitwise the sum divided by W on NCCL) are the GPU test
``tests/gpu/test_cudagraphs_gpu.py::test_avg_reduce_scatter_bitwise_on_nccl``."""

import pytest
import torch

from _graphs import run_pass, trace, counts

c10d = torch.ops._c10d_functional
DIV = "aten.div.Tensor"
RS = "_c10d_functional.reduce_scatter_tensor.default"


def _rs_div(g, world, group, divisor=None):
    out = c10d.wait_tensor(c10d.reduce_scatter_tensor(g, "sum", world, group))
    return out / (world if divisor is None else divisor)


def _grads(world=2, dtype=torch.float32, divisor=None):
    def f(a, b, c):
        return [_rs_div(a, world, "nccl_g", divisor), _rs_div(b.view(-1), world, "nccl_g", divisor),
                _rs_div(c, world, "gloo_g", divisor)]

    return trace(f, torch.randn(4, 8, dtype=dtype), torch.randn(2, 8, dtype=dtype), torch.randn(8, dtype=dtype))


@pytest.fixture
def backends(monkeypatch):
    from graphcomp import _compat

    monkeypatch.setattr(_compat, "group_backend", lambda name: {"nccl_g": "nccl", "gloo_g": "gloo"}.get(name))


def _ops(gm):
    return [n.args[1] for n in gm.graph.nodes if n.target is c10d.reduce_scatter_tensor.default]


def test_nccl_sum_and_division_become_avg(backends):
    gm = _grads()
    before = counts(gm)
    assert before[DIV] == 3
    gm, rec = run_pass("avg_reduce_scatter", gm)
    c = counts(gm)
    assert c[DIV] == 1 and c[RS] == 3  # only the gloo group keeps its division
    assert _ops(gm) == ["avg", "avg", "sum"]
    assert rec.counts == {"skipped:backend_gloo": 1}
    out = next(n for n in gm.graph.nodes if n.op == "output")
    # the outputs are the waits themselves, with the divided values' shapes and dtypes
    assert [a.target for a in out.args[0][:2]] == [c10d.wait_tensor.default] * 2
    assert [tuple(a.meta["val"].shape) for a in out.args[0]] == [(2, 8), (8,), (4,)]


@pytest.mark.parametrize("world,expect", [(3, "world_not_power_of_two"), (6, "world_not_power_of_two")])
def test_other_world_sizes_keep_the_division(backends, world, expect):
    def f(a):
        return [_rs_div(a, world, "nccl_g")]

    gm, rec = run_pass("avg_reduce_scatter", trace(f, torch.randn(12, 4)))
    assert counts(gm)[DIV] == 1 and _ops(gm) == ["sum"]
    assert rec.counts == {f"skipped:{expect}": 1}
    assert not rec.changed


def test_world_4_and_bf16_apply(backends):
    gm, rec = run_pass("avg_reduce_scatter", _grads(world=4, dtype=torch.bfloat16))
    assert _ops(gm) == ["avg", "avg", "sum"] and counts(gm)[DIV] == 1


def test_other_divisor_or_extra_use_is_left_alone(backends):
    def f(a, b):
        w = c10d.wait_tensor(c10d.reduce_scatter_tensor(a, "sum", 2, "nccl_g"))
        x = c10d.wait_tensor(c10d.reduce_scatter_tensor(b, "sum", 2, "nccl_g"))
        return [w / 4, x / 2, x * 3]  # a divisor other than W; a wait with a second use

    gm, rec = run_pass("avg_reduce_scatter", trace(f, torch.randn(4, 4), torch.randn(4, 4)))
    assert _ops(gm) == ["sum", "sum"] and counts(gm)[DIV] == 2
    assert rec.counts == {"skipped:no_division_by_world": 2}


def test_unresolvable_group_is_skipped():
    # no monkeypatch: "nccl_g" is not a process group of this process
    gm, rec = run_pass("avg_reduce_scatter", _grads())
    assert _ops(gm) == ["sum"] * 3 and counts(gm)[DIV] == 3
    assert rec.counts == {"skipped:backend_unknown": 3}


def test_averaged_reduce_scatters_bucket_together(backends):
    gm, _ = run_pass("avg_reduce_scatter", _grads())
    gm, rec = run_pass("bucket_collectives", gm, bucket_bytes=1 << 20)
    ops = _ops(gm)
    assert sorted(ops) == ["avg", "sum"]  # the two NCCL gradients in one bucket, the gloo one apart


def test_pass_order_and_switch():
    from graphcomp.config import Config
    from graphcomp.compiler.pipeline import PASS_ORDER

    assert PASS_ORDER.index("fuse_grad_upcast") < PASS_ORDER.index("avg_reduce_scatter") < \
        PASS_ORDER.index("bucket_collectives")
    assert Config.from_options({}).pass_enabled("avg_reduce_scatter")
    assert not Config.from_options({"passes": {"avg_reduce_scatter": False}}).pass_enabled("avg_reduce_scatter")
