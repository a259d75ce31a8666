"""CudaGraphRunner logic on the CPU, with a stand-in device whose "graph" replays
the captured function into the captured output tensors (what a CUDA graph does
to pool memory). Covers: static-buffer copies, static address checks, recapture,
output safety (clone / liveness fallback), max_captures, is_capturing during
warm-up and capture, teardown, the NCCL env warning, the destroy hook."""

from __future__ import annotations

import contextlib
import operator
import warnings

import pytest
import torch

import graphcomp
from graphcomp import _compat, runtime
from graphcomp.runtime import manager
from graphcomp.runtime.runner import CudaGraphRunner, StaticAddressError
from _fakecuda import FakeDevice, install_fake_device, install_pretend_cuda  # noqa: F401


@pytest.fixture(autouse=True)
def fake_device(monkeypatch):
    yield from install_fake_device(monkeypatch)


@pytest.fixture
def pretend_cuda(monkeypatch):
    install_pretend_cuda(monkeypatch)


def make_runner(fn, kinds, **kw):
    kw.setdefault("copy_outputs", "always")  # the tests below "auto" say so
    calls = {"n": 0, "capturing": []}

    def boxed(args):
        calls["n"] += 1
        calls["capturing"].append(runtime.is_capturing())
        return fn(*args)

    r = CudaGraphRunner("fwd/piece_0", boxed, kinds, input_names=[f"arg{i}" for i in range(len(kinds))], **kw)
    return r, calls


def test_replay_copies_non_static_inputs_and_counts():
    w = torch.randn(3, 3)
    r, calls = make_runner(lambda w, x: (x @ w,), ["param", "copy"], clone_outputs={0})
    for i in range(4):
        x = torch.randn(2, 3)
        (y,) = r(w, x)
        torch.testing.assert_close(y, x @ w, rtol=0, atol=0)
    c = graphcomp.counters
    assert c["captures"] == 1 and c["replays"] == 4 and c["pieces_captured"] == 1
    # 2 warm-ups, the trial capture, its replay and the capture ran with is_capturing()
    # True (the stand-in graph's replays call fn again, outside capture)
    assert calls["capturing"][:5] == [True] * 5
    assert not any(calls["capturing"][5:])
    assert not runtime.is_capturing()


def test_changed_param_address_raises_naming_input_and_fix():
    w, x = torch.randn(3, 3), torch.randn(2, 3)
    r, _ = make_runner(lambda w, x: (x @ w,), ["param", "copy"], clone_outputs={0}, check_static_inputs="always")
    r(w, x)
    with pytest.raises(StaticAddressError, match=r"'arg0'.*changed since capture.*copy_\(\).*on_address_change"):
        r(w.clone(), x)  # "reassigned parameter": same shape, new address


def test_first_check_only_checks_first_replay_always_checks_every():
    w, x = torch.randn(3, 3), torch.randn(2, 3)
    r, _ = make_runner(lambda w, x: (x @ w,), ["param", "copy"], clone_outputs={0}, check_static_inputs="first")
    r(w, x)  # capture + its own replay
    with pytest.raises(StaticAddressError):
        r(w.clone(), x)  # the first replay with new inputs is always checked
    r(w, x)
    r(w.clone(), x)  # later replays are not checked with "first" (documented trade-off)
    r2, _ = make_runner(lambda w, x: (x @ w,), ["param", "copy"], clone_outputs={0}, check_static_inputs="always")
    r2(w, x)
    with pytest.raises(StaticAddressError):
        r2(w.clone(), x)


def test_recapture_on_address_change():
    w, x = torch.randn(3, 3), torch.randn(2, 3)
    r, _ = make_runner(lambda w, x: (x @ w,), ["param", "copy"], clone_outputs={0},
                       check_static_inputs="always", on_address_change="recapture")
    r(w, x)
    w2 = torch.randn(3, 3)
    (y,) = r(w2, x)
    torch.testing.assert_close(y, x @ w2, rtol=0, atol=0)
    assert graphcomp.counters["recaptures"] == 1 and graphcomp.counters["captures"] == 2


def test_cloned_output_keeps_its_value_after_next_replay():
    w = torch.randn(3, 3)
    r, _ = make_runner(lambda w, x: ((x @ w).sum(),), ["param", "copy"], clone_outputs={0})
    x1, x2 = torch.randn(2, 3), torch.randn(2, 3)
    (l1,) = r(w, x1)
    (l2,) = r(w, x2)
    assert l1.item() == (x1 @ w).sum().item()
    assert l2.item() == (x2 @ w).sum().item()
    assert graphcomp.counters["cudagraph_output_copy_bytes"] == 2 * 4


