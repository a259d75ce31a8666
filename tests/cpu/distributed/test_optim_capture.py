"""graphcomp.optim.capture on the CPU, through a stand-in device (``_optim_standin``):
bitwise equality with torch's eager clip_grad_norm_ + opt.step() for Adam/AdamW/SGD in
their fused, foreach and for-loop forms, the non-finite skip, lr schedules, gradient
addresses (in place, moved, copied), re-captures, state_dict/DCP and 2 gloo ranks
(global norm). Fallbacks and errors: test_optim_fallbacks.py."""

from __future__ import annotations

import copy

import pytest
import torch

import graphcomp
from graphcomp import optim as gopt
from graphcomp.optim.captured_step import _MOVES_BEFORE_COPY

from _optim_standin import (  # noqa: F401 (fixtures dev, pg1)
    CONFIGS, STEPS, _local, assert_same, backward, copy_grads, dev, install_stand_in, lr_tensors_for, make, pg1, reference_step, schedule, train_pair,
)

# --------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(CONFIGS))
def test_captured_step_is_bitwise_eager(pg1, dev, name):
    cls, kw = CONFIGS[name]
    # (torch has no DTensor rule for fused SGD, eager or not: that one runs unsharded)
    step, norms, _ = train_pair(cls, kw, groups=name.startswith("adamw_f"), sharded=name != "sgd_fused_nesterov")
    for got, ref in norms:
        assert torch.equal(got, ref) or (got.isnan() and ref.isnan())
    c = graphcomp.counters
    assert step.sync_counters() == 1 and c["optimizer_steps_skipped_nonfinite"] == 1
    assert c["optimizer_steps_eager"] == 1  # the warm-up step
    assert c["optimizer_steps_captured"] == STEPS - 1
    if name.startswith("sgd"):  # lr is a constant of the graph: the schedule re-captures
        assert c["optimizer_recaptures"] >= 1 and c["optimizer_captures"] == 1 + c["optimizer_recaptures"]
    else:  # lr is a device tensor: the schedule changes it without a re-capture
        assert c["optimizer_captures"] == 1 and c["optimizer_recaptures"] == 0, step.decisions
    assert dev.if_nodes == c["optimizer_captures"]  # the update is inside the conditional node
    assert step.mode == "captured" and step.stats()["gradients"] == "in place"
    for g in step.opt.param_groups:
        assert isinstance(g["lr"], float)  # the user's groups keep their float lr


def test_new_gradient_tensors_each_step(pg1, dev):
    """zero_grad(set_to_none=True): each backward makes new gradient tensors."""
    step, norms, _ = train_pair(torch.optim.AdamW, dict(lr=1e-2, fused=True), set_to_none=True)
    assert all(torch.equal(a, b) or (a.isnan() and b.isnan()) for a, b in norms)


def test_moving_gradients_switch_to_static_buffers(pg1, dev):
    hold = []  # every step's gradients stay alive: the next ones are somewhere else
    step, norms, _ = train_pair(torch.optim.AdamW, dict(lr=1e-2, foreach=True), set_to_none=True, hold=hold)
    c = graphcomp.counters
    st = step.stats()
    assert st["gradients"] == "copied" and st["grad_buffer_bytes"] == sum(
        _local(p).numel() * 4 for p in step._with_grad)
    assert c["optimizer_recaptures"] == _MOVES_BEFORE_COPY + 1
    assert c["optimizer_grad_copy_bytes"] > 0
    assert c["optimizer_steps_captured"] == STEPS - 1


def test_gradient_accumulation_and_user_edits(pg1, dev):
    cls, kw = torch.optim.AdamW, dict(lr=1e-2, fused=True)
    m, o = make(0, cls, kw)
    rm, ro = make(0, cls, kw)
    step, lrs = gopt.capture(o, max_norm=1.0), lr_tensors_for(ro)
    for s in range(6):
        backward(m, 2 * s)
        backward(m, 2 * s + 1)  # accumulated into param.grad
        for p in m.parameters():
            p.grad.mul_(0.5)  # user code edits the gradient in place...
        if s == 3:
            b = m.fc2._parameters["bias"]
            b.grad = b.grad * 2  # ...or replaces it
        copy_grads(m, rm)
        assert torch.equal(step(), reference_step(ro, 1.0, lrs))
        assert_same(m, o, rm, ro)
        o.zero_grad(set_to_none=s % 2 == 0)
        ro.zero_grad()


