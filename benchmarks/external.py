"""Systems from other packages: graphcomp (and its per-pass ablation), DeepSpeed ZeRO-3
and DeepCompile. Written defensively: a package or API that is missing makes the
system "not run" with the reason, never a crash of the whole benchmark.

graphcomp runs as its README teaches::

    graphcomp.shard(model, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)   # fp8=... in the FP8 variants
    opt = AdamW(model.parameters())          # built after shard()
    step = graphcomp.train_step(model, opt, max_norm=1.0, options={...})
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


# A graphcomp system is a named variant, not a function: the keys of a variant are
#   options    graphcomp.Config fields (train_step's options=)
#   shard      graphcomp.shard() keywords beyond param_dtype / reduce_dtype
#   whole_step train_step's whole_step= (default "auto")
#   step       "train_step" (default: graphcomp.train_step, the one entry point), or
#              "manual": torch.compile(model) + a hand-written step whose update is
#              graphcomp.optim.capture(fold_clip=...) or, with "optimizer": "eager",
#              torch's eager clip_grad_norm_ + opt.step()
#   needs      "cuda": the variant does not run elsewhere (said as "not run")
# graphcomp-no_<pass> / graphcomp-with_<pass> are generated; --variant NAME=JSON adds more.
GRAPHCOMP_VARIANTS: dict[str, dict] = {
    "graphcomp": {},
    "graphcomp-pieces": {"whole_step": False},
    "graphcomp-eager_optimizer": {"step": "manual", "optimizer": "eager"},
    "graphcomp-fold_clip": {"step": "manual", "fold_clip": True, "needs": "cuda"},
    "graphcomp-clip_apart": {"step": "manual", "fold_clip": False, "needs": "cuda"},
    "graphcomp-exchange_fold_clip": {"step": "manual", "fold_clip": True, "shard": {"embedding": "exchange"},
                                     "needs": "cuda"},
    "graphcomp-remat_auto": {"options": {"remat": "auto"}},
    "graphcomp-remat_auto-gather": {"options": {"remat": "auto"}, "shard": {"embedding": "gather"}},
    "graphcomp-remat_auto-rs256": {"options": {"remat": "auto", "reduce_bucket_bytes": 256 * 2**20}},
    "graphcomp-remat_auto-whole_graph": {"options": {"remat": "auto", "compile_regions": False}},
    "graphcomp-bucket256": {"options": {"bucket_bytes": 256 * 2**20}},
    "graphcomp-rs256": {"options": {"reduce_bucket_bytes": 256 * 2**20}},
    "graphcomp-rs512": {"options": {"reduce_bucket_bytes": 512 * 2**20}},
    "graphcomp-wire150": {"options": {"collective_bytes_per_s": 150e9}},
    "graphcomp-compile_regions": {"options": {"compile_regions": True}},
    "graphcomp-whole_graph": {"options": {"compile_regions": False}},
    "graphcomp-fusion_inductor": {"options": {"inductor_fusion_search": "inductor"}},
    "graphcomp-inductor_memory_reorder": {"options": {"inductor_memory_reorder": True}},
    "graphcomp-except_last": {"options": {"reshard_after_forward": "except_last"}},
    "graphcomp-keep_params": {"options": {"reshard_after_forward": False}},
    "graphcomp-reshard_all": {"options": {"reshard_after_forward": True}},
    "graphcomp-guard_filter": {"options": {"guard_filter_fn": "graphcomp.guard_filter"}},
    "graphcomp-embedding_exchange": {"shard": {"embedding": "exchange"}},
    "graphcomp-exchange_keep": {"shard": {"embedding": "exchange"}, "options": {"reshard_after_forward": False}},
    "graphcomp-flat_buckets": {"options": {"passes": {"zero_copy_buckets": False}}},
    # FP8 linear layers (docs/fp8.md): shard(fp8=...) on several ranks, graphcomp.fp8.convert on one
    "graphcomp-fp8_tensorwise": {"fp8": "tensorwise"},
    "graphcomp-fp8_rowwise": {"fp8": "rowwise"},
}
_VARIANT_KEYS = {"options", "shard", "whole_step", "step", "optimizer", "fold_clip", "needs", "fp8"}
_INTERNAL_KEYS = {"_pass"}  # (pass_variant: the pass and its switch, checked against the registry)


def check_variant(name: str, v: dict) -> dict:
    """A variant's keys and values, checked (a typo is an error naming the valid keys)."""
    if not isinstance(v, dict):
        raise ValueError(f"graphcomp variant {name!r}: expected a JSON object, got {type(v).__name__}")
    bad = sorted(set(v) - _VARIANT_KEYS - _INTERNAL_KEYS)
    if bad:
        raise ValueError(f"graphcomp variant {name!r}: unknown key(s) {bad}; valid: {sorted(_VARIANT_KEYS)}")
    if v.get("step", "train_step") not in ("train_step", "manual"):
        raise ValueError(f"graphcomp variant {name!r}: step={v['step']!r}; valid: 'train_step', 'manual'")
    if v.get("needs") not in (None, "cuda"):
        raise ValueError(f"graphcomp variant {name!r}: needs={v['needs']!r}; valid: 'cuda'")
    if v.get("fp8") not in (None, "tensorwise", "rowwise"):
        raise ValueError(f"graphcomp variant {name!r}: fp8={v['fp8']!r}; valid: 'tensorwise', 'rowwise'")
    return v