def test_live_uncloned_output_forces_eager_not_overwrite():
    """Two forwards before one backward: the saved activation of call 1 is still
    held, so call 2 runs eagerly instead of overwriting it."""
    w = torch.randn(3, 3)
    r, _ = make_runner(lambda w, x: ((x @ w).sum(), (x @ w).relu()), ["param", "copy"], clone_outputs={0})
    x1, x2 = torch.randn(2, 3), torch.randn(2, 3)
    l1, saved1 = r(w, x1)
    with pytest.warns(RuntimeWarning, match="still referenced"):
        l2, saved2 = r(w, x2)
    torch.testing.assert_close(saved1, (x1 @ w).relu(), rtol=0, atol=0)
    torch.testing.assert_close(saved2, (x2 @ w).relu(), rtol=0, atol=0)
    assert graphcomp.counters["cudagraph_fallbacks"] == 1
    del saved1, saved2
    replays = graphcomp.counters["replays"]
    _, s3 = r(w, x1)  # nothing alive any more: replays again
    assert graphcomp.counters["replays"] == replays + 1
    torch.testing.assert_close(s3, (x1 @ w).relu(), rtol=0, atol=0)


def test_detached_alias_counts_as_alive():
    r, _ = make_runner(lambda x: (x * 2,), ["copy"])
    (y,) = r(torch.ones(3))
    kept = y.detach()  # e.g. losses.append(loss.detach())
    del y
    with pytest.warns(RuntimeWarning):
        r(torch.zeros(3))
    assert kept.tolist() == [2.0, 2.0, 2.0]


def test_saved_input_outside_the_pool_is_copied_from_the_first_capture():
    w = torch.randn(4)
    r, _ = make_runner(lambda w, s, g: (s * g * w,), ["param", "saved", "saved"], clone_outputs={0})
    s, g = torch.randn(4), torch.randn(4)
    r(w, s, g)
    # a user tensor the forward saved (not pool memory, not a parameter): copied from
    # the start; a saved parameter (seen as a "param" input at capture) stays static
    assert r.kinds == ["param", "copy", "copy"]
    r2, _ = make_runner(lambda w: (w * 2,), ["saved"], clone_outputs={0})
    r2(w)
    assert r2.kinds == ["saved"]
    for _ in range(3):
        s2 = torch.randn(4)  # e.g. produced by an eager piece: a new address every step
        (out,) = r(w, s2, g)
        torch.testing.assert_close(out, s2 * g * w, rtol=0, atol=0)
    assert graphcomp.counters["recaptures"] == 0 and graphcomp.counters["replays"] == 5


def test_saved_input_at_new_address_becomes_a_copied_input():
    """A saved input that was pool memory at capture (a forward piece's output) and
    then arrives elsewhere (that forward ran eagerly): copied from then on."""
    fwd, _ = make_runner(lambda x: (x * 3,), ["copy"])
    r, _ = make_runner(lambda s, g: (s * g,), ["saved", "copy"], clone_outputs={0})
    g = torch.randn(4)
    (out,) = r.call([fwd(torch.ones(4))[0], g])
    torch.testing.assert_close(out, 3 * g, rtol=0, atol=0)
    assert r.kinds == ["saved", "copy"]
    for _ in range(3):
        s2 = torch.randn(4)
        (out,) = r(s2, g)
        torch.testing.assert_close(out, s2 * g, rtol=0, atol=0)
    assert r.kinds == ["copy", "copy"]
    assert graphcomp.counters["recaptures"] == 1


def test_max_captures_then_eager_with_warning():
    r, _ = make_runner(lambda x: (x + 1,), ["copy"], clone_outputs={0}, max_captures=2)
    for n in (2, 3):
        r(torch.zeros(n))
    with pytest.warns(RuntimeWarning, match="max_captures=2"):
        (y,) = r(torch.zeros(5))
    assert y.tolist() == [1.0] * 5
    assert graphcomp.counters["captures"] == 2
    # a known shape still replays
    (y2,) = r(torch.zeros(3))
    assert y2.tolist() == [1.0] * 3


