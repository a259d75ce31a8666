"""Systems from other packages: graphcomp (and its per-pass ablation), DeepSpeed ZeRO-3
and DeepCompile. Written defensively: a package or API that is missing makes the
system "not run" with the reason, never a crash of the whole benchmark.

graphcomp contract (DESIGN.md)::

    graphcomp.shard(model, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = torch.compile(model, backend="graphcomp", options={...})
    opt = AdamW(model.parameters())          # built after shard()
"""

from __future__ import annotations

import logging

import torch

from . import workloads
from .systems import (
    ADAMW, BF16, CLIP, Built, Ctx, NotRun, _common_config, apply_tp, make_optimizer, no_tp, standard_step, tp_mesh,
    tp_step,
)

log = logging.getLogger(__name__)

ABLATION_PREFIX = "graphcomp-no_"
ENABLE_PREFIX = "graphcomp-with_"


# --------------------------------------------------------------------------- graphcomp
def _import_graphcomp():
    try:
        import graphcomp
    except Exception as e:  # noqa: BLE001 - any failure to import is a reason not to run
        raise NotRun(f"graphcomp not importable: {type(e).__name__}: {e}") from None
    if not callable(getattr(graphcomp, "shard", None)):
        raise NotRun("graphcomp.shard() does not exist yet (graphcomp/__init__.py exports no shard)")
    return graphcomp


def graphcomp_passes() -> tuple[dict[str, bool] | None, str | None]:
    """``({pass_name: enabled_by_default}, None)`` from ``graphcomp.compiler.pipeline``, or
    ``(None, reason)`` when that API is not there yet."""
    try:
        from graphcomp.compiler.pipeline import registered_passes
    except Exception as e:  # noqa: BLE001
        return None, f"graphcomp.compiler.pipeline.registered_passes unavailable: {type(e).__name__}: {e}"
    try:
        reg = registered_passes()
    except Exception as e:  # noqa: BLE001
        return None, f"graphcomp.compiler.pipeline.registered_passes() raised {type(e).__name__}: {e}"
    try:
        from graphcomp.compiler.pipeline import get_pass
    except Exception:  # noqa: BLE001
        get_pass = None
    items = reg.items() if isinstance(reg, dict) else [(getattr(x, "name", x), x) for x in reg]
    out: dict[str, bool] = {}
    for name, spec in items:
        name = str(name)
        default = getattr(spec, "default", None)
        if default is None and get_pass is not None:
            try:
                default = getattr(get_pass(name), "default", True)
            except Exception:  # noqa: BLE001
                default = True
        out[name] = bool(True if default is None else default)
    return out, None


def make_enable_builder(pass_name: str):
    def build(ctx: Ctx) -> Built:
        return build_graphcomp(ctx, enable=pass_name)

    return build


def ablation_systems() -> tuple[list[str], str | None]:
    """``graphcomp-no_<pass>`` for every pass on by default (switching off a pass that
    is already off measures nothing)."""
    passes, reason = graphcomp_passes()
    if passes is None:
        return [], reason
    return [ABLATION_PREFIX + p for p, on in passes.items() if on], None


def _resolve_backend(graphcomp) -> tuple[object, str]:
    try:
        from torch._dynamo import list_backends

        if "graphcomp" in list_backends(exclude_tags=()):
            return "graphcomp", 'backend="graphcomp" (entry point)'
    except Exception as e:  # noqa: BLE001
        log.warning("torch._dynamo.list_backends failed: %s", e)
    try:
        from graphcomp.compiler.backend import graphcomp_backend
    except Exception as e:  # noqa: BLE001
        raise NotRun(f'backend "graphcomp" not registered (is graphcomp pip-installed?) and '
                     f"graphcomp.compiler.backend.graphcomp_backend not importable: {type(e).__name__}: {e}") from None
    return graphcomp_backend, "backend=graphcomp.compiler.backend.graphcomp_backend (entry point not installed: pip install -e .)"


