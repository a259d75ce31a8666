"""graphcomp.optim.capture on the CPU, through a stand-in device: the captured code
path (the step function a CUDA graph would hold) is run at "capture" and at every
"replay". Checks bitwise equality with torch's eager clip_grad_norm_ + opt.step()
(with the lr as a tensor, as the captured step holds it) for Adam/AdamW/SGD in their
fused, foreach and for-loop forms, the non-finite skip, lr schedules, gradient
addresses (in place, moved, copied), fallbacks, errors, state_dict/DCP and 2 gloo
ranks (global norm)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import graphcomp
from graphcomp import optim as gopt
from graphcomp import runtime
from graphcomp.models import TinyMLP
from graphcomp.optim.captured_step import _MOVES_BEFORE_COPY
from graphcomp.runtime import manager

from _dist import DistPool

STEPS = 12
NAN_STEP = 5


# ------------------------------------------------------------ stand-in device
def graph_inputs(step):
    """The addresses a captured step's graph reads: gradients (or the static
    buffers), parameters and optimizer state, lr tensors."""
    grads = step._grad_bufs if step._copy_mode else [_local(p.grad) for p in step._step_params]
    ts = grads + step._static_tensors() + [t for t in step._lr if t is not None]
    return [t.data_ptr() for t in ts]


class StandInGraph:
    """A CUDA graph's capture executes nothing and its replays execute the kernels
    on the memory they were captured on. The stand-in runs the function once at
    capture (that call's step) and skips the capture call's own replay, then runs it
    again at every replay, after asserting that everything it reads is where it was
    at capture (a real graph would read stale memory otherwise)."""

    def __init__(self):
        self.fn = None
        self.skip_next = False
        self.was_reset = False
        self.inputs = None

    def replay(self):
        assert not self.was_reset
        assert graph_inputs(self.fn.__self__) == self.inputs, "replayed with inputs at other addresses"
        if self.skip_next:
            self.skip_next = False
            return
        self.fn([])

    def reset(self):
        self.was_reset = True


class StandInDevice(manager.CudaDevice):
    device_type = "cpu"

    def __init__(self):
        self.if_nodes = 0
        self.captures = 0

    def pool_handle(self):
        return ("private-pool", id(self))

    def new_stream(self):
        return object()

    def current_stream(self):
        return object()

    def wait(self, a, b):
        pass

    def stream(self, s):
        return contextlib.nullcontext()

    def new_graph(self):
        return StandInGraph()

    def capture(self, g, pool, stream, fn, inputs, replay_inputs):
        g.fn = fn
        g.inputs = graph_inputs(fn.__self__)
        self.captures += 1
        out = fn(inputs)
        g.skip_next = True
        return out

    def supports_if_nodes(self):
        return True

    def run_if(self, g, pred, fn):
        assert pred.dtype == torch.bool and pred.dim() == 0
        self.if_nodes += 1
        if bool(pred):
            fn()

    def available(self):
        return True

    def synchronize(self):
        pass


def install_stand_in(monkeypatch=None):
    """The stand-in device, and torch's capturable optimizer paths allowed on the CPU
    (torch asserts CUDA for capturable=True; its math runs on any device)."""
    import torch.optim.adam as adam_mod
    import torch.optim.optimizer as opt_mod

    orig = opt_mod._get_capturable_supported_devices

    def with_cpu(supports_xla: bool = True):
        return list(orig(supports_xla)) + ["cpu"]

    dev = StandInDevice()
    if monkeypatch is not None:
        monkeypatch.setattr(adam_mod, "_get_capturable_supported_devices", with_cpu)
        monkeypatch.setattr(runtime.RUNTIME, "device", dev)
        monkeypatch.setattr(manager, "check_nccl_env", lambda: True)
        monkeypatch.setattr(graphcomp._compat, "wrap_destroy_process_group", lambda: True)
    else:
        adam_mod._get_capturable_supported_devices = with_cpu
        runtime.RUNTIME.device = dev
        manager.check_nccl_env = lambda: True
        graphcomp._compat.wrap_destroy_process_group = lambda: True
    return dev


@pytest.fixture
def dev(monkeypatch):
    runtime.reset()
    d = install_stand_in(monkeypatch)
    yield d
    runtime.reset()


@pytest.fixture(scope="module")
def pg1():
    if dist.is_initialized():
        pytest.fail("a process group leaked from an earlier test (each in-process test must destroy its group)")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# ----------------------------------------------------------------- training
CONFIGS = {
    "adamw_fused": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, fused=True)),
    "adamw_foreach": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, foreach=True)),
    "adamw_forloop": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, foreach=False)),
    "adam_foreach_amsgrad": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01, amsgrad=True, foreach=True)),
    "sgd_fused_nesterov": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3, fused=True)),
    "sgd_foreach": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, foreach=True)),
}


def make(seed=0, cls=torch.optim.AdamW, kw=None, sharded=True, groups=False, capturable=True):
    torch.manual_seed(seed)
    m = TinyMLP(dim=8, hidden=13, out=3)
    if sharded:
        graphcomp.shard(m)
    kw = dict(kw or {})
    if cls in (torch.optim.Adam, torch.optim.AdamW) and not kw.get("fused") and capturable:
        kw["capturable"] = True  # the reference runs torch's graph-safe path, as the captured step does
    params = [{"params": list(m.fc1.parameters())}, {"params": list(m.fc2.parameters()), "lr": kw["lr"] / 2}] \
        if groups else m.parameters()
    return m, cls(params, **kw)


def batch(step, rank=0):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 8, generator=g) * 4, torch.randn(6, 3, generator=g)


def backward(m, step, rank=0, nan=False, bad=float("nan")):
    x, y = batch(step, rank)
    (m(x, y) * 50).backward()  # large gradients: clipping is active
    if nan:
        p = next(iter(m.parameters()))
        _local(p.grad).view(-1)[0] = bad


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def reference_step(opt, max_norm, lr_tensors, norm_type=2.0, skip=True):
    """torch's eager clip_grad_norm_ + opt.step() with each lr as a tensor."""
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    total = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"), norm_type) \
        if max_norm else torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
    t = total.full_tensor() if isinstance(total, DTensor) else total
    if skip and not torch.isfinite(t):
        return t
    saved = [g["lr"] for g in opt.param_groups]
    for g, lt in zip(opt.param_groups, lr_tensors):
        if lt is not None:
            lt.fill_(g["lr"])
            g["lr"] = lt
    try:
        opt.step()
    finally:
        for g, v in zip(opt.param_groups, saved):
            g["lr"] = v
    return t


def lr_tensors_for(opt):
    tensor_lr = type(opt) is not torch.optim.SGD
    return [torch.zeros(()) if tensor_lr else None for _ in opt.param_groups]


def copy_grads(src, dst):
    for ps, pd in zip(src.parameters(), dst.parameters()):
        pd.grad = None if ps.grad is None else ps.grad.detach().clone()


def assert_same(m1, o1, m2, o2):
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(_local(a), _local(b)), n
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        s1, s2 = o1.state[p1], o2.state[p2]
        assert s1.keys() == s2.keys()
        for k in s1:
            if isinstance(s1[k], torch.Tensor):
                assert torch.equal(_local(s1[k]).float(), _local(s2[k]).float()), k


def schedule(opt):
    """A per-step warm-up + decay; for SGD (its lr is a graph constant) a step schedule."""
    if isinstance(opt, torch.optim.SGD):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4) * 0.9 ** s)


