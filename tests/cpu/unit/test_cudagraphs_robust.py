"""The CUDA-graph runner on inputs and failures real models bring (CPU stand-in
device, tests/cpu/_fakecuda.py): static buffers for every input layout, a capture
that fails (auto: the piece turns eager for good with a recorded reason; require:
an error naming the piece), and outputs that are views of an input (rebuilt from
the call's input, never held by the runner)."""

from __future__ import annotations

import warnings

import pytest
import torch

import graphcomp
from _fakecuda import install_fake_device
from graphcomp.errors import CudaGraphsRequired
from graphcomp.compiler.plan import Piece
from graphcomp.runtime.runner import CudaGraphRunner
from graphcomp.runtime.static import memory_of, span, static_buffer


@pytest.fixture(autouse=True)
def fake_device(monkeypatch):
    yield from install_fake_device(monkeypatch)


def _runner(fn, kinds, **kw):
    kw.setdefault("copy_outputs", "always")
    return CudaGraphRunner("fwd/piece_0", lambda args: fn(*args), kinds,
                           input_names=[f"arg{i}" for i in range(len(kinds))], **kw)


# --------------------------------------------------------------------- layouts
LAYOUTS = {
    "expanded": lambda g: torch.randn(3, 1, generator=g).expand(3, 4),  # stride 0 (BERT's token_type_ids)
    "overlapping": lambda g: torch.randn(8, generator=g).as_strided((3, 3), (1, 1)),
    "non_contiguous": lambda g: torch.randn(5, 6, generator=g)[1:, ::2],
    "transposed": lambda g: torch.randn(4, 5, generator=g).t(),
    "offset_view": lambda g: torch.randn(10, generator=g)[3:7],
    "zero_size": lambda g: torch.randn(0, 3, generator=g),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_static_buffer_reproduces_layout_and_values(layout):
    a = LAYOUTS[layout](torch.Generator().manual_seed(0))
    view, base = static_buffer(a)
    assert view.shape == a.shape and view.stride() == a.stride()
    assert torch.equal(view, a)
    assert base.numel() == span(a) and memory_of(view).data_ptr() == base.data_ptr()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_copied_input_of_any_layout_replays_with_each_calls_values(layout):
    make = LAYOUTS[layout]
    r = _runner(lambda x: ((x * 2).sum(dim=-1, keepdim=True) + 1,), ["copy"], clone_outputs={0})
    for seed in range(4):
        x = make(torch.Generator().manual_seed(seed))
        (y,) = r(x)
        torch.testing.assert_close(y, (x * 2).sum(dim=-1, keepdim=True) + 1, rtol=0, atol=0)
    c = graphcomp.counters
    assert c["captures"] == 1 and c["replays"] == 4 and c["cudagraph_fallbacks"] == 0


# ------------------------------------------------------------ capture failures
def _fails_under_capture(dev):
    def fn(x):
        if dev.in_capture:  # e.g. an op that synchronizes with the host (.item(), .tolist())
            raise RuntimeError("operation not permitted when stream is capturing")
        return (x + 1,)
    return fn


def test_capture_failure_auto_runs_eagerly_for_good_with_reason(fake_device):
    piece = Piece(0, "cudagraph", 1)
    r = _runner(_fails_under_capture(fake_device), ["copy"], clone_outputs={0}, stats=piece.stats)
    with pytest.warns(RuntimeWarning, match=r"fwd/piece_0 cannot be captured.*trial capture.*not permitted"):
        (y,) = r(torch.ones(3))
    assert y.tolist() == [2.0, 2.0, 2.0]
    for i in range(3):  # eager from now on: no second attempt, no more warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            (y,) = r(torch.full((3,), float(i)))
        assert y.tolist() == [i + 1.0] * 3
    c = graphcomp.counters
    assert c["capture_failures"] == 1 and c["captures"] == 0 and c["replays"] == 0
    assert fake_device.trials == 1
    row = piece.row()
    assert row["mode"] == "eager" and row["reason"].startswith("capture_failed: trial capture: RuntimeError")
    assert r.disabled is not None


def test_capture_failure_in_warm_up_is_caught_too():
    calls = {"n": 0}

    def fn(x):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ValueError("warm-up only failure")
        return (x * 3,)

    r = _runner(fn, ["copy"], clone_outputs={0})
    with pytest.warns(RuntimeWarning, match="warm-up: ValueError: warm-up only failure"):
        (y,) = r(torch.ones(2))
    assert y.tolist() == [3.0, 3.0] and graphcomp.counters["capture_failures"] == 1


def test_capture_failure_require_raises_naming_the_piece(fake_device):
    r = _runner(_fails_under_capture(fake_device), ["copy"], clone_outputs={0}, require=True)
    with pytest.raises(CudaGraphsRequired, match=r"require.*fwd/piece_0 failed to capture.*not permitted"):
        r(torch.ones(3))


def test_capture_failure_keeps_the_inputs_for_the_eager_call(fake_device):
    """The trial capture runs before anything is consumed: a saved input (not a
    copy) is still there for the eager run of the failing call."""
    saved = torch.arange(4.0)
    r = _runner(lambda s, x: _fails_under_capture(fake_device)(s * x), ["param", "copy"], clone_outputs={0})
    with pytest.warns(RuntimeWarning):
        (y,) = r(saved, torch.full((4,), 2.0))
    assert y.tolist() == [1.0, 3.0, 5.0, 7.0]


# --------------------------------------------------------- outputs aliasing inputs
def test_view_of_another_pieces_output_is_rebuilt_not_held():
    """piece A produces an internal output h; piece B returns a view of h (a saved
    tensor, e.g. a tied weight's transpose). B must not hold h: after both calls'
    values die, A replays without "still referenced" and B's view sees each call's h."""
    a = _runner(lambda w, x: (x @ w,), ["param", "copy"], clone_outputs=set())
    a.name = "fwd/piece_0"
    b = CudaGraphRunner("fwd/piece_2", lambda args: (args[0].t(), args[0].sum()), ["piece_output"],
                        input_names=["h"], clone_outputs={1}, copy_outputs="always")
    w = torch.randn(3, 3)
    for step in range(4):
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(step))
        (h,) = a(w, x)
        ht, total = b(h)
        torch.testing.assert_close(ht, (x @ w).t(), rtol=0, atol=0)
        torch.testing.assert_close(total, (x @ w).sum(), rtol=0, atol=0)
        assert ht.untyped_storage().data_ptr() == h.untyped_storage().data_ptr()
        del h, ht, total
    c = graphcomp.counters
    assert c["cudagraph_fallbacks"] == 0 and c["captures"] == 2 and c["replays"] == 8, dict(c)


