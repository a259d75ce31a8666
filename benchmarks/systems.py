"""The torch-native systems: fsdp2, fsdp2_compile, ddp, ddp_compile, inductor.

Tensor parallel (``--tp N``, Llama workloads): ranks form a ``(dp, tp)`` mesh;
``fsdp2``/``fsdp2_compile`` follow torchtitan's recipe (``parallelize_module`` with
``graphcomp.models.tp_plan``, sequence and loss parallel on, then
``torch.compile`` per block, then ``fully_shard`` over ``dp``); graphcomp applies the
same plan and shards over ``dp`` (``external.py``). The other systems have no TP
recipe and do not run.

Each builder takes a :class:`Ctx` and returns a :class:`Built`: a ``step(tokens,
targets) -> loss`` closure doing one full training step, and the exact configuration
(written to the JSON). A builder that cannot run here raises :class:`NotRun` with the
reason. Every system uses the same model (``workloads.build_model``, identical fp32
weights on every rank), the same optimizer (:func:`make_optimizer`) and the same
clipping (``torch.nn.utils.clip_grad_norm_(params, 1.0)``) unless its framework
owns those (DeepSpeed, see ``external.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from . import workloads

log = logging.getLogger(__name__)

BF16 = torch.bfloat16
ADAMW = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CLIP = 1.0


class NotRun(Exception):
    """The system cannot run in this environment; ``str(e)`` is the reason."""


@dataclass
class Ctx:
    workload: workloads.Workload
    device: torch.device
    rank: int
    world: int
    seed: int
    flops_per_token: float | None = None
    """the model's FLOPs per token at the workload's seq (``workloads.model_info``)"""
    tp: int = 1
    """tensor-parallel degree (``--tp``): ranks form a (world // tp, tp) mesh ("dp", "tp")"""
    memory_cap_bytes: int | None = None
    """``--memory-cap``: the allocator's cap per GPU (graphcomp gets it as ``memory_budget``)"""


@dataclass
class Built:
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """one full training step (forward, backward, clip, optimizer, zero_grad); returns the detached loss"""
    config: dict[str, Any]
    """exact configuration of this system, as run"""
    compiles: bool = False
    """True when the first step compiles (progress line says so)"""
    keep: list = field(default_factory=list)
    """objects to drop at teardown (model, optimizer, engine)"""
    teardown: Callable[[], None] | None = None
    stats: Callable[[], dict] | None = None
    """system-specific facts read after the run (e.g. graphcomp counters)"""
    on_window: Callable[[str], None] | None = None
    """called with "start" before the first measured step and "end" after the last one
    (graphcomp snapshots its counters: what moved while the steps were timed)"""


# --------------------------------------------------------------------------- shared pieces
def make_optimizer(params, device: torch.device) -> tuple[torch.optim.Optimizer, dict]:
    """Fused AdamW where this torch supports it on ``device`` (CUDA always; CPU since
    torch 2.4), else foreach. Returns the optimizer and its recorded configuration."""
    params = list(params)
    try:
        opt = torch.optim.AdamW(params, fused=True, **ADAMW)
        impl = "fused"
    except (RuntimeError, TypeError) as e:
        log.warning("fused AdamW unavailable on %s (%s); using foreach", device, e)
        opt = torch.optim.AdamW(params, foreach=True, **ADAMW)
        impl = "foreach"
    return opt, {"optimizer": f"torch.optim.AdamW({impl})", **{k: list(v) if isinstance(v, tuple) else v
                                                               for k, v in ADAMW.items()}}


def standard_step(model: nn.Module, opt: torch.optim.Optimizer, device: torch.device, autocast: bool,
                  update: Callable[[], Any] | None = None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Forward (under autocast if asked), backward, ``update`` (default: torch's eager
    ``clip_grad_norm_(CLIP)`` + ``opt.step()``), ``zero_grad(set_to_none=True)``."""
    params = [p for p in model.parameters() if p.requires_grad]

    def eager_update() -> None:
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()

    run_update = update if update is not None else eager_update
    phases = _phase_peak_steps(device)
    calls = [0]

    def mark(what: str) -> None:
        """``BENCH_PHASE_PEAKS=N``: after each phase of the first N steps, print the
        running peak of allocated memory (a device sync each): the phase where it
        rises is where the run's peak is set (steps after the captures allocate
        nothing). The run's own peak is unaffected (nothing is reset)."""
        if calls[0] <= phases:
            torch.cuda.synchronize(device)
            print(f"[bench] phase-peak step {calls[0]} {what}: peak {torch.cuda.max_memory_allocated(device) / 2**30:.3f} "
                  f"GiB, now {torch.cuda.memory_allocated(device) / 2**30:.3f} GiB", flush=True)

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        with torch.autocast(device.type, dtype=BF16, enabled=autocast):
            loss = model(tokens, targets)
        mark("forward")
        loss.backward()
        mark("backward")
        run_update()
        mark("optimizer")
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _phase_peak_steps(device: torch.device) -> int:
    """How many first steps ``BENCH_PHASE_PEAKS`` asks to trace (0: none; CUDA only)."""
    import os

    n = os.environ.get("BENCH_PHASE_PEAKS", "0")
    if not n.isdigit():
        raise ValueError(f"BENCH_PHASE_PEAKS must be a number of steps (0 or more), got {n!r}")
    return int(n) if device.type == "cuda" else 0


# --------------------------------------------------------------------------- tensor parallel
def tp_mesh(ctx: Ctx):
    """The ``(dp, tp)`` device mesh of a ``--tp`` run (a new one per system: each
    builds and tears down its own model)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(ctx.device.type, (ctx.world // ctx.tp, ctx.tp), mesh_dim_names=("dp", "tp"))


def apply_tp(model: nn.Module, mesh) -> dict:
    """torchtitan's TP layout (``graphcomp.models.tp_plan``: sequence parallel and
    loss parallel on) on ``mesh["tp"]``; returns its description for the config."""
    from torch.distributed.tensor.parallel import parallelize_module

    from graphcomp.models import tp_plan

    parallelize_module(model, mesh["tp"], tp_plan(model, sequence_parallel=True, loss_parallel=True))
    return {"tensor_parallel": (f"parallelize_module(model, mesh['tp'] (size {mesh['tp'].size()}), "
                                "graphcomp.models.tp_plan(sequence_parallel=True, loss_parallel=True)); "
                                "the loss and its backward under loss_parallel()"),
            "mesh": {"dp": mesh["dp"].size(), "tp": mesh["tp"].size()}}


def tp_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``standard_step`` with the forward and backward under ``loss_parallel()`` (the
    logits stay vocabulary-sharded); no autocast (the systems cast by policy)."""
    from torch.distributed.tensor.parallel import loss_parallel

    params = [p for p in model.parameters() if p.requires_grad]

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with loss_parallel():
            loss = model(tokens, targets)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        return loss.to_local() if hasattr(loss, "to_local") else loss

    return step


