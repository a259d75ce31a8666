"""graphcomp.optim.capture on the CPU: what runs eagerly and why (unsupported
optimizers and options, step hooks, no CUDA, cudagraphs="off", no conditional graph
nodes), errors for bad arguments, teardown, warm-up under is_capturing(), and the
step's temporaries. Through the stand-in device of ``_optim_standin``."""

from __future__ import annotations

import pytest
import torch

import graphcomp
from graphcomp import optim as gopt
from graphcomp import runtime
from graphcomp.runtime import manager

from _optim_standin import (  # noqa: F401 (fixtures dev, pg1)
    STEPS, _local, assert_same, backward, copy_grads, dev, make, pg1, reference_step, train_pair,
)

def test_unsupported_optimizer_falls_back_once(pg1, dev):
    m, o = make(0, torch.optim.RMSprop, dict(lr=1e-2))
    rm, ro = make(0, torch.optim.RMSprop, dict(lr=1e-2))
    with pytest.warns(RuntimeWarning, match=r"RMSprop is not supported \(supported: Adam, AdamW, SGD\)"):
        step = gopt.capture(o, max_norm=1.0)
    for s in range(4):
        backward(m, s, nan=s == 2)
        copy_grads(m, rm)
        got, ref = step(), reference_step(ro, 1.0, [None])
        assert torch.equal(got, ref) or (s == 2 and got.isnan() and ref.isnan())
        assert_same(m, o, rm, ro)
        o.zero_grad()
        ro.zero_grad()
    c = graphcomp.counters
    assert c["optimizer_fallbacks"] == 1 and c["optimizer_steps_eager"] == 4
    assert c["optimizer_steps_skipped_nonfinite"] == 1 and c["optimizer_captures"] == 0
    assert step.mode == "reference"
    with pytest.raises(ValueError, match=r"cudagraphs='require'.*RMSprop is not supported"):
        gopt.capture(o, cudagraphs="require")


def test_step_hooks_fall_back(pg1, dev):
    m, o = make(0, torch.optim.AdamW, dict(lr=1e-2, fused=True))
    calls = []
    o.register_step_post_hook(lambda *a: calls.append(1))
    step = gopt.capture(o, max_norm=1.0)
    backward(m, 0)
    with pytest.warns(RuntimeWarning, match="step hooks"):
        step()
    backward(m, 1)
    step()
    assert len(calls) == 2 and graphcomp.counters["optimizer_captures"] == 0


def test_no_cuda_runs_eager_quietly(pg1):
    runtime.reset()
    assert not runtime.RUNTIME.device.available()
    m, o = make(0, torch.optim.AdamW, dict(lr=1e-2), capturable=False)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = gopt.capture(o, max_norm=1.0)
        backward(m, 0)
        step()
    assert step.mode == "reference" and step.reason == "no CUDA device"
    with pytest.raises(ValueError, match="require.*no CUDA device"):
        gopt.capture(o, cudagraphs="require")


def test_off_is_eager_with_the_same_semantics(pg1, dev):
    m, o = make(0, torch.optim.AdamW, dict(lr=1e-2, fused=True))
    step = gopt.capture(o, max_norm=1.0, cudagraphs="off")
    for s in range(3):
        backward(m, s, nan=s == 1)
        step()
        o.zero_grad()
    c = graphcomp.counters
    assert c["optimizer_steps_eager"] == 3 and c["optimizer_steps_skipped_nonfinite"] == 1 and c["optimizer_fallbacks"] == 0


def test_warmup_and_capture_run_under_is_capturing(pg1, dev, monkeypatch):
    seen = []
    orig = torch.nn.utils.get_total_norm

    def spy(*a, **k):
        seen.append(runtime.is_capturing())
        return orig(*a, **k)

    monkeypatch.setattr(torch.nn.utils, "get_total_norm", spy)
    m, o = make(0, torch.optim.AdamW, dict(lr=1e-2, fused=True))
    step = gopt.capture(o, max_norm=1.0)
    for s in range(3):
        backward(m, s)
        step()
        o.zero_grad(set_to_none=False)
    assert seen == [True, True, False]  # warm-up, capture, a replay (the stand-in runs the function)


def test_teardown_releases_the_graph_then_steps_run_eagerly(pg1, dev):
    step, _, _ = train_pair(torch.optim.AdamW, dict(lr=1e-2, fused=True), steps=3, nan_step=-1)
    assert runtime.teardown() == 1
    assert step._graph is None
    m, o = step.opt, None
    eager = graphcomp.counters["optimizer_steps_eager"]
    for p in step._params:
        p.grad = torch.zeros_like(p)
    step()
    assert graphcomp.counters["optimizer_steps_eager"] == eager + 1


@pytest.mark.parametrize("kw, match", [
    (dict(max_norm=0), "max_norm must be a finite number > 0 or None, got 0"),
    (dict(max_norm=float("nan")), "max_norm"),
    (dict(max_norm="1"), "max_norm"),
    (dict(norm_type=-1), "norm_type must be a number > 0 or float\\('inf'\\), got -1"),
    (dict(error_if_nonfinite=1), "error_if_nonfinite must be True or False, got 1"),
    (dict(skip_nonfinite=None), "skip_nonfinite"),
    (dict(foreach="yes"), "foreach must be None, True or False, got 'yes'"),
    (dict(cudagraphs="on"), "cudagraphs must be one of 'auto', 'require', 'off', got 'on'"),
    (dict(check_static_inputs="never"), "check_static_inputs must be 'first' or 'always', got 'never'"),
    (dict(max_recaptures=-1), "max_recaptures must be an int >= 0, got -1"),
])
def test_bad_arguments(kw, match):
    o = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match=match):
        gopt.capture(o, **kw)