def variant_builder(name: str, variant: dict):
    variant = check_variant(name, variant)

    def build(ctx: Ctx) -> Built:
        return build_graphcomp(ctx, variant)

    build.__doc__ = f"graphcomp variant {name}: {variant}"
    return build


def pass_variant(name: str) -> dict | None:
    """``graphcomp-no_<pass>`` (a pass on by default, switched off) and
    ``graphcomp-with_<pass>`` (a pass off by default, switched on); None for other names."""
    for prefix, on in ((ABLATION_PREFIX, False), (ENABLE_PREFIX, True)):
        if name.startswith(prefix):
            return {"options": {"passes": {name[len(prefix):]: on}}, "_pass": (name[len(prefix):], on)}
    return None


def _resolve_options(graphcomp, options: dict) -> dict:
    out = dict(options)
    if out.get("guard_filter_fn") == "graphcomp.guard_filter":
        out["guard_filter_fn"] = graphcomp.guard_filter
    return out


def build_graphcomp(ctx: Ctx, variant: dict | None = None) -> Built:
    """graphcomp as a user runs it: ``graphcomp.shard`` (more than one rank), then
    ``graphcomp.train_step`` with the variant's options (see ``GRAPHCOMP_VARIANTS``).
    One rank: BENCHMARKS.md's 1-GPU target is graphcomp (no sharding) against plain
    Inductor, so the model is not sharded and the forward runs under bf16 autocast, as
    the inductor system's."""
    graphcomp = _import_graphcomp()
    v = dict(variant or {})
    pass_check = v.pop("_pass", None)
    if pass_check is not None:
        passes, reason = graphcomp_passes()
        if passes is None:
            raise NotRun(reason)
        pname, on = pass_check
        if pname not in passes:
            raise NotRun(f"unknown graphcomp pass {pname!r}; registered: {sorted(passes)}")
        if passes[pname] == on:
            raise NotRun(f"pass {pname!r} is {'on' if on else 'off'} by default: the variant measures the default")
    if v.get("needs") == "cuda" and ctx.device.type != "cuda":
        raise NotRun("this variant measures an option of the captured optimizer step (CUDA only)")
    shard_kw = dict(v.get("shard") or {})
    fp8 = v.get("fp8")
    if ctx.tp > 1 and (shard_kw or fp8):
        raise NotRun(f"shard({shard_kw or {'fp8': fp8}}) applies to 1-D sharding only (--tp 1)")
    if fp8:
        shard_kw["fp8"] = fp8
    if ctx.tp > 1 and "fold_clip" in v:
        raise NotRun("fold_clip is an option of the captured optimizer, which --tp runs do not use")
    options = _resolve_options(graphcomp, v.get("options") or {})
    model = workloads.build_model(ctx.workload, ctx.device, ctx.seed)
    sharded = ctx.world > 1
    tp_cfg: dict = {}
    if ctx.tp > 1:  # the same TP plan as fsdp2 + TP, then graphcomp shards over dp (2-D DTensors)
        mesh = tp_mesh(ctx)
        tp_cfg = apply_tp(model, mesh)
        graphcomp.shard(model, mesh=mesh, dp_dim="dp", param_dtype=BF16, reduce_dtype=torch.float32)
    else:
        try:
            if sharded:
                graphcomp.shard(model, param_dtype=BF16, reduce_dtype=torch.float32, **shard_kw)
            elif fp8:  # (one rank is not sharded: the FP8 layers alone, with the default filter)
                graphcomp.fp8.convert(model, fp8)
        except ValueError as e:
            if not fp8 or "converts" not in str(e):
                raise
            raise NotRun(f"no FP8 layer in this workload: {e}") from None
    fp8_layers = [n for n, m in model.named_modules() if isinstance(m, graphcomp.fp8.Float8Linear)]
    if ctx.memory_cap_bytes is not None:
        # --memory-cap: graphcomp plans (remat, reshard, prefetch) under the cap less what
        # lives outside its graphs: AdamW's two moments, the size of the fp32 shards (an
        # explicit budget is used as given; only the default budget reserves this itself)
        moments = 2 * sum(_local(p).numel() * p.element_size() for p in model.parameters())
        options["memory_budget"] = ctx.memory_cap_bytes - moments
    opt, ocfg = make_optimizer(model.parameters(), ctx.device)
    shown = {**(v.get("options") or {}), **({"memory_budget": options["memory_budget"]}
                                             if "memory_budget" in options else {})}
    cfg = {**_common_config(ctx), **ocfg, **tp_cfg, "graphcomp_variant": {k: x for k, x in v.items()},
           "graphcomp_version": getattr(graphcomp, "__version__", None)}
    if fp8:
        cfg["fp8"] = {"recipe": fp8, "how": ("graphcomp.shard(..., fp8=...)" if sharded else
                                             "graphcomp.fp8.convert(model, recipe) (one rank: no sharding)"),
                      "layers": len(fp8_layers), "filter": "graphcomp.fp8.default_filter() (>= 2048 wide, not the head)"}
    if sharded:
        cfg.update({
            "wrapping": ("graphcomp.shard(model, mesh=mesh, dp_dim='dp', param_dtype=bf16, reduce_dtype=fp32) "
                         "after the TP plan" if ctx.tp > 1 else
                         f"graphcomp.shard(model, param_dtype=bf16, reduce_dtype=fp32"
                         f"{''.join(f', {k}={x!r}' for k, x in shard_kw.items())})"),
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

    window: dict[str, dict] = {}
    captured = tstep = None
    if v.get("step", "train_step") == "train_step" and ctx.tp == 1:
        tstep = graphcomp.train_step(model, opt, max_norm=CLIP, autocast=None if sharded else BF16, options=options,
                                     whole_step=v.get("whole_step", "auto"))
        step = tstep
        cfg["compile"] = f"graphcomp.train_step(model, opt, max_norm={CLIP}, options={shown}" + (
            "" if sharded else ", autocast=bf16") + (
            f", whole_step={v['whole_step']!r})" if "whole_step" in v else ")")
        cfg["optimizer_step"] = ("graphcomp.train_step: clip + step through graphcomp.optim.capture; the whole step "
                                 "one CUDA graph from the third call where train_step finds it safe")
    else:
        backend, backend_desc = _resolve_backend(graphcomp)
        compiled = torch.compile(model, backend=backend, options=options)
        cfg["compile"] = f"torch.compile(model, {backend_desc}, options={shown})"
        if ctx.tp > 1:
            step = tp_step(compiled, opt)
            cfg["optimizer_step"] = "eager clip_grad_norm_ + opt.step() (tensor parallel: loss_parallel step)"
        elif v.get("optimizer") == "eager":
            step = standard_step(compiled, opt, ctx.device, autocast=not sharded)
            cfg["optimizer_step"] = "eager clip_grad_norm_ + opt.step(), zero_grad(set_to_none=True)"
        else:
            fold_clip = v.get("fold_clip", "auto")
            captured = graphcomp.optim.capture(opt, max_norm=CLIP, fold_clip=fold_clip)
            step = standard_step(compiled, opt, ctx.device, autocast=not sharded, update=captured)
            cfg["optimizer_step"] = (f"graphcomp.optim.capture(opt, max_norm={CLIP}, fold_clip={fold_clip!r}), "
                                     "zero_grad(set_to_none=True)")

    def teardown() -> None:
        graphcomp.reset()

    def on_window(phase: str) -> None:
        window[phase] = _counters(graphcomp)

    def stats() -> dict:
        out = {"counters": _counters(graphcomp), "memory_estimate": memory_estimate(opt),
               "cuda_graphs_possible": ctx.device.type == "cuda"}
        if "start" in window and "end" in window:
            out["counters_measured"] = counters_delta(window["start"], window["end"])
        opt_step = captured if captured is not None else (tstep.update if tstep is not None else None)
        if opt_step is not None:
            opt_step.sync_counters()
            record = opt_step.stats()
            out["optimizer"] = {**record, "decisions": record["decisions"][-3:]}
        if fp8_layers:
            st = graphcomp.fp8.stats(model)
            out["fp8"] = {"layers": len(st), "input_saturated_total": sum(x["input_saturated_total"] for x in st.values()),
                          "input_scale_min": min(x["input_scale"] for x in st.values()),
                          "weight_scale_min": min(x["weight_scale"] for x in st.values())}
        if tstep is not None:
            out["train_step"] = {"whole_step": tstep.whole_step_reason}
            w = tstep.stats().get("whole_step_capture")
            if w is not None:
                out["whole_step"] = {**w, "decisions": w["decisions"][-3:]}
        return out

    return Built(step=step, config=cfg, compiles=True, keep=[model, opt, tstep], teardown=teardown, stats=stats,
                 on_window=on_window)


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


# --------------------------------------------------------------------------- torchao float8
def build_torchao_float8(ctx: Ctx, recipe: str) -> Built:
    """The FP8 peer: torchao's float8 training (``convert_to_float8_training`` with the
    recipe, the same layers as graphcomp's default filter) on the torch baseline of the
    run's size: one rank, ``torch.compile(model)`` under bf16 autocast (as ``inductor``);
    several, ``fsdp2_compile`` (tensorwise with FSDP2's float8 all-gather and the scales
    precomputed after each optimizer step, torchao's recipe; rowwise gathers bf16)."""
    from .systems import build_fsdp2, build_inductor

    no_tp(ctx, f"torchao_float8_{recipe}")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as e:  # noqa: BLE001
        raise NotRun(f"torchao not installed ({type(e).__name__}: {e})") from None
    import dataclasses

    from graphcomp.fp8 import default_filter

    config = Float8LinearConfig.from_recipe_name(recipe)
    fsdp_fp8 = ctx.world > 1 and recipe == "tensorwise"
    if fsdp_fp8:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)

    def prepare(model) -> dict:
        convert_to_float8_training(model, config=config, module_filter_fn=default_filter())
        import torchao

        return {"fp8": {"peer": f"torchao {torchao.__version__} float8 {recipe}", "config": repr(config),
                        "filter": "graphcomp.fp8.default_filter() (the same layers as graphcomp)"}}

    if ctx.world == 1:
        return build_inductor(ctx, prepare=prepare)
    after = None
    if fsdp_fp8:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        after = precompute_float8_dynamic_scale_for_fsdp
    return build_fsdp2(ctx, compile_blocks=True, prepare=prepare, after_step=after)


EXTERNAL_BUILDERS = {
    **{name: variant_builder(name, v) for name, v in GRAPHCOMP_VARIANTS.items()},
    "deepspeed_z3": build_deepspeed_z3,
    "deepcompile": build_deepcompile,
    "torchao_float8_tensorwise": lambda ctx: build_torchao_float8(ctx, "tensorwise"),
    "torchao_float8_rowwise": lambda ctx: build_torchao_float8(ctx, "rowwise"),
}
