"""Hugging Face ``transformers`` model families as graphcomp users build them.

One place that builds every HF model the tests (``tests/cpu/models/test_hf_zoo.py``,
``tests/gpu/hf_zoo_worker.py``) and the benchmark (``--workload hf-<family>``) train,
from a small config with random init (no download), ``use_cache=False`` and SDPA
attention, as a new user would::

    model = build_model("gpt2", "tiny", seed=0)        # fp32, identical on every rank
    batch = make_batch(model, batch=2, seq=16, seed=3)  # {"input_ids", "labels"}
    loss = model(**batch).loss

Families (``FAMILIES``): decoders ``llama`` (untied head), ``gpt2`` (tied head,
Conv1D, dropout), ``qwen3`` (q/k norms), ``gemma`` (tied head, embedding scaled by
sqrt(d)), ``phi3`` (fused ``qkv_proj`` and ``gate_up_proj``), ``gpt_neox`` (parallel
residual, fused ``query_key_value``), ``olmo2`` (post-norm blocks, q/k norms),
``mistral`` (sliding-window attention: ``SIZES``' window is shorter than the
sequences), MoE decoders ``mixtral`` with each experts implementation of
transformers 5 (``mixtral`` = ``grouped_mm``, the default; ``mixtral-batched_mm``;
``mixtral-eager``: the per-expert Python loop that only runs experts that received
tokens) and ``qwen2_moe`` (a shared expert beside the routed ones; ``grouped_mm``, and
``qwen2_moe-batched_mm``); the encoder ``bert`` (masked LM: a fixed number of masked
positions per sequence, so every rank's mean loss has the same weight and the sharded
gradient equals the global-batch gradient); the encoder-decoder ``t5`` (T5 v1.0, head
tied to the shared embedding); the vision transformer ``vit`` (image classification
on ``pixel_values``). Every decoder but ``gpt2`` and ``gemma`` has an untied head.

Sizes: ``tiny`` (CPU tests: 2 layers, d=64; the families from ``t5`` on have odd row
counts there, so some dim-0 shards are uneven on 2 ranks), ``gpu-tiny`` (2 layers,
d=256), ``small`` (the issue's benchmark size: 8 layers, d=1024, vocab 32000).
``dropout=None`` keeps each family's default dropout; the parity tests pass 0.0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(layers=2, d=64, heads=4, kv=2, ffn=128, vocab=128, pos=64, experts=4,
                 window=8, image=16, patch=4, labels=10),
    "gpu-tiny": dict(layers=2, d=256, heads=4, kv=2, ffn=512, vocab=1024, pos=256, experts=4,
                     window=32, image=64, patch=8, labels=10),
    "small": dict(layers=8, d=1024, heads=16, kv=8, ffn=2816, vocab=32000, pos=1024, experts=8,
                  window=512, image=512, patch=16, labels=1000),
}
"""Per size: ``window`` is the sliding window of ``mistral`` (shorter than the sequences
the tests and benchmarks train at that size: 16 tiny, 64 gpu-tiny, 1024 small); ``image``
and ``patch`` give ``vit`` ``(image / patch)**2`` patches (16, 64, 1024), ``labels`` its
classes."""


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # "causal" | "mlm" | "seq2seq" | "image"
    config: str  # transformers config class name
    extra: tuple[tuple[str, Any], ...] = ()
    dropout_keys: tuple[str, ...] = ("attention_dropout",)
    experts: str | None = None
    tiny: tuple[tuple[str, Any], ...] = ()  # config overrides at the tiny size only (odd row counts)


# The tiny size of these families makes some dim-0 shards uneven on 2 ranks (odd row
# counts: rows padded on the last rank): an odd vocabulary (embedding and LM head).
_ODD_VOCAB = (("vocab_size", 131),)


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "causal", "LlamaConfig"),
    "gpt2": Family("gpt2", "causal", "GPT2Config", dropout_keys=("resid_pdrop", "embd_pdrop", "attn_pdrop")),
    "qwen3": Family("qwen3", "causal", "Qwen3Config"),
    "gemma": Family("gemma", "causal", "GemmaConfig"),
    "mixtral": Family("mixtral", "causal", "MixtralConfig", experts="grouped_mm"),
    "mixtral-batched_mm": Family("mixtral-batched_mm", "causal", "MixtralConfig", experts="batched_mm"),
    "mixtral-eager": Family("mixtral-eager", "causal", "MixtralConfig", experts="eager"),
    "bert": Family("bert", "mlm", "BertConfig", dropout_keys=("hidden_dropout_prob", "attention_probs_dropout_prob")),
    "t5": Family("t5", "seq2seq", "T5Config", dropout_keys=("dropout_rate",), tiny=_ODD_VOCAB),
    "phi3": Family("phi3", "causal", "Phi3Config", dropout_keys=("resid_pdrop", "embd_pdrop", "attention_dropout"),
                   tiny=_ODD_VOCAB),
    "gpt_neox": Family("gpt_neox", "causal", "GPTNeoXConfig", extra=(("use_parallel_residual", True),),
                       dropout_keys=("hidden_dropout", "attention_dropout"), tiny=_ODD_VOCAB),
    "olmo2": Family("olmo2", "causal", "Olmo2Config", tiny=_ODD_VOCAB),
    "mistral": Family("mistral", "causal", "MistralConfig", tiny=_ODD_VOCAB),
    "qwen2_moe": Family("qwen2_moe", "causal", "Qwen2MoeConfig", experts="grouped_mm", tiny=(("num_experts", 5),)),
    "qwen2_moe-batched_mm": Family("qwen2_moe-batched_mm", "causal", "Qwen2MoeConfig", experts="batched_mm",
                                   tiny=(("num_experts", 5),)),
    "vit": Family("vit", "image", "ViTConfig", dropout_keys=("hidden_dropout_prob", "attention_probs_dropout_prob"),
                  tiny=(("num_labels", 5),)),
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
    elif fam.config == "T5Config":  # T5 v1.0: ReLU FFN, relative position buckets, head tied to `shared`
        common.pop("bos_token_id")
        kw = dict(d_model=s["d"], d_kv=head_dim, d_ff=s["ffn"], num_layers=s["layers"],
                  num_decoder_layers=s["layers"], num_heads=s["heads"], decoder_start_token_id=0)
    elif fam.config == "ViTConfig":  # no vocabulary, no KV cache
        common = dict(attn_implementation="sdpa")
        kw = dict(hidden_size=s["d"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                  intermediate_size=s["ffn"], image_size=s["image"], patch_size=s["patch"], num_channels=3,
                  num_labels=s["labels"], problem_type="single_label_classification")
    elif fam.config == "GPTNeoXConfig":  # multi-head attention (no kv heads), fused query_key_value
        kw = dict(hidden_size=s["d"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                  intermediate_size=s["ffn"], max_position_embeddings=s["pos"])
    else:
        kw = dict(hidden_size=s["d"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                  num_key_value_heads=s["kv"], intermediate_size=s["ffn"], max_position_embeddings=s["pos"],
                  head_dim=head_dim)
        if fam.config == "MixtralConfig":
            kw.update(num_local_experts=s["experts"], num_experts_per_tok=2, intermediate_size=s["ffn"] // 2)
        elif fam.config == "Qwen2MoeConfig":  # every layer sparse, plus the shared expert (full ffn width)
            kw.update(num_experts=s["experts"], num_experts_per_tok=2, moe_intermediate_size=s["ffn"] // 2,
                      shared_expert_intermediate_size=s["ffn"], decoder_sparse_step=1)
        elif fam.config == "MistralConfig":
            kw.update(sliding_window=s["window"])
        elif fam.config == "Phi3Config":
            kw.update(original_max_position_embeddings=s["pos"])
    if fam.experts is not None:
        kw["experts_implementation"] = fam.experts
    if dropout is not None:
        kw.update({k: dropout for k in fam.dropout_keys})
    kw.update(dict(fam.extra))
    if size == "tiny":
        kw.update(dict(fam.tiny))
    cfg = getattr(transformers, fam.config)(**{**common, **kw})
    return cfg


def build_model(family: str, size: str = "tiny", *, seed: int = 0, device: Any = "cpu",
                dropout: float | None = None, layers: int | None = None) -> torch.nn.Module:
    """fp32 model with weights drawn on the CPU from ``seed`` (identical on every rank,
    every device), then moved to ``device``; train mode. ``layers`` overrides the
    size's layer count (tests keep compiles short with one)."""
    import transformers

    cfg = make_config(family, size, dropout)
    if layers is not None:
        for key in ("num_hidden_layers", "n_layer", "num_decoder_layers"):  # (T5: num_layers is num_hidden_layers)
            if hasattr(cfg, key):
                setattr(cfg, key, layers)
    fam = _family(family)
    torch.manual_seed(seed)
    cls = getattr(transformers, _AUTO_CLASS[fam.kind])
    model = cls.from_config(cfg, attn_implementation="sdpa")
    model.config.use_cache = False
    model = model.to(device)
    model.train()
    model.graphcomp_family = family  # make_batch reads it
    return model


