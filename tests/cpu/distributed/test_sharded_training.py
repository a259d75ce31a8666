"""The end-to-end bar: the sharded, compiled Llama trains like an unsharded
single-process eager reference, for every combination of the collective passes,
on 2 and 4 gloo ranks, with and without gradient accumulation.

Optimizer: SGD. Its update is linear in the gradient, so the parameter error stays
at the gradient's rounding level; AdamW's update ~ lr * sign(g) would turn rounding
noise on near-zero gradients into lr-sized moves and say nothing about sharding.
"""

import itertools

import pytest
import torch


STEPS = 10
GLOBAL_BATCH, SEQ = 4, 16
COMBOS = list(itertools.product([True, False], [True, False]))  # (fuse, bucket)


def _reference(steps, micro, model="tiny"):
    from graphcomp.models import Llama, synthetic_batch

    torch.manual_seed(0)
    m = Llama(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        tok, tgt = synthetic_batch(m.cfg, GLOBAL_BATCH, SEQ, seed=step)
        total = 0.0
        for mb in range(micro):  # same split as the sharded run: micro-batch mb of every rank's slice
            loss = m(tok[mb::micro], tgt[mb::micro]) / micro
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))
    return losses, {k: v.detach().clone() for k, v in m.state_dict().items()}


def _train_sharded(rank, world, cfg):
    import torch.distributed as dist

    import graphcomp
    from graphcomp.models import Llama, synthetic_batch
    from graphcomp.sharding.shard import full_state_dict

    torch._dynamo.reset()
    graphcomp.reset()
    if cfg.get("fake_cuda"):  # CPU graphs split and captured as CUDA ones, on the runtime's stand-in device
        from _fakecuda import fake_cuda_runtime

        with fake_cuda_runtime():
            try:
                return _train_sharded(rank, world, {**cfg, "fake_cuda": False})
            finally:
                graphcomp.runtime.teardown()
    if cfg.get("zero_copy_cpu"):  # zero_copy_buckets on these CPU graphs too (restored below: pools are reused)
        import sys

        from graphcomp.compiler.plan import FramePlan

        gc_backend = sys.modules["graphcomp.compiler.backend"]

        gc_backend.FramePlan = lambda: FramePlan(zero_copy_cpu_graphs=True)
        try:
            return _train_sharded(rank, world, {**cfg, "zero_copy_cpu": False})
        finally:
            gc_backend.FramePlan = FramePlan
    if cfg.get("defer_all"):  # the wire modelled slow: defer_weight_grads moves everything it may
        opts = {**cfg.get("options", {}), "collective_bytes_per_s": 1.0}
        return _train_sharded(rank, world, {**cfg, "defer_all": False, "options": opts})
    torch.manual_seed(0)
    m = Llama(cfg.get("model", "tiny"))
    graphcomp.shard(m, param_dtype=cfg.get("param_dtype"))
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    options = {
        "codegen": cfg.get("codegen", "eager"),
        "bucket_bytes": cfg.get("bucket_bytes", 12288),
        "passes": {"fuse_allgather_downcast": cfg["fuse"], "bucket_collectives": cfg["bucket"], **cfg.get("passes", {})},
        **cfg.get("options", {}),  # e.g. reshard_after_forward, memory_budget, prefetch_bytes
    }
    cm = torch.compile(m, backend="graphcomp", options=options)
    micro = cfg.get("micro", 1)
    per_rank = GLOBAL_BATCH // world
    losses = []
    for step in range(cfg.get("steps", STEPS)):
        tok, tgt = synthetic_batch(m.cfg, GLOBAL_BATCH, SEQ, seed=step)
        # rank r takes every world-th sequence; micro-batch mb takes every micro-th of those,
        # so rank r micro-batch mb holds sequences {mb*world + r ...}: together the reference's split
        total = torch.zeros(())
        for mb in range(micro):
            idx = torch.arange(GLOBAL_BATCH)[mb::micro][rank::world]
            assert len(idx) == per_rank // micro
            loss = cm(tok[idx], tgt[idx]) / micro
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append(float(total) / world)
    c = dict(graphcomp.counters)
    return losses, full_state_dict(m), c


