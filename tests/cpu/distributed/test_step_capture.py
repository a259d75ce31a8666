"""graphcomp.capture_step (the whole-step option): the training step as one
graph, on CPU stand-in devices. A stand-in graph's capture runs the step once (that
call's step: a CUDA capture executes nothing and the capture call then replays) and
each replay runs the step function again, into the graph's outputs; what these tests
check is the host logic: what is captured, what is checked before a replay, the
fallbacks, and that a replayed step computes what the uncaptured step computes
(bitwise, on the CPU). They prove nothing about CUDA: tests/gpu/test_step_capture_gpu.py
runs the same on a GPU."""

from __future__ import annotations

import warnings

import pytest
import torch

import graphcomp
from graphcomp import optim as gopt
from graphcomp.runtime import RUNTIME
from graphcomp.runtime import capture

from _fakecuda import replay_whole_step
from _optim_standin import (  # noqa: F401 (fixtures dev, pg1)
    StandInDevice, StandInGraph, _local, batch, dev, make, pg1,
)


class StepGraph(StandInGraph):
    """A whole-step graph: the capture call's step ran at capture; each replay runs
    the step function again and writes its results into the captured outputs."""

    outs = None  # set by StepDevice.capture for a whole step (else: an optimizer graph)

    def replay(self):
        if self.outs is None:
            return super().replay()
        assert not self.was_reset
        if self.skip_next:
            self.skip_next = False
            return
        replay_whole_step(self, self.fn, self.outs)


class StepDevice(StandInDevice):
    """The optimizer stand-in, which also captures whole steps."""

    def __init__(self):
        super().__init__()
        self.step_captures = 0
        self.in_step_capture = False

    def capture_active(self):
        # (reset_graph refuses while this is True: on CUDA, destroying a graph during
        # another graph's capture breaks that capture)
        return self.in_step_capture

    def new_graph(self):
        return StepGraph()

    def capture(self, g, pool, stream, fn, inputs, replay_inputs):
        rec = capture.recording()
        if rec is not None and rec.kind == "step" and rec.graph is g:
            self.step_captures += 1
            g.fn, g.skip_next = fn, True
            self.in_step_capture = True
            try:
                g.outs = list(fn(inputs))
            finally:
                self.in_step_capture = False
            return list(g.outs)
        return super().capture(g, pool, stream, fn, inputs, replay_inputs)


@pytest.fixture
def sdev(monkeypatch, dev):
    d = StepDevice()
    monkeypatch.setattr(RUNTIME, "device", d)
    return d


