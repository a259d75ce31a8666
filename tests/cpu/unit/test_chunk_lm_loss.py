"""chunk_lm_loss on Dynamo graphs (exact op counts, fallbacks with reasons, the
rewritten graph's semantics) and the numerics of its ops against torch.

The graphs are the real torch-level graphs Dynamo hands a backend (captured with
a backend that returns the graph), so the pass sees what it sees in training."""

import math

import pytest
import torch
import torch.nn.functional as F

from _graphs import counts, run_pass

from graphcomp.ops import loss as loss_ops
from graphcomp.analysis import memory
from graphcomp.ops.loss import OPS

LCE = "graphcomp.linear_cross_entropy.default"
CE = "graphcomp.cross_entropy.default"
N, D, V = 10, 8, 23  # tokens (2 x 5), hidden, vocab


def dynamo_graph(fn, *args):
    """The torch-level graph Dynamo builds for ``fn(*args)`` (one graph, no breaks)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True, dynamic=False)(*args)
    (gm,) = graphs
    return gm


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 5, D, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.3).to(dtype).requires_grad_()
    t = torch.randint(0, V, (2, 5), generator=g)
    t[0, 1] = t[1, 3] = -100
    return h, w, t


def llama_loss(h, w, t):  # graphcomp.models.Llama's loss
    return F.cross_entropy(F.linear(h, w).float().flatten(0, 1), t.flatten())


def hf_loss(h, w, t):  # transformers' ForCausalLMLoss: the logits are returned too
    logits = F.linear(h, w)
    loss = F.cross_entropy(logits.float().view(-1, V), t.view(-1), ignore_index=-100, reduction="sum") / 7
    return loss, logits


def _run(gm, chunk=4):
    return run_pass("chunk_lm_loss", gm, stage="dynamo", loss_chunk_tokens=chunk)


def _check_semantics(fn, gm, args, rtol=1e-5):
    """The rewritten graph computes fn's outputs and gradients."""
    for a in args:
        a.grad = None
    ref_args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    ref = fn(*ref_args)
    out = gm(*args)
    ref = ref if isinstance(ref, tuple) else (ref,)
    out = out if isinstance(out, (tuple, list)) else (out,)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, rtol=rtol, atol=1e-6)
    (out[0] * 0.7).backward()
    (ref[0] * 0.7).backward()
    for a, r in zip(args, ref_args):
        if a.requires_grad:
            torch.testing.assert_close(a.grad, r.grad, rtol=rtol, atol=1e-7)


# ------------------------------------------------------------------ rewrites
def test_linear_head_becomes_one_chunked_op():
    h, w, t = _inputs()
    gm = dynamo_graph(llama_loss, h, w, t)
    before = counts(gm)
    assert before["linear"] == 1 and before["float"] == 1 and before["flatten"] == 2 and before["cross_entropy"] == 1
    gm, rec = _run(gm, chunk=4)
    after = counts(gm)
    assert after["linear"] == 0 and after["float"] == 0 and after["cross_entropy"] == 0
    assert after["flatten"] == 1  # the target's
    assert after["reshape"] == 1 and after[LCE] == 1 and after["getitem"] == 1
    assert rec.reason is None
    assert rec.counts == {"linear_cross_entropy": 1, "chunks": math.ceil(N / 4), "fp32_logits_bytes": N * V * 4}
    (op,) = [n for n in gm.graph.nodes if n.target is OPS["linear_cross_entropy"]]
    # (ignore_index, reduction, chunk, loss dtype, grad hidden, grad weight, compiled: loss_chunk_kernels="inductor")
    assert op.args[3:] == (-100, "mean", 4, torch.float32, True, True, True)
    assert [tuple(v.shape) for v in op.meta["example_value"]] == [(), (N, D), (V, D)]
    _check_semantics(llama_loss, gm, (h, w, t))


def test_logits_that_are_also_returned_keep_their_linear():
    h, w, t = _inputs()
    gm = dynamo_graph(hf_loss, h, w, t)
    gm, rec = _run(gm)
    after = counts(gm)
    assert after["linear"] == 1 and after["float"] == 0 and after["view"] == 1  # the target's
    assert after["reshape"] == 1 and after[CE] == 1 and after["cross_entropy"] == 0 and after[LCE] == 0
    assert rec.counts["cross_entropy"] == 1
    (op,) = [n for n in gm.graph.nodes if n.target is OPS["cross_entropy"]]
    assert op.args[2:] == (-100, "sum", 4, torch.float32, True)
    _check_semantics(hf_loss, gm, (h, w, t))