CUDAGRAPH_COUNTERS = ("cudagraph_fallbacks", "recaptures", "hazard_recaptures", "captures", "pieces_captured",
                      "pieces_eager", "capture_failures")
"""graphcomp's CUDA-graph counters: always in a graphcomp row's ``stats.counters`` (0 when
never incremented), and their change over the measured steps in ``stats.counters_measured``."""


def _counters(graphcomp) -> dict:
    """``graphcomp.counters`` as a plain dict, with every :data:`CUDAGRAPH_COUNTERS` key."""
    return {**{k: 0 for k in CUDAGRAPH_COUNTERS}, **_raw_counters(graphcomp)}


def _raw_counters(graphcomp) -> dict:
    c = getattr(graphcomp, "counters", None)
    if c is None:
        return {}
    for attr in ("as_dict", "to_dict", "snapshot"):
        fn = getattr(c, attr, None)
        if callable(fn):
            try:
                return dict(fn())
            except Exception:  # noqa: BLE001
                pass
    try:
        return {str(k): (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v))
                for k, v in dict(c).items()}
    except Exception:  # noqa: BLE001
        return {"repr": repr(c)}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor as it is)."""
    return t.to_local() if hasattr(t, "to_local") else t


def build_graphcomp(ctx: Ctx, disable: str | None = None, enable: str | None = None,
                    eager_optimizer: bool = False, whole_step: bool = False, options: dict | None = None,
                    embedding: str | None = None, fold_clip: bool | str = "auto") -> Built:
    """``eager_optimizer``: torch's eager clip + step (the ``graphcomp-eager_optimizer``
    system) instead of graphcomp's captured step (``graphcomp``, on CUDA).
    ``whole_step``: the ``graphcomp`` step (captured optimizer) through
    ``graphcomp.capture_step``, one CUDA graph per step (``graphcomp-whole_step``).
    ``options``: ``graphcomp.Config`` options over the defaults (a system that
    measures one option, e.g. ``graphcomp-inductor_memory_reorder``).
    ``embedding``: ``graphcomp.shard``'s ``embedding=`` (None: its default, ``"auto"``;
    ``graphcomp-embedding_exchange``: ``"exchange"``; the table gather is the ablation
    row ``graphcomp-no_embedding_exchange``).
    ``fold_clip``: ``graphcomp.optim.capture(..., fold_clip=...)``: ``"auto"`` (the default: the
    exact fold where the probe matches), ``True`` (``graphcomp-fold_clip``), ``False``
    (``graphcomp-clip_apart``)."""
    graphcomp = _import_graphcomp()
    options = dict(options or {})
    if enable is not None:  # graphcomp-with_<pass>: a pass that is off by default, switched on
        passes, reason = graphcomp_passes()
        if passes is None:
            raise NotRun(reason)
        if enable not in passes:
            raise NotRun(f"unknown graphcomp pass {enable!r}; registered: {sorted(passes)}")
        options["passes"] = {enable: True}
    if disable is not None:
        passes, reason = graphcomp_passes()
        if passes is None:
            raise NotRun(reason)
        if disable not in passes:
            raise NotRun(f"unknown graphcomp pass {disable!r}; registered: {sorted(passes)}")
        if not passes[disable]:
            raise NotRun(f"pass {disable!r} is off by default: nothing to ablate")
        options["passes"] = {disable: False}
    backend, backend_desc = _resolve_backend(graphcomp)
    model = workloads.build_model(ctx.workload, ctx.device, ctx.seed)
    # One rank: BENCHMARKS.md's 1-GPU target is "graphcomp (no sharding)" vs plain
    # Inductor, so the model is not sharded and the step is the inductor system's
    # (autocast bf16): the two differ only in the backend.
    sharded = ctx.world > 1
    tp_cfg: dict = {}
    if ctx.tp > 1:  # the same TP plan as fsdp2 + TP, then graphcomp shards over dp (2-D DTensors)
        mesh = tp_mesh(ctx)
        tp_cfg = apply_tp(model, mesh)
        graphcomp.shard(model, mesh=mesh, dp_dim="dp", param_dtype=BF16, reduce_dtype=torch.float32)
    elif sharded:
        try:
            kw = {} if embedding is None else {"embedding": embedding}
            graphcomp.shard(model, param_dtype=BF16, reduce_dtype=torch.float32, **kw)
        except (AttributeError, ImportError) as e:
            raise NotRun(f"graphcomp.shard() not usable yet: {type(e).__name__}: {e}") from None
    if ctx.memory_cap_bytes is not None:
        # --memory-cap: graphcomp plans (remat, reshard, prefetch) under the cap less what
        # lives outside its graphs: AdamW's two moments, the size of the fp32 shards (an
        # explicit budget is used as given; only the default budget reserves this itself)
        moments = 2 * sum(_local(p).numel() * p.element_size() for p in model.parameters())
        options["memory_budget"] = ctx.memory_cap_bytes - moments
    compiled = torch.compile(model, backend=backend, options=options)
    opt, ocfg = make_optimizer(model.parameters(), ctx.device)
    cfg = {
        **_common_config(ctx), **ocfg, **tp_cfg,
        "compile": f"torch.compile(model, {backend_desc}, options={options})",
        "graphcomp_version": getattr(graphcomp, "__version__", None),
    }
    if sharded:
        cfg.update({
            "wrapping": ("graphcomp.shard(model, mesh=mesh, dp_dim='dp', param_dtype=bf16, reduce_dtype=fp32) "
                         "after the TP plan, then torch.compile" if ctx.tp > 1 else
                         f"graphcomp.shard(model, param_dtype=bf16, reduce_dtype=fp32"
                         f"{'' if embedding is None else f', embedding={embedding!r}'}), then torch.compile"),
            "mixed_precision": "param_dtype=bf16 (gathered weights bf16), reduce_dtype=fp32; no autocast",
            "compute": workloads.compute_note(ctx.workload),
            "master_weights": "fp32 shards (optimizer built on model.parameters() after shard)",
        })
    else:
        cfg.update({
            "wrapping": "none: one rank, no sharding (BENCHMARKS.md: graphcomp (no sharding) vs plain Inductor)",
            "mixed_precision": f"torch.autocast({ctx.device.type}, bf16) around forward+loss, as the inductor system",
            "compute": "autocast: matmuls/SDPA in bf16, the rest as autocast decides",
            "master_weights": "fp32",
        })

    def teardown() -> None:
        reset = getattr(graphcomp, "reset", None)
        if callable(reset):
            reset()

    window: dict[str, dict] = {}

    def on_window(phase: str) -> None:
        window[phase] = _counters(graphcomp)

    def stats() -> dict:
        out = {"counters": _counters(graphcomp), "memory_estimate": memory_estimate(opt),
               "cuda_graphs_possible": ctx.device.type == "cuda"}
        if "start" in window and "end" in window:
            out["counters_measured"] = counters_delta(window["start"], window["end"])
        return out

    capture = getattr(getattr(graphcomp, "optim", None), "capture", None)
    captured = None  # graphcomp.optim.capture's step, when the system uses it
    if ctx.tp > 1:
        step = tp_step(compiled, opt)
        cfg["optimizer_step"] = "eager clip_grad_norm_ + opt.step() (tensor parallel: captured step not measured)"
    elif eager_optimizer or capture is None:
        step = standard_step(compiled, opt, ctx.device, autocast=not sharded)
        cfg["optimizer_step"] = "eager clip_grad_norm_ + opt.step(), zero_grad(set_to_none=True)"
    else:
        # the captured backward writes the next gradients to the same pool memory, where the
        # captured step reads them, as long as zero_grad sets them to None (set_to_none=False
        # keeps param.grad: autograd adds into it and the runner copies every gradient out of
        # the pool per step; measured on W1, 1 GPU: 536 MB per step, +1.46 GiB peak)
        captured = capture(opt, max_norm=CLIP, fold_clip=fold_clip)
        step = standard_step(compiled, opt, ctx.device, autocast=not sharded, update=captured)
        cfg["optimizer_step"] = (f"graphcomp.optim.capture(opt, max_norm={CLIP}, fold_clip={fold_clip!r}) "
                                 "(clip + step as one CUDA graph; torch's eager clip + step without CUDA), "
                                 "zero_grad(set_to_none=True)")
    whole = None  # graphcomp.capture_step's step, when the system uses it
    if whole_step:
        capture_step = getattr(graphcomp, "capture_step", None)
        if capture_step is None or captured is None:
            raise NotRun("graphcomp.capture_step needs this graphcomp's capture_step and the captured optimizer "
                         "(one rank or more, no --tp)")
        whole = capture_step(step, params=[p for p in model.parameters() if p.requires_grad], optimizers=[captured])
        step = whole
        cfg["optimizer_step"] += "; the whole step (forward, backward, clip + step, zero_grad) through " \
                                 "graphcomp.capture_step (one CUDA graph per step after 2 warm-up steps)"
    base_stats = stats

    def stats() -> dict:  # noqa: F811 - adds the captured step's own record
        out = base_stats()
        if captured is not None:
            captured.sync_counters()
            record = captured.stats()
            out["optimizer"] = {**record, "decisions": record["decisions"][-3:]}
        if whole is not None:
            record = whole.stats()
            out["whole_step"] = {**record, "decisions": record["decisions"][-3:]}
        return out

    return Built(step=step, config=cfg, compiles=True,
                 keep=[compiled, model, opt], teardown=teardown, stats=stats, on_window=on_window)


def counters_delta(start: dict, end: dict) -> dict:
    """How much each numeric counter moved between two snapshots: every
    :data:`CUDAGRAPH_COUNTERS` key, plus any other counter that changed."""
    keys = list(CUDAGRAPH_COUNTERS) + sorted(k for k in end if k not in CUDAGRAPH_COUNTERS)
    out = {}
    for k in keys:
        a, b = start.get(k, 0), end.get(k, 0)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and (k in CUDAGRAPH_COUNTERS or a != b):
            out[k] = b - a
    return out


def memory_estimate(opt: torch.optim.Optimizer, codegen: str = "inductor") -> dict:
    """graphcomp's static memory model for one training step (issue 5's "measured vs
    estimated peak"): the largest per-stage peak of the compiled graphs (graph inputs,
    i.e. parameter shards and saved activations, included), plus what no graph holds:
    the optimizer state. Gradients are graph outputs, counted in the backward peak.
    With ``codegen="inductor"`` the stage peaks model Inductor's fusion and in-place
    reuse (``peak_bytes_inductor``); ``estimated_step_peak_bytes_unfused`` is the same
    sum with every FX value materialized (what ``codegen="eager"`` allocates)."""
    import graphcomp
    from graphcomp.analysis import memory

    peaks: dict[str, int] = {}
    unfused: dict[str, int] = {}
    for f in graphcomp.frame_summaries():
        for stage, d in f.get("stages", {}).items():
            mem = d.get("memory") or {}
            flat = memory.allocated_peak(mem, "eager")  # what max_memory_allocated counts, unfused
            pk = memory.allocated_peak(mem, codegen)
            if stage in ("fwd", "bwd") and isinstance(pk, int):
                peaks[stage] = max(peaks.get(stage, 0), pk)
                unfused[stage] = max(unfused.get(stage, 0), flat)

    state_bytes = sum(_local(t).numel() * t.element_size() for st in opt.state.values() for t in st.values()
                      if isinstance(t, torch.Tensor) and t.device.type != "cpu")
    out = {"stage_peak_bytes": peaks, "optimizer_state_bytes": state_bytes, "codegen": codegen}
    if peaks:
        out["estimated_step_peak_bytes"] = max(peaks.values()) + state_bytes
        out["estimated_step_peak_bytes_unfused"] = max(unfused.values()) + state_bytes
    return out


def build_graphcomp_eager_optimizer(ctx: Ctx) -> Built:
    return build_graphcomp(ctx, eager_optimizer=True)


def build_graphcomp_whole_step(ctx: Ctx) -> Built:
    return build_graphcomp(ctx, whole_step=True)


def build_graphcomp_except_last(ctx: Ctx) -> Built:
    """graphcomp with ``reshard_after_forward="except_last"``: the gather the backward
    reads first (the last block's) is kept from the forward instead of re-gathered."""
    return build_graphcomp(ctx, options={"reshard_after_forward": "except_last"})


def build_graphcomp_inductor_memory_reorder(ctx: Ctx) -> Built:
    """graphcomp with Inductor's reorder_for_peak_memory allowed on its scheduled
    graphs (``Config.inductor_memory_reorder=True``; the default keeps graphcomp's order)."""
    return build_graphcomp(ctx, options={"inductor_memory_reorder": True})


def build_graphcomp_embedding_exchange(ctx: Ctx) -> Built:
    """graphcomp with ``shard(model, embedding="exchange")``: the input embedding's
    compiled lookups exchange tokens and rows instead of gathering the table."""
    if ctx.tp > 1:
        raise NotRun("embedding='exchange' applies to 1-D sharding only (--tp 1)")
    return build_graphcomp(ctx, embedding="exchange")


def _with_fold_clip(ctx: Ctx, fold_clip: bool) -> Built:
    """graphcomp with ``graphcomp.optim.capture(..., fold_clip=fold_clip)``: an option of
    the captured optimizer, which only CUDA runs without ``--tp`` use."""
    if ctx.device.type != "cuda":
        raise NotRun("fold_clip is an option of the captured optimizer (CUDA)")
    if ctx.tp > 1:
        raise NotRun("fold_clip is an option of the captured optimizer, which --tp runs do not use")
    return build_graphcomp(ctx, fold_clip=fold_clip)


def build_graphcomp_fold_clip(ctx: Ctx) -> Built:
    """graphcomp with ``graphcomp.optim.capture(opt, max_norm=..., fold_clip=True)``: the
    clip coefficient applied inside fused AdamW (its grad_scale), no separate pass
    multiplying every gradient."""
    return _with_fold_clip(ctx, True)


def build_graphcomp_clip_apart(ctx: Ctx) -> Built:
    """graphcomp with ``graphcomp.optim.capture(opt, max_norm=..., fold_clip=False)``: the
    clip as its own pass over the gradients (the ablation row of the exact clip fold,
    ``fold_clip="auto"``)."""
    return _with_fold_clip(ctx, False)


def build_graphcomp_exchange_fold_clip(ctx: Ctx) -> Built:
    """``graphcomp-embedding_exchange`` and ``graphcomp-fold_clip`` together: the two
    opt-in step-time options of a language model on 1-D sharding."""
    if ctx.device.type != "cuda":
        raise NotRun("fold_clip needs the captured optimizer's fused AdamW (CUDA)")
    if ctx.tp > 1:
        raise NotRun("embedding='exchange' and fold_clip apply to 1-D sharding only (--tp 1)")
    return build_graphcomp(ctx, embedding="exchange", fold_clip=True)


def build_graphcomp_guard_filter(ctx: Ctx) -> Built:
    """graphcomp with ``options={"guard_filter_fn": graphcomp.guard_filter}``: Dynamo's
    per-call spec guards on the sharded parameters dropped (host time per call)."""
    return build_graphcomp(ctx, options={"guard_filter_fn": _import_graphcomp().guard_filter})


def build_graphcomp_keep_params(ctx: Ctx) -> Built:
    """graphcomp with ``reshard_after_forward=False``: every gathered parameter is kept
    from the forward to the backward (no re-gather, no second cast and unpack), the
    memory-for-speed end of ``schedule_free``."""
    return build_graphcomp(ctx, options={"reshard_after_forward": False})


def build_graphcomp_reshard_all(ctx: Ctx) -> Built:
    """graphcomp with ``reshard_after_forward=True`` (the default before 2026-11-26's
    "auto"): every gathered parameter resharded after the forward, least memory."""
    return build_graphcomp(ctx, options={"reshard_after_forward": True})


def build_graphcomp_exchange_keep(ctx: Ctx) -> Built:
    """``graphcomp-embedding_exchange`` and ``graphcomp-keep_params`` together."""
    if ctx.tp > 1:
        raise NotRun("embedding='exchange' applies to 1-D sharding only (--tp 1)")
    return build_graphcomp(ctx, embedding="exchange", options={"reshard_after_forward": False})


def build_graphcomp_remat_auto(ctx: Ctx) -> Built:
    """graphcomp with ``remat="auto"``: the user's activation checkpointing (W3's per
    block) is a candidate, not an order; under the memory budget graphcomp saves
    the activations that fit (before keeping gathered parameters) and recomputes
    the rest."""
    return build_graphcomp(ctx, options={"remat": "auto"})


def build_graphcomp_remat_auto_gather(ctx: Ctx) -> Built:
    """``graphcomp-remat_auto`` with the input embedding's table gathered
    (``shard(..., embedding="gather")``): the table-gather row for workloads that run
    ``remat="auto"`` (W3), as ``graphcomp-no_embedding_exchange`` is for the defaults."""
    if ctx.tp > 1:
        raise NotRun("embedding= applies to 1-D sharding only (--tp 1)")
    return build_graphcomp(ctx, options={"remat": "auto"}, embedding="gather")


def build_graphcomp_bucket256(ctx: Ctx) -> Built:
    """graphcomp with ``bucket_bytes`` at 256 MiB (default 64): fewer, larger buckets.
    On W2 the default cuts each block's fp32 gradients (about 360 MB) into four or five
    reduce-scatters, 67 per step against fsdp2_compile's 17, and they took 1.3x its
    reduce-scatter time (2 H200s, fourteenth session's traces)."""
    return build_graphcomp(ctx, options={"bucket_bytes": 256 * 2**20})


def build_graphcomp_wire150(ctx: Ctx) -> Built:
    """graphcomp with ``collective_bytes_per_s`` at 150e9 (default 250e9):
    ``defer_weight_grads`` models the wire slower and moves more weight-gradient
    compute behind the last reduce-scatter."""
    return build_graphcomp(ctx, options={"collective_bytes_per_s": 150e9})


def build_graphcomp_rs256(ctx: Ctx) -> Built:
    """graphcomp with ``reduce_bucket_bytes`` at 256 MiB: the gathers keep the default
    64 MiB buckets, the gradient reduce-scatters are packed into up to 256 MiB."""
    return build_graphcomp(ctx, options={"reduce_bucket_bytes": 256 * 2**20})


def build_graphcomp_rs512(ctx: Ctx) -> Built:
    """graphcomp with ``reduce_bucket_bytes`` at 512 MiB (gathers at the default 64 MiB):
    about one reduce-scatter per block of W2 and more."""
    return build_graphcomp(ctx, options={"reduce_bucket_bytes": 512 * 2**20})


def build_graphcomp_remat_auto_rs256(ctx: Ctx) -> Built:
    """``graphcomp-remat_auto`` with ``reduce_bucket_bytes`` at 256 MiB (W3: a block's fp32
    gradients, about 870 MB, go in 4 reduce-scatters instead of 14)."""
    return build_graphcomp(ctx, options={"remat": "auto", "reduce_bucket_bytes": 256 * 2**20})


def build_graphcomp_compile_regions(ctx: Ctx) -> Built:
    """graphcomp with ``compile_regions=True``: the forward and backward graphs cut
    into regions (one per block in a sharded transformer) and each distinct region
    compiled once (cold compile of deep models)."""
    return build_graphcomp(ctx, options={"compile_regions": True})


def build_graphcomp_whole_graph(ctx: Ctx) -> Built:
    """graphcomp with ``compile_regions=False``: every stage graph compiled whole, as
    before ``"auto"`` became the default (the A/B of regional compilation on deep
    models, where ``"auto"`` cuts regions)."""
    return build_graphcomp(ctx, options={"compile_regions": False})


def build_graphcomp_remat_auto_whole_graph(ctx: Ctx) -> Built:
    """``graphcomp-remat_auto`` with every graph compiled whole (``compile_regions=False``):
    W3's fastest configuration as measured before regions became the default."""
    return build_graphcomp(ctx, options={"remat": "auto", "compile_regions": False})


def build_graphcomp_fusion_inductor(ctx: Ctx) -> Built:
    """graphcomp with ``inductor_fusion_search="inductor"``: Inductor's own fusion
    search (pairs with the next 64 readers of a buffer, loop reordering on) instead
    of graphcomp's default "fast" one (the A/B of that option: cold compile, step)."""
    return build_graphcomp(ctx, options={"inductor_fusion_search": "inductor"})


def build_graphcomp_whole_step_flat_buckets(ctx: Ctx) -> Built:
    """``graphcomp-whole_step`` with ``zero_copy_buckets`` off: its buckets gathered
    into one flat buffer and copied out, gradients packed into one (W1's A/B of that
    pass, whose default row is host-bound)."""
    return build_graphcomp(ctx, whole_step=True, disable="zero_copy_buckets")


def make_ablation_builder(pass_name: str):
    def build(ctx: Ctx) -> Built:
        return build_graphcomp(ctx, disable=pass_name)

    return build


# --------------------------------------------------------------------------- DeepSpeed
def deepspeed_config(ctx: Ctx, deepcompile: bool) -> dict:
    """The exact DeepSpeed config (also printed in benchmarks/README.md). ZeRO-3 values
    are DeepSpeed's documented defaults, spelled out; overlap_comm on."""
    return {
        "train_micro_batch_size_per_gpu": ctx.workload.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": True},
        "communication_data_type": "fp32",
        "optimizer": {"type": "AdamW", "params": {
            "lr": ADAMW["lr"], "betas": list(ADAMW["betas"]), "eps": ADAMW["eps"],
            "weight_decay": ADAMW["weight_decay"], "torch_adam": True, "fused": True}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 500_000_000,
            "stage3_prefetch_bucket_size": 50_000_000,
            "stage3_param_persistence_threshold": 100_000,
            "stage3_max_live_parameters": 1_000_000_000,
            "stage3_max_reuse_distance": 1_000_000_000,
            "sub_group_size": 1_000_000_000,
        },
        "compile": {"deepcompile": deepcompile},
    }


def build_deepspeed(ctx: Ctx, deepcompile: bool = False) -> Built:
    no_tp(ctx, "deepcompile" if deepcompile else "deepspeed_z3")
    if ctx.device.type != "cuda":
        raise NotRun("DeepSpeed ZeRO-3 needs CUDA + NCCL; this run is on CPU/gloo")
    # DeepSpeed's op builder parses TORCH_CUDA_ARCH_LIST and fails on "9.0a"
    # ("invalid literal for int() with base 10: '0a'"): the H200 machines' image sets
    # it so. Give DeepCompile's JIT op build the device's own plain arch instead.
    import os
    import re

    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    entries = [a for a in arch.replace(" ", ";").split(";") if a]
    if not entries or any(not re.fullmatch(r"\d+\.\d+(\+PTX)?", a) for a in entries):
        os.environ["TORCH_CUDA_ARCH_LIST"] = "%d.%d" % torch.cuda.get_device_capability(ctx.device)
        if arch:
            log.warning("TORCH_CUDA_ARCH_LIST=%r is not parseable by DeepSpeed's op builder; using %r",
                        arch, os.environ["TORCH_CUDA_ARCH_LIST"])
    try:
        import deepspeed
    except Exception as e:  # noqa: BLE001
        raise NotRun(f"deepspeed not importable ({type(e).__name__}: {e}); "
                     f"see benchmarks/install_offline.sh") from None
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    model = workloads.build_model(ctx.workload, ctx.device, ctx.seed)
    ds_cfg = deepspeed_config(ctx, deepcompile)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_cfg, dist_init_required=False)
    if deepcompile:
        engine.compile()  # DeepCompile, default schedule (passes chosen by DeepSpeed)

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()  # clipping (gradient_clipping), optimizer step and zero_grad
        return loss.detach()

    def teardown() -> None:
        destroy = getattr(engine, "destroy", None)
        if callable(destroy):
            destroy()

    cfg = {
        **_common_config(ctx),
        "deepspeed_version": deepspeed.__version__,
        "deepspeed_config": ds_cfg,
        "grad_clip": f"DeepSpeed gradient_clipping={CLIP}",
        "mixed_precision": "bf16.enabled (bf16 partitioned params, fp32 master partitions), "
                           "communication_data_type=fp32",
        "compile": "engine.compile() with compile.deepcompile=true, default schedule" if deepcompile else None,
        "optimizer": "torch.optim.AdamW(fused) via DeepSpeed optimizer config torch_adam=true",
    }
    return Built(step=step, config=cfg, compiles=deepcompile, keep=[engine, model], teardown=teardown)


