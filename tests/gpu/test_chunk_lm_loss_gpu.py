"""chunk_lm_loss on a real GPU: op numerics (the fp32-output matmul and the
Inductor-compiled chunk arithmetic exist only on CUDA), the memory a W2-sized
loss saves, and training with CUDA graphs.

Budget: about 3 minutes on one H200 (most of it Inductor compiles). The memory
test prints one ``CHUNK_LM_LOSS`` JSON line (peak memory and step time of the
W2-sized loss with the pass off, on with compiled chunk kernels, on with eager
ones, on with 2048-token chunks); with ``$OUT`` set it also writes
``$OUT/chunk_lm_loss_gpu.json``."""

from __future__ import annotations

import json
import os
import statistics
import time

import pytest
import torch
import torch.nn.functional as F

import graphcomp
from graphcomp import _compat
from graphcomp.ops import loss as loss_ops
from graphcomp.models import Llama, synthetic_batch

pytestmark = pytest.mark.gpu
GIB = 2**30


@pytest.fixture(autouse=True)
def _no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def test_fp32_output_matmul_is_available():
    """The weight gradient is summed in fp32 by the matmul itself (no bf16
    [vocab, hidden] temporary per chunk): needs aten::addmm.dtype_out (torch >= 2.8)."""
    assert _compat.has_fp32_out_addmm(torch.empty(1, device="cuda"))
    acc = torch.zeros(64, 48, device="cuda")
    a = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(32, 48, device="cuda", dtype=torch.bfloat16)
    _compat.addmm_accumulate_(acc, a, b)
    _compat.addmm_accumulate_(acc, a, b)
    torch.testing.assert_close(acc, 2 * (a.float() @ b.float()), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kernels", ["inductor", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_match_torch_on_cuda(dtype, kernels):
    torch._dynamo.reset()
    compiled = kernels == "inductor"
    n, d, v, chunk = 1000, 256, 5003, 300
    g = torch.Generator("cuda").manual_seed(0)
    h = torch.randn(n, d, device="cuda", generator=g).to(dtype)
    w = (torch.randn(v, d, device="cuda", generator=g) * 0.05).to(dtype)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[::7] = -100
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = F.cross_entropy((hr @ wr.t()).float(), t)
    (ref * 0.5).backward()
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, _, _ = torch.ops.graphcomp.linear_cross_entropy(hh, ww, t, -100, "mean", chunk, torch.float32, True, True,
                                                          compiled)
    (loss * 0.5).backward()
    x = (h @ w.t()).detach().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    ref2 = F.cross_entropy(xr.float(), t, reduction="sum")
    ref2.backward()
    loss2 = torch.ops.graphcomp.cross_entropy(x, t, -100, "sum", chunk, torch.float32, compiled)
    loss2.backward()
    if dtype == torch.float32:
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    else:  # bf16 logits from chunked matmuls (cuBLAS may round a row differently for another M)
        torch.testing.assert_close(loss, ref, rtol=1e-3, atol=0)
    torch.testing.assert_close(loss2, ref2, rtol=1e-5, atol=0)  # same logits: only the summation order differs
    for a, b in ((hh.grad, hr.grad), (ww.grad, wr.grad)):
        assert a.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-2 * float(b.float().abs().max()))
    assert x.grad.dtype == dtype
    torch.testing.assert_close(x.grad.float(), xr.grad.float(), rtol=1e-5 if dtype == torch.float32 else 8e-3,
                               atol=1e-7)


# ------------------------------------------------------------- W2-sized loss
class _Head(torch.nn.Module):
    """W2's loss: fp32 master weight cast to bf16 where used (``param_dtype``),
    bf16 hidden states, loss in fp32 (``logits.float()``)."""

    def __init__(self, vocab=128256, dim=2048):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(vocab, dim, device="cuda") * 0.02)

    def forward(self, h, t):
        return F.cross_entropy(F.linear(h, self.weight.to(torch.bfloat16)).float().flatten(0, 1), t.flatten())


