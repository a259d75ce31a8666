"""Hugging Face ``transformers`` model families as graphcomp users build them.

One place that builds every HF model the tests (``tests/cpu/models/test_hf_zoo.py``,
``tests/gpu/hf_zoo_worker.py``) and the benchmark (``--workload hf-<family>``) train,
from a small config with random init (no download), ``use_cache=False`` and SDPA
attention, as a new user would::

    model = build_model("gpt2", "tiny", seed=0)        # fp32, identical on every rank
    batch = make_batch(model, batch=2, seq=16, seed=3)  # {"input_ids", "labels"}
    loss = model(**batch).loss

Families (``FAMILIES``): decoders ``llama``, ``gpt2`` (tied head, Conv1D, dropout),
``qwen3`` (q/k norms), ``gemma`` (tied head, embedding scaled by sqrt(d)), ``mixtral``
with each experts implementation of transformers 5 (``mixtral`` = ``grouped_mm``, the
default; ``mixtral-batched_mm``; ``mixtral-eager``: the per-expert Python loop that
only runs experts that received tokens), and one encoder, ``bert`` (masked LM: a
fixed number of masked positions per sequence, so every rank's mean loss has the same
weight and the sharded gradient equals the global-batch gradient).

Sizes: ``tiny`` (CPU tests: 2 layers, d=64), ``gpu-tiny`` (2 layers, d=256),
``small`` (the issue's benchmark size: 8 layers, d=1024, vocab 32000).
``dropout=None`` keeps each family's default dropout; the parity tests pass 0.0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(layers=2, d=64, heads=4, kv=2, ffn=128, vocab=128, pos=64, experts=4),
    "gpu-tiny": dict(layers=2, d=256, heads=4, kv=2, ffn=512, vocab=1024, pos=256, experts=4),
    "small": dict(layers=8, d=1024, heads=16, kv=8, ffn=2816, vocab=32000, pos=1024, experts=8),
}


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # "causal" | "mlm"
    config: str  # transformers config class name
    extra: tuple[tuple[str, Any], ...] = ()
    dropout_keys: tuple[str, ...] = ("attention_dropout",)
    experts: str | None = None


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "causal", "LlamaConfig"),
    "gpt2": Family("gpt2", "causal", "GPT2Config", dropout_keys=("resid_pdrop", "embd_pdrop", "attn_pdrop")),
    "qwen3": Family("qwen3", "causal", "Qwen3Config"),
    "gemma": Family("gemma", "causal", "GemmaConfig"),
    "mixtral": Family("mixtral", "causal", "MixtralConfig", experts="grouped_mm"),
    "mixtral-batched_mm": Family("mixtral-batched_mm", "causal", "MixtralConfig", experts="batched_mm"),
    "mixtral-eager": Family("mixtral-eager", "causal", "MixtralConfig", experts="eager"),
    "bert": Family("bert", "mlm", "BertConfig", dropout_keys=("hidden_dropout_prob", "attention_probs_dropout_prob")),
}

MASK_PER_SEQ = 4  # bert: masked positions per sequence (a fixed count: equal weights per rank)


def _family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown HF model family {name!r}; valid: {sorted(FAMILIES)}")
    return FAMILIES[name]


def make_config(family: str, size: str = "tiny", dropout: float | None = None) -> Any:
    """The transformers config of ``family`` at ``size`` (SDPA, no KV cache)."""
    import transformers

    fam = _family(family)
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; valid: {sorted(SIZES)}")
    s = SIZES[size]
    head_dim = s["d"] // s["heads"]
    common = dict(vocab_size=s["vocab"], use_cache=False, attn_implementation="sdpa",
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if fam.config == "GPT2Config":
        kw = dict(n_embd=s["d"], n_layer=s["layers"], n_head=s["heads"], n_inner=s["ffn"], n_positions=s["pos"])
    elif fam.config == "BertConfig":
        kw = dict(hidden_size=s["d"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                  intermediate_size=s["ffn"], max_position_embeddings=s["pos"])
    else:
        kw = dict(hidden_size=s["d"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                  num_key_value_heads=s["kv"], intermediate_size=s["ffn"], max_position_embeddings=s["pos"],
                  head_dim=head_dim)
        if fam.config == "MixtralConfig":
            kw.update(num_local_experts=s["experts"], num_experts_per_tok=2, intermediate_size=s["ffn"] // 2)
    if fam.experts is not None:
        kw["experts_implementation"] = fam.experts
    if dropout is not None:
        kw.update({k: dropout for k in fam.dropout_keys})
    kw.update(dict(fam.extra))
    cfg = getattr(transformers, fam.config)(**common, **kw)
    return cfg


def build_model(family: str, size: str = "tiny", *, seed: int = 0, device: Any = "cpu",
                dropout: float | None = None, layers: int | None = None) -> torch.nn.Module:
    """fp32 model with weights drawn on the CPU from ``seed`` (identical on every rank,
    every device), then moved to ``device``; train mode. ``layers`` overrides the
    size's layer count (tests keep compiles short with one)."""
    import transformers

    cfg = make_config(family, size, dropout)
    if layers is not None:
        for key in ("num_hidden_layers", "n_layer"):
            if hasattr(cfg, key):
                setattr(cfg, key, layers)
    fam = _family(family)
    torch.manual_seed(seed)
    cls = transformers.AutoModelForMaskedLM if fam.kind == "mlm" else transformers.AutoModelForCausalLM
    model = cls.from_config(cfg, attn_implementation="sdpa")
    model.config.use_cache = False
    model = model.to(device)
    model.train()
    model.graphcomp_family = family  # make_batch reads it
    return model


