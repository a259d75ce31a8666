"""FP8 training end to end on 2 gloo ranks: the sharded, compiled tiny Llama with FP8
linear layers (``graphcomp.fp8``), its weights gathered as FP8 bytes (pass
``fp8_allgather``), trains bitwise like an unsharded eager model with the same layers
(tensorwise and rowwise); its FP8 gathers move half the bytes of the bf16 gathers they
replace, and its graphs run as captured pieces on the CPU stand-in CUDA-graph device.

The tiny Llama (one block, to keep the compiles short) is far below the default
filter's width, so the tests choose the layers (``module_filter``: the attention
projections and ``w2``); on CPU the feature counts need not be multiples of 16."""

import pytest
import torch

STEPS = 3
GLOBAL_BATCH, SEQ = 4, 16
FP8_LAYERS = ("wq", "wk", "wv", "wo", "w2")  # (w2 reads 72 features; the rest of the MLP stays, to keep compiles short)
N_LINEAR = len(FP8_LAYERS)


def _model():
    from graphcomp.models import Llama, get_config

    return Llama(get_config("tiny").with_(n_layers=1))


def _chosen(module, fqn):
    return fqn.rsplit(".", 1)[-1] in FP8_LAYERS


def _reference(recipe, world=2, steps=STEPS):
    """The unsharded model, eager, the same FP8 layers, fp32. Each step runs the ranks'
    halves of the batch one after the other (``loss / world`` each, gradients summed):
    an FP8 cast scales by its own tensor's amax, so the data-parallel run's numbers are
    those of per-rank batches, not of the whole batch at once."""
    import graphcomp.fp8
    from graphcomp.models import synthetic_batch

    torch.manual_seed(0)
    m = _model()
    graphcomp.fp8.convert(m, recipe, module_filter=_chosen)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        tok, tgt = synthetic_batch(m.cfg, GLOBAL_BATCH, SEQ, seed=step)
        total = 0.0
        for r in range(world):
            idx = torch.arange(GLOBAL_BATCH)[r::world]
            loss = m(tok[idx], tgt[idx]) / world
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in m.state_dict().items()}


def _train(rank, world, cfg):
    """One sharded run per entry of ``cfg["runs"]`` (recipe, param_dtype, pass on):
    losses, final parameters, counters and the graphs' gathered bytes by dtype."""
    import torch.distributed as dist

    import graphcomp
    import graphcomp.fp8
    import graphcomp.runtime
    from graphcomp.models import synthetic_batch
    from graphcomp.sharding.shard import full_state_dict

    if cfg.get("fake_cuda"):  # CPU graphs split and captured as CUDA ones, on the runtime's stand-in device
        from _fakecuda import fake_cuda_runtime

        with fake_cuda_runtime():
            try:
                return _train(rank, world, {**cfg, "fake_cuda": False})
            finally:
                graphcomp.runtime.teardown()
    out = []
    for recipe, param_dtype, on in cfg["runs"]:
        torch._dynamo.reset()
        graphcomp.reset()
        torch.manual_seed(0)
        m = _model()
        graphcomp.fp8.convert(m, recipe, module_filter=_chosen)
        graphcomp.shard(m, param_dtype=param_dtype)
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        cm = torch.compile(m, backend="graphcomp", options={
            "codegen": "eager", "bucket_bytes": 4096, "passes": {"fp8_allgather": on}})
        losses = []
        for step in range(cfg.get("steps", STEPS)):
            tok, tgt = synthetic_batch(m.cfg, GLOBAL_BATCH, SEQ, seed=step)
            idx = torch.arange(GLOBAL_BATCH)[rank::world]
            loss = cm(tok[idx], tgt[idx])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total) / world)
        (frame,) = graphcomp.frame_summaries()
        gathered = {"joint": next(p["counts"] for p in frame["stages"]["joint"]["passes"]
                                  if p["name"] == "fp8_allgather")}
        for st in ("fwd", "bwd"):  # bytes all-gathered per dtype, from the graphs as compiled
            gathered[st] = {}
            for c in frame["stages"][st]["collectives"]:
                if c["kind"] == "all_gather":
                    gathered[st][c["dtype"]] = gathered[st].get(c["dtype"], 0) + c["bytes"]
        out.append((losses, full_state_dict(m), dict(graphcomp.counters), gathered, graphcomp.fp8.stats(m)))
    return out


@pytest.fixture(scope="module")
def ranks2(shared_ranks2):
    return shared_ranks2.view(timeout=300)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_sharded_matches_the_unsharded_fp8_reference(ranks2, recipe):
    """fp32 master weights, each FP8 layer's weight cast on its shard and gathered as
    FP8 bytes (one amax all-reduce for all of them): bitwise the unsharded eager model's
    parameters, the losses within float summation order."""
    ref_losses, ref_params = _reference(recipe)
    for (losses, params, counters, gathered, st), in ranks2.run(_train, {"runs": [(recipe, None, True)]}):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)
        for k, v in ref_params.items():
            torch.testing.assert_close(params[k], v, rtol=0, atol=0, msg=lambda s, k=k: f"{k}: {s}")
        # rowwise: each weight gathered twice, by rows (forward) and by columns (backward)
        gathers = N_LINEAR if recipe == "tensorwise" else 2 * N_LINEAR
        assert counters["fp8_gathers"] == gathers and counters["fp8_amax_all_reduces"] == 1, counters
        assert gathered["fwd"]["float8_e4m3fn"] > 0 and gathered["bwd"]["float8_e4m3fn"] > 0
        assert len(st) == N_LINEAR and all(s["input_saturated_total"] == 0 and s["weight_scale"] > 0
                                          for s in st.values()), st


def test_fp8_gathers_move_half_the_bytes_of_bf16_and_are_captured(ranks2):
    """param_dtype=bf16: the FP8 layers' bf16 gathers become FP8 gathers of half the
    bytes, counted from the graphs: the joint graph's replaced gathers, the forward's
    gathers and the backward's re-gathers (each weight re-gathered in FP8: the
    tensorwise backward reads the forward's FP8 weight). The graphs run as CUDA graphs
    on the CPU stand-in device: split into captured pieces only, replayed, no fallback."""
    cfg = {"runs": [("tensorwise", torch.bfloat16, True)], "fake_cuda": True}
    for (losses, _, counters, gathered, _), in ranks2.run(_train, cfg):
        assert all(torch.isfinite(torch.tensor(losses)))
        assert counters["pieces_captured"] == 2 and counters["replays"] > 0, counters
        assert not any(counters.get(k) for k in ("pieces_eager", "cudagraph_fallbacks", "capture_failures"))
        joint = gathered["joint"]
        assert joint["weights_fp8"] == N_LINEAR and joint["amax_all_reduces"] == 1
        assert joint["wire_bytes_after"] * 2 == joint["wire_bytes_before"], joint
        assert gathered["fwd"]["float8_e4m3fn"] == joint["wire_bytes_after"], gathered
        assert gathered["bwd"]["float8_e4m3fn"] == joint["wire_bytes_after"], gathered
        assert "float32" not in gathered["fwd"] and counters["bytes_gathered:float8_e4m3fn"] > 0