def test_nonfinite_first_step_keeps_warming_up(pg1, dev):
    step, _, _ = train_pair(torch.optim.AdamW, dict(lr=1e-2, fused=True), steps=4, nan_step=0)
    c = graphcomp.counters
    assert c["optimizer_steps_eager"] == 2 and c["optimizer_steps_captured"] == 2  # no state before step 1


def test_inf_norm_and_no_clip(pg1, dev):
    train_pair(torch.optim.AdamW, dict(lr=1e-2, fused=True), norm_type=float("inf"))
    graphcomp.reset()
    train_pair(torch.optim.Adam, dict(lr=1e-2, foreach=True), max_norm=None)


def test_skip_nonfinite_false_applies_the_nonfinite_update_like_eager(pg1, dev):
    m, o = make(0, torch.optim.SGD, dict(lr=0.1))
    rm, ro = make(0, torch.optim.SGD, dict(lr=0.1))
    step = gopt.capture(o, max_norm=1.0, skip_nonfinite=False)
    for s in range(4):
        backward(m, s, nan=s == 2)
        copy_grads(m, rm)
        step()
        reference_step(ro, 1.0, [None], skip=False)
        for a, b in zip(m.parameters(), rm.parameters()):
            assert torch.equal(_local(a), _local(b)) or torch.equal(_local(a).isnan(), _local(b).isnan())
        o.zero_grad()
        ro.zero_grad()
    assert any(_local(p).isnan().any() for p in m.parameters())
    assert dev.if_nodes == 0


def test_error_if_nonfinite_raises_after_skipping(pg1, dev):
    m, o = make(0, torch.optim.AdamW, dict(lr=1e-2, fused=True))
    step = gopt.capture(o, max_norm=1.0, error_if_nonfinite=True)
    for s in range(3):
        backward(m, s)
        step()
        o.zero_grad()
    before = [_local(p).clone() for p in m.parameters()]
    backward(m, 3, nan=True)
    with pytest.raises(RuntimeError, match="non-finite.*skipped this update"):
        step()
    assert all(torch.equal(a, _local(b)) for a, b in zip(before, m.parameters()))
    assert graphcomp.counters["optimizer_steps_skipped_nonfinite"] == 1


def test_hyperparameter_change_recaptures_and_too_many_go_eager(pg1, dev):
    cls, kw = torch.optim.AdamW, dict(lr=1e-2, fused=True, weight_decay=0.1)
    m, o = make(0, cls, kw)
    rm, ro = make(0, cls, kw)
    step, lrs = gopt.capture(o, max_norm=1.0, max_recaptures=2), lr_tensors_for(ro)
    for s in range(8):
        if s >= 3:
            for g in (o.param_groups[0], ro.param_groups[0]):
                g["weight_decay"] = 0.1 + s  # a new constant every step from step 3
        backward(m, s)
        copy_grads(m, rm)
        if s == 5:  # the third re-capture
            with pytest.warns(RuntimeWarning, match="max_recaptures=2"):
                step()
        else:
            step()
        reference_step(ro, 1.0, lrs)
        assert_same(m, o, rm, ro)
        o.zero_grad(set_to_none=False)  # (gradients stay put: only the hyper-parameter re-captures)
        ro.zero_grad()
    assert step.mode == "eager" and graphcomp.counters["optimizer_fallbacks"] == 1
    assert graphcomp.counters["optimizer_captures"] == 3
    assert any("weight_decay" in d for d in step.decisions)


