"""Workloads (BENCHMARKS.md), the one model every system trains, identical init, data.

Every system builds its model through :func:`build_model`: the module is created on
the ``meta`` device (no wasted random init), materialised on the target device and
initialised from a fixed seed with a generator *on that device*, so every rank and
every system starts from bit-identical fp32 weights before any sharding happens.

Data: step ``s`` draws a global batch of ``batch * world`` sequences from
``synthetic_batch(seed = seed * 1_000_003 + s)``; rank ``r`` trains on rows
``[r * batch, (r + 1) * batch)``. All batches are made before the timed loop.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from dataclasses import asdict, dataclass
from types import ModuleType

import torch
from torch import nn

log = logging.getLogger(__name__)


def _load_models() -> ModuleType:
    """``graphcomp.models``; if the graphcomp package itself fails to import (it is
    being written while this harness runs), load ``graphcomp/models.py`` by path so
    the baselines can still run."""
    try:
        return importlib.import_module("graphcomp.models")
    except Exception as e:  # noqa: BLE001 - any import failure of the package
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "graphcomp", "models.py")
        log.warning("import graphcomp.models failed (%s); loading %s directly", e, path)
        spec = importlib.util.spec_from_file_location("_bench_graphcomp_models", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


models = _load_models()
Llama = models.Llama
PRESETS = models.PRESETS
flops_per_token = models.flops_per_token
synthetic_batch = models.synthetic_batch
num_params = models.num_params


@dataclass(frozen=True)
class Workload:
    name: str
    preset: str
    batch: int
    """micro-batch per rank (sequences)"""
    seq: int
    warmup: int
    """steps run before the measured window (the first one is the compile step)"""
    steps: int
    """measured steps (median step time is taken over these)"""
    activation_checkpointing: bool = False
    note: str = ""

    def to_json(self) -> dict:
        return asdict(self)


WORKLOADS: dict[str, Workload] = {
    # BENCHMARKS.md: median of steps 20..60 -> 20 warmup + 40 measured
    "W1": Workload("W1", "W1", batch=4, seq=1024, warmup=20, steps=40,
                   note="~160M, launch/host overhead, many small collectives"),
    "W2": Workload("W2", "W2", batch=4, seq=2048, warmup=20, steps=40,
                   note="~1.2B, gather/compute overlap, fused downcast, bucketing"),
    "W3": Workload("W3", "W3", batch=1, seq=8192, warmup=5, steps=15, activation_checkpointing=True,
                   note="~8B, memory; activation checkpointing per block"),
    # CI: 2 gloo CPU ranks, seconds per system
    "smoke": Workload("smoke", "tiny", batch=2, seq=16, warmup=3, steps=3, note="CI smoke (tiny preset)"),
}


def get_workload(name: str, *, batch: int | None = None, seq: int | None = None, warmup: int | None = None,
                 steps: int | None = None, activation_checkpointing: bool | None = None) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; valid: {sorted(WORKLOADS)}")
    w = WORKLOADS[name]
    kw = {k: v for k, v in dict(batch=batch, seq=seq, warmup=warmup, steps=steps,
                                  activation_checkpointing=activation_checkpointing).items() if v is not None}
    w = Workload(**{**asdict(w), **kw})
    if w.warmup < 1 or w.steps < 1:
        raise ValueError("--warmup and --steps must be >= 1 (the first warmup step is the compile step)")
    cfg = PRESETS[w.preset]
    if w.seq > cfg.max_seq_len:
        raise ValueError(f"seq {w.seq} > max_seq_len {cfg.max_seq_len} of preset {w.preset}")
    return w


def model_config(w: Workload):
    return PRESETS[w.preset]


class CheckpointedBlock(nn.Module):
    """``torch.utils.checkpoint`` (non-reentrant) around one transformer block."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x, cos, sin):
        return torch.utils.checkpoint.checkpoint(self.block, x, cos, sin, use_reentrant=False)


@torch.no_grad()
def build_model(w: Workload, device: torch.device, seed: int) -> nn.Module:
    """Full fp32 Llama on ``device``, identical on every rank and for every system.
    Blocks are wrapped in :class:`CheckpointedBlock` when the workload asks for it."""
    cfg = model_config(w)
    with torch.device("meta"):
        model = Llama(cfg)
    model = model.to_empty(device=device)
    model.reset_parameters(seed=seed)
    cos, sin = models.rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=device)
    model.rope_cos.copy_(cos)
    model.rope_sin.copy_(sin)
    if w.activation_checkpointing:
        for i, blk in enumerate(list(model.layers)):
            model.layers[i] = CheckpointedBlock(blk)
    return model


def blocks(model: nn.Module) -> list[nn.Module]:
    """The per-block modules (the checkpoint wrappers where present)."""
    return list(model.layers)


def make_batches(w: Workload, n_steps: int, rank: int, world: int, seed: int, device: torch.device):
    """``n_steps`` (tokens, targets) pairs for this rank, already on ``device``."""
    cfg = model_config(w)
    out = []
    for s in range(n_steps):
        toks, tgts = synthetic_batch(cfg, w.batch * world, w.seq, seed=seed * 1_000_003 + s)
        lo, hi = rank * w.batch, (rank + 1) * w.batch
        out.append((toks[lo:hi].contiguous().to(device), tgts[lo:hi].contiguous().to(device)))
    return out
