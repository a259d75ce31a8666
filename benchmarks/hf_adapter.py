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
positions, the encoder-decoder (``t5``) source ``input_ids`` and target ``labels``,
the image classifier (``vit``) ``(pixel_values, labels)``. :func:`make_batches` draws
one global batch per step and gives each rank its rows, so every system trains on the
same data; :func:`model_info` is the model's metadata for the result JSON (parameters,
FLOPs per token, the config).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from . import hf_models

log = logging.getLogger(__name__)

# Where each architecture keeps its transformer blocks: every path that exists, in
# this order (an encoder-decoder has two lists: T5's encoder and decoder blocks).
LAYER_PATHS = ("model.layers", "transformer.h", "bert.encoder.layer", "gpt_neox.layers", "vit.layers",
               "encoder.block", "decoder.block")


class BlockLists:
    """The blocks of several ``nn.ModuleList``s (an encoder-decoder's encoder and
    decoder blocks) behind the calls the harness makes on ``model.layers``: iteration,
    ``len``, ``named_children`` (names ``"<list>.<index>"``) and ``register_module``,
    which replaces the block in its own list (so a compiled block is the one that runs)."""

    def __init__(self, lists: list[nn.ModuleList]):
        self.lists = lists

    def __iter__(self):
        for blocks in self.lists:
            yield from blocks

    def __len__(self) -> int:
        return sum(len(b) for b in self.lists)

    def __getitem__(self, i: int) -> nn.Module:
        return list(self)[i]

    def named_children(self):
        for j, blocks in enumerate(self.lists):
            for name, blk in blocks.named_children():
                yield f"{j}.{name}", blk

    def register_module(self, name: str, module: nn.Module) -> None:
        j, _, sub = name.partition(".")
        self.lists[int(j)].register_module(sub, module)


def decoder_layers(hf: nn.Module) -> nn.ModuleList | BlockLists:
    """The ``nn.ModuleList`` of ``hf``'s transformer blocks (decoder layers; BERT's and
    ViT's encoder layers), or for a model with several (T5) a :class:`BlockLists` of
    them. Raises ``TypeError`` for a model with none of :data:`LAYER_PATHS`."""
    found = []
    for path in LAYER_PATHS:
        try:
            mod = hf.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(mod, nn.ModuleList):
            found.append(mod)
    if len(found) == 1:
        return found[0]
    if found:
        return BlockLists(found)
    raise TypeError(f"{type(hf).__name__} has no transformer block list at any of {LAYER_PATHS}; "
                    f"add its path to benchmarks.hf_adapter.LAYER_PATHS")


class HFLM(nn.Module):
    """``forward(tokens, targets) -> loss`` around a ``transformers`` model.

    ``tokens`` are the model's main input (``input_ids`` ``[batch, seq]`` int64; an
    image model's ``pixel_values``), ``targets`` the ``labels`` (an encoder-decoder's
    target sequence; one class per image); the loss is the model's own (fp32
    cross-entropy over the non-``-100`` labels, shifted for causal LMs). ``layers`` is
    the model's block ``ModuleList`` itself (both of an encoder-decoder's, as
    :class:`BlockLists`), so replacing an entry (a compiled block) changes the model
    that runs."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf
        decoder_layers(hf)  # fail at construction for an unknown architecture
        self.input_name = hf.main_input_name  # "input_ids"; an image model's "pixel_values"

    @property
    def layers(self) -> nn.ModuleList | BlockLists:
        return decoder_layers(self.hf)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.hf(**{self.input_name: tokens}, labels=targets).loss


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
        inputs, labels = b.values()  # (the main input first: input_ids, or an image model's pixel_values)
        out.append((inputs.to(device), labels.to(device)))
    return out


def max_positions(family: str, size: str) -> int | None:
    """The longest sequence the config allows (learned position tables: GPT-2, BERT;
    RoPE models report ``max_position_embeddings`` too; an image model's sequence is its
    patch count, :func:`benchmarks.hf_models.image_patches`; None: no limit, T5's
    relative positions)."""
    patches = hf_models.image_patches(family, size)
    if patches is not None:
        return patches
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
