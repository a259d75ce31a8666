"""Fused optimizers on DTensor parameters take no FakeTensor fallback.

torch has no Meta kernel for ``_fused_adam(w)_.tensor_lr`` (the captured step's lr is a
tensor). DTensor's sharding propagation then runs the op
through FakeTensor's fallback, which materializes a real copy of every parameter, gradient
and state: 60+ s and an extra copy of the optimizer's memory in W3's first step on 4
H200s. ``_compat.register_fused_optimizer_meta`` fills the gap (``shard`` and the
captured step call it)."""
from __future__ import annotations

import pytest
import torch
import torch._subclasses.fake_tensor as fake_tensor

from graphcomp import _compat


@pytest.fixture
def fallbacks(monkeypatch):
    seen: list[str] = []
    real = fake_tensor.run_fallback_kernel

    def spy(fake_mode, func, *args, **kwargs):
        seen.append(str(func))
        return real(fake_mode, func, *args, **kwargs)

    monkeypatch.setattr(fake_tensor, "run_fallback_kernel", spy)
    return seen


def test_registration_is_idempotent_and_only_where_missing():
    _compat.register_fused_optimizer_meta()
    for name in _compat._FUSED_INPLACE_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Meta"), name
    assert _compat.register_fused_optimizer_meta() == []
    # torch's own kernels are left alone
    assert "_fused_adamw_" not in _compat._FUSED_INPLACE_OPS


def _params(mesh, n=3, rows=8):
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    ps = [torch.nn.Parameter(distribute_tensor(torch.randn(rows, 4), mesh, [Shard(0)])) for _ in range(n)]
    for p in ps:
        p.grad = distribute_tensor(torch.randn(rows, 4), mesh, [Shard(0)])
    return ps


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-2), fused=True),
    lambda ps: torch.optim.Adam(ps, lr=torch.tensor(1e-2), fused=True),
], ids=["adamw_tensor_lr", "adam_tensor_lr"])
def test_fused_step_on_dtensors_takes_no_fallback_and_matches_plain_tensors(pg1, fallbacks, make):
    from torch.distributed.device_mesh import init_device_mesh

    _compat.register_fused_optimizer_meta()
    mesh = init_device_mesh("cpu", (1,))
    ps = _params(mesh)
    plain = [torch.nn.Parameter(p.full_tensor().detach().clone()) for p in ps]
    for q, p in zip(plain, ps):
        q.grad = p.grad.full_tensor().clone()
    opt, ref = make(ps), make(plain)
    for _ in range(3):
        opt.step()
        ref.step()
    assert fallbacks == []
    for p, q in zip(ps, plain):
        assert torch.equal(p.full_tensor(), q), "a fused step on DTensors differs from the same step on tensors"
    st, rst = opt.state[ps[0]], ref.state[plain[0]]
    for k, v in rst.items():
        got = st[k].full_tensor() if hasattr(st[k], "full_tensor") else st[k]
        assert torch.equal(got, v), k


def test_without_the_kernels_torch_falls_back(pg1, fallbacks):
    """The test above can fail: with graphcomp's kernels taken out again, the same step
    goes through FakeTensor's fallback."""
    from torch.distributed.device_mesh import init_device_mesh

    _compat.register_fused_optimizer_meta()
    if _compat._FUSED_META_LIB is None:
        pytest.skip("this torch has its own Meta kernels for the tensor-lr fused Adam")
    _compat._FUSED_META_LIB._destroy()
    _compat._FUSED_META_LIB = None
    try:
        ps = _params(init_device_mesh("cpu", (1,)), rows=6)  # shapes of their own: DTensor caches propagation
        torch.optim.AdamW(ps, lr=torch.tensor(1e-2), fused=True).step()
        assert fallbacks == ["aten._fused_adamw_.tensor_lr"]
    finally:
        assert _compat.register_fused_optimizer_meta() == list(_compat._FUSED_INPLACE_OPS)