@pytest.mark.parametrize("torch_form", ["2.13", "2.11", "2.11-no-thread-binding"])
def test_pool_pin_uses_the_allocator_binding_this_torch_has(monkeypatch, torch_form):
    """The shared pool's pin (``_compat.pin_pool``) must call the allocator binding
    with the arguments this torch accepts: 2.13's ``_cuda_beginAllocateToPool`` takes
    a stream filter, 2.11's takes two arguments (a 3-argument call raised TypeError in
    every capture on the 2.11 GPU machines, 2026-11-25). Each form adds exactly one
    begin and one end for the pool, and no allocation is routed."""
    from graphcomp import _compat

    calls = []

    def begin3(dev, pool, flt):
        assert flt(object()) is False
        calls.append(("begin", dev, pool))

    def begin2(dev, pool):
        calls.append(("begin", dev, pool))

    def thread2(dev, pool):
        calls.append(("begin-thread", dev, pool))

    def end(dev, pool):
        calls.append(("end", dev, pool))

    def positional(fn, n):  # pybind's arity check: TypeError before any side effect
        def call(*a):
            if len(a) != n:
                raise TypeError(f"incompatible function arguments ({len(a)} given)")
            return fn(*a)
        return call

    if torch_form == "2.13":
        monkeypatch.setattr(torch._C, "_cuda_beginAllocateToPool", positional(begin3, 3), raising=False)
        monkeypatch.setattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", positional(thread2, 2), raising=False)
    else:
        monkeypatch.setattr(torch._C, "_cuda_beginAllocateToPool", positional(begin2, 2), raising=False)
        if torch_form == "2.11":
            monkeypatch.setattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", positional(thread2, 2), raising=False)
        else:
            monkeypatch.delattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", raising=False)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
    monkeypatch.setattr(_compat, "_PIN_FORM", None)
    for _ in range(2):  # the second call uses the remembered form directly
        _compat.pin_pool(0, (0, 7))
    first = {"2.13": "begin", "2.11": "begin-thread", "2.11-no-thread-binding": "begin"}[torch_form]
    assert calls == [(first, 0, (0, 7)), ("end", 0, (0, 7))] * 2
    assert _compat._PIN_FORM == {"2.13": "filter", "2.11": "thread", "2.11-no-thread-binding": "plain"}[torch_form]