TP_FAMILIES = ("llama", "qwen3")
"""Families :func:`tp_plan` has a tensor-parallel plan for (Llama-style decoders)."""


def tp_plan(model: torch.nn.Module) -> dict[str, Any]:
    """A tensor-parallel plan for ``parallelize_module(model, mesh["tp"], plan)`` of a
    Llama-style decoder (:data:`TP_FAMILIES`), as transformers' own ``base_model_tp_plan``
    lays it out: attention ``q/k/v_proj`` and MLP ``gate/up_proj`` column-wise,
    ``o_proj`` and ``down_proj`` row-wise (each rank computes its heads and hidden
    units; transformers' attention reshapes with ``-1`` heads, so it runs on the
    local ones). The embedding is row-wise (vocabulary rows split, output reduced
    over tp) and the LM head column-wise with its logits gathered (``Replicate``),
    so the loss runs unchanged; the norms stay plain (replicated) modules. Needs
    heads, key/value heads, the MLP size and the vocabulary divisible by tp, and an
    untied head."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    family = getattr(model, "graphcomp_family", None)
    if family not in TP_FAMILIES:
        raise ValueError(f"no tensor-parallel plan for HF family {family!r}; families with one: {list(TP_FAMILIES)}")
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight is emb.weight:
        raise ValueError(f"{family}: the LM head is tied to the embedding; the plan splits them differently")
    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(model.config.num_hidden_layers):
        pre = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{pre}.self_attn.{name}"] = ColwiseParallel()
        plan[f"{pre}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{pre}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"{pre}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{pre}.mlp.down_proj"] = RowwiseParallel()
    return plan


def make_batch(model_or_family: Any, batch: int, seq: int, seed: int, device: Any = "cpu") -> dict[str, torch.Tensor]:
    """``{"input_ids", "labels"}`` drawn from ``seed`` on the CPU, moved to ``device``.
    Causal LMs: labels = input_ids (the model shifts). Masked LMs: MASK_PER_SEQ
    positions per sequence are masked; other labels are -100."""
    if isinstance(model_or_family, str):
        family, vocab = model_or_family, make_config(model_or_family).vocab_size
    else:
        family, vocab = model_or_family.graphcomp_family, model_or_family.config.vocab_size
    fam = _family(family)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    if fam.kind == "causal":
        return {"input_ids": ids.to(device), "labels": ids.clone().to(device)}
    labels = torch.full_like(ids, -100)
    pos = torch.stack([torch.randperm(seq, generator=g)[:MASK_PER_SEQ] for _ in range(batch)])
    rows = torch.arange(batch).unsqueeze(1).expand_as(pos)
    labels[rows, pos] = ids[rows, pos]
    masked = ids.clone()
    masked[rows, pos] = 1  # a fixed "[MASK]"-like id
    return {"input_ids": masked.to(device), "labels": labels.to(device)}


def split_batch(b: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s rows of a global batch (contiguous blocks)."""
    n = b["input_ids"].shape[0] // world
    return {k: v[rank * n:(rank + 1) * n].contiguous() for k, v in b.items()}


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token(model: torch.nn.Module, seq: int) -> float:
    """Nominal training FLOPs per token, counted as ``graphcomp.models.flops_per_token``
    counts its Llama: 6 x the matmul weights a token passes through (every parameter of
    2+ dims outside an ``nn.Embedding``; a tied LM head counted as the matmul it is; MoE
    experts (``.experts.`` parameters) scaled by ``num_experts_per_tok /
    num_local_experts``: the experts a token is routed to) plus attention's score and
    value matmuls, ``12 L (heads x head_dim) seq``, halved for causal models."""
    cfg = model.config
    d = getattr(cfg, "hidden_size", None) or cfg.n_embd
    layers = getattr(cfg, "num_hidden_layers", None) or cfg.n_layer
    heads = getattr(cfg, "num_attention_heads", None) or cfg.n_head
    head_dim = getattr(cfg, "head_dim", None) or d // heads
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    active = getattr(cfg, "num_experts_per_tok", None)
    experts = getattr(cfg, "num_local_experts", None)
    dense = 0.0
    for name, p in model.named_parameters():  # tied parameters once
        if p.dim() < 2 or id(p) in tables:
            continue
        dense += p.numel() * (active / experts if experts and ".experts." in name else 1.0)
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and emb is not None and head.weight is emb.weight:
        dense += head.weight.numel()
    causal = FAMILIES[model.graphcomp_family].kind == "causal"
    return 6.0 * dense + 12.0 * layers * heads * head_dim * seq * (0.5 if causal else 1.0)
