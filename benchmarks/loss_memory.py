"""Estimated memory saving of pass ``chunk_lm_loss``, from graphcomp's memory model
(``graphcomp/analysis/memory.py``), without a GPU.

    python -m benchmarks.loss_memory W2 [--batch 4] [--seq 2048] [--chunk 1024,2048] [--layers N]
                                        [--kernels inductor|eager] [--return-logits]

Traces one training step (forward + backward) of the workload's Llama on the
``meta`` device (no memory is allocated, nothing is computed) with the pass off and
on, and prints each stage's estimated peak and the difference. The set-up is what
``graphcomp.shard(model, param_dtype=torch.bfloat16)`` gives on one rank, without
the collectives (which do not involve the loss): fp32 parameters cast to bf16 where
they are used, bf16 activations, the loss in fp32 (``logits.float()``). The joint
graph is traced with Inductor's decompositions, as ``codegen="inductor"`` traces
it, so ``inductor`` (Inductor's fusion and in-place reuse modelled) is the figure
the measured W2 peaks track (0.91-0.93 of it, README "Graph dumps"); ``fx`` counts
every FX value materialized (``codegen="eager"``).

The step peak is the larger of the forward and backward peaks (optimizer state
is the same with and without the pass and is left out). ``--layers`` traces fewer
transformer blocks (faster; the loss's share is unchanged).

Two substitutions make the meta trace match the CUDA one, both with the aten ops
the CPU and CUDA paths dispatch to: ``F.cross_entropy`` (pass off only; on meta
tensors its composite ``aten::nll_loss`` has no autograd formula, so the traced
backward would be empty) becomes ``log_softmax`` + ``nll_loss_forward``; and SDPA,
whose meta dispatch picks the math kernel (a ``[B, H, S, S]`` probability tensor
saved per layer), runs the flash-attention kernel, which saves what CUDA's flash
attention saves (output and log-sum-exp). The chunked loss's scratch memory is
modelled as on CUDA (its weight gradient summed by fp32-output matmuls, each
chunk's arithmetic compiled unless ``--kernels eager``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize


class _CastOnUse(nn.Module):
    """``weight -> weight.to(dtype)`` on every read (world-1 ``param_dtype`` casting)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.to(self.dtype)


def _cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: Any = None, size_average: Any = None,
                   ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                   label_smoothing: float = 0.0) -> torch.Tensor:
    assert weight is None and label_smoothing == 0.0 and reduction in ("mean", "sum")
    logp = torch.log_softmax(input, 1)
    return torch.ops.aten.nll_loss_forward(logp, target, None, {"mean": 1, "sum": 2}[reduction], ignore_index)[0]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None, dropout_p: float = 0.0,
          is_causal: bool = False, **kw: Any) -> torch.Tensor:
    assert attn_mask is None and not kw
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal)[0]


@contextlib.contextmanager
def _meta_substitutes(pass_on: bool) -> Iterator[None]:
    import torch.nn.functional as F

    saved = F.cross_entropy, F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _sdpa
    if not pass_on:
        F.cross_entropy = _cross_entropy
    try:
        yield
    finally:
        F.cross_entropy, F.scaled_dot_product_attention = saved


class _Checkpointed(nn.Module):
    """``workloads.CheckpointedBlock`` without saving the RNG state (meta tensors
    have none; the blocks draw no random numbers)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, cos, sin, use_reentrant=False, preserve_rng_state=False)


class _ReturnsLogits(nn.Module):
    """The model as a Hugging Face causal LM runs it: the loss and the logits are
    both returned (``outputs.loss``, ``outputs.logits``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.nn.functional as F

        logits = self.model(tokens)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()), logits


def _model(preset: str, layers: int | None, checkpoint: bool = False) -> nn.Module:
    from graphcomp.models import Llama, get_config

    cfg = get_config(preset)
    if layers is not None:
        cfg = replace(cfg, n_layers=layers)
    with torch.device("meta"):
        m = Llama(cfg)
    for mod in list(m.modules()):
        if isinstance(mod, (nn.Linear, nn.Embedding)) or type(mod).__name__ == "RMSNorm":
            parametrize.register_parametrization(mod, "weight", _CastOnUse(torch.bfloat16), unsafe=True)
    if checkpoint:  # the workload's per-block activation checkpointing
        for i, blk in enumerate(list(m.layers)):
            m.layers[i] = _Checkpointed(blk)
    return m


