"""graphcomp.fp8 on CPU: the scale arithmetic and the FP8 casts against a float64
reference (torch's float8 dtypes emulate the casts, ``torch._scaled_mm`` runs on CPU),
the FP8 linear layer's three matmuls per recipe against a float64 emulation, and the
conversion's filters and errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import graphcomp
import graphcomp.fp8
from graphcomp.fp8 import scaling
from graphcomp.fp8.linear import Float8Linear
from graphcomp.fp8.scaling import E4M3, E5M2, RECIPES, Cast


def _ref_scale(amax: float, cast: Cast) -> float:
    """fp8_max / max(amax, EPS) in float64, rounded to float32; rounded down to a power
    of two exactly (frexp) for pow2."""
    s = float(torch.tensor(cast.fp8_max / max(amax, scaling.EPS), dtype=torch.float64).to(torch.float32))
    if cast.pow2:
        m, e = math.frexp(s)  # s = m * 2**e, 0.5 <= m < 1
        s = 2.0 ** (e - 1)
    return s


def _ref_quantize(x: torch.Tensor, cast: Cast) -> tuple[torch.Tensor, torch.Tensor]:
    """The cast in float64: per scale group, the scaled values clamped and rounded to FP8
    straight from float64 (round to nearest even), and the float64 inverse scales."""
    x64 = x.double()
    a = x64.abs()
    amax = a.amax() if cast.axis == "tensor" else a.amax(dim=-1 if cast.axis == "row" else 0, keepdim=True)
    scale = amax.clone().apply_(lambda v: _ref_scale(v, cast)) if amax.dim() else torch.tensor(_ref_scale(float(amax), cast), dtype=torch.float64)
    y = (x64 * scale).clamp(-cast.fp8_max, cast.fp8_max)
    return y.to(cast.dtype), 1.0 / scale


CASTS = [Cast("tensor", E4M3), Cast("tensor", E5M2), Cast("row", E4M3, True), Cast("col", E4M3, True),
         Cast("row", E4M3), Cast("col", E5M2)]


@pytest.mark.parametrize("cast", CASTS, ids=lambda c: c.key())
def test_scales_and_casts_match_the_float64_reference(cast):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 40, generator=g) * torch.logspace(-3, 2, 40)  # columns of very different ranges
    x[3, 5] = 0.0
    data, inv = scaling.quantize(x, cast)
    ref_data, ref_inv = _ref_quantize(x, cast)
    assert data.dtype == cast.dtype and inv.dtype == torch.float32
    assert inv.shape == {"tensor": (), "row": (48, 1), "col": (1, 40)}[cast.axis]
    # the scales: bitwise the float64 arithmetic rounded to float32
    torch.testing.assert_close(inv.double(), ref_inv.to(torch.float32).double(), rtol=0, atol=0)
    # the values: a power-of-two scale multiplies exactly, so bitwise; otherwise the
    # float32 product is rounded twice (to float32, then to FP8) and may land one FP8
    # step off the single rounding of the float64 product, at a tie only
    diff = (data.float() != ref_data.float())
    if cast.pow2:
        assert not diff.any()
    else:
        assert diff.float().mean() < 1e-3
        step = (ref_data.float() - data.float()).abs()[diff]
        assert (step <= ref_data.float().abs()[diff] * 2.0 ** -(1 if cast.dtype == E5M2 else 2)).all()
    # dequantized, within half an FP8 step of x (relative 2^-4 for e4m3, 2^-3 for e5m2;
    # absolute near zero, where FP8 is subnormal)
    deq = data.double() * inv.double()
    rel = 2.0 ** -(4 if cast.dtype == E4M3 else 3)
    tiny = inv.double() * torch.finfo(cast.dtype).smallest_normal
    assert ((deq - x.double()).abs() <= rel * x.double().abs() + tiny).all()


def test_zero_huge_and_padding():
    c = Cast("tensor", E4M3)
    z = torch.zeros(4, 8)
    data, inv = scaling.quantize(z, c)
    assert torch.isfinite(inv) and (data.float() == 0).all()
    big = torch.full((2, 3), 1e30)
    data, inv = scaling.quantize(big, c)
    assert torch.isfinite(inv) and (data.float() == 448).all()
    # dim-0 shards padded with zero rows: their amaxes' max is the whole tensor's, exactly
    x = torch.randn(5, 8)
    shards = [torch.cat([x[:3]]), torch.cat([x[3:], torch.zeros(1, 8)])]
    for cast in (Cast("tensor", E4M3), Cast("col", E4M3, True)):
        agreed = torch.stack([scaling.amax(s, cast) for s in shards]).amax(0)
        assert torch.equal(agreed, scaling.amax(x, cast))
    # a row's scale is its own: the shard's rows cast alone equal the whole tensor's rows
    row = Cast("row", E4M3, True)
    full, full_inv = scaling.quantize(x, row)
    part, part_inv = scaling.quantize(shards[1], row)
    assert torch.equal(part[:2].view(torch.uint8), full[3:].view(torch.uint8)) and torch.equal(part_inv[:2], full_inv[3:])


def test_pow2_floor_is_exact_and_saturation_bounds():
    s = torch.tensor([1.0, 1.5, 3.999999, 4.0, 1e-30, 3e38])
    assert scaling.pow2_floor(s).tolist() == [1.0, 1.0, 2.0, 4.0, 2.0 ** math.floor(math.log2(1e-30)),
                                              2.0 ** 127]
    assert Cast("tensor", E4M3).saturation_bound == 464.0 and Cast("tensor", E5M2).saturation_bound == 61440.0
    assert Cast.parse(Cast("col", E5M2, True).key()) == Cast("col", E5M2, True)
    with pytest.raises(ValueError, match="valid"):
        Cast("diag", E4M3)


def test_saturation_counts_what_the_clamp_changes():
    c = Cast("tensor", E4M3)
    x = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    data, inv, scale, sat = scaling.quantize_counted(x, c)
    assert int(sat) == 0 and float(data.float().abs().max()) == 448.0  # amax lands on fp8_max
    y = scaling.scaled(torch.tensor([465.0, -500.0, 463.0, 10.0]), torch.tensor(1.0))
    assert int((y.abs() >= c.saturation_bound).sum()) == 2


def test_scaled_mm_matches_float64_matmul_of_the_dequantized_operands():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g)
    for name, r in RECIPES.items():
        a8, ai = scaling.quantize(a, r.input)
        b8, bi = scaling.quantize(b, r.weight)
        sb = bi.reshape(1, -1) if r.weight.axis == "row" else bi
        out = torch._scaled_mm(a8, b8.t(), scale_a=ai, scale_b=sb, out_dtype=torch.float32)
        ref = (a8.double() * ai.double()) @ (b8.double() * bi.double()).t()
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5, msg=name)


# ------------------------------------------------------------- the FP8 linear
def _emulated(x, w, recipe, g):
    """The recipe's forward and both backward matmuls in float64 on float64-quantized
    operands (``_ref_quantize``): what the layer must compute, up to fp32 accumulation."""
    r = RECIPES[recipe]

    def q(t, cast):
        d, inv = _ref_quantize(t, cast)
        return d.double() * inv

    out = q(x, r.input) @ q(w, r.weight).t()
    if recipe == "tensorwise":
        gq = q(g, r.grad)
        gx = gq @ q(w, r.weight)
        gw = gq.t() @ q(x, r.input)
    else:
        gx = q(g, r.grad) @ q(w, r.weight_t)
        gw = q(g, Cast("col", E4M3, True)).t() @ q(x, Cast("col", E4M3, True))
    return out, gx, gw


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_linear_three_matmuls_match_the_float64_emulation(recipe):
    torch.manual_seed(0)
    lin = nn.Linear(32, 48, bias=False)
    model = nn.Sequential(lin)
    assert graphcomp.fp8.convert(model, recipe, min_features=16) == ["0"]
    x = torch.randn(3, 6, 32, requires_grad=True)  # 18 tokens: the weight gradient's reduction pads to 32
    g = torch.randn(3, 6, 48)
    y = model(x)
    y.backward(g)
    out, gx, gw = _emulated(x.detach().reshape(-1, 32), lin.weight.detach(), recipe, g.reshape(-1, 48))
    # rowwise computes in bf16 (what _scaled_mm supports on CUDA)
    tol = dict(rtol=1e-2, atol=1e-2) if recipe == "rowwise" else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.detach().reshape(-1, 48).double(), out, **tol)
    torch.testing.assert_close(x.grad.reshape(-1, 32).double(), gx, **tol)
    torch.testing.assert_close(lin.weight.grad.double(), gw, **tol)
    st = graphcomp.fp8.stats(model)["0"]
    assert st["input_saturated"] == 0 and st["input_scale"] > 0 and st["weight_scale"] > 0


def test_linear_under_autocast_bias_and_state_dict():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16, bias=False))
    keys = list(model.state_dict())
    graphcomp.fp8.convert(model, "tensorwise", min_features=16)
    assert list(model.state_dict()) == keys  # checkpoints unchanged (fp8_stats is not persistent)
    x = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    assert isinstance(model[0], nn.Linear) and "fp8_recipe='tensorwise'" in repr(model[0])
    before = graphcomp.fp8.stats(model)["0"]["input_scale"]
    model(x * 4)
    assert graphcomp.fp8.stats(model)["0"]["input_scale"] == pytest.approx(before / 4, rel=1e-2)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)
        self.small = nn.Linear(32, 8)
        self.head = nn.Linear(32, 64, bias=False)


def test_default_filter_skips_the_head_small_and_tied_layers():
    m = _Tiny()
    assert graphcomp.fp8.convert(m, "rowwise", min_features=32) == ["up", "down"]  # small: 8 < 32; head: by name
    assert m.up.fp8_recipe == "rowwise" and type(m.head) is nn.Linear
    t = _Tiny()
    t.head.weight = t.emb.weight  # tied to the embedding: left alone whatever the filter says
    assert graphcomp.fp8.convert(t, "tensorwise", module_filter=lambda mod, fqn: True) == ["up", "down", "small"]
    with pytest.raises(ValueError, match="no layer of _Tiny converts"):
        graphcomp.fp8.convert(_Tiny(), "tensorwise")  # nothing is 2048 wide
    assert graphcomp.fp8.DEFAULT_MIN_FEATURES == 2048


def test_convert_and_shard_name_bad_values():
    with pytest.raises(ValueError, match=r"'fp16' is not an FP8 recipe; valid: 'tensorwise', 'rowwise'"):
        graphcomp.fp8.convert(_Tiny(), "fp16")
    with pytest.raises(ValueError, match=r"fp8='e4m3'; valid: None, 'tensorwise', 'rowwise'"):
        graphcomp.shard(_Tiny(), fp8="e4m3")
    m = _Tiny()
    graphcomp.fp8.convert(m, "tensorwise", min_features=32)
    with pytest.raises(ValueError, match="already holds FP8 linears"):
        graphcomp.fp8.convert(m, "tensorwise", min_features=32)

    class MyLinear(nn.Linear):
        pass

    with pytest.raises(ValueError, match="subclass of nn.Linear"):
        graphcomp.fp8.convert(nn.Sequential(MyLinear(32, 32)), "tensorwise", module_filter=lambda mod, fqn: True)
    with pytest.raises(ValueError, match="min_features"):
        graphcomp.fp8.convert(_Tiny(), "tensorwise", min_features=0)


def test_compiled_layer_carries_the_cast_marks():
    """Dynamo and AOTAutograd keep the annotations of the weight's cast (what the pass
    matches): the forward's and, rowwise, the backward's column cast."""
    from graphcomp import _compat

    seen = []

    def backend(gm, inputs):
        from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
        from torch._functorch.aot_autograd import aot_module_simplified

        def part(joint, *a, **k):
            seen.extend(m for n in joint.graph.nodes if (m := _compat.fx_annotations(n).get(scaling.ANNOTATION)))
            return min_cut_rematerialization_partition(joint, *a, **k)

        c = lambda g, i: make_boxed_func(g.forward)  # noqa: E731
        return aot_module_simplified(gm, inputs, fw_compiler=c, bw_compiler=c, partition_fn=part)

    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(32, 32, bias=False))
    graphcomp.fp8.convert(model, "rowwise", min_features=16)
    torch.compile(model, backend=backend)(torch.randn(4, 32, requires_grad=True)).sum().backward()  # (grad_x: the column cast)
    torch._dynamo.reset()
    keys = {m.rsplit("/", 1)[0] if "/" in m else m for m in seen}
    assert keys == {Cast("row", E4M3, True).key(), Cast("col", E4M3, True).key()}
    assert {m for m in seen if "/" in m} == {f"{k}/{r}" for k in keys for r in ("data", "scale")}


def test_benchmark_systems_for_fp8():
    """The harness's FP8 rows: graphcomp's variants are checked data; the torchao peer
    says why it does not run where torchao is missing; a workload with no layer wide
    enough says so instead of failing."""
    import importlib.util

    from benchmarks import external, workloads
    from benchmarks.run import expand_systems
    from benchmarks.systems import Ctx, NotRun

    names = "graphcomp-fp8_tensorwise,graphcomp-fp8_rowwise,torchao_float8_tensorwise,torchao_float8_rowwise"
    assert [n for n, _ in expand_systems(names, False)] == names.split(",")
    assert external.check_variant("graphcomp-fp8_rowwise", external.GRAPHCOMP_VARIANTS["graphcomp-fp8_rowwise"])
    with pytest.raises(ValueError, match="fp8='e4m3'; valid: 'tensorwise', 'rowwise'"):
        external.check_variant("x", {"fp8": "e4m3"})
    ctx = Ctx(workloads.get_workload("smoke"), device=torch.device("cpu"), rank=0, world=1, seed=0)
    if importlib.util.find_spec("torchao") is None:
        with pytest.raises(NotRun, match="torchao not installed"):
            external.build_torchao_float8(ctx, "tensorwise")
    with pytest.raises(NotRun, match="no FP8 layer in this workload"):
        external.build_graphcomp(ctx, external.GRAPHCOMP_VARIANTS["graphcomp-fp8_tensorwise"])


def test_shard_converts_with_the_default_filter_and_refuses_tensor_parallel(pg1):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048, bias=False), nn.Linear(2048, 64))
    graphcomp.shard(model, fp8="rowwise")
    assert isinstance(model[0], Float8Linear) and model[0].fp8_recipe == "rowwise"
    assert not isinstance(model[1], Float8Linear)  # 64 < 2048: left in high precision
    y = model(torch.randn(3, 2048))  # eager, the gathered weight cast in the layer
    assert y.shape == (3, 64) and torch.isfinite(y).all()

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    tp = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    parallelize_module(tp, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    with pytest.raises(NotImplementedError, match="FP8 linear layers with tensor parallelism"):
        graphcomp.shard(tp, mesh=mesh, dp_dim="dp", fp8="tensorwise")
    assert not any(isinstance(m, Float8Linear) for m in tp.modules())  # refused before converting