def test_scalar_inputs_are_part_of_the_signature():
    r, _ = make_runner(lambda x, k: (x * k,), ["copy", "scalar"], clone_outputs={0})
    assert r(torch.ones(2), 2)[0].tolist() == [2.0, 2.0]
    assert r(torch.ones(2), 3)[0].tolist() == [3.0, 3.0]
    assert graphcomp.counters["captures"] == 2


def test_teardown_releases_graphs_and_runs_eagerly_after():
    r, _ = make_runner(lambda x: (x + 1,), ["copy"], clone_outputs={0})
    r(torch.zeros(2))
    graphs = [c.graph for c in r.captures.values()]
    assert runtime.teardown() == 1
    assert all(g.released for g in graphs) and not r.captures
    assert r(torch.zeros(2))[0].tolist() == [1.0, 1.0]
    assert not r.captures
    # a runner created after teardown (a new compile) captures again
    r2, _ = make_runner(lambda x: (x + 2,), ["copy"], clone_outputs={0})
    assert r2(torch.zeros(2))[0].tolist() == [2.0, 2.0]
    assert len(r2.captures) == 1 and graphcomp.counters["captures"] == 2


def test_graphcomp_reset_releases_graphs():
    r, _ = make_runner(lambda x: (x + 1,), ["copy"], clone_outputs={0})
    r(torch.zeros(2))
    graphs = [c.graph for c in r.captures.values()]
    graphcomp.reset()
    assert all(g.released for g in graphs) and graphcomp.counters["captures"] == 0
    assert r(torch.zeros(2))[0].tolist() == [1.0, 1.0] and not r.captures


def test_nccl_env_warning():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert "NCCL_GRAPH_REGISTER=0" in manager.nccl_env_problem(env)
    assert manager.nccl_env_problem({**env, "NCCL_GRAPH_REGISTER": "0"}) is None
    assert manager.nccl_env_problem({}) is None
    assert manager.nccl_env_problem({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}) is None


def test_is_capturing_false_on_cpu_build():
    assert runtime.is_capturing() is False


def test_wrap_destroy_process_group_tears_down_first(monkeypatch):
    import importlib

    import torch.distributed as dist

    compat = importlib.reload(importlib.import_module("graphcomp._compat"))  # the real function
    calls = []
    orig = dist.destroy_process_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: calls.append("destroy"))
    monkeypatch.setattr(runtime, "teardown", lambda: calls.append("teardown") or 0)
    monkeypatch.setattr(compat, "_DESTROY_WRAPPED", False)
    manager._register_destroy_hook()  # (the reload emptied _compat's registry; the runtime registers its teardown)
    assert compat.wrap_destroy_process_group()
    assert compat.wrap_destroy_process_group()  # idempotent
    dist.destroy_process_group()
    assert calls == ["teardown", "destroy"]
    monkeypatch.setattr(dist, "destroy_process_group", orig)


def test_storage_refs_see_aliases():
    t = torch.zeros(4)
    h = _compat.storage_handle(t)
    base = _compat.storage_refs(h)
    v = t.detach()
    assert _compat.storage_refs(h) == base + 1
    del v
    assert _compat.storage_refs(h) == base


# ------------------------------------------------ end to end through the backend
class ItemModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.l1(x)).sin().cos()
        s = (h > 0.5).sum().item()  # a host sync (int: stays in the graph): the graph is cut here
        return (self.l2(h * (s + 1)) ** 2).mean() / (s + 1)


