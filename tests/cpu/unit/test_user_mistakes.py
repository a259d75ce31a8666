"""Common mistakes around sharding raise a named error instead of training nothing.

An optimizer built before ``graphcomp.shard(model)`` holds the parameters shard
replaced: its steps would update tensors the model no longer uses. It raises
``OptimizerParamsError`` at its first step (a plain loop), when captured
(``graphcomp.optim.capture``) and in ``graphcomp.train_step``, naming the parameter."""

from __future__ import annotations

import pytest
import torch

import graphcomp
from graphcomp.errors import OptimizerParamsError


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_optimizer_built_before_shard_raises_at_its_first_step(pg1):
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    graphcomp.shard(m)
    m(torch.ones(3, 4)).sum().backward()
    with pytest.raises(OptimizerParamsError, match=r"AdamW holds 4 parameter\(s\) that graphcomp.shard replaced "
                                                   r"with shards \(the first: '0.weight'\).*after graphcomp.shard"):
        opt.step()


def test_optimizer_built_after_shard_steps_and_changes_the_shards(pg1):
    m = _model()
    graphcomp.shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = [p.detach().clone() for p in m.parameters()]
    for _ in range(2):  # (the check runs once per optimizer; later steps skip it)
        m(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert any(not torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_captured_optimizer_and_train_step_refuse_a_stale_optimizer(pg1):
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    graphcomp.shard(m)
    with pytest.raises(OptimizerParamsError, match="graphcomp.optim.capture: AdamW holds 4 parameter"):
        graphcomp.optim.capture(opt, max_norm=1.0)
    with pytest.raises(OptimizerParamsError, match="graphcomp.train_step: AdamW holds 4 parameter"):
        graphcomp.train_step(m, opt)


def test_graphcomps_own_hook_does_not_count_as_a_step_hook(pg1):
    """The check is a global step pre-hook; captured optimizer steps fall back on step
    hooks (they would run at capture only), so graphcomp's own is not counted."""
    from graphcomp import _compat

    m = _model()
    graphcomp.shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    assert _compat.optimizer_step_hooks(opt) == 0
    h = opt.register_step_pre_hook(lambda *a: None)
    assert _compat.optimizer_step_hooks(opt) == 1
    h.remove()