def train_pair(cls, kw, steps=STEPS, max_norm=1.0, set_to_none=False, nan_step=NAN_STEP, rank=0, hold=None,
               norm_type=2.0, groups=False, sharded=True, **capture_kw):
    """The captured step and the eager reference, on the same gradients, step by step."""
    m, o = make(0, cls, kw, groups=groups, sharded=sharded)
    rm, ro = make(0, cls, kw, groups=groups, sharded=sharded)
    sched, rsched = schedule(o), schedule(ro)
    step = gopt.capture(o, max_norm=max_norm, norm_type=norm_type, **capture_kw)
    lrs = lr_tensors_for(ro)
    norms = []
    for s in range(steps):
        backward(m, s, rank, nan=s == nan_step, bad=float("inf") if norm_type == float("inf") else float("nan"))
        copy_grads(m, rm)
        norms.append((step(), reference_step(ro, max_norm, lrs, norm_type)))
        assert_same(m, o, rm, ro)
        if hold is not None:
            hold.append([p.grad for p in m.parameters()])  # old gradients kept alive: new ones move
        o.zero_grad(set_to_none=set_to_none)
        ro.zero_grad()
        sched.step()
        rsched.step()
    return step, norms, (m, o, rm, ro)


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
def ranks2():
    with DistPool(2) as pool:
        yield pool


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