def test_state_dict_round_trip_and_load_recaptures(pg1, dev, tmp_path):
    cls, kw = torch.optim.AdamW, dict(lr=1e-2, foreach=True)
    m, o = make(0, cls, kw)
    sched, step = schedule(o), gopt.capture(o, max_norm=1.0)
    for s in range(10):
        if s == 5:
            m2, o2 = make(0, cls, kw)
            sched2 = schedule(o2)
            m2.load_state_dict(m.state_dict())
            o2.load_state_dict(copy.deepcopy(o.state_dict()))  # (a loaded state dict aliases its tensors)
            sched2.load_state_dict(sched.state_dict())
            step2 = gopt.capture(o2, max_norm=1.0)
            o.load_state_dict(o.state_dict())  # the same optimizer reloaded: state objects replaced
        backward(m, s)
        step()
        o.zero_grad()
        sched.step()
        if s >= 5:
            backward(m2, s)
            step2()
            o2.zero_grad()
            sched2.step()
    assert_same(m, o, m2, o2)
    assert any("load_state_dict" in d for d in step.decisions)
    assert o.state_dict()["param_groups"][0]["capturable"] is True


def test_host_tensor_hyperparameter_changed_in_place_recaptures(pg1, dev):
    """An SGD lr held in a CPU tensor (a graph constant) that a scheduler fills in place."""
    m, o = make(0, torch.optim.SGD, dict(lr=torch.tensor(0.1), momentum=0.9))
    rm, ro = make(0, torch.optim.SGD, dict(lr=torch.tensor(0.1), momentum=0.9))
    step = gopt.capture(o, max_norm=1.0)
    for s in range(5):
        if s == 3:
            o.param_groups[0]["lr"].fill_(0.05)
            ro.param_groups[0]["lr"].fill_(0.05)
        backward(m, s)
        copy_grads(m, rm)
        step()
        reference_step(ro, 1.0, [None])
        assert_same(m, o, rm, ro)
        o.zero_grad(set_to_none=False)
        ro.zero_grad()
    assert graphcomp.counters["optimizer_recaptures"] == 1


# ----------------------------------------------------------- 2 gloo ranks
def _two_ranks(rank, world, tmp):
    torch._dynamo.reset()
    graphcomp.reset()
    install_stand_in()
    from torch.distributed.tensor.debug import CommDebugMode

    out = {}
    for name, norm_type in (("adamw_fused", 2.0), ("adamw_foreach", float("inf"))):
        graphcomp.reset()
        cls, kw = CONFIGS[name]
        # different data per rank; the injected NaN is on rank 1 only: both ranks skip
        m, o = make(0, cls, kw)
        rm, ro = make(0, cls, kw)
        step, lrs = gopt.capture(o, max_norm=1.0, norm_type=norm_type), lr_tensors_for(ro)
        comms = []
        for s in range(8):
            # (an inf: torch's CPU max-norm kernel can drop a NaN, in eager clip_grad_norm_ too)
            backward(m, s, rank, nan=(s == 4 and rank == 1), bad=float("inf") if norm_type == float("inf") else float("nan"))
            copy_grads(m, rm)
            cm = CommDebugMode()
            with cm:
                got = step()
            comms.append(cm.get_total_counts())
            ref = reference_step(ro, 1.0, lrs, norm_type)
            assert torch.equal(got, ref) or (got.isnan() and ref.isnan()), (s, got, ref)
            assert_same(m, o, rm, ro)
            o.zero_grad()
            ro.zero_grad()
        step.sync_counters()
        out[name] = {"comms": comms, "skipped": graphcomp.counters["optimizer_steps_skipped_nonfinite"],
                     "captured": graphcomp.counters["optimizer_steps_captured"]}
    # DCP: save the captured optimizer's state, load it into a fresh one, continue
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    graphcomp.reset()
    cls, kw = CONFIGS["adamw_foreach"]
    m, o = make(0, cls, kw)
    step = gopt.capture(o, max_norm=1.0)
    for s in range(4):
        backward(m, s, rank)
        step()
        o.zero_grad()
    dcp.save({"model": m.state_dict(), "optim": get_optimizer_state_dict(m, o)}, checkpoint_id=f"{tmp}/ckpt")
    m2, o2 = make(1, cls, kw)
    step2 = gopt.capture(o2, max_norm=1.0)
    sd = {"model": m2.state_dict(), "optim": get_optimizer_state_dict(m2, o2)}
    dcp.load(sd, checkpoint_id=f"{tmp}/ckpt")
    m2.load_state_dict(sd["model"])
    set_optimizer_state_dict(m2, o2, sd["optim"])
    for s in range(4, 8):
        for mm, oo, st in ((m, o, step), (m2, o2, step2)):
            backward(mm, s, rank)
            st()
            oo.zero_grad()
    assert_same(m, o, m2, o2)
    out["dcp_captured"] = graphcomp.counters["optimizer_steps_captured"]
    return out