_AUTO_CLASS = {"causal": "AutoModelForCausalLM", "mlm": "AutoModelForMaskedLM",
               "seq2seq": "AutoModelForSeq2SeqLM", "image": "AutoModelForImageClassification"}


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
    """One batch drawn from ``seed`` on the CPU, moved to ``device``: the model's main
    input (``input_ids``, or ``pixel_values`` for images) first, then ``labels``.

    * causal: labels = input_ids (the model shifts them).
    * mlm: MASK_PER_SEQ positions per sequence are masked; other labels are -100.
    * seq2seq: source ``input_ids`` and target ``labels``, both ``seq`` long (one source
      and one target token per position); the model shifts the labels right into its
      ``decoder_input_ids``, as it does for a user who passes labels only.
    * image: ``pixel_values`` ``[batch, channels, image, image]`` fp32 (the model casts
      them to its weights' dtype) and one class label per image; ``seq`` is not used:
      the config's image and patch sizes fix the sequence (:func:`image_patches`)."""
    if isinstance(model_or_family, str):
        family, cfg = model_or_family, make_config(model_or_family)
    else:
        family, cfg = model_or_family.graphcomp_family, model_or_family.config
    fam = _family(family)
    g = torch.Generator().manual_seed(seed)
    if fam.kind == "image":
        px = torch.randn(batch, cfg.num_channels, cfg.image_size, cfg.image_size, generator=g)
        labels = torch.randint(0, cfg.num_labels, (batch,), generator=g)
        return {"pixel_values": px.to(device), "labels": labels.to(device)}
    vocab = cfg.vocab_size
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    if fam.kind == "causal":
        return {"input_ids": ids.to(device), "labels": ids.clone().to(device)}
    if fam.kind == "seq2seq":
        tgt = torch.randint(3, vocab, (batch, seq), generator=g)
        return {"input_ids": ids.to(device), "labels": tgt.to(device)}
    labels = torch.full_like(ids, -100)
    pos = torch.stack([torch.randperm(seq, generator=g)[:MASK_PER_SEQ] for _ in range(batch)])
    rows = torch.arange(batch).unsqueeze(1).expand_as(pos)
    labels[rows, pos] = ids[rows, pos]
    masked = ids.clone()
    masked[rows, pos] = 1  # a fixed "[MASK]"-like id
    return {"input_ids": masked.to(device), "labels": labels.to(device)}