def test_bias_and_narrowing_cast_keep_the_logits():
    h, w, t = _inputs()
    b = torch.randn(V, requires_grad=True)

    def with_bias(h, w, b, t):
        return F.cross_entropy(F.linear(h, w, b).view(-1, V), t.view(-1))

    def narrowing(h, w, t):  # the bf16 round trip rounds: it stays outside the op
        return F.cross_entropy(F.linear(h, w).to(torch.bfloat16).float().view(-1, V), t.view(-1))

    gm = dynamo_graph(with_bias, h, w, b, t)
    gm, rec = _run(gm)
    assert counts(gm)[CE] == 1 and counts(gm)["linear"] == 1 and rec.counts["cross_entropy"] == 1
    _check_semantics(with_bias, gm, (h, w, b, t))
    gm = dynamo_graph(narrowing, h, w, t)
    gm, _ = _run(gm)
    c = counts(gm)
    assert c[CE] == 1 and c["linear"] == 1 and c["to"] == 1 and c["float"] == 0
    (op,) = [n for n in gm.graph.nodes if n.target is OPS["cross_entropy"]]
    assert op.args[0].meta["example_value"].dtype == torch.bfloat16 and op.args[-2] == torch.float32
    _check_semantics(narrowing, gm, (h, w, t))


def test_frozen_head_and_inference_compute_no_unneeded_gradients():
    h, w, t = _inputs()
    w.requires_grad_(False)
    gm, _ = _run(dynamo_graph(llama_loss, h, w, t))
    (op,) = [n for n in gm.graph.nodes if n.target is OPS["linear_cross_entropy"]]
    assert op.args[-3:-1] == (True, False)
    _check_semantics(llama_loss, gm, (h, w, t))
    with torch.no_grad():
        gm = dynamo_graph(llama_loss, h, w, t)
        gm, _ = _run(gm)
        (op,) = [n for n in gm.graph.nodes if n.target is OPS["linear_cross_entropy"]]
        assert op.args[-3:-1] == (False, False)
        torch.testing.assert_close(gm(h, w, t)[0], llama_loss(h, w, t), rtol=1e-5, atol=0)


# ---------------------------------------------------------------- fallbacks
def _logits_ce(**kw):
    def fn(h, w, t):
        return F.cross_entropy(F.linear(h, w).float().view(-1, V), t.view(-1), **kw)

    return fn


@pytest.mark.parametrize("kw, key", [
    ({"label_smoothing": 0.1}, "skipped:label_smoothing"),
    ({"weight": "w"}, "skipped:class_weights"),
    ({"reduction": "none"}, "skipped:reduction_none"),
])
def test_unsupported_variants_fall_back_unchanged_with_a_reason(kw, key):
    h, w, t = _inputs()
    if "weight" in kw:
        kw = {"weight": torch.rand(V)}
    gm = dynamo_graph(_logits_ce(**kw), h, w, t)
    code = gm.code
    gm, rec = _run(gm)
    assert gm.code == code
    assert rec.counts == {key: 1}
    assert rec.reason == "none of the 1 cross_entropy call(s) can be chunked (see counts)"
    assert rec.notes and key.split(":")[1] in rec.notes[0]


def test_shapes_it_does_not_chunk_fall_back():
    h, w, t = _inputs()

    def probs(h, w, t):  # probability targets
        x = F.linear(h, w).view(-1, V)
        return F.cross_entropy(x, torch.softmax(x.detach(), -1))

    def class_dim_1(h, w, t):  # [batch, vocab, seq] input
        return F.cross_entropy(F.linear(h, w).transpose(1, 2), t)

    def no_loss(h, w, t):
        return F.linear(h, w).sum()

    cases = [(probs, "skipped:target_not_class_indices"), (class_dim_1, "skipped:input_not_2d"), (no_loss, None)]
    for fn, key in cases:
        gm = dynamo_graph(fn, h, w, t)
        code = gm.code
        gm, rec = _run(gm)
        assert gm.code == code, fn.__name__
        if key is None:
            assert rec.reason == "no cross_entropy call in the graph" and rec.counts == {}
        else:
            assert rec.counts == {key: 1}, (fn.__name__, rec.counts)