def _train(whole: bool, steps: int = 8, **kw):
    """TinyMLP sharded on one rank, fused AdamW through graphcomp.optim.capture (clip
    1.0); ``whole``: the step function through capture_step."""
    m, opt = make(seed=0, cls=torch.optim.AdamW, kw=dict(lr=1e-2, weight_decay=0.1, fused=True))
    cstep = gopt.capture(opt, max_norm=1.0)

    def train_step(x, y):
        loss = m(x, y) * 50
        loss.backward()
        norm = cstep()
        opt.zero_grad(set_to_none=True)
        return {"loss": loss.detach(), "norm": norm}

    run = graphcomp.capture_step(train_step, params=m.parameters(), optimizers=[cstep], **kw) if whole else train_step
    outs = []
    for i in range(steps):
        x, y = batch(i)
        outs.append(run(x, y))
    params = [_local(p).clone() for p in m.parameters()]
    state = [_local(v).clone() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return run, cstep, outs, params, state


def test_whole_step_is_bitwise_the_uncaptured_step(pg1, sdev):
    graphcomp.reset()
    _, _, ref, ref_p, ref_s = _train(whole=False)
    RUNTIME.device = sdev
    graphcomp.reset()
    RUNTIME.device = sdev
    step, cstep, got, got_p, got_s = _train(whole=True)
    for a, b in zip(got, ref):
        assert torch.equal(a["loss"], b["loss"]) and torch.equal(a["norm"], b["norm"]), (a, b)
    assert all(torch.equal(a, b) for a, b in zip(got_p, ref_p))
    assert all(torch.equal(a, b) for a, b in zip(got_s, ref_s))
    c = graphcomp.counters
    c.expect(step_captures=1, step_replays=6, step_calls_uncaptured=2, step_recaptures=0, step_capture_fallbacks=0)
    assert sdev.step_captures == 1
    st = step.stats()
    assert st["mode"] == "captured" and st["replays"] == 6 and st["calls"] == 8, st
    # the optimizer step was recorded into the whole-step graph with its host hook
    assert c["optimizer_steps_in_step_graph"] >= 1
    assert any("whole-step" in d for d in cstep.decisions), cstep.decisions
    # returned outputs are copies: the next replay does not change them
    assert got[-2]["loss"].data_ptr() != got[-1]["loss"].data_ptr()


def _scheduled(whole: bool, sdev):
    graphcomp.reset()
    RUNTIME.device = sdev
    m, opt = make(seed=0, cls=torch.optim.AdamW, kw=dict(lr=1e-2, fused=True))
    cstep = gopt.capture(opt, max_norm=1.0)

    def train_step(x, y):
        (m(x, y) * 50).backward()
        cstep()
        opt.zero_grad(set_to_none=True)

    # on a GPU a refresh inside the capture would be a copy kernel in the graph, resetting
    # the lr to the capture's value at every replay: none may run while fn is captured
    real_sync = cstep._sync_lr

    def sync_lr():
        assert capture.recording("step") is None, "lr refreshed while the whole step was being captured"
        real_sync()

    cstep._sync_lr = sync_lr
    # (the torch optimizer passed, not the captured step: the runtime still finds the step)
    run = graphcomp.capture_step(train_step, params=m.parameters(), optimizers=[opt]) if whole else train_step
    seen = []
    for i in range(6):
        opt.param_groups[0]["lr"] = 1e-2 / (i + 1)  # a schedule, outside the step function
        run(*batch(i))
        seen.append(float(cstep._lr[0]))
    return seen, [_local(p).clone() for p in m.parameters()]


def test_lr_schedule_reaches_the_replays_without_recapture(pg1, sdev):
    """The captured optimizer's lr is refreshed before the capture (outside it) and by
    its host hook before every replay: the same parameters as without capture_step."""
    ref_seen, ref = _scheduled(False, sdev)
    seen, got = _scheduled(True, sdev)
    assert seen == [pytest.approx(1e-2 / (i + 1)) for i in range(6)] == ref_seen, seen
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    graphcomp.counters.expect(step_captures=1, step_recaptures=0)


def _sgd_step(sdev=None):
    """After graphcomp.reset() (and with the stand-in device ``sdev``, if given): a
    TinyMLP sharded on one rank with SGD, and its step function (forward, backward,
    step, zero_grad(set_to_none=True)) returning the loss."""
    graphcomp.reset()
    if sdev is not None:
        RUNTIME.device = sdev
    m, opt = make(seed=0, cls=torch.optim.SGD, kw=dict(lr=0.1))

    def train_step(x, y):
        loss = m(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return m, opt, train_step


def test_changed_inputs_run_uncaptured_and_recapture(pg1, sdev):
    m, _opt, train_step = _sgd_step(sdev)
    step = graphcomp.capture_step(train_step, params=m.parameters(), warmup=1)
    x, y = batch(0)
    step(x, y)  # warm-up
    step(x, y)  # capture
    step(x[:3], y[:3])  # another shape: runs as it is, the graph is dropped
    step(x, y)  # captures again
    step(x, y)  # replays
    c = graphcomp.counters
    c.expect(step_captures=2, step_recaptures=1, step_replays=3, step_calls_uncaptured=2)
    assert "inputs differ" in step.decisions[1], step.decisions


def test_gradient_state_other_than_captured_never_replays(pg1, sdev):
    """The graph replays what the captured call did to the gradients (created them, or
    accumulated into the ones it found, in place). A call that finds them otherwise
    (kept where the capture found none, or the reverse) runs as it is; a pattern that
    keeps changing ends uncaptured. Same parameters as without capture_step."""
    graphcomp.reset()
    RUNTIME.device = sdev
    m, opt = make(seed=0, cls=torch.optim.SGD, kw=dict(lr=0.1))

    def train_step(x, y):
        m(x, y).backward()  # no zero_grad: the user zeroes every other step, outside
        opt.step()

    ref_m, ref_opt = make(seed=0, cls=torch.optim.SGD, kw=dict(lr=0.1))
    step = graphcomp.capture_step(train_step, params=m.parameters(), warmup=1, max_recaptures=1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for i in range(8):
            if i % 2 == 0:
                opt.zero_grad(set_to_none=True)
                ref_opt.zero_grad(set_to_none=True)
            step(*batch(i))
            ref_m(*batch(i)).backward()
            ref_opt.step()
    for a, b in zip(m.parameters(), ref_m.parameters()):
        assert torch.equal(_local(a), _local(b))
    assert step.mode == "uncaptured" and "re-captures" in step.reason, step.stats()
    assert any("runs uncaptured from now on" in str(x.message) for x in w)
    assert any("gradients differ" in d for d in step.decisions), step.decisions
    graphcomp.counters.expect(step_capture_fallbacks=1)


def test_gradients_accumulated_in_place_replay(pg1, sdev):
    """Gradient accumulation across calls (the step never zeroes): the captured call
    accumulated into the gradients in place, and so does every replay."""
    graphcomp.reset()
    RUNTIME.device = sdev
    m, _ = make(seed=0, cls=torch.optim.SGD, kw=dict(lr=0.1))
    ref_m, _ = make(seed=0, cls=torch.optim.SGD, kw=dict(lr=0.1))

    def train_step(x, y):
        m(x, y).backward()

    step = graphcomp.capture_step(train_step, params=m.parameters(), warmup=1)
    for i in range(5):
        step(*batch(i))
        ref_m(*batch(i)).backward()
    for a, b in zip(m.parameters(), ref_m.parameters()):
        assert torch.equal(_local(a.grad), _local(b.grad))
    graphcomp.counters.expect(step_captures=1, step_replays=4, step_recaptures=0)


def test_capture_failure_falls_back_or_raises(pg1, sdev):
    m, _opt, sgd = _sgd_step(sdev)

    def returns_float(x, y):
        return float(sgd(x, y))  # a host value: would be the capture's value forever

    step = graphcomp.capture_step(returns_float, params=m.parameters(), warmup=1)
    step(*batch(0))
    with pytest.warns(RuntimeWarning, match="capture failed: TypeError: the step function returned a float"):
        out = step(*batch(1))
    assert isinstance(out, float) and step.mode == "uncaptured"
    graphcomp.counters.expect(step_capture_failures=1, step_capture_fallbacks=1)
    req = graphcomp.capture_step(returns_float, params=m.parameters(), warmup=1, cudagraphs="require")
    req(*batch(2))
    with pytest.raises(RuntimeError, match="cudagraphs='require'.*returned a float"):
        req(*batch(3))


def test_optimizer_that_runs_eagerly_refuses_inline(pg1, sdev):
    """A graphcomp.optim.capture step that runs torch's eager clip + step (an
    unsupported optimizer) decides on the host: the whole-step capture fails with that
    reason ('require' raises; 'auto' runs the step uncaptured, same numerics)."""
    graphcomp.reset()
    RUNTIME.device = sdev
    m, opt = make(seed=0, cls=torch.optim.RMSprop, kw=dict(lr=1e-2))
    with pytest.warns(RuntimeWarning, match="not supported"):
        cstep = gopt.capture(opt)

    entry = []

    def train_step(x, y):
        entry.append(all(p.grad is None for p in m.parameters()))
        (m(x, y)).backward()
        cstep()
        opt.zero_grad(set_to_none=True)

    step = graphcomp.capture_step(train_step, params=m.parameters(), warmup=1, cudagraphs="require")
    step(*batch(0))
    with pytest.raises(RuntimeError, match="runs eagerly \\(optimizer RMSprop is not supported"):
        step(*batch(1))
    auto = graphcomp.capture_step(train_step, params=m.parameters(), warmup=1)
    auto(*batch(2))
    with pytest.warns(RuntimeWarning, match="capture failed: RuntimeError: graphcomp.optim: optim/RMSprop"):
        auto(*batch(3))
    assert auto.mode == "uncaptured"
    # the aborted capture's backward assigned gradients (memory no kernel wrote, on a
    # GPU): the call run after it found them as they were before the capture
    assert entry == [True] * 5, entry  # (require: 2 calls; auto: the warm-up, the capture, the call run after it)


def test_replaced_optimizer_state_recaptures(pg1, sdev):
    graphcomp.reset()
    RUNTIME.device = sdev
    m, opt = make(seed=0, cls=torch.optim.AdamW, kw=dict(lr=1e-2, fused=True))
    cstep = gopt.capture(opt)

    def train_step(x, y):
        (m(x, y)).backward()
        cstep()
        opt.zero_grad(set_to_none=True)

    step = graphcomp.capture_step(train_step, params=m.parameters(), optimizers=[opt])
    for i in range(4):
        step(*batch(i))
    opt.load_state_dict(opt.state_dict())  # new state tensors
    step(*batch(4))
    assert any("state or param_groups were replaced" in d for d in step.decisions), step.decisions
    graphcomp.counters.expect(step_recaptures=1)


def test_off_no_cuda_and_teardown(pg1, dev, monkeypatch):
    m, _opt, sgd = _sgd_step()
    calls = []

    def train_step(x, y):
        calls.append(1)
        sgd(x, y)

    off = graphcomp.capture_step(train_step, params=m.parameters(), cudagraphs="off")
    for i in range(3):
        off(*batch(i))
    assert off.mode == "off" and len(calls) == 3
    monkeypatch.setattr(dev, "available", lambda: False)
    nocuda = graphcomp.capture_step(train_step, params=m.parameters(), warmup=1)
    for i in range(3):
        nocuda(*batch(i))
    assert nocuda.stats()["reason"] == "no CUDA device" and len(calls) == 6
    graphcomp.counters.expect(step_captures=0, step_calls_uncaptured=6)


def test_teardown_releases_the_graph(pg1, sdev):
    m, _opt, train_step = _sgd_step(sdev)

    step = graphcomp.capture_step(train_step, params=m.parameters(), warmup=1)
    for i in range(3):
        step(*batch(i))
    assert step.graph is not None
    assert graphcomp.runtime.teardown() >= 1
    assert step.graph is None and step.mode == "uncaptured"
    step(*batch(3))  # runs as it is
    graphcomp.counters.expect(step_calls_uncaptured=2)


def test_teardown_records_what_ran_captured_for_inspect(pg1, sdev, tmp_path, monkeypatch):
    """With dumps on, teardown writes rank<R>/runtime.json (the whole-step and optimizer
    captures, the counters) and ``graphcomp inspect`` (text and HTML) shows it."""
    from graphcomp.tools.inspect_dumps import inspect_dir
    from graphcomp.tools.inspect_html import render_html

    monkeypatch.setenv("GRAPHCOMP_DUMP_DIR", str(tmp_path))
    graphcomp.reset()
    RUNTIME.device = sdev
    torch._dynamo.reset()
    torch.compile(lambda t: t * 2 + 1, backend="graphcomp")(torch.ones(4))  # a compiled frame: the dump dir is in use
    step, cstep, _outs, _p, _s = _train(whole=True)
    assert not (tmp_path / "rank0" / "runtime.json").exists()
    graphcomp.runtime.teardown()
    text = inspect_dir(tmp_path)
    assert "what ran captured (written at teardown)" in text, text
    line = next(ln for ln in text.splitlines() if ln.startswith("step/"))
    assert line.split()[1:6] == ["captured", "yes", "8", "6", "0"], line  # mode, graph held, calls, replays, recaptures
    assert any(ln.startswith("optim/AdamW") for ln in text.splitlines()), text
    counters = dict(ln.split()[:2] for ln in text.split("counter")[-1].splitlines()[2:])
    # (a stand-in replay runs the step function again, so the inline recording counts per replay here)
    assert counters["step_replays"] == "6" and int(counters["optimizer_steps_in_step_graph"]) >= 1, counters
    page = render_html(tmp_path)
    assert "What ran captured (at teardown)" in page and "step/" in page
    # without dumps, teardown writes nothing
    graphcomp.reset()
    assert graphcomp.runtime.teardown() == 0 and SESSION_dump_target() is None


def test_reset_writes_the_runtime_record_before_clearing(pg1, tmp_path, monkeypatch):
    """``graphcomp.reset()`` with dumps on writes rank<R>/runtime.json (the counters as
    they were) before clearing them: the benchmark harness resets between systems, so
    before this no runtime.json (and no measured peak for ``graphcomp inspect``) was
    ever written there (2 H200s, 246ab78)."""
    import json

    monkeypatch.setenv("GRAPHCOMP_DUMP_DIR", str(tmp_path))
    graphcomp.reset()
    torch._dynamo.reset()
    torch.compile(lambda t: t * 2 + 1, backend="graphcomp")(torch.ones(4))
    assert not (tmp_path / "rank0" / "runtime.json").exists()
    graphcomp.reset()
    rec = json.loads((tmp_path / "rank0" / "runtime.json").read_text())
    assert rec["counters"].get("frames_compiled") == 1, rec
    assert graphcomp.counters.get("frames_compiled", 0) == 0 and SESSION_dump_target() is None
    # the next reset has no dump target: nothing is rewritten
    (tmp_path / "rank0" / "runtime.json").unlink()
    graphcomp.reset()
    assert not (tmp_path / "rank0" / "runtime.json").exists()


def SESSION_dump_target():
    from graphcomp.session import SESSION

    return SESSION.dump_target


@pytest.mark.parametrize("bad, match", [
    (dict(cudagraphs="yes"), "cudagraphs='yes'; valid: 'auto', 'require', 'off'"),
    (dict(warmup=0), "warmup=0; valid: an int >= 1"),
    (dict(check_static_inputs="never"), "check_static_inputs='never'; valid: 'first', 'always'"),
    (dict(max_recaptures=-1), "max_recaptures=-1"),
    (dict(params=[]), "params must be a non-empty iterable of tensors"),
    (dict(optimizers=[object()]), "optimizers must be torch optimizers"),
])
def test_bad_arguments_name_the_value(bad, match):
    kw = dict(params=[torch.zeros(1)])
    kw.update(bad)
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        graphcomp.capture_step(lambda: None, **kw)
    with pytest.raises(ValueError, match="fn must be callable"):
        graphcomp.capture_step(3, params=[torch.zeros(1)])


# --------------------------------------- a compiled, sharded model on 2 gloo ranks
def _compiled(rank: int, world: int, whole: bool) -> dict:
    """The tiny Llama sharded over 2 ranks, compiled with graphcomp (its pieces captured
    and replayed on the CPU stand-in device), SGD; ``whole``: through capture_step."""
    from _fakecuda import fake_cuda_runtime

    from graphcomp.models import Llama, synthetic_batch
    from graphcomp.sharding.shard import full_state_dict

    with fake_cuda_runtime():
        torch.manual_seed(0)
        m = Llama("tiny")
        m.reset_parameters(seed=0)
        graphcomp.shard(m)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        cm = torch.compile(m, backend="graphcomp", dynamic=False, options={"codegen": "eager", "cudagraphs": "auto"})

        def train_step(tok, tgt):
            loss = cm(tok, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        run = graphcomp.capture_step(train_step, params=m.parameters(), optimizers=[opt]) if whole else train_step
        losses, piece_replays = [], []
        for step in range(6):
            tok, tgt = synthetic_batch(m.cfg, 2, 16, seed=100 * rank + step)
            losses.append(run(tok, tgt))
            piece_replays.append(graphcomp.counters.get("replays", 0))
        counters = dict(graphcomp.counters)
        params = full_state_dict(m)
        stats = run.stats() if whole else None
        graphcomp.runtime.teardown()
    return {"losses": losses, "params": params, "counters": counters, "piece_replays": piece_replays, "stats": stats}


def _compiled_plain_then_whole(rank: int, world: int) -> tuple[dict, dict]:
    """Both runs in one task, each from a fresh compile state."""
    torch._dynamo.reset()
    graphcomp.reset()
    ref = _compiled(rank, world, False)
    torch._dynamo.reset()
    graphcomp.reset()
    return ref, _compiled(rank, world, True)


def test_compiled_sharded_step_on_2_ranks_runs_its_pieces_inline(shared_ranks2):
    """Whole-step replays run every piece inline (the pieces' own graphs are not
    replayed), with the ranks' collectives in step, and compute what the uncaptured
    step computes, bitwise. (On the session's pair of ranks, tests/cpu/conftest.py:
    a fresh pair cost two processes' start in CI.)"""
    res = shared_ranks2.run(_compiled_plain_then_whole, timeout=480)
    for r in range(2):
        e, g = res[r]
        assert all(torch.equal(a, b) for a, b in zip(g["losses"], e["losses"])), (g["losses"], e["losses"])
        for k in e["params"]:
            assert torch.equal(g["params"][k], e["params"][k]), k
        c = g["counters"]
        assert c.get("step_captures") == 1 and c.get("step_replays") == 4 and c.get("step_calls_uncaptured") == 2, c
        # the pieces replayed their own graphs in the uncaptured calls only
        pr = g["piece_replays"]
        assert pr[1] > 0 and pr[2] == pr[1] and pr[-1] == pr[1], pr
        assert g["stats"]["mode"] == "captured", g["stats"]