def test_not_an_optimizer():
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got list"):
        gopt.capture([torch.zeros(1)])
    with pytest.raises(ValueError, match="the optimizer has no parameters"):
        gopt.capture(torch.optim.SGD([{"params": []}], lr=0.1))


def test_if_node_seam_ends_the_body_on_error():
    calls = []

    class G:
        def begin_capture_to_if_node(self, pred):
            calls.append(("begin", pred.dtype))

        def end_capture_to_conditional_node(self):
            calls.append("end")

    def body():
        raise KeyError("inside")

    with pytest.raises(KeyError):
        manager.CudaDevice().run_if(G(), torch.ones((), dtype=torch.bool), body)
    assert calls == [("begin", torch.bool), "end"]
    assert graphcomp._compat.cuda_graph_if_supported() is (torch.version.cuda is not None
                                                          and hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")
                                                          and tuple(int(x) for x in torch.version.cuda.split(".")[:2]) >= (12, 4))


class _PeakTemporaries(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak bytes of tensors created (not written in place) while active: what a
    captured step's private pool must hold."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        import torch.utils._pytree as pytree

        out = func(*args, **(kwargs or {}))
        leaves = pytree.tree_leaves((args, kwargs))
        ins = {_local(t).untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            local = _local(t)
            ptr, n = local.untyped_storage().data_ptr(), local.untyped_storage().nbytes()
            if ptr in ins or ptr in self.seen:
                continue
            self.seen.add(ptr)
            self.live += n
            self.peak = max(self.peak, self.live)

            def dead(n=n, ptr=ptr):
                self.live -= n
                self.seen.discard(ptr)

            weakref.finalize(local, dead)
        return out


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_temporaries_of_the_step(pg1, dev, kind):
    """The memory a captured step's private pool holds: a few bytes per parameter
    for fused AdamW, one copy of the local parameter shards for foreach AdamW."""
    from graphcomp.models import Llama

    torch.manual_seed(0)
    m = Llama("tiny")
    graphcomp.shard(m)
    o = torch.optim.AdamW(m.parameters(), lr=1e-3, **({"fused": True} if kind == "fused" else {"foreach": True}))
    step = gopt.capture(o, max_norm=1.0)
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    step()  # warm-up: the state exists
    step._step_params = list(step._params)
    mode = _PeakTemporaries()
    with mode:
        step._body([])
    local = sum(_local(p).numel() * _local(p).element_size() for p in m.parameters())
    if kind == "fused":
        assert mode.peak <= 16 * len(step._params) + 64, mode.peak
    else:
        assert local <= mode.peak <= local + 16 * len(step._params) + 64, (mode.peak, local)


def test_unsupported_option_falls_back(pg1, dev):
    m, o = make(0, torch.optim.AdamW, dict(lr=1e-2, differentiable=True), capturable=False)
    with pytest.warns(RuntimeWarning, match=r"param_groups\[0\] has differentiable=True"):
        step = gopt.capture(o, max_norm=1.0)
    assert step.mode == "reference" and graphcomp.counters["optimizer_fallbacks"] == 1


def test_without_conditional_nodes_the_skip_needs_eager(pg1, dev, monkeypatch):
    """No conditional nodes (torch 2.11): a foreach optimizer cannot skip on the
    device, so the skip falls back to eager; without the skip it captures."""
    monkeypatch.setattr(dev, "supports_if_nodes", lambda: False)
    m, o = make(0, torch.optim.AdamW, dict(lr=1e-2, foreach=True))
    with pytest.warns(RuntimeWarning, match="conditional CUDA graph nodes.*fused.*skip_nonfinite=False"):
        assert gopt.capture(o, max_norm=1.0).mode == "reference"
    step = gopt.capture(o, max_norm=1.0, skip_nonfinite=False)  # no skip: no conditional node needed
    for s in range(3):
        backward(m, s)
        step()
        o.zero_grad(set_to_none=False)
    assert graphcomp.counters["optimizer_steps_captured"] == 2 and dev.if_nodes == 0


def test_without_conditional_nodes_a_fused_adamw_skips_through_found_inf(pg1, dev, monkeypatch):
    """No conditional nodes (torch 2.11): a fused AdamW is still captured, and skips a
    non-finite step on the device through its kernel's found_inf: bitwise the eager
    reference (lr schedule, a NaN step) after every step."""
    monkeypatch.setattr(dev, "supports_if_nodes", lambda: False)
    step, norms, _ = train_pair(torch.optim.AdamW, dict(lr=1e-2, fused=True), groups=True)
    assert step.skip_by == "found_inf" and step.mode == "captured", step.decisions
    for got, ref in norms:
        assert torch.equal(got, ref) or (got.isnan() and ref.isnan())
    c = graphcomp.counters
    assert step.sync_counters() == 1 and c["optimizer_steps_captured"] == STEPS - 1 and dev.if_nodes == 0