def _item_models(codegen, lr):
    """An eager ItemModel and an identical compiled one, each with its SGD."""
    ref, m = ItemModel(), ItemModel()
    cm = torch.compile(m, backend="graphcomp", options={"codegen": codegen, "min_piece_nodes": 1})
    return ref, m, cm, torch.optim.SGD(ref.parameters(), lr=lr), torch.optim.SGD(m.parameters(), lr=lr)


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_end_to_end_item_model_split_and_replayed(pretend_cuda, codegen):
    ref, m, cm, opt_r, opt_m = _item_models(codegen, 1e-4)
    tol = dict(rtol=1e-4, atol=1e-4) if codegen == "inductor" else dict(rtol=1e-5, atol=1e-6)
    losses, refs = [], []
    settled = None
    for step in range(6):
        if step == 4:  # steps 1, 2: hazard re-captures; 3: the backward demotes x (new every step)
            settled = graphcomp.counters["captures"]
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        lr_, lm = ref(x), cm(x)
        lr_.backward()
        lm.backward()
        losses.append(lm.detach())  # kept across steps: must keep its own value
        refs.append(lr_.detach())
        for a, b in zip(ref.parameters(), m.parameters()):
            torch.testing.assert_close(b.grad, a.grad, **tol)
        opt_r.step(); opt_m.step()
        opt_r.zero_grad(set_to_none=step % 2 == 0); opt_m.zero_grad(set_to_none=step % 2 == 0)
        torch.testing.assert_close(lm, lr_, **tol)
    torch.testing.assert_close(torch.stack(losses), torch.stack(refs), **tol)  # read after later steps
    c = graphcomp.counters
    assert c["captures"] >= 2 and c["replays"] >= 8, dict(c)
    assert c["pieces_eager"] >= 1
    frame = graphcomp.frame_summaries()[0]
    modes = [p["mode"] for p in frame["stages"]["fwd"]["partitions"]]
    assert "cudagraph" in modes and "eager" in modes
    captured = [p for p in frame["stages"]["fwd"]["partitions"] if p["mode"] == "cudagraph"]
    # copy_outputs="auto": the gradients kept by zero_grad(set_to_none=False) (step 2)
    # re-capture the forward pieces once (the backward copies its gradients from then
    # on; the kept losses are forward outputs, always copied); no capture after that
    assert all(1 <= p["captures"] <= 2 and p["pool_bytes"] > 0 for p in captured), captured
    # each capture call's phases are timed (host seconds; the harness reports them)
    assert all(set(p["capture_seconds"]) == {"warmup", "trial_capture", "capture"}
               and min(p["capture_seconds"].values()) >= 0 for p in captured), captured
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from benchmarks.measure import graphcomp_pass_seconds

    secs = graphcomp_pass_seconds()
    assert secs["cudagraph_warmup"] > 0 and "cudagraph_capture" in secs, secs
    assert c["hazard_recaptures"] >= 1 and c["captures"] == settled, dict(c)
    from graphcomp.tools.inspect_dumps import format_frame

    text = format_frame(frame)
    assert "captures" in text and "pool" in text and "host_sync" in text and "cudagraph" in text


def test_end_to_end_two_microbatches_accumulate(pretend_cuda):
    ref, m = ItemModel(), ItemModel()
    cm = torch.compile(m, backend="graphcomp", options={"codegen": "eager", "min_piece_nodes": 1})
    for step in range(3):
        xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + k)) for k in range(2)]
        # two forwards before one backward (losses summed)
        (ref(xs[0]) + ref(xs[1])).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            (cm(xs[0]) + cm(xs[1])).backward()
        # and plain accumulation: forward/backward twice
        for x in xs:
            ref(x).backward()
            cm(x).backward()
        for a, b in zip(ref.parameters(), m.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)
        ref.zero_grad(); m.zero_grad()
    assert graphcomp.counters["cudagraph_fallbacks"] >= 1  # the second forward ran eagerly


# ---------------------------------------------------- copy_outputs="auto" (the pool ledger)
def test_auto_hands_visible_outputs_out_uncopied_until_one_is_kept():
    w = torch.randn(3, 3)
    r, _ = make_runner(lambda w, x: ((x @ w).sum(),), ["param", "copy"], clone_outputs={0}, copy_outputs="auto")
    for _ in range(3):
        x = torch.randn(2, 3)
        assert r(w, x)[0].item() == (x @ w).sum().item()  # dropped at once
    c = graphcomp.counters
    assert c["captures"] == 1 and c["cudagraph_output_copy_bytes"] == 0 and c["hazard_recaptures"] == 0
    x1, x2, x3 = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    (kept,) = r(w, x1)  # kept across the next call: a kept loss
    (l2,) = r(w, x2)  # must not overwrite `kept`: captured again around it, copies from now on
    (l3,) = r(w, x3)
    assert kept.item() == (x1 @ w).sum().item()
    assert l2.item() == (x2 @ w).sum().item() and l3.item() == (x3 @ w).sum().item()
    assert c["hazard_recaptures"] == 1 and c["captures"] == 2 and r.copy_now == {0}
    assert c["cudagraph_output_copy_bytes"] == 2 * 4


