"""The one cost model (graphcomp/analysis/cost_model.py)."""

import pathlib
import re

from graphcomp.analysis import cost_model

PASSES = pathlib.Path(__file__).resolve().parents[3] / "graphcomp" / "passes"


def test_rows_by_device_name():
    assert cost_model.for_device_name("NVIDIA H100 80GB HBM3").name == "H100"
    assert cost_model.for_device_name("NVIDIA H200").name == "H200"
    assert cost_model.for_device_name("NVIDIA A100-SXM4-80GB") is cost_model.REFERENCE
    assert cost_model.for_device_name(None) is cost_model.REFERENCE


def test_formulas():
    c = cost_model.DeviceCosts("x", matmul_flops_per_s=1e12, memory_bytes_per_s=1e9, launch_s=1e-6,
                               collective_bytes_per_s=1e9, collective_latency_s=1e-5)
    assert c.op_seconds(2e12, 0) == 1e-6 + 2.0  # compute-bound
    assert c.op_seconds(0, 3e9) == 1e-6 + 3.0  # memory-bound
    assert c.matmul_seconds(5e11) == 0.5
    assert c.ring_seconds(4e9, 4) == 3.0  # (W-1)/W of the input over the bus
    assert c.collective_seconds(2e9) == 1e-5 + 2.0
    assert c.with_wire(None) is c and c.with_wire(2e9).collective_bytes_per_s == 2e9


def test_no_pass_writes_a_rate_of_its_own():
    """Every time or bandwidth constant lives in the cost model: a pass that models time
    takes a DeviceCosts (``ctx.env.costs``)."""
    rate = re.compile(r"^[A-Z_]*(FLOPS|BYTES_PER_S|BPS|LATENCY|LAUNCH)[A-Z_]*\s*=", re.M)
    found = {p.name: rate.findall(p.read_text()) for p in PASSES.glob("*.py")}
    assert not {k: v for k, v in found.items() if v}, found