@pytest.fixture(scope="module")
def ranks2(shared_ranks2):
    return shared_ranks2.view(timeout=300)


def test_two_ranks_global_norm_skip_and_dcp(ranks2, tmp_path):
    res = ranks2.run(_two_ranks, str(tmp_path), timeout=240)
    for r in res:
        for name in ("adamw_fused", "adamw_foreach"):
            assert r[name]["skipped"] == 1, r  # the NaN was on rank 1: both ranks skipped
            assert r[name]["captured"] == 7
            assert all(c == 1 for c in r[name]["comms"]), r[name]["comms"]  # one all-reduce per step
        assert r["dcp_captured"] >= 6


def test_ready_and_replay_for_replay_sequences(pg1, dev):
    m, o = make(0, torch.optim.AdamW, dict(lr=1e-2, fused=True))
    rm, ro = make(0, torch.optim.AdamW, dict(lr=1e-2, fused=True))
    step, lrs = gopt.capture(o, max_norm=1.0), lr_tensors_for(ro)
    for s in range(5):
        backward(m, s)
        copy_grads(m, rm)
        if s < 2:
            assert not step.ready()  # warm-up, then the capture
            step()
        else:
            assert step.ready()
            step.replay()
        ref = reference_step(ro, 1.0, lrs)
        assert torch.equal(step.last_norm, ref)
        assert_same(m, o, rm, ro)
        o.zero_grad(set_to_none=False)
        ro.zero_grad()
    p = m.fc1._parameters["weight"]
    p.grad = p.grad.clone()  # moved: not ready, step() re-captures
    assert not step.ready()
    assert graphcomp.counters["optimizer_steps_captured"] == 4


def test_parameter_with_a_late_first_gradient(pg1, dev):
    """fc2 gets no gradient in the first steps: when it does, one eager step creates
    its state, then the step is captured again for all parameters."""
    cls, kw = torch.optim.AdamW, dict(lr=1e-2, foreach=True)
    m, o = make(0, cls, kw)
    rm, ro = make(0, cls, kw)
    step, lrs = gopt.capture(o, max_norm=1.0), lr_tensors_for(ro)
    late = list(m.fc2.parameters())
    for s in range(6):
        backward(m, s)
        if s < 3:
            for p in late:
                p.grad = None
        copy_grads(m, rm)
        step()
        reference_step(ro, 1.0, lrs)
        assert_same(m, o, rm, ro)
        o.zero_grad(set_to_none=False)
        ro.zero_grad()
    c = graphcomp.counters
    assert c["optimizer_steps_eager"] == 2 and c["optimizer_captures"] == 2
    assert any("set of parameters with a gradient changed" in d for d in step.decisions)


# ------------------------------------------------------------ fold_clip
def _close(m1, o1, m2, o2):
    """Parameters and state within rounding of the reference (fold_clip divides by the
    reciprocal of the clip coefficient where the reference multiplies by it)."""
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(_local(a), _local(b), rtol=1e-5, atol=1e-7, msg=n)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        for k, v in o1.state[p1].items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(_local(v).float(), _local(o2.state[p2][k]).float(), rtol=1e-4, atol=1e-9)


