"""Hugging Face model families (benchmarks/hf_models.py) under graphcomp on the CPU.

* Parity, 2 gloo ranks: ``graphcomp.shard`` + ``backend="graphcomp"`` vs an unsharded
  eager reference on the global batch: losses, step-1 gradients (before clipping) and
  final parameters after SGD steps with clipping (SGD: an update linear in the
  gradient keeps rounding at rounding level; AdamW's sign-like first step would hide
  a scaled gradient). Eager codegen for every family (the grouped_mm MoE families:
  Inductor for Mixtral, the batched_mm twin for Qwen2-MoE), Inductor for some.
* MoE routing that differs per rank (transformers' eager experts loop, which reads
  only the experts that received tokens): no collective mismatch, eager or compiled.
* CUDA graphs through the CPU stand-in device (tests/cpu/_fakecuda.py), one rank:
  bf16 training reaches a steady state (no fallback, no re-capture after warm-up).
  This checks the runner's decisions on real graphs; the GPU test
  (tests/gpu/test_hf_zoo_gpu.py) checks the same on CUDA.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from _fakecuda import fake_cuda_runtime, install_fake_device, install_pretend_cuda
from _sharded import full_grads

pytest.importorskip("transformers")

from benchmarks import hf_models as zoo  # noqa: E402

GLOBAL_BATCH, SEQ, STEPS, LR = 4, 16, 3, 0.1
INDUCTOR = ("llama", "mixtral", "bert")

# CI time: the families that each bring one architecture feature one block shows
# (encoder-decoder, fused projections, parallel residual, post-norm with q/k norms,
# sliding window, shared expert, vision transformer) train one layer (T5: one encoder
# and one decoder block), for two steps in the parity tests and six in the CUDA-graph
# one; the others two layers for STEPS.
ONE_LAYER = ("gpt_neox", "mistral", "olmo2", "phi3", "qwen2_moe", "qwen2_moe-batched_mm", "t5", "vit")


def _layers(family: str) -> int | None:
    return 1 if family in ONE_LAYER else None


def _steps(family: str) -> int:
    return 2 if family in ONE_LAYER else STEPS


def _train(model, batches, step_fn, steps):
    """SGD with clip_grad_norm_(1.0); returns losses and the step-1 gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, g1 = [], None
    for s in range(steps):
        loss = step_fn(model, batches[s])
        loss.backward()
        if s == 0:
            g1 = full_grads(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, g1


def _reference(family):
    m = zoo.build_model(family, "tiny", seed=0, dropout=0.0, layers=_layers(family))
    steps = _steps(family)
    batches = [zoo.make_batch(m, GLOBAL_BATCH, SEQ, seed=s) for s in range(steps)]
    losses, g1 = _train(m, batches, lambda mm, b: mm(**b).loss, steps)
    return [float(x) for x in losses], g1, {k: v.detach().clone() for k, v in m.state_dict().items()}


def _sharded(rank, world, family, codegen, embedding="gather", exchanged=None, options=None):
    import torch.distributed as dist

    import graphcomp
    from graphcomp.sharding.shard import full_state_dict

    torch._dynamo.reset()
    graphcomp.reset()
    m = zoo.build_model(family, "tiny", seed=0, dropout=0.0, layers=_layers(family))
    graphcomp.shard(m, embedding=embedding)
    if exchanged is not None:  # (the embeddings that exchange tokens, by module name)
        exchanged.extend(n for n, mod in m.named_modules() if "_graphcomp_exchange" in mod.__dict__)
    cm = torch.compile(m, backend="graphcomp", options={"codegen": codegen, **(options or {})})
    steps = _steps(family)
    batches = [zoo.split_batch(zoo.make_batch(m, GLOBAL_BATCH, SEQ, seed=s), rank, world) for s in range(steps)]
    losses, g1 = _train(m, batches, lambda mm, b: cm(**b).loss, steps)
    lt = torch.stack(losses)
    dist.all_reduce(lt)
    return [float(x) / world for x in lt], g1, full_state_dict(m)


def _sharded_exchange(rank, world, family):
    names: list[str] = []
    return (*_sharded(rank, world, family, "eager", "exchange", names), names)


def _close(name, got, ref, rtol, floor):
    """Relative error of a tensor, with an absolute floor for tensors whose reference
    is (numerically) zero: the gradient of a bias before a softmax is rounding noise."""
    err = float((got.float() - ref.float()).norm())
    scale = max(float(ref.float().norm()), floor)
    assert err <= rtol * scale, f"{name}: |diff| {err:.3g} > {rtol} * {scale:.3g}"


def _check(family, res, rtol):
    ref_losses, ref_g1, ref_params = _reference(family)
    gmax = max(float(g.norm()) for g in ref_g1.values())
    pmax = max(float(p.float().norm()) for p in ref_params.values())
    for losses, g1, params in res:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=0)
        assert set(g1) == set(ref_g1), set(ref_g1) ^ set(g1)
        for k in ref_g1:
            _close(f"{family} grad {k}", g1[k], ref_g1[k], rtol * 10, 1e-3 * gmax)
        for k in ref_params:
            if k in params:
                _close(f"{family} param {k}", params[k], ref_params[k], rtol * 10, 1e-3 * pmax)