def _measure(options, steps=8):
    torch._dynamo.reset()
    graphcomp.reset()
    torch.manual_seed(0)
    m = _Head()
    # CUDA graphs off: the private pool would blur allocated-memory peaks
    cm = torch.compile(m, backend="graphcomp", options={"cudagraphs": "off", **options})
    g = torch.Generator("cuda").manual_seed(1)
    h = torch.randn(4, 2048, 2048, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    t = torch.randint(0, 128256, (4, 2048), device="cuda", generator=g)
    times, losses = [], []
    for s in range(steps):
        if s == 2:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = cm(h, t)
        loss.backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        m.weight.grad = h.grad = None
    peak = torch.cuda.max_memory_allocated() - base
    est = max((d.get("memory") or {}).get("peak_bytes_inductor", 0)
              for f in graphcomp.frame_summaries() for st, d in f["stages"].items() if st in ("fwd", "bwd"))
    return {"peak_over_steady_gib": peak / GIB, "est_stage_peak_gib": est / GIB,
            "step_ms_median": 1e3 * statistics.median(times[2:]), "loss": losses[-1]}


def test_w2_sized_loss_saves_memory_and_records_time():
    """W2 micro-batch (4 x 2048 tokens, vocab 128256, hidden 2048): the pass's
    measured saving of peak memory over a step (forward + backward), >= 0.75 GiB
    (an H100 with torch 2.11 measures 0.98 GiB: the unchunked step's peak over the
    steady state is 2.97 GiB, not the 7.37 GiB the static estimate gives, because
    Inductor frees the fp32 logits early)."""
    off = _measure({"passes": {"chunk_lm_loss": False}})
    on_ = {"passes": {"chunk_lm_loss": True}}  # (off by default until measured)
    on = _measure(on_)
    on_eager = _measure({**on_, "loss_chunk_kernels": "eager"})
    on_2048 = _measure({**on_, "loss_chunk_tokens": 2048})  # fewer, larger chunks: the time/memory trade
    out = {"off": off, "on_inductor_kernels": on, "on_eager_kernels": on_eager, "on_chunk_2048": on_2048,
           "saved_gib": off["peak_over_steady_gib"] - on["peak_over_steady_gib"],
           "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    print("CHUNK_LM_LOSS " + json.dumps(out))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "chunk_lm_loss_gpu.json"), "w") as f:
            json.dump(out, f, indent=1)
    for r in (on, on_eager, on_2048):
        assert abs(r["loss"] - off["loss"]) <= 1e-3 * abs(off["loss"])
    assert out["saved_gib"] >= 0.75, out


# ------------------------------------------------------------ CUDA graphs
def _train_tiny(options, steps=5):
    torch._dynamo.reset()
    graphcomp.reset()
    torch.manual_seed(0)
    m = Llama("tiny").cuda()
    cm = torch.compile(m, backend="graphcomp", options={"codegen": "inductor", "loss_chunk_tokens": 5, **options})
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    losses = []
    for s in range(steps):
        tok, tgt = synthetic_batch(m.cfg, 2, 16, seed=s, device="cuda")
        loss = cm(tok, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach().clone() for p in m.parameters()], dict(graphcomp.counters)


def test_tiny_llama_with_cuda_graphs_trains_like_the_pass_off():
    """The compiled chunk arithmetic compiles at the warm-up call, so the captured
    piece replays it; nothing falls back to eager."""
    l_off, p_off, _ = _train_tiny({"passes": {"chunk_lm_loss": False}})
    l_on, p_on, c = _train_tiny({"passes": {"chunk_lm_loss": True}})
    torch.testing.assert_close(l_on, l_off, rtol=1e-5, atol=0)
    for a, b in zip(p_on, p_off):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert c["lm_losses_chunked"] == 1
    assert c.get("pieces_captured", 0) > 0 and c.get("cudagraph_fallbacks", 0) == 0, c
    assert loss_ops._compiled_chunk_math.cache_info().currsize == 1  # the compiled chunk arithmetic ran