def test_fold_clip_matches_eager_clipping_and_leaves_the_gradients(pg1, dev):
    """fold_clip=True: the clip coefficient goes into fused AdamW's grad_scale (no pass
    multiplying the gradients). Clipping is active every step here (gradients x50):
    parameters and state stay within rounding of torch's clip_grad_norm_ + step, the
    non-finite step is still skipped, and param.grad holds the clipped gradients
    afterwards (the fused kernel stores what it divided), as after clip_grad_norm_."""
    step, norms, (m, o, rm, ro) = train_pair(torch.optim.AdamW, dict(lr=1e-2, fused=True, weight_decay=0.1),
                                             check=_close, fold_clip=True)
    for got, ref in norms:
        assert torch.equal(got, ref) or (got.isnan() and ref.isnan())
        assert got.isnan() or float(got) > 1.0  # (clipping was active)
    assert step.sync_counters() == 1 and graphcomp.counters["optimizer_steps_skipped_nonfinite"] == 1
    assert step.mode == "captured"
    backward(m, 99)
    raw = [_local(p.grad).clone() for p in m.parameters()]
    norm = step()
    coef = 1.0 / (float(norm) + 1e-6)
    for p, g in zip(m.parameters(), raw):  # the fused kernel stores the scaled gradients, as clipping does
        torch.testing.assert_close(_local(p.grad), g * coef, rtol=1e-6, atol=0)


def test_fold_clip_is_bitwise_when_nothing_is_clipped(pg1, dev):
    """A coefficient of 1 is a grad_scale of exactly 1: the same numbers as eager."""
    train_pair(torch.optim.AdamW, dict(lr=1e-2, fused=True), max_norm=1e9, fold_clip=True)


def test_fold_clip_needs_fused_adam_and_max_norm(pg1):
    m, o = make(0, torch.optim.AdamW, dict(lr=1e-2))
    with pytest.raises(ValueError, match=r"fold_clip=True needs a fused Adam or AdamW"):
        gopt.capture(o, max_norm=1.0, fold_clip=True)
    m, o = make(0, torch.optim.AdamW, dict(lr=1e-2, fused=True))
    with pytest.raises(ValueError, match=r"fold_clip=True needs max_norm"):
        gopt.capture(o, fold_clip=True)
    with pytest.raises(ValueError, match=r"fold_clip must be 'auto', True or False, got 'yes'"):
        gopt.capture(o, max_norm=1.0, fold_clip="yes")
    with pytest.raises(ValueError, match=r"fold_clip must be 'auto', True or False, got 1"):
        gopt.capture(o, max_norm=1.0, fold_clip=1)


def test_exact_clip_fold_refusals_name_the_reason(pg1):
    """The exact fold (fold_clip="auto", graphcomp/optim/clip_fold.py) runs only for a
    fused Adam/AdamW without amsgrad or step hooks, on CUDA with Triton (its kernel is
    checked bitwise on the GPU: tests/gpu/test_clip_fold_gpu.py); otherwise the captured
    step clips apart and says why in its decisions."""
    from graphcomp.optim import clip_fold

    def why(cls, **kw):
        return clip_fold.refusal(make(0, cls, dict(lr=1e-2, **kw))[1])

    assert why(torch.optim.SGD) == "SGD is not Adam or AdamW"
    assert why(torch.optim.AdamW, foreach=True) == "param group 0 is not fused (fused=True)"
    assert why(torch.optim.Adam, fused=True, amsgrad=True) == "param group 0 uses amsgrad"
    m, o = make(0, torch.optim.AdamW, dict(lr=1e-2, fused=True))
    h = o.register_step_pre_hook(lambda *a: None)
    assert clip_fold.refusal(o) == "the optimizer has step hooks (the fold does not call opt.step())"
    h.remove()
    assert clip_fold.refusal(o) == ("no CUDA device" if not torch.cuda.is_available() else None)