@pytest.fixture(scope="module")
def ranks2(shared_ranks2):
    return shared_ranks2.view(timeout=600)


# Mixtral's default experts (transformers' grouped_mm fallback reads token counts on
# the host: a graph break per layer and a frame per piece) run with Inductor codegen
# only: the same frames with eager codegen cost 47 s of CI on 2 cores and test no
# path the other families' eager runs and Mixtral's Inductor run leave out. Qwen2-MoE's
# grouped_mm experts are the same code (its fp32 parity: 50 s with eager codegen):
# its shared expert's parity runs with batched_mm experts (qwen2_moe-batched_mm), its
# grouped_mm experts in the bf16 CUDA-graph test below (bf16: torch's grouped_mm, no
# graph break).
EAGER = tuple(f for f in sorted(zoo.FAMILIES) if f not in ("mixtral", "qwen2_moe"))


@pytest.mark.parametrize("family", EAGER)
def test_parity_eager_codegen_2ranks(ranks2, family):
    _check(family, ranks2.run(_sharded, family, "eager"), rtol=1e-5)


@pytest.mark.parametrize("family", INDUCTOR)
def test_parity_inductor_2ranks(ranks2, family):
    _check(family, ranks2.run(_sharded, family, "inductor"), rtol=1e-4)


@pytest.mark.parametrize("family,exchanged", [("llama", ["model.embed_tokens"]), ("gpt2", ["transformer.wpe"])])
def test_parity_embedding_exchange_2ranks(ranks2, family, exchanged):
    """shard(embedding="exchange") against the unsharded eager reference: Llama's
    embed_tokens exchanges tokens; GPT-2's wte is tied to lm_head and stays gathered,
    its position embedding wpe (looked up by position ids) exchanges."""
    res = ranks2.run(_sharded_exchange, family)
    for r in res:
        assert r[3] == exchanged, r[3]
    _check(family, [r[:3] for r in res], rtol=1e-5)


def _sharded_keep(rank, world, family):
    import graphcomp

    res = _sharded(rank, world, family, "eager", options={"reshard_after_forward": False})
    recs = [p for f in graphcomp.frame_summaries() for p in f["stages"].get("joint", {}).get("passes", [])
            if p["name"] == "schedule_free"]
    kept = sum(p["counts"].get("gathers_kept", 0) for p in recs)
    resharded = sum(p["counts"].get("gathers_resharded", 0) for p in recs)
    return (*res, (kept, resharded))


@pytest.mark.parametrize("family", ["llama", "mixtral-batched_mm"])
def test_parity_gathers_kept_for_backward_2ranks(ranks2, family):
    """Every gathered parameter kept from the forward to the backward (what the
    default reshard_after_forward="auto" does on CUDA while it fits; the CPU default
    reshards): the same numbers as the unsharded eager reference, also with
    batched_mm's expanding reads of gathered expert weights recomputed in backward."""
    res = ranks2.run(_sharded_keep, family)
    for r in res:
        kept, resharded = r[3]
        assert kept > 0 and resharded == 0, r[3]
    _check(family, [r[:3] for r in res], rtol=1e-5)


# ------------------------------------------------------------ MoE routing per rank
def _moe_divergent(rank, world, compiled):
    """8 experts, top-2, 3 tokens per rank: ranks reach different experts."""
    import transformers

    import graphcomp

    torch._dynamo.reset()
    graphcomp.reset()
    cfg = zoo.make_config("mixtral-eager", "tiny", dropout=0.0)
    cfg.num_local_experts = 8
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    m.graphcomp_family = "mixtral-eager"
    hits = []
    for layer in m.model.layers:
        layer.mlp.experts.register_forward_pre_hook(
            lambda mod, args: hits.append(sorted(set(args[1].flatten().tolist()))))
    graphcomp.shard(m)
    run = torch.compile(m, backend="graphcomp", options={"codegen": "eager"}) if compiled else m
    losses = []
    for s in range(2):
        b = zoo.make_batch(m, 1, 3, seed=100 * rank + s)
        loss = run(**b).loss
        loss.backward()
        losses.append(float(loss))
    grads = {k: v.grad.full_tensor() for k, v in m.named_parameters() if "experts" in k}
    return hits, losses, grads