def test_hazard_log_names_who_holds_the_output(caplog):
    """The INFO line of a hazard says who keeps the output alive: the Python tensors
    on its storage and what refers to them (here a user's dict holds a view)."""
    import logging

    w = torch.randn(3, 3)
    r, _ = make_runner(lambda w, x: ((x @ w).sum(0),), ["param", "copy"], clone_outputs={0}, copy_outputs="auto")
    r(w, torch.randn(2, 3))
    (kept,) = r(w, torch.randn(2, 3))
    user = {"view": kept[:2]}
    del kept
    with caplog.at_level(logging.INFO, logger="graphcomp.runtime.runner"):
        r(w, torch.randn(2, 3))
    line = next(m for m in caplog.messages if "still referenced when" in m)
    assert "outputs [0]:" in line and "tensor (2,) torch.float32 referred to by ['dict']" in line, line
    assert user["view"].shape == (2,)


def test_replay_never_overwrites_live_outputs_of_a_piece_captured_later():
    """A forward piece captured first, a backward piece captured after it (its
    gradients may sit in the forward's scratch space). Gradients kept past the next
    forward (accumulation) must survive that forward's replay."""
    w = torch.randn(3, 3)
    fwd, _ = make_runner(lambda w, x: ((x @ w).relu(),), ["param", "copy"], copy_outputs="auto")
    bwd = CudaGraphRunner("bwd/piece_0", lambda a: [a[0] * 2], ["copy"], clone_outputs={0}, copy_outputs="auto")
    x1, x2 = torch.randn(2, 3), torch.randn(2, 3)
    (h1,) = fwd(w, x1)
    (g1,) = bwd(h1)  # "param.grad": kept
    del h1
    (h2,) = fwd(w, x2)  # would scribble over g1 in a shared pool
    torch.testing.assert_close(g1, (x1 @ w).relu() * 2, rtol=0, atol=0)
    torch.testing.assert_close(h2, (x2 @ w).relu(), rtol=0, atol=0)
    assert bwd.copy_now == {0} and graphcomp.counters["hazard_recaptures"] == 1
    (g2,) = bwd(h2)  # its input now comes from a newer capture: captured again too
    torch.testing.assert_close(g2, (x2 @ w).relu() * 2, rtol=0, atol=0)
    torch.testing.assert_close(g1, (x1 @ w).relu() * 2, rtol=0, atol=0)
    n = graphcomp.counters["captures"]
    for _ in range(3):  # settled: replays only
        del h2, g2
        (h2,) = fwd(w, x2)
        (g2,) = bwd(h2)
        torch.testing.assert_close(g2, (x2 @ w).relu() * 2, rtol=0, atol=0)
    assert graphcomp.counters["captures"] == n


def test_released_capture_keeps_tracking_outputs_a_user_holds():
    """R's first capture is released (re-captured around its kept output); that
    output is an orphan, still protected from Q, which was captured before R."""
    q, _ = make_runner(lambda x: (x + 1,), ["copy"], copy_outputs="auto")
    r = CudaGraphRunner("fwd/piece_r", lambda a: [a[0] * 3, a[0] * 5], ["copy"], clone_outputs={0, 1},
                        copy_outputs="auto")
    q(torch.zeros(4))
    o1 = r(torch.ones(4))[0]  # the second output is dropped at once
    r(torch.ones(4) * 2)  # o1 held: R re-captured, its first capture released
    (orphan,) = [c for c in runtime.RUNTIME.ledger.entries if c.orphan]
    assert orphan.outputs[1] is None and len(orphan.tracked) == 1  # keeps only what is held
    q(torch.zeros(4))  # Q must not replay over o1: captured again instead
    assert o1.tolist() == [3.0] * 4
    del o1
    q(torch.zeros(4))  # the orphan is dead now: forgotten, its pool tensors dropped
    assert not any(c.orphan for c in runtime.RUNTIME.ledger.entries)


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_end_to_end_set_to_none_training_needs_no_output_copies(pretend_cuda, codegen):
    ref, m, cm, opt_r, opt_m = _item_models(codegen, 1e-2)
    for step in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        ref(x).backward()
        cm(x).backward()
        for a, b in zip(ref.parameters(), m.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5)
        opt_r.step(); opt_m.step()
        opt_r.zero_grad(set_to_none=True); opt_m.zero_grad(set_to_none=True)
    c = graphcomp.counters
    # only the forward's loss (a 4-byte scalar per step) is copied; no gradient
    assert c["replays"] >= 8 and c["hazard_recaptures"] == 0 and c["cudagraph_output_copy_bytes"] == 4 * 4, dict(c)
    assert c["cudagraph_fallbacks"] == 0, dict(c)
    # the saved activations went through AOTAutograd, the glue and the runners without
    # any other reference: the backward's capture could reuse every one of them
    runners = {r.name: r for r in runtime.RUNTIME.runners}
    fwd = [cap for n, r in runners.items() if "/fwd/" in n for cap in r.captures.values() if cap.released]
    bwd = [cap for n, r in runners.items() if "/bwd/" in n for cap in r.captures.values()]
    assert fwd and bwd
    for f in fwd:
        freed = set().union(*(b.overwrites.get(f, set()) for b in bwd))
        assert freed == set(f.released), (len(freed), len(f.released))


