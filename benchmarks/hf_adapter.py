"""Hugging Face models behind the benchmark's model contract.

The harness trains every model as ``loss = model(tokens, targets)`` and finds the
transformer blocks at ``model.layers`` (per-block ``fully_shard``, per-block
``torch.compile``). :class:`HFLM` gives a ``transformers`` model (built by
:func:`benchmarks.hf_models.build_model`) that shape::

    model = HFLM(hf_models.build_model("gpt2", "small", seed=0, device="cuda"))
    loss = model(input_ids, labels)         # = hf(input_ids=..., labels=...).loss
    model.layers                            # the GPT2Block ModuleList (transformer.h)

A batch is ``(input_ids, labels)`` as :func:`benchmarks.hf_models.make_batch` draws it:
causal LMs get ``labels = input_ids`` (the model shifts them itself), the masked LM
(``bert``) gets masked ``input_ids`` and ``-100`` labels except at the masked
positions. :func:`make_batches` draws one global batch per step and gives each rank its
rows, so every system trains on the same data; :func:`model_info` is the model's
metadata for the result JSON (parameters, FLOPs per token, the config).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from . import hf_models

log = logging.getLogger(__name__)

# Where each architecture keeps its transformer blocks (first match wins).
LAYER_PATHS = ("model.layers", "transformer.h", "bert.encoder.layer")


def decoder_layers(hf: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` of ``hf``'s transformer blocks (decoder layers; BERT's
    encoder layers). Raises ``TypeError`` for a model with none of :data:`LAYER_PATHS`."""
    for path in LAYER_PATHS:
        try:
            mod = hf.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(mod, nn.ModuleList):
            return mod
    raise TypeError(f"{type(hf).__name__} has no transformer block list at any of {LAYER_PATHS}; "
                    f"add its path to benchmarks.hf_adapter.LAYER_PATHS")


class HFLM(nn.Module):
    """``forward(tokens, targets) -> loss`` around a ``transformers`` LM.

    ``tokens`` are the ``input_ids``, ``targets`` the ``labels`` (both ``[batch, seq]``
    int64); the loss is the model's own (fp32 cross-entropy over the non-``-100``
    labels, shifted for causal LMs). ``layers`` is the model's block ``ModuleList``
    itself, so replacing an entry (a compiled block) changes the model that runs."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf
        decoder_layers(hf)  # fail at construction for an unknown architecture

    @property
    def layers(self) -> nn.ModuleList:
        return decoder_layers(self.hf)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=tokens, labels=targets).loss


def build(family: str, size: str, device: torch.device | str, seed: int,
          dropout: float | None = None) -> HFLM:
    """fp32 :class:`HFLM` of ``family`` at ``size``: weights drawn on the CPU from
    ``seed`` (bit-identical on every rank and for every system), then moved to
    ``device``; train mode. ``dropout=None`` keeps the family's default dropout."""
    return HFLM(hf_models.build_model(family, size, seed=seed, device=device, dropout=dropout))


def make_batches(family: str, size: str, batch: int, seq: int, n_steps: int, rank: int, world: int,
                 seed: int, device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n_steps`` ``(input_ids, labels)`` pairs for this rank, on ``device``: step ``s``
    draws a global batch of ``batch * world`` sequences with
    ``hf_models.make_batch(seed = seed * 1_000_003 + s)`` and rank ``r`` takes rows
    ``[r * batch, (r + 1) * batch)``."""
    spec = SimpleNamespace(graphcomp_family=family, config=hf_models.make_config(family, size))
    out = []
    for s in range(n_steps):
        b = hf_models.split_batch(hf_models.make_batch(spec, batch * world, seq, seed=seed * 1_000_003 + s),
                                  rank, world)
        out.append((b["input_ids"].to(device), b["labels"].to(device)))
    return out


def max_positions(family: str, size: str) -> int | None:
    """The longest sequence the config allows (learned position tables: GPT-2, BERT;
    RoPE models report ``max_position_embeddings`` too)."""
    cfg = hf_models.make_config(family, size)
    return getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None)


def model_info(family: str, size: str, seq: int, dropout: float | None = None) -> dict[str, Any]:
    """Metadata of the model every system trains, from a copy built on ``meta``:
    ``hf_class``, ``params`` (unique parameters, tied ones once), ``flops_per_token``
    (:func:`benchmarks.hf_models.flops_per_token` at ``seq``) and ``config`` (the
    transformers config as a dict)."""
    with torch.device("meta"):
        hf = hf_models.build_model(family, size, seed=0, device="meta", dropout=dropout)
    return {"family": family, "size": size, "hf_class": type(hf).__name__,
            "params": hf_models.num_params(hf), "flops_per_token": hf_models.flops_per_token(hf, seq),
            "layers": len(decoder_layers(hf)), "config": hf.config.to_dict()}