def build_deepspeed_z3(ctx: Ctx) -> Built:
    return build_deepspeed(ctx, deepcompile=False)


def build_deepcompile(ctx: Ctx) -> Built:
    return build_deepspeed(ctx, deepcompile=True)


EXTERNAL_BUILDERS = {
    "graphcomp": build_graphcomp,
    "graphcomp-eager_optimizer": build_graphcomp_eager_optimizer,
    "graphcomp-remat_auto": build_graphcomp_remat_auto,
    "graphcomp-bucket256": build_graphcomp_bucket256,
    "graphcomp-rs256": build_graphcomp_rs256,
    "graphcomp-wire150": build_graphcomp_wire150,
    "graphcomp-rs512": build_graphcomp_rs512,
    "graphcomp-remat_auto-rs256": build_graphcomp_remat_auto_rs256,
    "graphcomp-remat_auto-gather": build_graphcomp_remat_auto_gather,
    "graphcomp-compile_regions": build_graphcomp_compile_regions,
    "graphcomp-whole_graph": build_graphcomp_whole_graph,
    "graphcomp-remat_auto-whole_graph": build_graphcomp_remat_auto_whole_graph,
    "graphcomp-fusion_inductor": build_graphcomp_fusion_inductor,
    "graphcomp-whole_step": build_graphcomp_whole_step,
    "graphcomp-whole_step-flat_buckets": build_graphcomp_whole_step_flat_buckets,
    "graphcomp-inductor_memory_reorder": build_graphcomp_inductor_memory_reorder,
    "graphcomp-except_last": build_graphcomp_except_last,
    "graphcomp-embedding_exchange": build_graphcomp_embedding_exchange,
    "graphcomp-fold_clip": build_graphcomp_fold_clip,
    "graphcomp-clip_apart": build_graphcomp_clip_apart,
    "graphcomp-exchange_fold_clip": build_graphcomp_exchange_fold_clip,
    "graphcomp-guard_filter": build_graphcomp_guard_filter,
    "graphcomp-keep_params": build_graphcomp_keep_params,
    "graphcomp-reshard_all": build_graphcomp_reshard_all,
    "graphcomp-exchange_keep": build_graphcomp_exchange_keep,
    "deepspeed_z3": build_deepspeed_z3,
    "deepcompile": build_deepcompile,
}