def test_copy_outputs_option_is_validated():
    with pytest.raises(ValueError, match=r"copy_outputs.*'sometimes'.*\['auto', 'always'\]"):
        graphcomp.Config.from_options({"copy_outputs": "sometimes"})


# ---------------------------------------------- released outputs (pool memory reuse)
def _fwd_bwd(w):
    """A forward piece (internal output h, released) and a backward piece consuming h."""
    fwd, _ = make_runner(lambda w, x: ((x @ w).relu(),), ["param", "copy"], copy_outputs="auto")
    bwd = CudaGraphRunner("bwd/piece_0", lambda a: [a[0] * 2], ["saved"], clone_outputs={0}, copy_outputs="auto")
    return fwd, bwd


def test_backward_capture_reuses_released_activation_memory():
    """The forward keeps no reference to its internal output: once the backward
    consumed it during its capture, its memory is free for the backward's own
    buffers (the stand-in graph scribbles over it on every backward replay), and
    every later forward hands out a new tensor on the same memory."""
    w = torch.randn(3, 3)
    fwd, bwd = _fwd_bwd(w)
    for step in range(4):
        x = torch.randn(2, 3)
        (g,) = bwd.call([fwd(w, x)[0]])  # the saved activation is only in the list
        torch.testing.assert_close(g, (x @ w).relu() * 2, rtol=0, atol=0)
        del g
    (fcap,) = fwd.captures.values()
    (bcap,) = bwd.captures.values()
    assert fcap.released and fcap.outputs == [None] and fcap.first is None
    assert fcap.alive_outputs() == []  # nothing alive: the runner holds no reference
    assert set(bcap.overwrites[fcap]) == set(fcap.released)  # the backward may reuse it
    assert runtime.RUNTIME.device.captured[1].freed  # ... and the stand-in does
    c = graphcomp.counters
    assert c["captures"] == 2 and c["replays"] == 8 and c["cudagraph_fallbacks"] == 0, dict(c)
    (h,) = fwd(w, x)  # a replay's output: on the capture's memory, owning nothing
    assert h.untyped_storage().data_ptr() == next(iter(fcap.released))
    torch.testing.assert_close(h, (x @ w).relu(), rtol=0, atol=0)


def test_released_output_held_past_a_replay_over_its_memory_runs_that_replay_eagerly():
    w = torch.randn(3, 3)
    fwd, bwd = _fwd_bwd(w)
    other, _ = make_runner(lambda y: (y + 1,), ["copy"], clone_outputs={0}, copy_outputs="auto")
    x = torch.randn(2, 3)
    bwd.call([fwd(w, x)[0]])
    other(torch.zeros(2))  # captured after the activation's memory was freed: may reuse it
    (h,) = fwd(w, x)  # held (e.g. a saved activation of a pending backward)
    with pytest.warns(RuntimeWarning, match="eagerly"):
        (o,) = other(torch.ones(2))
    assert o.tolist() == [2.0, 2.0]
    torch.testing.assert_close(h, (x @ w).relu(), rtol=0, atol=0)  # not scribbled over
    (g,) = bwd.call([h])  # the backward itself may overwrite what it consumes
    del h
    torch.testing.assert_close(g, (x @ w).relu() * 2, rtol=0, atol=0)
    assert graphcomp.counters["cudagraph_fallbacks"] == 1


def test_no_capture_while_a_released_output_is_held_over_free_memory():
    w = torch.randn(3, 3)
    fwd, bwd = _fwd_bwd(w)
    x = torch.randn(2, 3)
    bwd.call([fwd(w, x)[0]])
    late, _ = make_runner(lambda y: (y * 5,), ["copy"], clone_outputs={0}, copy_outputs="auto")
    (h,) = fwd(w, x)
    with pytest.warns(RuntimeWarning, match="capturing later"):
        (o,) = late(torch.ones(2))  # a capture now could allocate h's memory
    assert o.tolist() == [5.0, 5.0] and not late.captures
    torch.testing.assert_close(h, (x @ w).relu(), rtol=0, atol=0)
    bwd.call([h])
    del h
    late(torch.ones(2))  # nothing held: captured now
    assert len(late.captures) == 1