@pytest.fixture(scope="module")
def ranks2(shared_ranks2):
    return shared_ranks2.view(timeout=300)


@pytest.fixture(scope="module")
def ranks4(shared_ranks4):
    return shared_ranks4.view(timeout=300)


def _check(results, ref_losses, ref_params, rtol, atol):
    for losses, params, _ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol)
        assert set(params) == set(ref_params)
        for k, v in ref_params.items():
            torch.testing.assert_close(params[k], v, rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("fuse, bucket", COMBOS)
def test_fp32_2ranks_matches_unsharded_reference(ranks2, fuse, bucket):
    ref_losses, ref_params = _reference(STEPS, 1)
    # (the fused and bucketed run is also read by test_zero_copy_buckets_is_bitwise_the_flat_buckets)
    res = ranks2.run_once(_train_sharded, {"fuse": fuse, "bucket": bucket})
    _check(res, ref_losses, ref_params, rtol=1e-5, atol=1e-6)
    counters = res[0][2]
    assert counters.get("collective_buckets", 0) > 0 if bucket else counters.get("collective_buckets", 0) == 0
    assert counters.get("bytes_gathered:float32", 0) > 0 and "bytes_gathered:bfloat16" not in counters


# 4 ranks: the defaults and everything off (the mixed combinations run on 2 ranks
# above and in the micro-batch test; each 4-rank case costs 10-18 s of CI on 2 cores)
@pytest.mark.parametrize("fuse, bucket", [(True, True), (False, False)])
def test_fp32_4ranks_matches_unsharded_reference(ranks4, fuse, bucket):
    ref_losses, ref_params = _reference(STEPS, 1)
    res = ranks4.run(_train_sharded, {"fuse": fuse, "bucket": bucket})
    _check(res, ref_losses, ref_params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fuse, bucket", COMBOS)
def test_grad_accumulation_2_microbatches(ranks2, fuse, bucket):
    ref_losses, ref_params = _reference(STEPS, 2)
    res = ranks2.run(_train_sharded, {"fuse": fuse, "bucket": bucket, "micro": 2})
    _check(res, ref_losses, ref_params, rtol=1e-5, atol=1e-6)


def test_bf16_params_fused_is_bitwise_the_unfused_result_and_halves_the_bytes(ranks2):
    """param_dtype=bf16: casting the shard before the gather gives exactly the same
    bf16 weights as casting after it (a gather is a copy), so fuse on/off and bucket
    on/off are bitwise equal; and the fused graphs move half the bytes."""
    # (the fused and bucketed run is also read by the next test; the fused unbucketed
    # one by test_bf16_schedule_policies_are_bitwise_equal)
    runs = {c: ranks2.run_once(_train_sharded, {"fuse": c[0], "bucket": c[1], "param_dtype": torch.bfloat16, "steps": 5}) for c in COMBOS}
    base_losses, base_params, _ = runs[(False, False)][0]
    for c, res in runs.items():
        for losses, params, _ in res:
            assert losses == base_losses, c
            for k in base_params:
                torch.testing.assert_close(params[k], base_params[k], rtol=0, atol=0)
    fused, unfused = runs[(True, False)][0][2], runs[(False, False)][0][2]
    assert "bytes_gathered:float32" not in fused
    assert fused["bytes_gathered:bfloat16"] * 2 == unfused["bytes_gathered:float32"]
    assert fused["gathers_fused"] > 0


def test_bf16_params_track_the_fp32_reference(ranks2):
    """bf16 weights and activations (fp32 master weights, fp32 reduce-scatter, fp32
    loss): bf16 keeps 8 mantissa bits, so each matmul carries ~2^-8 = 0.4% relative
    rounding; over 2 layers and 5 SGD steps the loss stays within 2% of fp32."""
    ref_losses, _ = _reference(5, 1)
    (losses, _, _), _ = ranks2.run_once(_train_sharded, {"fuse": True, "bucket": True, "param_dtype": torch.bfloat16, "steps": 5})
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)


def test_inductor_codegen_2ranks_all_passes(ranks2):
    ref_losses, ref_params = _reference(3, 1)
    res = ranks2.run(_train_sharded, {"fuse": True, "bucket": True, "codegen": "inductor", "steps": 3})
    _check(res, ref_losses, ref_params, rtol=1e-4, atol=1e-5)


def test_compile_regions_2ranks_match_the_reference_and_reuse_compiled_regions(ranks2):
    """``compile_regions``: the tiny Llama's forward and backward cut into regions
    (Inductor, 2 gloo ranks), identical regions compiled once; the same numbers as the
    unsharded reference, as the whole-graph Inductor test above (31 regions, 15 reused
    when written)."""
    ref_losses, ref_params = _reference(2, 1, model="tiny-deep")
    res = ranks2.run(_train_sharded, {"fuse": True, "bucket": True, "codegen": "inductor", "steps": 2,
                                      # a prefetch cap of about one weight (W3's is 2 buckets of 64 MiB against
                                      # 436 MB of weights per block) leaves points with nothing in flight
                                      "model": "tiny-deep",
                                      "options": {"compile_regions": True, "region_min_nodes": 8, "prefetch_bytes": 2048}})
    _check(res, ref_losses, ref_params, rtol=1e-4, atol=1e-5)
    for _, _, c in res:
        assert c["regions"] >= 10, c
        assert c["regions_reused"] >= 5, c
        assert c["regions_compiled"] + c["regions_reused"] == c["regions"], c


def test_compile_regions_captured_on_the_stand_in_device_match_the_reference(ranks2):
    """``compile_regions`` on the capture path: the CPU graphs split as CUDA ones, the
    regions compiled apart and run in order inside each captured piece (one graph per
    piece, not per region: many graphs made ``cudaGraphLaunch`` block the host on W3),
    on the runtime's stand-in device (whose replays scribble over memory a real pool
    could reuse), identical regions sharing one compiled function, some cut with a
    collective in flight (waited in the next region); the numbers are the unsharded
    reference's."""
    ref_losses, ref_params = _reference(3, 1, model="tiny-deep")
    res = ranks2.run(_train_sharded, {"fuse": True, "bucket": True, "codegen": "inductor", "steps": 3,
                                      "model": "tiny-deep", "fake_cuda": True,
                                      "options": {"compile_regions": True, "region_min_nodes": 8, "prefetch_bytes": 2048}})
    _check(res, ref_losses, ref_params, rtol=1e-4, atol=1e-5)
    for _, _, c in res:
        assert c["regions"] >= 10 and c["regions_reused"] >= 5, c
        # cuts with a prefetched gather or a reduce-scatter in flight (its wait in the next region)
        assert c.get("region_cuts_in_flight", 0) > 0, c
        assert c["pieces_captured"] <= 2 < c["regions"], c  # the forward and the backward: one graph each
        assert c.get("cudagraph_fallbacks", 0) == 0 and c.get("capture_failures", 0) == 0, c
        assert c.get("replays", 0) > 0, c


# schedule_prefetch and schedule_free are on by default, so every test above runs
# them with fuse/bucket on and off; these pin the other scheduling choices.
_SCHED = {
    "off": {"passes": {"schedule_prefetch": False, "schedule_free": False}},
    "keep": {"options": {"reshard_after_forward": False, "prefetch_bytes": 4096}},
    "auto": {"options": {"reshard_after_forward": "auto", "memory_budget": 260_000, "prefetch_bytes": 0}},
    "except_last": {"options": {"reshard_after_forward": "except_last"}},
}


def test_bf16_schedule_policies_are_bitwise_equal(ranks2):
    """Resharding, keeping, keeping the last, "auto" under a budget, any prefetch cap, and both
    scheduling passes off give bitwise the same training (scheduling only moves
    and re-runs gathers; a re-gather of the fused bf16 shard is the same bits)."""
    # (the base run is the fused unbucketed one of the bf16 test above: 5 steps, one compile less)
    base = ranks2.run_once(_train_sharded, {"fuse": True, "bucket": False, "param_dtype": torch.bfloat16, "steps": 5})
    for name, extra in _SCHED.items():
        res = ranks2.run(_train_sharded, {"fuse": True, "bucket": False, "param_dtype": torch.bfloat16, "steps": 5, **extra})
        for (losses, params, _), (bl, bp, _) in zip(res, base):
            assert losses == bl, name
            for k in bp:
                torch.testing.assert_close(params[k], bp[k], rtol=0, atol=0, msg=lambda m, k=k: f"{name} {k}: {m}")
        if name == "except_last":  # one gather (the last layer's weight read first) kept, the rest resharded
            assert res[0][2]["gathers_resharded"] == base[0][2]["gathers_resharded"] - 1
    c = base[0][2]
    # schedule_free resharded; schedule_prefetch reordered the forward and the backward
    # (the CPU parameters sit on a one-worker-thread gloo group: docs/heap-corruption.md)
    assert c["gathers_resharded"] > 0 and c.get("pass:schedule_prefetch:changed", 0) == 2


def test_zero_copy_buckets_is_bitwise_the_flat_buckets(ranks2):
    """zero_copy_buckets only changes where each member of a bucket lives: bitwise the
    flat buckets' training (bf16 params with kept gathers; fp32 with resharded gathers;
    eager codegen: Inductor's lowering of the grouped collectives ran on GPUs, W1, W2
    and the HF zoo). The pass runs on CUDA graphs by default; here it is let onto the
    CPU graphs (FramePlan.zero_copy_cpu_graphs), and a default CPU run leaves them flat."""
    # (fp32: 10 steps, the flat run is test_fp32_2ranks_matches_unsharded_reference[True-True]'s, one compile less)
    for extra in ({"param_dtype": torch.bfloat16, "options": {"reshard_after_forward": False}, "steps": 2}, {}):
        on = ranks2.run(_train_sharded, {"fuse": True, "bucket": True, "zero_copy_cpu": True, **extra})
        flat = ranks2.run_once(_train_sharded, {"fuse": True, "bucket": True, **extra})
        for (losses, params, c), (fl, fp, fc) in zip(on, flat):
            assert losses == fl, extra
            for k in fp:
                torch.testing.assert_close(params[k], fp[k], rtol=0, atol=0, msg=lambda m, k=k: f"{extra} {k}: {m}")
            assert c["pass:zero_copy_buckets:changed"] == 2 and "pass:zero_copy_buckets:changed" not in fc


def test_defer_weight_grads_is_bitwise_the_original_order(ranks2):
    """defer_weight_grads only moves nodes: with everything it may move moved (the wire
    modelled slow), training is bitwise the pass-off run's (bf16 params, buckets, eager
    codegen; also the deep model captured on the stand-in device)."""
    for extra in ({}, {"model": "tiny-deep", "fake_cuda": True}):
        cfg = {"fuse": True, "bucket": True, "param_dtype": torch.bfloat16, "steps": 3, **extra}
        on = ranks2.run(_train_sharded, {**cfg, "defer_all": True})
        off = ranks2.run(_train_sharded, {**cfg, "passes": {"defer_weight_grads": False}})
        for (losses, params, c), (ol, op, oc) in zip(on, off):
            assert losses == ol, extra
            for k in op:
                torch.testing.assert_close(params[k], op[k], rtol=0, atol=0, msg=lambda m, k=k: f"{extra} {k}: {m}")
            assert c["weight_grad_nodes_deferred"] >= 10 and "weight_grad_nodes_deferred" not in oc, (extra, c)
