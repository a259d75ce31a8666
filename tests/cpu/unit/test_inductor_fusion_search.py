"""Config.inductor_fusion_search: the Inductor settings graphcomp's own compiles get."""
from __future__ import annotations

import pytest
import torch

import graphcomp
from graphcomp import _compat


def _fn(x, w):
    h = torch.relu(x @ w)
    return (h.sin().sum(0) * h.cos().sum(0)).sum() + (h * x.sum(1, keepdim=True)).mean()


@pytest.mark.parametrize("mode", ["fast", "inductor"])
def test_fusion_search_settings_hold_inside_graphcomps_compiles_only(mode, monkeypatch):
    import torch._inductor.config as iconfig
    from torch._inductor import scheduler

    before = (iconfig.max_fusion_buffer_group_pairwise_attempts, iconfig.loop_ordering_after_fusion)
    seen = []
    orig = scheduler.Scheduler.get_possible_fusions

    def spy(self, *a, **k):
        seen.append((iconfig.max_fusion_buffer_group_pairwise_attempts, iconfig.loop_ordering_after_fusion))
        return orig(self, *a, **k)

    monkeypatch.setattr(scheduler.Scheduler, "get_possible_fusions", spy)
    torch._dynamo.reset()
    graphcomp.reset()
    x = torch.randn(8, 6, requires_grad=True)
    w = torch.randn(6, 5, requires_grad=True)
    with iconfig.patch(fx_graph_cache=False):  # a cache hit would skip the scheduler
        f = torch.compile(_fn, backend="graphcomp", options={"codegen": "inductor", "inductor_fusion_search": mode})
        out = f(x, w)
        out.backward()
    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    _fn(ref_x, ref_w).backward()
    torch.testing.assert_close(out, _fn(x, w), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-6)
    expect = ((_compat.FAST_FUSION_SEARCH["max_fusion_buffer_group_pairwise_attempts"],
               _compat.FAST_FUSION_SEARCH["loop_ordering_after_fusion"]) if mode == "fast" else before)
    assert len(seen) >= 2, seen  # the forward's and the backward's scheduler
    assert set(seen) == {expect}, (mode, seen)
    # outside graphcomp's compiles Inductor's settings are as they were
    assert (iconfig.max_fusion_buffer_group_pairwise_attempts, iconfig.loop_ordering_after_fusion) == before
    torch._dynamo.reset()


def test_bad_fusion_search_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match=r"inductor_fusion_search.*'wide'.*\['fast', 'inductor'\]"):
        graphcomp.Config.from_options({"inductor_fusion_search": "wide"})
