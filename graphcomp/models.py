"""Reference models shared by the tests, the demo and the benchmarks.

``Llama`` is a Llama-style decoder: RMSNorm, rotary position embeddings (RoPE),
SwiGLU MLP, scaled-dot-product attention with grouped-query attention (GQA), an
untied embedding and LM head. ``PRESETS`` holds the sizes the benchmarks use
(W1/W2/W3, see ``../shared/BENCHMARKS.md``) and small ones for tests and the demo.

Every system in ``benchmarks/`` builds its model from this one file, so a
comparison never measures two different models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int = 12
    ffn_dim: int = 2048
    max_seq_len: int = 1024
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def with_(self, **kw) -> "LlamaConfig":
        return replace(self, **kw)


PRESETS: dict[str, LlamaConfig] = {
    # tests: a few hundred parameters per tensor, odd sizes so dim-0 shards are uneven
    "tiny": LlamaConfig(vocab_size=131, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=72, max_seq_len=64),
    # tensor-parallel tests: "tiny" with a vocabulary divisible by 2, 4 and 8 (TP splits it)
    # regional compilation tests: "tiny" with 5 blocks (3 of them between the first and the last)
    "tiny-deep": LlamaConfig(vocab_size=131, dim=32, n_layers=5, n_heads=4, n_kv_heads=2, ffn_dim=72, max_seq_len=64),
    "tiny-tp": LlamaConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=72, max_seq_len=64),
    # `make demo`: trains in seconds on 2 CPU ranks
    "demo": LlamaConfig(vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=344, max_seq_len=128),
    # BENCHMARKS.md workloads
    "W1": LlamaConfig(vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=2048, max_seq_len=1024),
    "W2": LlamaConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, max_seq_len=2048),
    "W3": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, max_seq_len=8192),
    # W3's depth, sequence and vocabulary at a quarter of its width: the same graphs and
    # kernels to compile (cold-compile breakdown on 2 GPUs, where W3 itself does not fit)
    "W3-narrow": LlamaConfig(vocab_size=128256, dim=1024, n_layers=32, n_heads=8, n_kv_heads=2, ffn_dim=3584,
                             max_seq_len=8192),
}


def _valid_presets() -> str:
    return ", ".join(sorted(PRESETS))


def get_config(name: str) -> LlamaConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {_valid_presets()}") from None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [seq_len, head_dim // 2] in fp32."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    t = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv)
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, S, D]; rotates pairs (x[..., :D/2], x[..., D/2:])."""
    d2 = x.shape[-1] // 2
    x1, x2 = x[..., :d2].float(), x[..., d2:].float()
    c, s = cos[: x.shape[-2]], sin[: x.shape[-2]]
    out = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # heads counted from the projections (-1): under tensor parallelism each rank
        # holds n_heads / tp query heads and n_kv_heads / tp key/value heads
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Llama-style decoder. ``forward(tokens, targets=None)`` returns logits, or the
    mean cross-entropy loss (computed in fp32) when ``targets`` is given."""

    def __init__(self, cfg: LlamaConfig | str = "tiny"):
        super().__init__()
        if isinstance(cfg, str):
            cfg = get_config(cfg)
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """N(0, 0.02) weights (output projections scaled by 1/sqrt(2 * n_layers)),
        norms 1. With ``seed``, drawn from a generator on the parameters' device, so
        a 1B-8B model initializes in milliseconds on a GPU; the values depend on the
        device type. Without it, from the global RNG."""
        p0 = next(self.parameters())
        gen = None
        if seed is not None and p0.device.type != "meta":
            gen = torch.Generator(device=p0.device).manual_seed(seed)
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                s = std / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else std
                p.normal_(0.0, s, generator=gen)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tok_emb(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def tp_plan(model: "Llama", *, sequence_parallel: bool = True, loss_parallel: bool = False) -> dict[str, object]:
    """The tensor-parallel plan of :class:`Llama` for
    ``torch.distributed.tensor.parallel.parallelize_module(model, mesh["tp"], plan)``
    (torchtitan's layout): attention ``wq``/``wk``/``wv`` and MLP ``w1``/``w3``
    column-wise (each rank holds ``n_heads / tp`` heads and ``ffn_dim / tp`` hidden
    units), ``wo`` and ``w2`` row-wise (their partial sums are reduced over tp).

    ``sequence_parallel`` (default): the residual stream between blocks is sharded
    on the sequence (``Shard(1)``), so the norms run on ``seq / tp`` tokens
    (``SequenceParallel``: their weights are replicated DTensors whose gradients are
    reduced over tp) and each row-wise output is a reduce-scatter instead of an
    all-reduce; the blocks all-gather the sequence on entry. Without it the residual
    stream is replicated and the norms stay plain modules.

    The embedding is row-wise (vocabulary rows split over tp; its output is reduced
    over tp) and the head column-wise. ``loss_parallel``: the head's logits stay a
    ``Shard(-1)`` DTensor (vocabulary-sharded, never gathered), and the model's
    cross-entropy must run under ``torch.distributed.tensor.parallel.loss_parallel()``
    (forward and backward); otherwise the logits are gathered (``Replicate``).

    Requires ``n_heads``, ``n_kv_heads``, ``ffn_dim`` and ``vocab_size`` divisible by
    the tp size, and with ``sequence_parallel`` the sequence length too. Blocks are
    found by type, so a block inside a wrapper module gets its plan too.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
    )

    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, object] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "head": ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    # every Block, wherever it sits (a wrapper, e.g. an activation-checkpoint module, may hold it)
    for pre in (name for name, mod in model.named_modules() if isinstance(mod, Block)):
        plan.update({
            f"{pre}.attn.wq": ColwiseParallel(),
            f"{pre}.attn.wk": ColwiseParallel(),
            f"{pre}.attn.wv": ColwiseParallel(),
            f"{pre}.attn.wo": RowwiseParallel(output_layouts=seq),
            f"{pre}.mlp.w1": ColwiseParallel(),
            f"{pre}.mlp.w3": ColwiseParallel(),
            f"{pre}.mlp.w2": RowwiseParallel(output_layouts=seq),
        })
        if sequence_parallel:
            plan.update({
                f"{pre}.attn_norm": SequenceParallel(),
                f"{pre}.mlp_norm": SequenceParallel(),
                # x (Shard(1) DTensor from the norm) -> whole sequence; cos/sin stay plain
                f"{pre}.attn": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                f"{pre}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    return plan


class TinyMLP(nn.Module):
    """Two linears with a bias and a GELU: the smallest model with a real backward."""

    def __init__(self, dim: int = 16, hidden: int = 37, out: int = 5):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        y = self.fc2(F.gelu(self.fc1(x)))
        if target is None:
            return y
        return F.mse_loss(y, target)


class BatchNormMLP(nn.Sequential):
    """Linear, BatchNorm1d, ReLU, Linear: a model whose forward writes buffers in place
    (BatchNorm's running statistics and step count), for the tests of inputs a captured
    piece writes. ``self[1]`` is the BatchNorm."""

    def __init__(self, dim: int = 8, hidden: int = 16, out: int = 1):
        super().__init__(nn.Linear(dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, out))

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of the BatchNorm's buffers, then of every parameter."""
        return [t.clone() for t in self[1].buffers()] + [p.detach().clone() for p in self.parameters()]


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 * N (dense weights, embedding lookup excluded)
    plus attention score/value matmuls (forward 4*S*d per layer, x3 for fwd+bwd, /2 causal)."""
    n_dense = cfg.n_layers * (
        cfg.dim * cfg.n_heads * cfg.head_dim * 2
        + cfg.dim * cfg.n_kv_heads * cfg.head_dim * 2
        + 3 * cfg.dim * cfg.ffn_dim
    ) + cfg.dim * cfg.vocab_size
    attn = cfg.n_layers * 4 * seq_len * cfg.n_heads * cfg.head_dim * 3 / 2
    return 6.0 * n_dense + attn


def synthetic_batch(cfg: LlamaConfig, batch: int, seq_len: int, seed: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic synthetic tokens and next-token targets (no downloads)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    toks = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=gen)
    toks = toks.to(device) if device is not None else toks
    return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()