def test_teardown_keeps_the_pool_while_a_released_output_is_held(fake_device):
    w = torch.randn(3, 3)
    fwd, bwd = _fwd_bwd(w)
    x = torch.randn(2, 3)
    bwd.call([fwd(w, x)[0]])
    (h,) = fwd(w, x)
    assert runtime.teardown() == 2
    assert fake_device.pins == [runtime.RUNTIME.pool]  # h's memory must not go back to the device
    torch.testing.assert_close(h, (x @ w).relu(), rtol=0, atol=0)
    del h
    runtime.teardown()
    assert fake_device.pins == []


def test_glue_drops_each_value_before_the_call_that_uses_it_last():
    """run_glue passes each piece a list it owns: an input freed by the piece (as
    Inductor frees a saved activation after its last read) is really freed."""
    import weakref

    from graphcomp.compiler.codegen import run_glue

    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.placeholder("y")
    p0 = g.call_module("piece_0", (x,))
    a = g.call_function(operator.getitem, (p0, 0))
    p1 = g.call_module("piece_1", (a, y))
    b = g.call_function(operator.getitem, (p1, 0))
    g.output((b, y))
    seen = {}

    class Piece(torch.nn.Module):
        def __init__(self, name, fn):
            super().__init__()
            self.impl, self.single, self.name, self.fn = self, False, name, fn

        def call(self, args):
            t = args[0]
            ref = weakref.ref(t)
            res = self.fn(*args)
            args.clear()
            del t
            seen[self.name] = ref() is None  # freed: nothing else held it
            return res

    root = torch.nn.Module()
    root.piece_0 = Piece("p0", lambda x: (x + 1,))
    root.piece_1 = Piece("p1", lambda a, y: (a * y,))
    run = run_glue(torch.fx.GraphModule(root, g))
    args = [torch.ones(3), torch.full((3,), 2.0)]
    out = run(args)
    assert args == [] and out[0].tolist() == [4.0] * 3 and out[1].tolist() == [2.0] * 3
    assert seen == {"p0": True, "p1": True}


def test_output_at_a_consumed_inputs_address_is_tracked_not_an_input_alias():
    """The allocator may place an output (a gradient) at the address of a saved
    activation freed inside the capture. It is a new buffer, handed out to user code:
    tracked like any other output (not mistaken for an alias of that input)."""
    w = torch.randn(3, 3)
    fwd, _ = make_runner(lambda w, x: ((x @ w).relu(),), ["param", "copy"], copy_outputs="auto")

    def bwd_fn(a):
        t = a[0]
        a.clear()
        st = t.untyped_storage()
        ptr, n, shape, dt = st.data_ptr(), st.nbytes(), t.shape, t.dtype
        del t, st  # the input is dead: the allocator gives its memory to the output
        out = torch.empty(0, dtype=dt).set_(torch._C._construct_storage_from_data_pointer(ptr, torch.device("cpu"), n), 0, shape)
        return [out.fill_(5.0)]  # (a constant: the stand-in graph really runs at capture too)

    bwd = CudaGraphRunner("bwd/piece_0", bwd_fn, ["saved"], clone_outputs={0}, copy_outputs="auto")
    x = torch.randn(2, 3)
    (g,) = bwd.call([fwd(w, x)[0]])
    (bcap,) = bwd.captures.values()
    assert bcap.tracked and bcap.alive_outputs() == [0]  # g is held: seen
    assert g.tolist() == [[5.0] * 3] * 2
    (h,) = fwd(w, torch.randn(2, 3))  # would write the memory g lives in: must not run over it
    assert g.tolist() == [[5.0] * 3] * 2
    assert graphcomp.counters["hazard_recaptures"] == 1 and bwd.copy_now == {0}


def test_input_copied_at_a_later_shapes_capture_releases_the_other_captures():
    """A saved input first seen as pool memory, then (another shape) as a user tensor:
    it becomes a copied input, and the older capture (no buffer for it) is dropped."""
    fwd, _ = make_runner(lambda x: (x * 3,), ["copy"])
    r, _ = make_runner(lambda s: (s + 1,), ["saved"], clone_outputs={0})
    r.call([fwd(torch.ones(4))[0]])
    assert r.kinds == ["saved"] and len(r.captures) == 1
    (out,) = r(torch.ones(6))  # a new shape, from outside the pool
    assert r.kinds == ["copy"] and len(r.captures) == 1 and out.tolist() == [2.0] * 6
    (out,) = r(torch.zeros(4))  # the first shape again: captured anew, with a buffer
    assert out.tolist() == [1.0] * 4 and len(r.captures) == 2