def trace(preset: str, batch: int, seq: int, chunk: int | None, layers: int | None,
          kernels: str = "inductor", checkpoint: bool = False, return_logits: bool = False) -> dict[str, Any]:
    """Stage memory estimates of one step; ``chunk=None`` runs with the pass off."""
    import graphcomp
    from graphcomp import _compat
    from graphcomp.ops import loss as loss_ops
    import graphcomp

    torch._dynamo.reset()
    graphcomp.reset()
    m = _model(preset, layers, checkpoint)
    if return_logits:
        m = _ReturnsLogits(m)
    opts: dict[str, Any] = {"codegen": "eager", "passes": {"chunk_lm_loss": chunk is not None},
                            "loss_chunk_kernels": kernels}
    if chunk is not None:
        opts["loss_chunk_tokens"] = chunk
    tok = torch.zeros((batch, seq), dtype=torch.long, device="meta")
    tgt = torch.zeros((batch, seq), dtype=torch.long, device="meta")
    orig = _compat.aot_autograd

    def with_decomps(**kw: Any) -> Any:  # trace the joint graph as codegen="inductor" does
        return orig(decompositions=_compat.inductor_decompositions(), **kw)

    _compat.aot_autograd = with_decomps
    # model CUDA's kernels: fp32-output matmuls, the compiled chunk arithmetic
    cuda_mm, _compat.has_fp32_out_addmm = _compat.has_fp32_out_addmm, lambda t: True
    cuda_chunk, loss_ops._use_compiled = loss_ops._use_compiled, lambda compiled, t: compiled
    try:
        with _meta_substitutes(chunk is not None):
            cm = torch.compile(m, backend="graphcomp", dynamic=False, options=opts)
            out = cm(tok, tgt)
            (out[0] if return_logits else out).backward()
    finally:
        _compat.aot_autograd, _compat.has_fp32_out_addmm, loss_ops._use_compiled = orig, cuda_mm, cuda_chunk
    out: dict[str, Any] = {"chunk": chunk}
    for f in graphcomp.frame_summaries():
        for stage, d in f["stages"].items():
            mem = d.get("memory") or {}
            if stage in ("fwd", "bwd") and "peak_bytes_allocated" in mem:
                out[stage] = {"fx": mem["peak_bytes_allocated"], "inductor": mem["peak_bytes_inductor"],
                              "peak_node_inductor": mem.get("peak_node_inductor"), "peak_node": mem.get("peak_node"),
                              "largest_live": mem.get("largest_live", [])[:4]}
            if stage == "dynamo":
                out["pass"] = [p for p in d["passes"] if p["name"] == "chunk_lm_loss"][0]["counts"]
    for k in ("fx", "inductor"):
        out[f"step_{k}"] = max(out["fwd"][k], out["bwd"][k])
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="benchmarks.loss_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("workload", nargs="?", default="W2")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--chunk", default="1024", help="comma list of Config.loss_chunk_tokens values to try")
    p.add_argument("--layers", type=int, help="trace this many transformer blocks (default: the preset's)")
    p.add_argument("--kernels", default="inductor", choices=("inductor", "eager"), help="Config.loss_chunk_kernels")
    p.add_argument("--activation-checkpointing", choices=("on", "off"), help="override the workload's setting")
    p.add_argument("--return-logits", action="store_true",
                   help="return the logits with the loss, as Hugging Face models do (the pass's form 2)")
    args = p.parse_args(argv)
    from . import workloads

    ac = None if args.activation_checkpointing is None else args.activation_checkpointing == "on"
    w = workloads.get_workload(args.workload, batch=args.batch, seq=args.seq, activation_checkpointing=ac)
    gib = 2**30
    ckpt = w.activation_checkpointing
    base = trace(w.preset, w.batch, w.seq, None, args.layers, checkpoint=ckpt, return_logits=args.return_logits)
    print(f"{w.name}: batch {w.batch} x seq {w.seq}, vocab {workloads.model_config(w).vocab_size}, "
          f"layers {args.layers or workloads.model_config(w).n_layers}, chunk kernels {args.kernels}, "
          f"activation checkpointing {'on' if ckpt else 'off'}{', logits returned' if args.return_logits else ''}")
    print(f"  pass off : fwd {base['fwd']['inductor'] / gib:6.2f} GiB  bwd {base['bwd']['inductor'] / gib:6.2f} GiB "
          f"(Inductor model; FX-only {base['fwd']['fx'] / gib:.2f} / {base['bwd']['fx'] / gib:.2f})")
    rows = [base]
    for c in [int(x) for x in args.chunk.split(",")]:
        r = trace(w.preset, w.batch, w.seq, c, args.layers, args.kernels, ckpt, args.return_logits)
        rows.append(r)
        print(f"  chunk {c:5d}: fwd {r['fwd']['inductor'] / gib:6.2f} GiB  bwd {r['bwd']['inductor'] / gib:6.2f} GiB "
              f"(FX-only {r['fwd']['fx'] / gib:.2f} / {r['bwd']['fx'] / gib:.2f}); step peak saved: "
              f"{(base['step_inductor'] - r['step_inductor']) / gib:.2f} GiB Inductor model, "
              f"{(base['step_fx'] - r['step_fx']) / gib:.2f} GiB FX-only")
    print("LOSS_MEMORY " + json.dumps(rows, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
