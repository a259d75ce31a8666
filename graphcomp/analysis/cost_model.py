"""The one cost model: how long an op, a recompute and a collective take.

Every pass that estimates time asks a :class:`DeviceCosts` (``ctx.env.costs``): remat
ranks recomputations by bytes freed per second, ``defer_weight_grads`` covers a
reduce-scatter with compute, ``schedule_free`` ranks gathers by re-gather cost per
byte held. Each rate is written once, in :data:`DEVICES`.

The rows are what large kernels reach on the device, not its data-sheet peak: dense
bf16 matmuls (the H100 of ``benchmarks/results`` measures 769 TFLOP/s), HBM bandwidth
for elementwise kernels, a kernel launch, and NCCL's bus bandwidth and latency over
NVLink within a node. H100 and H200 share the compute die and NVLink; the H200's
memory is faster.

The row follows the CUDA device the compile runs on (its name); a GPU not in the
table, and a compile without CUDA, use :data:`REFERENCE` (the H100's), so CPU runs
of the passes (tests, dry runs) decide what an H100 would. ``Config.collective_bytes_per_s``
overrides the collective bandwidth (a slower or faster wire than NVLink).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceCosts:
    name: str
    matmul_flops_per_s: float
    """Dense bf16 matmul rate of large GEMMs."""
    memory_bytes_per_s: float
    """Memory bandwidth an elementwise kernel reaches (bytes read plus written)."""
    launch_s: float
    """Fixed cost of one kernel."""
    collective_bytes_per_s: float
    """Bus bandwidth of a ring collective within a node."""
    collective_latency_s: float
    """Fixed cost of one collective."""

    def op_seconds(self, flops: float, io_bytes: float) -> float:
        """One kernel: its launch, then the slower of its flops and its bytes."""
        return self.launch_s + max(flops / self.matmul_flops_per_s, io_bytes / self.memory_bytes_per_s)

    def matmul_seconds(self, flops: float) -> float:
        """A matmul's flops at the matmul rate (no launch: it overlaps a collective)."""
        return flops / self.matmul_flops_per_s

    def ring_seconds(self, in_bytes: float, world: int) -> float:
        """A reduce-scatter (or all-gather) of ``in_bytes`` over ``world`` ranks: each
        rank moves ``(world - 1) / world`` of them, at the bus bandwidth."""
        return in_bytes * (world - 1) / world / self.collective_bytes_per_s

    def collective_seconds(self, wire_bytes: float) -> float:
        """One collective moving ``wire_bytes``: its latency plus the bytes."""
        return self.collective_latency_s + wire_bytes / self.collective_bytes_per_s

    def with_wire(self, bytes_per_s: float | None) -> DeviceCosts:
        """This row with another collective bandwidth (``Config.collective_bytes_per_s``)."""
        return self if bytes_per_s is None else dataclasses.replace(self, collective_bytes_per_s=float(bytes_per_s))


DEVICES: dict[str, DeviceCosts] = {
    "H100": DeviceCosts("H100", matmul_flops_per_s=790e12, memory_bytes_per_s=3.0e12, launch_s=3e-6,
                        collective_bytes_per_s=250e9, collective_latency_s=10e-6),
    "H200": DeviceCosts("H200", matmul_flops_per_s=790e12, memory_bytes_per_s=4.3e12, launch_s=3e-6,
                        collective_bytes_per_s=250e9, collective_latency_s=10e-6),
}
REFERENCE = DEVICES["H100"]
"""The row of a GPU not in :data:`DEVICES` and of compiles without CUDA."""


def for_device_name(name: str | None) -> DeviceCosts:
    """The row whose key appears in a CUDA device name (``"NVIDIA H100 80GB HBM3"``),
    else :data:`REFERENCE`."""
    for key, row in DEVICES.items():
        if name and key in name.upper():
            return row
    return REFERENCE


def current() -> DeviceCosts:
    """The row of this process's current CUDA device (:data:`REFERENCE` without one)."""
    import torch

    if not torch.cuda.is_available():
        return REFERENCE
    return _row_of(torch.cuda.get_device_name(torch.cuda.current_device()))


@functools.cache
def _row_of(name: str) -> DeviceCosts:
    """:func:`for_device_name`, said once per device name when it falls back."""
    row = for_device_name(name)
    if row is REFERENCE and REFERENCE.name not in name.upper():
        log.info("graphcomp: no cost-model row for %r: planning with the %s's", name, REFERENCE.name)
    return row