def no_tp(ctx: Ctx, name: str) -> None:
    if ctx.tp > 1:
        raise NotRun(f"{name} has no tensor-parallel recipe here (--tp {ctx.tp}); "
                     "with --tp: graphcomp, fsdp2, fsdp2_compile")


def _common_config(ctx: Ctx) -> dict:
    w = ctx.workload
    return {"micro_batch_per_rank": w.batch, "seq_len": w.seq, "world_size": ctx.world, "tp": ctx.tp,
            "activation_checkpointing": ("torch.utils.checkpoint(use_reentrant=False) per block"
                                         if w.activation_checkpointing else None),
            "grad_clip": f"torch.nn.utils.clip_grad_norm_(params, {CLIP})",
            "init": workloads.init_note(w, ctx.device, ctx.seed)}


def _compile_blocks(model: nn.Module, fullgraph: bool = True) -> int:
    """torchtitan's recipe: ``torch.compile(block, fullgraph=True)`` per block,
    re-registered under the same name, before ``fully_shard`` (``fullgraph=False``
    only for a workload whose blocks have data-dependent control flow)."""
    n = 0
    for name, blk in list(model.layers.named_children()):
        model.layers.register_module(name, torch.compile(blk, fullgraph=fullgraph))
        n += 1
    return n


# --------------------------------------------------------------------------- FSDP2
def _fsdp2_api():
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # torch >= 2.6
    except ImportError:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def build_fsdp2(ctx: Ctx, compile_blocks: bool = False, prepare: Callable[[nn.Module], dict] | None = None,
                after_step: Callable[[nn.Module], None] | None = None) -> Built:
    """``prepare(model)``: changes the model before compile and ``fully_shard`` (a peer's
    FP8 conversion), returns what to add to the configuration; ``after_step(model)``:
    runs after each optimizer step (its precomputed FP8 scales)."""
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard, MixedPrecisionPolicy = _fsdp2_api()
    model = workloads.build_model(ctx.workload, ctx.device, ctx.seed)
    prep_cfg = prepare(model) if prepare is not None else {}
    tp_cfg: dict = {}
    if ctx.tp > 1:  # torchtitan: TP, then compile per block, then fully_shard over dp
        mesh2d = tp_mesh(ctx)
        tp_cfg = apply_tp(model, mesh2d)
    fullgraph = ctx.workload.block_fullgraph
    n_compiled = _compile_blocks(model, fullgraph) if compile_blocks else 0
    mesh = mesh2d["dp"] if ctx.tp > 1 else init_device_mesh(ctx.device.type, (ctx.world,))
    mp = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    layers = list(model.layers)
    for i, blk in enumerate(layers):
        # torchtitan: the last block is needed again at once by backward, keep it gathered
        fully_shard(blk, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt, ocfg = make_optimizer(model.parameters(), ctx.device)
    cfg = {
        **_common_config(ctx), **ocfg, **tp_cfg, **prep_cfg,
        "wrapping": (f"fully_shard(block, mesh={'mesh[dp]' if ctx.tp > 1 else '1-D mesh over all ranks'}, mp_policy, "
                     "reshard_after_forward=True except the last block) for each block; fully_shard(root)"),
        "mixed_precision": "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32); no autocast",
        "compute": workloads.compute_note(ctx.workload),
        "master_weights": "fp32 DTensor shards (dim 0)",
        "compile": (f"torch.compile(block, fullgraph={fullgraph}) for {n_compiled} blocks, before fully_shard"
                    if compile_blocks else None),
    }
    update = None
    if after_step is not None:
        params = [p for p in model.parameters() if p.requires_grad]

        def update() -> None:
            torch.nn.utils.clip_grad_norm_(params, CLIP)
            opt.step()
            after_step(model)

    step = tp_step(model, opt) if ctx.tp > 1 else standard_step(model, opt, ctx.device, autocast=False, update=update)
    return Built(step=step, config=cfg, compiles=compile_blocks, keep=[model, opt])


def build_fsdp2_compile(ctx: Ctx) -> Built:
    return build_fsdp2(ctx, compile_blocks=True)


# --------------------------------------------------------------------------- DDP / inductor
def build_ddp(ctx: Ctx, compile_model: bool = False) -> Built:
    from torch.nn.parallel import DistributedDataParallel as DDP

    no_tp(ctx, "ddp_compile" if compile_model else "ddp")
    model = workloads.build_model(ctx.workload, ctx.device, ctx.seed)
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    run = torch.compile(ddp) if compile_model else ddp
    opt, ocfg = make_optimizer(ddp.parameters(), ctx.device)
    cfg = {
        **_common_config(ctx), **ocfg,
        "wrapping": "DistributedDataParallel(model) defaults (bucket_cap_mb=25, gradient_as_bucket_view=False)",
        "mixed_precision": f"torch.autocast({ctx.device.type}, bf16) around forward+loss",
        "compute": "autocast: matmuls/SDPA in bf16, the rest as autocast decides",
        "master_weights": "fp32, replicated; fp32 gradient all-reduce",
        "compile": ("torch.compile(DDP(model)) defaults (DDPOptimizer splits graphs at bucket boundaries)"
                    if compile_model else None),
    }
    return Built(step=standard_step(run, opt, ctx.device, autocast=True), config=cfg,
                 compiles=compile_model, keep=[run, ddp, model, opt])


def build_ddp_compile(ctx: Ctx) -> Built:
    return build_ddp(ctx, compile_model=True)


def build_inductor(ctx: Ctx, prepare: Callable[[nn.Module], dict] | None = None) -> Built:
    """``prepare(model)``: as :func:`build_fsdp2`'s (a peer's FP8 conversion, before compile)."""
    no_tp(ctx, "inductor")
    if ctx.world != 1:
        raise NotRun(f"inductor is the unsharded single-process baseline (1-GPU target); "
                     f"world size is {ctx.world}: run it with --nproc-per-node 1")
    model = workloads.build_model(ctx.workload, ctx.device, ctx.seed)
    prep_cfg = prepare(model) if prepare is not None else {}
    compiled = torch.compile(model)
    opt, ocfg = make_optimizer(model.parameters(), ctx.device)
    cfg = {
        **_common_config(ctx), **ocfg, **prep_cfg,
        "wrapping": "none (single process, no sharding, no gradient communication)",
        "mixed_precision": f"torch.autocast({ctx.device.type}, bf16) around forward+loss",
        "compute": "autocast: matmuls/SDPA in bf16, the rest as autocast decides",
        "master_weights": "fp32",
        "compile": "torch.compile(model) defaults (Inductor, mode=None)",
    }
    return Built(step=standard_step(compiled, opt, ctx.device, autocast=True), config=cfg,
                 compiles=True, keep=[compiled, model, opt])


BUILDERS: dict[str, Callable[[Ctx], Built]] = {
    "fsdp2": build_fsdp2,
    "fsdp2_compile": build_fsdp2_compile,
    "ddp": build_ddp,
    "ddp_compile": build_ddp_compile,
    "inductor": build_inductor,
}


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
