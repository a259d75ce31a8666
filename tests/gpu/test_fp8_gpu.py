"""FP8 training on CUDA (``graphcomp.fp8``, pass ``fp8_allgather``).

* each recipe's layer (forward and both backward matmuls) against a float64 emulation of
  the recipe on CUDA's ``torch._scaled_mm``, against the same layer on CPU, and against
  torchao's float8 layer of the same recipe where torchao is installed;
* the layer compiled by Inductor against the layer eager;
* a short training run on 1 and 2 GPUs (``tests/gpu/fp8_worker.py``): bf16 against FP8
  tensorwise and rowwise with ``graphcomp.train_step`` at its defaults (CUDA graphs,
  Inductor): the FP8 losses fall like bf16's, no CUDA-graph fallback, and on 2 GPUs the
  FP8 weights cross the wire as FP8 (one amax all-reduce per graph) and the pass changes
  no loss against the FP8 run with the pass off.

Run: ``python -m pytest -q -m gpu tests/gpu/test_fp8_gpu.py`` (needs compute capability
8.9+: H100 / H200). Writes ``fp8_gpu.json`` (and the workers' JSON) to
``$GRAPHCOMP_GPU_RESULTS`` when set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
RESULTS: dict = {}


def _fp8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = pytest.mark.skipif(not _fp8_capable(), reason="needs FP8 tensor cores (compute capability 8.9+)")


def _keep(name: str, value) -> None:
    RESULTS[name] = value
    kept = os.environ.get("GRAPHCOMP_GPU_RESULTS")
    if kept:
        os.makedirs(kept, exist_ok=True)
        Path(kept, "fp8_gpu.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def _emulated(x, w, g, recipe):
    """The recipe in float64 on float64-dequantized FP8 operands (the casts by
    ``graphcomp.fp8.scaling``, exact up to the operands): out, grad_x, grad_w."""
    from graphcomp.fp8 import scaling
    from graphcomp.fp8.scaling import RECIPES, Cast

    r = RECIPES[recipe]

    def q(t, cast):
        d, inv = scaling.quantize(t, cast)
        return d.double() * inv.double()

    out = q(x, r.input) @ q(w, r.weight).t()
    if recipe == "tensorwise":
        gx, gw = q(g, r.grad) @ q(w, r.weight), q(g, r.grad).t() @ q(x, r.input)
    else:
        col = Cast("col", r.grad.dtype, True)
        gx, gw = q(g, r.grad) @ q(w, r.weight_t), q(g, col).t() @ q(x, col)
    return out, gx, gw


def _layer(recipe, device, seed=0):
    import graphcomp.fp8

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4096, 2048, bias=False)).to(device)
    graphcomp.fp8.convert(model, recipe)
    return model


def _run(model, x, g, call=None):
    """(output, grad_x, grad_w) of ``model`` (through ``call``: a compiled ``model``)."""
    x = x.clone().requires_grad_()
    y = (call or model)(x)
    y.backward(g)
    return y.detach(), x.grad, model[0].weight.grad


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@needs_fp8
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_recipe_matches_its_float64_emulation_the_cpu_layer_and_torchao(recipe):
    dev = torch.device("cuda")
    torch.manual_seed(1)
    x = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
    g = torch.randn(8192, 2048, device=dev, dtype=torch.bfloat16)
    model = _layer(recipe, dev)
    y, gx, gw = _run(model, x, g)
    assert y.dtype == gx.dtype == torch.bfloat16 and gw.dtype == torch.float32
    ref = _emulated(x.float(), model[0].weight.detach().float(), g.float(), recipe)
    errs = {k: _rel(a, r) for k, a, r in zip(("out", "grad_x", "grad_w"), (y, gx, gw), ref)}
    # what remains is the bf16 rounding of the outputs (2^-9) and the accumulation (the
    # forward's in CUDA's fast-accumulation mode)
    assert errs["out"] < 1e-2 and errs["grad_x"] < 5e-3 and errs["grad_w"] < 5e-3, errs
    cpu = _layer(recipe, "cpu")
    cpu.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    yc, gxc, gwc = _run(cpu, x.cpu(), g.cpu())
    vs_cpu = {k: _rel(a.cpu(), b) for k, a, b in zip(("out", "grad_x", "grad_w"), (y, gx, gw), (yc, gxc, gwc))}
    assert vs_cpu["out"] < 1e-2 and vs_cpu["grad_x"] < 5e-3 and vs_cpu["grad_w"] < 5e-3, vs_cpu
    out = {"vs_float64": errs, "vs_cpu": vs_cpu}
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as e:  # noqa: BLE001
        out["vs_torchao"] = f"not run: torchao not installed ({type(e).__name__})"
    else:
        torch.manual_seed(0)
        peer = nn.Sequential(nn.Linear(4096, 2048, bias=False)).to(dev)
        peer.load_state_dict(model.state_dict())
        convert_to_float8_training(peer, config=Float8LinearConfig.from_recipe_name(recipe))
        yt, gxt, gwt = _run(peer, x, g)
        vs = {k: _rel(a, b) for k, a, b in zip(("out", "grad_x", "grad_w"), (y, gx, gw), (yt, gxt, gwt))}
        out["vs_torchao"] = vs
        assert all(e < 1e-2 for e in vs.values()), vs  # (torchao rounds power-of-two scales through log2)
    print(f"FP8_RECIPE {recipe} {json.dumps(out)}")
    _keep(f"recipe_{recipe}", out)


@needs_fp8
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_inductor_compiled_layer_matches_eager(recipe):
    dev = torch.device("cuda")
    torch.manual_seed(2)
    x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    g = torch.randn(4096, 2048, device=dev, dtype=torch.bfloat16)
    model = _layer(recipe, dev)
    eager = _run(model, x, g)
    model.zero_grad(set_to_none=True)
    compiled = _run(model, x, g, call=torch.compile(model))
    errs = {k: _rel(a, b) for k, a, b in zip(("out", "grad_x", "grad_w"), compiled, eager)}
    assert all(e < 2e-3 for e in errs.values()), errs
    _keep(f"compiled_{recipe}", errs)


@needs_fp8
@pytest.mark.parametrize("ngpu", [1, 2])
def test_fp8_training_tracks_bf16_and_gathers_fp8(ngpu, tmp_path):
    if torch.cuda.device_count() < ngpu:
        pytest.skip(f"needs {ngpu} GPUs")
    import sys

    sys.path.insert(0, str(HERE))
    from _launch import torchrun_results

    res = torchrun_results(HERE / "fp8_worker.py", [str(tmp_path)], ngpu, tmp_path, stem="fp8",
                           keep=f"fp8_{ngpu}gpu", what="FP8 training", timeout=900, compile_threads=4)
    for r in res:
        bf16 = r["bf16"]
        drop = bf16["losses"][0] - sum(bf16["losses"][-5:]) / 5
        assert drop > 1.0, bf16["losses"]  # (two batches, memorized)
        for name in ("tensorwise", "rowwise"):
            run = r[name]
            d = run["losses"][0] - sum(run["losses"][-5:]) / 5
            assert d > 0.8 * drop, (name, run["losses"], bf16["losses"])
            c = run["counters"]
            assert run["fp8_layers"] == 14 and run["scales_finite"] and run["input_saturated_total"] == 0, run
            assert c.get("cudagraph_fallbacks", 0) == 0 and c.get("capture_failures", 0) == 0, c
            if ngpu > 1:  # the weights cross the wire as FP8, cast on their shards
                assert c["fp8_gathers"] >= 14 and c["fp8_amax_all_reduces"] >= 1, c
                assert run["gathered_bytes"].get("float8_e4m3fn", 0) > 0, run["gathered_bytes"]
                assert run["gathered_bytes"].get("bfloat16", 0) < bf16["gathered_bytes"]["bfloat16"]
            else:
                assert c.get("fp8_gathers", 0) == 0  # (one rank: nothing gathered)
        off = r["tensorwise_nopass"]
        assert off["counters"].get("fp8_gathers", 0) == 0
        # the pass changes the bytes, not the values: the same losses up to kernel order
        diff = max(abs(a - b) for a, b in zip(r["tensorwise"]["losses"], off["losses"]))
        assert diff < 1e-2, (r["tensorwise"]["losses"], off["losses"])
    summary = {n: {k: res[0][n][k] for k in ("step_ms_median", "peak_allocated_gib", "gathered_bytes")}
               for n in ("bf16", "tensorwise", "rowwise", "tensorwise_nopass")}
    print(f"FP8_TRAINING {ngpu}gpu {json.dumps(summary)}")
    _keep(f"training_{ngpu}gpu", {"summary": summary, "losses": {n: res[0][n]["losses"] for n in summary}})
