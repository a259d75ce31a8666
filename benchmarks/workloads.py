"""Workloads (BENCHMARKS.md), the one model every system trains, identical init, data.

Every system builds its model through :func:`build_model`: the module is created on
the ``meta`` device (no wasted random init), materialised on the target device and
initialised from a fixed seed with a generator *on that device*, so every rank and
every system starts from bit-identical fp32 weights before any sharding happens.

Data: step ``s`` draws a global batch of ``batch * world`` sequences from
``synthetic_batch(seed = seed * 1_000_003 + s)``; rank ``r`` trains on rows
``[r * batch, (r + 1) * batch)``. All batches are made before the timed loop.

The ``hf-<family>`` workloads train a Hugging Face ``transformers`` model instead
(``benchmarks/hf_models.py`` builds it, ``benchmarks/hf_adapter.py`` gives it the same
``model(tokens, targets) -> loss`` / ``model.layers`` shape); everything here dispatches
on :attr:`Workload.family`, so every system runs either model unchanged.
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

from . import hf_adapter, hf_models

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
    """graphcomp's Llama preset (``graphcomp.models.PRESETS``); for an HF workload the
    ``benchmarks.hf_models.SIZES`` size"""
    batch: int
    """micro-batch per rank (sequences)"""
    seq: int
    warmup: int
    """steps run before the measured window (the first one is the compile step)"""
    steps: int
    """measured steps (median step time is taken over these)"""
    activation_checkpointing: bool = False
    note: str = ""
    family: str | None = None
    """Hugging Face model family (``benchmarks.hf_models.FAMILIES``); None: graphcomp's Llama"""
    dropout: float | None = None
    """HF only: dropout probability of the family's dropout keys; None keeps the family's default"""
    block_fullgraph: bool = True
    """``fullgraph`` of the per-block ``torch.compile`` (fsdp2_compile); False where a block
    has data-dependent Python control flow that cannot be one graph"""

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def label(self) -> str:
        """Name used in output file names: the workload, plus the HF size when not the default."""
        if self.family is not None and self.preset != HF_DEFAULT_SIZE:
            return f"{self.name}-{self.preset}"
        return self.name


WORKLOADS: dict[str, Workload] = {
    # BENCHMARKS.md: median of steps 20..60 -> 20 warmup + 40 measured
    "W1": Workload("W1", "W1", batch=4, seq=1024, warmup=20, steps=40,
                   note="~160M, launch/host overhead, many small collectives"),
    "W2": Workload("W2", "W2", batch=4, seq=2048, warmup=20, steps=40,
                   note="~1.2B, gather/compute overlap, fused downcast, bucketing"),
    "W3": Workload("W3", "W3", batch=1, seq=8192, warmup=5, steps=15, activation_checkpointing=True,
                   note="~8B, memory; activation checkpointing per block"),
    "W3c": Workload("W3c", "W3-narrow", batch=1, seq=8192, warmup=3, steps=5, activation_checkpointing=True,
                    note="W3's 32 layers, seq 8192 and checkpointing at 1/4 width: W3's compile on 2 GPUs"),
    # CI: 2 gloo CPU ranks, seconds per system
    "smoke": Workload("smoke", "tiny", batch=2, seq=16, warmup=3, steps=3, note="CI smoke (tiny preset)"),
    # the same with a vocabulary tensor parallelism can split (--tp 2 / 4)
    "smoke-tp": Workload("smoke-tp", "tiny-tp", batch=2, seq=16, warmup=3, steps=3,
                         note="CI smoke for --tp (tiny-tp preset)"),
}

# HF workloads: one per family, issue 12's small config (8 layers, d=1024, seq 1024,
# micro-batch 4). --hf-size picks another size; its shape and step counts come from here.
HF_DEFAULT_SIZE = "small"
HF_SIZE_SHAPES: dict[str, dict[str, int]] = {
    "small": dict(batch=4, seq=1024, warmup=20, steps=40),
    "gpu-tiny": dict(batch=4, seq=256, warmup=10, steps=20),
    "tiny": dict(batch=2, seq=32, warmup=3, steps=3),  # CPU smoke
}
# transformer blocks whose Python control flow depends on data (the per-expert loop
# runs only the experts that received tokens): one graph per block is impossible
_HF_GRAPH_BREAKS = {"mixtral-eager": "per-expert loop over the experts that received tokens"}


def _hf_workloads() -> dict[str, Workload]:
    out = {}
    for fam, spec in hf_models.FAMILIES.items():
        breaks = _HF_GRAPH_BREAKS.get(fam)
        shape = dict(HF_SIZE_SHAPES[HF_DEFAULT_SIZE])
        shape["seq"] = hf_models.image_patches(fam, HF_DEFAULT_SIZE) or shape["seq"]  # images: the patch count
        out[f"hf-{fam}"] = Workload(
            f"hf-{fam}", HF_DEFAULT_SIZE, **shape, family=fam, block_fullgraph=breaks is None,
            note=f"transformers {spec.config.removesuffix('Config')} ({spec.kind})"
                 + (f"; fsdp2_compile blocks fullgraph=False: {breaks}" if breaks else ""))
    return out


WORKLOADS.update(_hf_workloads())