def test_fold_orchestration_with_a_stand_in_kernel(pg1, dev, monkeypatch):
    """The captured step's side of the exact fold, on the stand-in device with the
    kernel replaced by what it must equal (multiply the given gradients by the given
    coefficient, then torch's fused step on those parameters alone): bitwise torch's
    clip_grads_with_norm_ + opt.step() over the run (NaN step skipped), the tables
    prepared before the capture for the parameters the step passes, one decision and
    one count. The kernel itself is checked on GPUs (tests/gpu/test_clip_fold_gpu.py)."""
    from graphcomp.optim import clip_fold

    prepared, stepped = [], []

    def fake_step(opt, params, coef, found_inf=None, keep=None):
        assert coef.dim() == 0 and coef.dtype == torch.float32 and found_inf is None  # (IF nodes here)
        stepped.append(len(params))
        torch._foreach_mul_([_local(p.grad) for p in params], coef)
        ids = {id(p) for p in params}
        hidden = [(p, p.grad) for g in opt.param_groups for p in g["params"] if id(p) not in ids and p.grad is not None]
        for p, _ in hidden:
            p.grad = None
        try:
            opt.step()
        finally:
            for p, g in hidden:
                p.grad = g
        return None

    def fake_prepare(opt, subsets):
        if any(not opt.state.get(p) for ps in subsets for p in ps):
            return "optimizer state not created yet"
        prepared.append([len(ps) for ps in subsets])
        return None

    monkeypatch.setattr(clip_fold, "refusal", lambda opt: None)
    monkeypatch.setattr(clip_fold, "device_refusal", lambda device: None)
    monkeypatch.setattr(clip_fold, "probe", lambda opt, device: None)
    monkeypatch.setattr(clip_fold, "probed", lambda opt: None)
    monkeypatch.setattr(clip_fold, "prepare", fake_prepare)
    monkeypatch.setattr(clip_fold, "step", fake_step)
    step, norms, (m, o, rm, ro) = train_pair(torch.optim.AdamW, dict(lr=1e-2, fused=True, weight_decay=0.1))
    n = len([p for p in m.parameters()])
    assert step.mode == "captured" and graphcomp.counters["optimizer_clip_folds"] == 1
    said = [d for d in step.decisions if d.startswith("clip")]
    assert said == ["clip apart from the optimizer step: optimizer state not created yet",
                    "clip folded into the fused optimizer kernel (graphcomp/optim/clip_fold.py: "
                    "bitwise clip_grads_with_norm_ + opt.step(), one pass over the gradients fewer)"], step.decisions
    # every step after the warm-up (the stand-in replays its recorded body; the NaN step
    # is skipped by the IF node), all parameters in one call
    assert len(stepped) >= STEPS - 2 and set(stepped) == {n}
    assert prepared[0] == [n]  # before the capture, for the parameters the body passes


def test_clip_fold_block_table():
    """The kernel's program table: each tensor gets ceil(numel / block) programs, in
    order, numbered within it (a 1-element tensor one, an empty one none)."""
    from graphcomp.optim.clip_fold import block_table

    assert block_table([5000, 1, 0, 4096], 2048).tolist() == [[0, 0, 0, 1, 3, 3], [0, 1, 2, 0, 0, 1]]
    assert block_table([2048], 2048).tolist() == [[0], [0]]
    assert block_table([2049], 2048).dtype == torch.int32


def test_default_clip_on_the_cpu_says_why_it_is_apart(pg1, dev):
    """fold_clip="auto" (the default) on the stand-in device: the clip runs apart (no
    CUDA), the step is bitwise torch's, and the decision names the reason once."""
    step, norms, _ = train_pair(torch.optim.AdamW, dict(lr=1e-2, fused=True, weight_decay=0.1))
    said = [d for d in step.decisions if "clip" in d and "apart" in d]
    assert said == ["clip apart from the optimizer step: no CUDA device"], step.decisions
    assert graphcomp.counters["optimizer_clip_folds"] == 0