def _call_holding_outputs(r, w, n):
    """``n`` calls, each while every earlier output is still referenced (two
    forwards before one backward): from the second call on, a hazard."""
    held = []
    for _ in range(n):
        held.append(r(w, torch.randn(2, 3))[0])
    return held


def test_fixed_shape_piece_falls_back_until_the_reentry_limit():
    from graphcomp.runtime.runner import REENTRY_LIMIT

    w = torch.randn(3, 3)
    r, _ = make_runner(lambda w, x: (x @ w,), ["param", "copy"], copy_outputs="auto", code=7)
    _call_holding_outputs(r, w, REENTRY_LIMIT)  # (code 7 never compiled with dynamic shapes)
    c = graphcomp.counters
    assert c["cudagraph_fallbacks"] == REENTRY_LIMIT - 1 and c["pieces_turned_eager"] == 0
    _call_holding_outputs(r, w, 2)
    assert c["pieces_turned_eager"] == 1 and r.disabled and "3 call(s)" in r.disabled
    assert r.follows_data is None


def test_shape_specialization_of_a_dynamic_function_turns_eager_at_its_first_hazard():
    """A fixed-shape frame of a function Dynamo also compiled with dynamic shapes
    (tokens per expert in a Python MoE loop: frames for sizes 0/1 and the first size
    seen are fixed-shape) runs only in steps where its exact size comes up: it turns
    eager at its first hazard, as a dynamic-shape piece does, instead of falling back
    at unpredictable steps long after warm-up (2 GPUs, HF Mixtral with eager experts)."""
    from graphcomp.session import SESSION

    w = torch.randn(3, 3)
    r, _ = make_runner(lambda w, x: (x @ w,), ["param", "copy"], copy_outputs="auto", code=7)
    SESSION.shape_following_code.add(7)  # as the backend does when code 7 compiles with symbolic shapes
    held = _call_holding_outputs(r, w, 3)
    c = graphcomp.counters
    assert c["cudagraph_fallbacks"] == 0 and c["pieces_turned_eager"] == 1, dict(c)
    assert "Dynamo also compiled with dynamic shapes" in r.disabled
    for h in held:
        assert h.shape == (2, 3)
    graphcomp.reset()
    assert not SESSION.shape_following_code


def test_backend_records_functions_compiled_with_dynamic_shapes():
    from graphcomp.session import SESSION

    graphcomp.reset()
    torch._dynamo.reset()

    def f(x):
        return (x * 2).sum()

    cf = torch.compile(f, backend="graphcomp")
    cf(torch.randn(3))
    assert not SESSION.shape_following_code  # first compile: fixed shapes
    cf(torch.randn(4))  # a new size: Dynamo recompiles the same function with dynamic shapes
    assert len(SESSION.shape_following_code) == 1
    torch._dynamo.reset()
    graphcomp.reset()


def test_glue_unpacks_piece_tuples_and_keeps_one_read_whole():
    """The glue unpacks a piece's tuple into its getitems (no step per getitem);
    a tuple also read whole by another node is passed whole; an unused getitem is
    never evaluated."""
    from graphcomp.compiler.codegen import run_glue

    g = torch.fx.Graph()
    x = g.placeholder("x")
    p0 = g.call_module("piece_0", (x,))
    a = g.call_function(operator.getitem, (p0, 0))
    g.call_function(operator.getitem, (p0, 2))  # unused
    b = g.call_function(operator.getitem, (p0, 1))
    whole = g.call_function(len, (p0,))
    p1 = g.call_module("piece_1", (b, a))
    c = g.call_function(operator.getitem, (p1, 0))
    g.output((c, whole))

    class Piece(torch.nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.impl, self.single, self.fn = self, False, fn

        def call(self, args):
            res = self.fn(*args)
            args.clear()
            return res

    root = torch.nn.Module()
    root.piece_0 = Piece(lambda x: (x + 1, x * 2, x - 5))
    root.piece_1 = Piece(lambda b, a: (b - a,))
    run = run_glue(torch.fx.GraphModule(root, g))
    out = run([torch.full((2,), 3.0)])
    assert out[0].tolist() == [2.0, 2.0] and out[1] == 3