def _moe_reference():
    import transformers

    cfg = zoo.make_config("mixtral-eager", "tiny", dropout=0.0)
    cfg.num_local_experts = 8
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    m.graphcomp_family = "mixtral-eager"
    for s in range(2):
        bs = [zoo.make_batch(m, 1, 3, seed=100 * r + s) for r in range(2)]
        for b in bs:  # mean of the two ranks' means = the sharded gradient
            (m(**b).loss / 2).backward()
    return {k: v.grad for k, v in m.named_parameters() if "experts" in k}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_moe_eager_experts_loop_with_routing_that_differs_per_rank(ranks2, compiled):
    res = ranks2.run(_moe_divergent, compiled, timeout=420)
    (h0, _, g0), (h1, _, _) = res
    assert h0 != h1, "the test needs ranks whose tokens reach different experts"
    ref = _moe_reference()
    for k, v in ref.items():  # gathered once per module, reduce-scattered once: the same gradients
        torch.testing.assert_close(g0[k], v, rtol=1e-4, atol=1e-6)


# --------------------------------------------- CUDA-graph steady state (stand-in device)
@pytest.fixture
def world1():
    """A one-process gloo group for this test, destroyed afterwards (a group left
    behind would make other tests' in-process groups impossible). First, what earlier
    tests left alive moves to the collector's permanent generation, as the ranks do
    before each task (tests/cpu/_dist.py ``_freeze_survivors``): the compile's and the
    runtime's collections walk only this test's objects (each in-process test here
    took 30-50% longer after the module's other in-process compiles than alone)."""
    import gc

    import torch.distributed as dist

    assert not dist.is_initialized(), "a process group leaked from an earlier test"
    gc.collect()
    gc.freeze()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fake_cuda(monkeypatch):
    gen = install_fake_device(monkeypatch)
    dev = next(gen)
    install_pretend_cuda(monkeypatch)
    yield dev
    next(gen, None)


def _bf16_steps(family: str, steps: int, seed: Any, clip: bool) -> dict:
    """Build the family's tiny model, shard it (bf16 gathers), compile it (eager
    codegen) and train ``steps`` AdamW steps on batches ``seed(step)``; returns the
    counters after step 3 (warm-up: the first step captures, the next ones settle)."""
    import graphcomp

    torch._dynamo.reset()
    graphcomp.reset()
    m = zoo.build_model(family, "tiny", seed=0, layers=_layers(family))
    graphcomp.shard(m, param_dtype=torch.bfloat16)
    cm = torch.compile(m, backend="graphcomp", options={"codegen": "eager"})
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    warm: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(steps):
            loss = cm(**zoo.make_batch(m, 2, SEQ, seed=seed(s))).loss
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            assert torch.isfinite(loss)
            if s == 3:
                warm = dict(graphcomp.counters)
    return warm


# (not qwen2_moe-batched_mm: its experts are mixtral-batched_mm's code, its shared expert
# qwen2_moe's, both captured here)
@pytest.mark.parametrize("family", [f for f in sorted(zoo.FAMILIES) if f != "qwen2_moe-batched_mm"])
def test_cudagraph_steady_state_bf16(world1, fake_cuda, family):
    """bf16 training with the family's default dropout, a standard loop
    (backward, clip, AdamW, zero_grad): every piece captured once, then replayed,
    with no eager fallback and no re-capture after the first steps."""
    import graphcomp

    warm = _bf16_steps(family, 6 if family in ONE_LAYER else 8, seed=lambda s: s, clip=True)
    c = graphcomp.counters
    for k in ("cudagraph_fallbacks", "recaptures", "hazard_recaptures", "captures", "capture_failures"):
        assert c[k] == warm.get(k, 0), (family, k, dict(c))
    assert c["capture_failures"] == 0 and c["cudagraph_fallbacks"] == 0, dict(c)
    if family != "mixtral-eager":
        assert c["pieces_turned_eager"] == 0, dict(c)
    # (the eager experts loop runs small compiled frames per expert, with token counts that
    # follow the routing: those pieces turn eager by decision the first time they cannot
    # replay, instead of falling back every step)
    assert c["captures"] > 0 and c["replays"] > c["captures"], dict(c)
    graphcomp.reset()


def _steady_2ranks(rank: int, world: int, family: str, steps: int) -> dict:
    """bf16 training on 2 ranks (each its own batches: routing differs per rank)
    with every capturable piece through the stand-in CUDA-graph runtime."""
    import graphcomp

    with fake_cuda_runtime():
        warm = _bf16_steps(family, steps, seed=lambda s: 1000 * rank + s, clip=False)
        return {"warm": warm, "end": dict(graphcomp.counters)}