def test_autocast_is_left_to_autocast():
    h, w, t = _inputs()

    def linear_in_autocast(h, w, t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = F.linear(h, w)
        return F.cross_entropy(x.float().view(-1, V), t.view(-1))

    def loss_in_autocast(h, w, t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.cross_entropy(F.linear(h, w).view(-1, V), t.view(-1))

    gm, rec = _run(dynamo_graph(linear_in_autocast, h, w, t))
    assert counts(gm)[CE] == 1 and counts(gm)["linear"] == 1  # autocast's bf16 linear stays, the loss is chunked
    _check_semantics(linear_in_autocast, gm, (h, w, t), rtol=2e-2)
    gm = dynamo_graph(loss_in_autocast, h, w, t)
    code = gm.code
    gm, rec = _run(gm)
    assert gm.code == code and rec.counts == {"skipped:autocast": 1}
    gm = dynamo_graph(llama_loss, h, w, t)
    code = gm.code
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gm, rec = _run(gm)
    assert gm.code == code and rec.counts == {"skipped:autocast": 1} and "autocast is enabled" in rec.reason


# ------------------------------------------------------------------ numerics
def _reference(h, w, t, reduction, dtype_loss=torch.float32):
    return F.cross_entropy((h @ w.t()).to(dtype_loss), t, reduction=reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
def test_linear_cross_entropy_fp32_matches_torch(reduction, chunk):
    h, w, t = _inputs()
    h, t = h.detach().reshape(N, D).requires_grad_(), t.reshape(N)
    hr, wr = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = _reference(hr, wr, t, reduction)
    (ref * 0.3).backward()
    loss, _, _ = torch.ops.graphcomp.linear_cross_entropy(h, w, t, -100, reduction, chunk, torch.float32, True, True,
                                                          False)
    (loss * 0.3).backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(h.grad, hr.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_on_logits_fp32_and_bf16_match_torch(reduction):
    g = torch.Generator().manual_seed(1)
    for dtype, rtol in ((torch.float32, 1e-5), (torch.bfloat16, 0)):
        x = (torch.randn(N, V, generator=g) * 3).to(dtype).requires_grad_()
        t = torch.randint(0, V, (N,), generator=g)
        t[2] = 5  # a repeated class, and an ignored row
        t[7] = -1
        xr = x.detach().clone().requires_grad_()
        ref = F.cross_entropy(xr.float(), t, ignore_index=-1, reduction=reduction)
        (ref * 1.7).backward()
        loss = torch.ops.graphcomp.cross_entropy(x, t, -1, reduction, 3, torch.float32, False)
        (loss * 1.7).backward()
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
        assert x.grad.dtype == dtype
        # bf16: the gradient is rounded once from the same fp32 value (bitwise on CPU)
        torch.testing.assert_close(x.grad, xr.grad, rtol=rtol, atol=1e-7 if rtol else 0)


def test_linear_cross_entropy_bf16_matches_torch():
    """bf16 hidden and weight, fp32 loss: the per-chunk logits and gradient are
    rounded like the reference's, and the weight gradient is summed in fp32 and
    rounded once, so the result is the reference's up to fp32 summation order
    (here: bitwise, on CPU)."""
    h, w, t = _inputs(torch.bfloat16)
    h, t = h.detach().reshape(N, D).requires_grad_(), t.reshape(N)
    hr, wr = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = _reference(hr, wr, t, "mean")
    ref.backward()
    loss, _, _ = torch.ops.graphcomp.linear_cross_entropy(h, w, t, -100, "mean", 3, torch.float32, True, True, False)
    loss.backward()
    assert loss.dtype == torch.float32 and h.grad.dtype == w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(h.grad, hr.grad, rtol=8e-3, atol=1e-6)
    torch.testing.assert_close(w.grad, wr.grad, rtol=8e-3, atol=1e-6)


def test_every_target_ignored_gives_nan_loss_and_zero_gradients_like_torch():
    h, w, _ = _inputs()
    h = h.detach().reshape(N, D).requires_grad_()
    t = torch.full((N,), -100)
    ref = F.cross_entropy(h @ w.t(), t)
    loss, gh, gw = torch.ops.graphcomp.linear_cross_entropy(h, w, t, -100, "mean", 4, torch.float32, True, True, False)
    assert torch.isnan(ref) and torch.isnan(loss)
    assert torch.equal(gh, torch.zeros_like(gh)) and torch.equal(gw, torch.zeros_like(gw))


def test_gradients_not_asked_for_are_empty():
    h, w, t = _inputs()
    h, t = h.detach().reshape(N, D), t.reshape(N)
    loss, gh, gw = torch.ops.graphcomp.linear_cross_entropy(h, w.detach(), t, -100, "sum", 4, torch.float32, False,
                                                            False, False)
    assert gh.numel() == 0 and gw.numel() == 0
    torch.testing.assert_close(loss, _reference(h, w.detach(), t, "sum"), rtol=1e-5, atol=0)


def test_bad_arguments_are_clear_errors():
    h, w, t = _inputs()
    h, t = h.detach().reshape(N, D), t.reshape(N)
    with pytest.raises(ValueError, match=r"reduction='none' is not supported; valid: \['mean', 'sum'\]"):
        torch.ops.graphcomp.linear_cross_entropy(h, w, t, -100, "none", 4, torch.float32, False, False, False)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1, got 0"):
        torch.ops.graphcomp.cross_entropy(h @ w.t(), t, -100, "mean", 0, torch.float32, False)
    with pytest.raises(ValueError, match=r"target must be int64 \[N\] with N=10, got torch.int64 \[9\]"):
        torch.ops.graphcomp.cross_entropy(h @ w.t(), t[:9], -100, "mean", 4, torch.float32, False)
    with pytest.raises(ValueError, match=r"hidden must be \[N, D\] and weight \[V, D\]"):
        torch.ops.graphcomp.linear_cross_entropy(h, w.t(), t, -100, "mean", 4, torch.float32, False, False, False)


def test_memory_model_counts_the_ops_scratch_while_they_run():
    """The workspace is live at the op only: two [c, V] chunk buffers at most, and
    on the CPU fp32 copies of a bf16 chunk's matmul operands (the fp32 weight-
    gradient sum is an output, counted as one)."""
    h, w, t = _inputs(torch.bfloat16)
    gm, _ = _run(dynamo_graph(llama_loss, h, w, t), chunk=4)
    from torch.fx.experimental.proxy_tensor import make_fx

    joint = make_fx(lambda h, w, t: torch.autograd.grad(gm(h, w, t)[0], (h, w)), tracing_mode="fake")(h, w, t)
    (op,) = [n for n in joint.graph.nodes if n.target is OPS["linear_cross_entropy"]]
    assert [v.dtype for v in op.meta["val"]] == [torch.float32, torch.bfloat16, torch.float32]
    c = 4
    chunk = c * V * max(2 + 4, 4 + 4, 4 + 2)  # logits+fp32 copy, copy+log-probs, probs+bf16 grad
    cpu_upcasts = (c * V + c * D) * 4  # CPU: the chunk's matmul operands in fp32
    assert memory.workspace_bytes(op) == chunk + cpu_upcasts
    nodes, live, size = memory.intervals(joint)
    (ws,) = [k for k in live if isinstance(k, memory.Workspace)]
    i = nodes.index(op)
    assert live[ws] == [(i, i)] and size[ws] == chunk + cpu_upcasts
    assert loss_ops.workspace_bytes(torch.ops.aten.mm.default, (), []) == 0


def test_compiled_chunk_math_matches_the_eager_kernels(monkeypatch):
    """The Inductor-compiled chunk arithmetic (CUDA's default; forced here on the
    CPU) gives the eager kernels' results up to fp32 rounding."""
    monkeypatch.setattr(loss_ops, "_use_compiled", lambda compiled, t: compiled)
    torch._dynamo.reset()
    h, w, t = _inputs()
    h, t = h.detach().reshape(N, D), t.reshape(N)
    res = {}
    for compiled in (False, True):
        hh, ww = h.clone().requires_grad_(), w.detach().clone().requires_grad_()
        loss, _, _ = torch.ops.graphcomp.linear_cross_entropy(hh, ww, t, -100, "mean", 5, torch.float32, True, True,
                                                              compiled)
        loss.backward()
        x = (h @ w.t()).detach().to(torch.bfloat16).requires_grad_()
        l2 = torch.ops.graphcomp.cross_entropy(x, t, -100, "sum", 5, torch.float32, compiled)
        l2.backward()
        res[compiled] = (loss, hh.grad, ww.grad, l2, x.grad)
    for a, b in zip(res[True], res[False]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5 if a.dtype == torch.float32 else 8e-3, atol=1e-6)


def test_config_options_are_validated():
    from graphcomp.config import Config

    with pytest.raises(ValueError, match=r"Config.loss_chunk_tokens: must be >= 1, got 0"):
        Config.from_options({"loss_chunk_tokens": 0})
    with pytest.raises(ValueError, match=r"Config.loss_chunk_tokens: expected int, got float 8.0"):
        Config.from_options({"loss_chunk_tokens": 8.0})
    with pytest.raises(ValueError, match=r"Config.loss_chunk_kernels: invalid value 'triton'; valid values: "
                                         r"\['inductor', 'eager'\]"):
        Config.from_options({"loss_chunk_kernels": "triton"})
    assert Config.from_options({}).loss_chunk_tokens == 1024


def test_eager_kernels_option_reaches_the_op():
    h, w, t = _inputs()
    gm = dynamo_graph(llama_loss, h, w, t)
    gm, _ = run_pass("chunk_lm_loss", gm, stage="dynamo", loss_chunk_tokens=4, loss_chunk_kernels="eager")
    (op,) = [n for n in gm.graph.nodes if n.target is OPS["linear_cross_entropy"]]
    assert op.args[-1] is False