# ------------------------------------------------------------ input mutations
def _bump(buf, x):
    """A functionalized input mutation (BatchNorm's running statistics: read-modify-write)."""
    buf.copy_(buf * 0.5 + x.sum())
    return (x * 2,)


@pytest.mark.parametrize("kind", ["param", "copy"])
def test_written_input_is_written_once_per_call_on_capture_calls(kind):
    """Warm-ups and the trial replay run the piece before the capture: their writes to
    an input are undone, so a capture call writes once, as every later call does; a
    copied input's write reaches the caller's tensor."""
    r = _runner(_bump, [kind, "copy"], clone_outputs={0}, mutated_inputs=[0])
    buf, ref = torch.zeros(3), torch.zeros(3)
    for step in range(4):
        x = torch.full((2,), float(step + 1))
        (y,) = r(buf, x)
        _bump(ref, x)
        torch.testing.assert_close(buf, ref, rtol=0, atol=0)
        torch.testing.assert_close(y, x * 2, rtol=0, atol=0)
    graphcomp.counters.expect(captures=1, replays=4)


def test_written_input_is_restored_for_the_eager_call_after_a_failed_capture(fake_device):
    calls = []

    def fn(buf, x):
        calls.append(1)
        if len(calls) == 2:  # the second warm-up run fails, after the first one wrote
            raise RuntimeError("operation not permitted when stream is capturing")
        return _bump(buf, x)

    r = _runner(fn, ["param", "copy"], clone_outputs={0}, mutated_inputs=[0])
    buf, ref = torch.zeros(3), torch.zeros(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r(buf, torch.ones(2))
    _bump(ref, torch.ones(2))
    torch.testing.assert_close(buf, ref, rtol=0, atol=0)  # one write: the eager call's


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_batchnorm_running_statistics_match_eager_with_cuda_graphs(codegen):
    """End to end: BatchNorm1d's running mean/var and step count after 4 training steps
    under graphcomp with pieces captured and replayed equal eager PyTorch's (bitwise
    with eager codegen)."""
    from _fakecuda import fake_cuda_runtime

    from graphcomp.models import BatchNormMLP

    def make():
        torch.manual_seed(0)
        return BatchNormMLP(8, 16, 1)

    def train(m, fn):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for i in range(4):
            x = torch.randn(32, 8, generator=torch.Generator().manual_seed(i))
            fn(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return m.snapshot()

    ref = make()
    want = train(ref, ref)
    torch._dynamo.reset()
    with fake_cuda_runtime():
        graphcomp.reset()
        m = make()
        got = train(m, torch.compile(m, backend="graphcomp", options={"codegen": codegen}))
        c = graphcomp.counters
        assert c["captures"] >= 2 and c["replays"] >= 8 and not c.get("cudagraph_fallbacks"), dict(c)
        assert int(m[1].num_batches_tracked) == 4
    tol = 0 if codegen == "eager" else 1e-5
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_mutated_placeholders_finds_in_place_writes_of_inputs():
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphcomp.analysis.graph_utils import mutated_placeholders

    def f(a, b, c, d):
        a.copy_(b + 1)  # a write of an input
        c.view(-1).add_(1)  # through a view
        return b * 2 + d.sum()  # b and d only read

    gm = make_fx(f)(torch.zeros(3), torch.ones(3), torch.zeros(2, 3), torch.ones(2))
    assert mutated_placeholders(gm) == [0, 2]