def test_moe_eager_experts_settle_on_2_ranks_through_the_graph_runtime(ranks2):
    """HF Mixtral with the Python experts loop on 2 ranks, pieces through the
    CUDA-graph runtime: the per-expert frames (fixed-shape specializations and
    dynamic-shape ones of the same function, called at steps the routing picks)
    turn eager at their first hazard; after warm-up nothing falls back or
    re-captures (on 2 GPUs, fixed-shape expert frames fell back at random steps)."""
    for r in ranks2.run(_steady_2ranks, "mixtral-eager", 16, timeout=600):
        w, e = r["warm"], r["end"]
        for k in ("cudagraph_fallbacks", "recaptures", "hazard_recaptures", "capture_failures"):
            assert e.get(k, 0) == w.get(k, 0), (k, w, e)
        assert e.get("replays", 0) > w.get("replays", 0), e


def _gpt2_steps(steps: int, hold: bool, options: dict, dropout: float | None = None
                ) -> tuple[list[float], dict, list[bool]]:
    """GPT-2 (graph break before its loss: the logits leave the first frame) with
    CUDA graphs through the stand-in device, AdamW. ``hold``: the loop keeps the
    model's output object (logits included) until the next step's forward has
    returned, as hand-written Hugging Face loops do; returns, per step, whether the
    held logits still had their values after that next step."""
    import graphcomp

    torch._dynamo.reset()
    graphcomp.reset()
    m = zoo.build_model("gpt2", "tiny", seed=0, dropout=dropout)
    graphcomp.shard(m, param_dtype=torch.bfloat16)
    cm = torch.compile(m, backend="graphcomp", options={"codegen": "eager", **options})
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    losses, intact, prev = [], [], None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(steps):
            out = cm(**zoo.make_batch(m, 2, SEQ, seed=s))
            if prev is not None:
                intact.append(torch.equal(prev[0].logits, prev[1]))
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(out.loss))
            prev = (out, out.logits.detach().clone()) if hold else None
            del out
    return losses, dict(graphcomp.counters), intact


def test_large_forward_outputs_leave_the_pool_uncopied(world1, fake_cuda, monkeypatch):
    """Forward outputs over ``FORWARD_COPY_BELOW`` bytes (logits, tensors handed
    across a graph break) are handed out of the pool like gradients under
    ``copy_outputs="auto"``: not copied while nothing holds them at the next replay
    (HF GPT-2 on 2 H100s copied its 262 MB of logits every step); the compile's own
    reference cycles, which hold the first call's outputs, are collected before a
    hazard is declared (without that, every piece was captured again at step 1).
    Losses are bitwise those of ``copy_outputs="always"`` (the stand-in device
    scribbles over pool memory a replay may overwrite)."""
    import graphcomp.compiler.codegen as codegen

    monkeypatch.setattr(codegen, "FORWARD_COPY_BELOW", 64)  # the tiny model's logits are 8 KiB
    ref, c_ref, _ = _gpt2_steps(6, False, {"copy_outputs": "always"})
    got, c, _ = _gpt2_steps(6, False, {})
    assert got == ref, (got, ref)
    assert c.get("hazard_recaptures", 0) == 0 and c.get("recaptures", 0) == 0, c
    assert c.get("cudagraph_fallbacks", 0) == 0 and c["replays"] > c["captures"] > 0, c
    assert c.get("cudagraph_output_copy_bytes", 0) == 6 * 4, c  # only the fp32 loss of each step
    assert c_ref["cudagraph_output_copy_bytes"] > 6 * 8192, c_ref  # (logits were copied with "always")


def test_held_large_forward_output_is_never_overwritten(world1, fake_cuda, monkeypatch):
    """A loop that keeps the model's output (its logits) across the next forward:
    the piece sees them held, copies them out of the pool from then on and is
    captured again around the live tensor, once (with the pieces captured after it);
    held logits keep their values.
    (Dropout off: a re-capture's warm-up call draws random numbers, so with dropout
    the losses would differ from a run without one.)"""
    import graphcomp.compiler.codegen as codegen

    monkeypatch.setattr(codegen, "FORWARD_COPY_BELOW", 64)
    ref, _, _ = _gpt2_steps(6, True, {"copy_outputs": "always"}, dropout=0.0)
    got, c, intact = _gpt2_steps(6, True, {}, dropout=0.0)
    assert got == ref, (got, ref)
    assert intact and all(intact), intact
    # once: the held piece and the pieces captured after it (their memory may overlap)
    assert 1 <= c.get("hazard_recaptures", 0) <= c["pieces_captured"] and c.get("cudagraph_fallbacks", 0) == 0, c
    assert c.get("cudagraph_output_copy_bytes", 0) > 0, c
