"""Shared by the graphcomp.optim.capture CPU tests: a stand-in device on which the
captured code path (the step function a CUDA graph would hold) runs at "capture" and
at every "replay", fixtures, and training helpers that step a captured optimizer
beside torch's eager clip_grad_norm_ + opt.step() (with the lr as a tensor, as the
captured step holds it)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import graphcomp
from graphcomp import optim as gopt
from graphcomp import runtime
from graphcomp.models import TinyMLP
from graphcomp.runtime import manager

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
        self.pool = None

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
        self.pools = 0
        self.graphs_by_pool = {}  # pool id -> graphs captured into it

    def pool_handle(self):
        self.pools += 1
        return ("private-pool", id(self), self.pools)

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
        # torch's rule (CUDACachingAllocator / CachingHostAllocator beginAllocateToPool):
        # a capture into a pool id that graphs used before needs one of them alive
        used = self.graphs_by_pool.setdefault(pool, [])
        if used and all(x.was_reset for x in used):
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED (stand-in: a capture into a pool "
                               "whose graphs were all reset)")
        used.append(g)
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
               norm_type=2.0, groups=False, sharded=True, check=None, **capture_kw):
    """The captured step and the eager reference, on the same gradients, step by step
    (``check(m, o, rm, ro)`` after each step: default bitwise, ``assert_same``)."""
    check = check or assert_same
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
        check(m, o, rm, ro)
        if hold is not None:
            hold.append([p.grad for p in m.parameters()])  # old gradients kept alive: new ones move
        o.zero_grad(set_to_none=set_to_none)
        ro.zero_grad()
        sched.step()
        rsched.step()
    return step, norms, (m, o, rm, ro)