def image_patches(family: str, size: str) -> int | None:
    """The patches per image of an image family at ``size`` (its sequence length);
    None for text families."""
    if _family(family).kind != "image":
        return None
    s = SIZES[size]
    return (s["image"] // s["patch"]) ** 2


def split_batch(b: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s rows of a global batch (contiguous blocks)."""
    n = next(iter(b.values())).shape[0] // world
    return {k: v[rank * n:(rank + 1) * n].contiguous() for k, v in b.items()}


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token(model: torch.nn.Module, seq: int) -> float:
    """Nominal training FLOPs per token, counted as ``graphcomp.models.flops_per_token``
    counts its Llama: 6 x the matmul weights a token passes through (every parameter of
    2+ dims outside an ``nn.Embedding``, a ViT's class token and position table; a tied
    LM head counted as the matmul it is; MoE experts (``.experts.`` parameters) scaled by
    ``num_experts_per_tok / num_local_experts`` (``num_experts``): the experts a token is
    routed to) plus attention's score and value matmuls, ``12 L (heads x head_dim) seq``,
    halved for causal self-attention. Encoder-decoders count a source and a target
    token as one (:func:`make_batch` draws them equally long): every weight once, and
    the encoder's, the decoder's causal and its cross-attention's matmuls. Images count
    a patch as a token."""
    cfg = model.config
    d = getattr(cfg, "hidden_size", None) or cfg.n_embd
    layers = getattr(cfg, "num_hidden_layers", None) or cfg.n_layer
    heads = getattr(cfg, "num_attention_heads", None) or cfg.n_head
    head_dim = getattr(cfg, "head_dim", None) or d // heads
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    active = getattr(cfg, "num_experts_per_tok", None)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    dense = 0.0
    for name, p in model.named_parameters():  # tied parameters once
        if p.dim() < 2 or id(p) in tables or name.endswith(("cls_token", "position_embeddings")):
            continue
        dense += p.numel() * (active / experts if experts and ".experts." in name else 1.0)
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and emb is not None and head.weight is emb.weight:
        dense += head.weight.numel()
    kind = FAMILIES[model.graphcomp_family].kind
    attn = 12.0 * heads * head_dim * seq
    if kind == "seq2seq":  # encoder (full) + decoder (causal self, full cross)
        return 6.0 * dense + attn * (layers + 1.5 * cfg.num_decoder_layers)
    return 6.0 * dense + attn * layers * (0.5 if kind == "causal" else 1.0)