def get_workload(name: str, *, batch: int | None = None, seq: int | None = None, warmup: int | None = None,
                 steps: int | None = None, activation_checkpointing: bool | None = None,
                 hf_size: str | None = None, hf_dropout: float | None = None) -> Workload:
    """The workload ``name`` with the given overrides (None keeps the workload's value).
    ``hf_size`` (HF workloads only) switches the model size and, unless overridden too,
    takes that size's batch, seq and step counts from :data:`HF_SIZE_SHAPES` (an image
    family's seq is its patch count at that size); ``hf_dropout`` sets every dropout of
    the HF model."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; valid: {sorted(WORKLOADS)}")
    w = WORKLOADS[name]
    base = asdict(w)
    if w.family is None:
        if hf_size is not None or hf_dropout is not None:
            raise ValueError(f"--hf-size/--hf-dropout apply to the hf-* workloads only, not to {name!r}")
    else:
        if hf_size is not None:
            if hf_size not in HF_SIZE_SHAPES:
                raise ValueError(f"unknown --hf-size {hf_size!r}; valid: {sorted(HF_SIZE_SHAPES)}")
            base.update(preset=hf_size, **HF_SIZE_SHAPES[hf_size])
        if hf_dropout is not None:
            if not 0.0 <= hf_dropout < 1.0:
                raise ValueError(f"--hf-dropout must be in [0, 1), got {hf_dropout}")
            base["dropout"] = hf_dropout
        if activation_checkpointing:
            raise ValueError(f"--activation-checkpointing on is not supported for the HF workload {name!r} "
                             f"(its blocks take keyword arguments the checkpoint wrapper does not pass); use off")
    kw = {k: v for k, v in dict(batch=batch, seq=seq, warmup=warmup, steps=steps,
                                  activation_checkpointing=activation_checkpointing).items() if v is not None}
    patches = hf_models.image_patches(w.family, base["preset"]) if w.family is not None else None
    if patches is not None:  # an image model's sequence is its patch count, fixed by the size
        if seq is not None and seq != patches:
            raise ValueError(f"--seq {seq}: the sequence of {name} at size {base['preset']} is its "
                             f"{patches} patches per image")
        kw["seq"] = patches
    w = Workload(**{**base, **kw})
    if w.warmup < 1 or w.steps < 1:
        raise ValueError("--warmup and --steps must be >= 1 (the first warmup step is the compile step)")
    if w.batch < 1 or w.seq < 2:
        raise ValueError(f"--batch must be >= 1 and --seq >= 2, got batch={w.batch} seq={w.seq}")
    if w.family is None:
        max_seq = PRESETS[w.preset].max_seq_len
    else:
        max_seq = hf_adapter.max_positions(w.family, w.preset)
    if max_seq is not None and w.seq > max_seq:
        raise ValueError(f"seq {w.seq} > the {max_seq} positions of {w.label} ({w.preset})")
    return w


def model_config(w: Workload):
    """graphcomp's Llama config of a native workload (HF workloads: :func:`model_info`)."""
    if w.family is not None:
        raise ValueError(f"{w.name} trains a transformers model; use model_info(w)")
    return PRESETS[w.preset]


def model_info(w: Workload) -> dict:
    """The model's metadata for the result JSON: ``preset``, ``family`` (None for
    graphcomp's Llama), ``params``, ``flops_per_token`` (at ``w.seq``) and ``config``;
    HF workloads add ``hf_class``, ``size`` and ``layers`` (:func:`hf_adapter.model_info`)."""
    if w.family is not None:
        return {"preset": w.preset, **hf_adapter.model_info(w.family, w.preset, w.seq, w.dropout)}
    cfg = model_config(w)
    with torch.device("meta"):
        n_params = num_params(Llama(cfg))
    return {"preset": w.preset, "family": None, "config": asdict(cfg), "params": n_params,
            "flops_per_token": flops_per_token(cfg, w.seq)}


def compute_note(w: Workload) -> str:
    """Where the model computes in fp32 although its weights are bf16 (recorded per system)."""
    if w.family is not None:
        return "bf16 params/activations; fp32 where the transformers model upcasts (norms, the loss's logits)"
    return "bf16 params/activations; RMSNorm, RoPE and loss upcast to fp32 inside the model"


def init_note(w: Workload, device: torch.device, seed: int) -> str:
    """How the identical fp32 weights were drawn (recorded per system)."""
    if w.family is not None:
        return (f"fp32, transformers' init from torch.manual_seed({seed}) on the CPU, then moved to "
                f"{device.type}, before any wrapping")
    return f"fp32, seed {seed}, generator on {device.type}, before any wrapping"


class CheckpointedBlock(nn.Module):
    """``torch.utils.checkpoint`` (non-reentrant) around one transformer block."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x, cos, sin):
        return torch.utils.checkpoint.checkpoint(self.block, x, cos, sin, use_reentrant=False)


@torch.no_grad()
def build_model(w: Workload, device: torch.device, seed: int) -> nn.Module:
    """Full fp32 model on ``device``, identical on every rank and for every system:
    graphcomp's Llama, or for an HF workload :class:`hf_adapter.HFLM` (same
    ``model(tokens, targets) -> loss`` and ``model.layers``). Llama blocks are wrapped
    in :class:`CheckpointedBlock` when the workload asks for it."""
    if w.family is not None:
        return hf_adapter.build(w.family, w.preset, device, seed, dropout=w.dropout)
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
    """``n_steps`` (tokens, targets) pairs for this rank, already on ``device`` (HF
    workloads: ``(input_ids, labels)``, see :func:`hf_adapter.make_batches`)."""
    if w.family is not None:
        return hf_adapter.make_batches(w.family, w.preset, w.batch, w.seq, n_steps, rank, world, seed, device)
    cfg = model_config(w)
    out = []
    for s in range(n_steps):
        toks, tgts = synthetic_batch(cfg, w.batch * world, w.seq, seed=seed * 1_000_003 + s)
        lo, hi = rank * w.batch, (rank + 1) * w.batch
        out.append((toks[lo:hi].contiguous().to(device), tgts[lo:hi].contiguous().to(device)))
    return out
