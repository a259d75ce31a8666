"""torchtitan's compiler-based FSDP as benchmark systems: ``simplefsdp`` and ``graph_trainer``.

``simplefsdp`` is torchtitan's SimpleFSDP (``torchtitan.experiments.simple_fsdp``,
torchtitan 0.2.2: the last release whose code imports on the GPU machines' torch 2.11,
see ``benchmarks/README.md``) applied to the harness's own model the way torchtitan's
``simple_fsdp/llama3/parallelize.py`` applies it to its Llama 3:

1. ``data_parallel(model, mesh, mode="fully_shard", mp_policy=MixedPrecisionPolicy(
   param_dtype=bf16, reduce_dtype=fp32))``: every parameter becomes a ``Shard(0)``
   fp32 DTensor, read through a parametrization that all-gathers it in bf16 (the
   cast happens on the shard) and reduce-scatters its gradient in fp32;
2. ``torch._inductor.config.reorder_for_peak_memory = False`` and
   ``torch.compile(model, backend=get_compile_backend_with_passes(...), fullgraph=True)``
   with ``compile.backend = "inductor"``, ``fsdp_reshard_after_forward = True``
   (torchtitan's ``"default"`` without pipeline parallelism: the joint-graph pass marks
   the all-gathers ``MUST_RECOMPUTE``, so backward re-gathers) and the bucketing /
   reordering pass :data:`GRAPH_PASSES` over one bucket per transformer block, the
   embedding, and the final norm + LM head together (the plan
   ``get_transformer_block_buckets`` builds for torchtitan's Llama, in this model's
   module names).

torchtitan normalises the loss as local token sum / global token count because
SimpleFSDP's reduce-scatter sums gradients; with equal token counts per rank that is
the local mean loss / world size, which is what the step differentiates (the gradients
are then the mean over ranks, as for every other system; the reported loss is the
local mean).

``graph_trainer`` (torchtitan's joint-graph trainer with its CUDA-graph pass) reports
"not run" with the reason found at build time; :func:`graph_trainer_reason` documents
what was checked.

The torchtitan backend changes global Inductor settings (``post_grad_custom_post_pass``,
``allow_buffer_reuse``, ``reorder_for_*``, ``aten_distributed_optimizations.*``); they
are restored when the system is torn down, so later systems compile as before.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from . import workloads
from .systems import BF16, CLIP, Built, Ctx, NotRun, _common_config, make_optimizer

log = logging.getLogger(__name__)

TORCHTITAN_VERSION = "0.2.2"
"""the version ``benchmarks/fetch_wheels.sh`` fetches (recorded; another one is used if installed)"""

GRAPH_PASSES = "transformer_block_bucketing"
"""SimpleFSDP's bucketing/reordering pass (its README: "manual optimization"). Its other
pass, ``auto_bucketing``, is not used: torchtitan 0.2.2 sets
``aten_distributed_optimizations.collective_bucketing = True`` but calls
``schedule_overlap_bucketing(gm)``, whose ``collective_bucketing`` argument defaults to
False on torch 2.11 (the config is read only by ``..._from_inductor_configs``, which
torchtitan uses from 0.3.0 on): it would reorder without bucketing."""

GRAPH_PASSES_CHOICES = ("transformer_block_bucketing", "auto_bucketing", "none")
PASSES_ENV = "BENCH_SIMPLEFSDP_PASSES"
"""environment variable choosing SimpleFSDP's ``compile.graph_passes`` (default
:data:`GRAPH_PASSES`; ``none``: plain Inductor, no bucketing/reordering)"""

COMPILE_BACKEND = "inductor"
"""torchtitan's default ``compile.backend``"""


def _import_simple_fsdp():
    """torchtitan's SimpleFSDP modules, or :class:`NotRun` with the precise import error."""
    try:
        import torchtitan
    except Exception as e:  # noqa: BLE001 - any import failure is a reason not to run
        raise NotRun(f"torchtitan not importable ({type(e).__name__}: {e}); "
                     f"see benchmarks/fetch_wheels.sh and install_offline.sh") from None
    version = getattr(torchtitan, "__version__", "?")
    try:
        from torchtitan.experiments.simple_fsdp import backend as sf_backend
        from torchtitan.experiments.simple_fsdp import simple_fsdp as sf
    except Exception as e:  # noqa: BLE001
        raise NotRun(f"torchtitan {version}: experiments.simple_fsdp not importable ({type(e).__name__}: {e}); "
                     f"benchmarks/fetch_wheels.sh fetches torchtitan {TORCHTITAN_VERSION}, whose SimpleFSDP "
                     f"this system uses (0.3.0 moved it into experiments.graph_trainer)") from None
    for mod, name in ((sf, "data_parallel"), (sf, "MixedPrecisionPolicy"),
                      (sf_backend, "get_compile_backend_with_passes")):
        if not callable(getattr(mod, name, None)):
            raise NotRun(f"torchtitan {version}: {mod.__name__}.{name} missing")
    return version, sf, sf_backend


def graph_passes() -> str | None:
    """SimpleFSDP's ``compile.graph_passes`` for this run: ``$BENCH_SIMPLEFSDP_PASSES`` or
    :data:`GRAPH_PASSES`; None for ``none``. An unknown value is a ``ValueError``."""
    value = os.environ.get(PASSES_ENV, GRAPH_PASSES).strip()
    if value not in GRAPH_PASSES_CHOICES:
        raise ValueError(f"{PASSES_ENV}={value!r}: valid values are {', '.join(GRAPH_PASSES_CHOICES)}")
    return None if value == "none" else value


def block_bucket_plan(model: nn.Module) -> list[list[str] | str]:
    """SimpleFSDP's ``transformer_block_bucketing`` plan for the harness's Llama: the
    embedding alone, the final norm and the LM head together, then one bucket per
    block (module FQNs, as torchtitan's ``get_transformer_block_buckets`` lists them
    for its own Llama). A module missing from ``model`` is left out."""
    names = {m: n for n, m in model.named_modules()}
    plan: list[list[str] | str] = []
    for group in (["tok_emb"], ["norm", "head"]):
        fqns = [names[getattr(model, a)] for a in group if isinstance(getattr(model, a, None), nn.Module)]
        if len(fqns) == 1:
            plan.append(fqns[0])
        elif fqns:
            plan.append(fqns)
    plan += [names[b] for b in model.layers]
    return plan


def _inductor_snapshot() -> dict[str, Any]:
    import torch._inductor.config as icfg

    return icfg.get_config_copy()


def _inductor_restore(saved: dict[str, Any]) -> list[str]:
    """Put back every Inductor setting that differs from ``saved``; returns the keys restored."""
    import torch._inductor.config as icfg

    now = icfg.get_config_copy()
    changed = {k: v for k, v in saved.items() if k in now and now[k] is not v and now[k] != v}
    if changed:
        icfg.load_config(changed)
    return sorted(changed)


def _loss_scale_note(world: int) -> str:
    return (f"loss.backward() on local mean loss / {world} (torchtitan's local token sum / global token count: "
            f"SimpleFSDP's reduce-scatter sums, so the gradients are the mean over ranks)")


def build_simplefsdp(ctx: Ctx) -> Built:
    """torchtitan SimpleFSDP, compiled with its bucketing/reordering pass (module docstring)."""
    if ctx.world < 2:
        raise NotRun(f"SimpleFSDP is data parallelism: torchtitan applies no data_parallel with one rank "
                     f"(world size {ctx.world}); compare with 'inductor' on one GPU")
    if ctx.workload.family is not None:
        raise NotRun(f"simplefsdp is wired for the harness's Llama (W1/W2/W3/smoke), not the HF workload "
                     f"{ctx.workload.name!r}")
    passes = graph_passes()
    version, sf, sf_backend = _import_simple_fsdp()
    from torch.distributed.device_mesh import init_device_mesh

    saved = _inductor_snapshot()
    try:
        model = workloads.build_model(ctx.workload, ctx.device, ctx.seed)
        mesh = init_device_mesh(ctx.device.type, (ctx.world,), mesh_dim_names=("fsdp",))
        mp = sf.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
        model = sf.data_parallel(model, mesh, mode="fully_shard", mp_policy=mp)
        plan = block_bucket_plan(model)
        torch._inductor.config.reorder_for_peak_memory = False  # parallelize_llama does this before compiling
        compile_cfg = SimpleNamespace(backend=COMPILE_BACKEND, graph_passes=passes)
        backend = sf_backend.get_compile_backend_with_passes(compile_cfg, True, plan)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        opt, ocfg = make_optimizer(model.parameters(), ctx.device)
    except BaseException:  # the backend may have changed global Inductor settings already
        _inductor_restore(saved)
        raise
    params = [p for p in model.parameters() if p.requires_grad]
    scale = 1.0 / ctx.world

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = compiled(tokens, targets)
        (loss * scale).backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def teardown() -> None:
        restored = _inductor_restore(saved)
        if restored:
            log.info("simplefsdp: restored Inductor settings %s", restored)

    cfg = {
        **_common_config(ctx), **ocfg,
        "torchtitan_version": version,
        "wrapping": ("torchtitan.experiments.simple_fsdp.simple_fsdp.data_parallel(model, mesh=1-D 'fsdp' mesh over "
                     "all ranks, mode='fully_shard', mp_policy)"),
        "mixed_precision": ("simple_fsdp.MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): bf16 all-gather "
                            "(cast on the shard), fp32 reduce-scatter; no autocast"),
        "compute": workloads.compute_note(ctx.workload),
        "master_weights": "fp32 DTensor shards (Shard(0))",
        "compile": (f"torch.compile(model, backend=simple_fsdp.backend.get_compile_backend_with_passes("
                    f"compile.backend={COMPILE_BACKEND!r}, compile.graph_passes={passes!r}, "
                    f"fsdp_reshard_after_forward=True, buckets), fullgraph=True); "
                    f"inductor reorder_for_peak_memory=False"),
        "bucket_plan": plan if passes == "transformer_block_bucketing" else None,
        "loss_scaling": _loss_scale_note(ctx.world),
    }
    return Built(step=step, config=cfg, compiles=True, keep=[compiled, model, opt], teardown=teardown)


def graph_trainer_reason() -> str:
    """Why ``graph_trainer`` cannot run here, as checked: the installed torchtitan's
    ``experiments.graph_trainer`` (torchtitan >= 0.3.0) and, in its absence, the 0.2.2
    predecessor ``experiments.compiler_toolkit``."""
    try:
        import torchtitan
    except Exception as e:  # noqa: BLE001
        return f"torchtitan not importable ({type(e).__name__}: {e}); see benchmarks/fetch_wheels.sh"
    version = getattr(torchtitan, "__version__", "?")
    try:
        import torchtitan.experiments.graph_trainer.trainer  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name not in ("torchtitan.experiments.graph_trainer", "torchtitan.experiments.graph_trainer.trainer"):
            return (f"torchtitan {version}: experiments.graph_trainer does not import "
                    f"(missing module {e.name!r}: {e})")
        gt = f"torchtitan {version} has no experiments.graph_trainer ({e})"
    except Exception as e:  # noqa: BLE001
        return (f"torchtitan {version}: experiments.graph_trainer does not import on torch {torch.__version__} "
                f"({type(e).__name__}: {e})")
    else:
        return (f"torchtitan {version}'s graph_trainer imports, but it is a whole trainer (its own model "
                f"definitions, make_fx tracing of the train step, job config): not wired to the harness's model")
    return (f"{gt}. The graph trainer was first released in torchtitan 0.3.0, whose code needs a newer torch "
            f"than 2.11 (torchtitan/distributed/fsdp.py imports torch.distributed.fsdp.DataParallelMeshDims, "
            f"graph_trainer/fsdp_passes.py overlap_manual_scheduling._move_overlap_nodes, both absent in 2.11); "
            f"its 0.2.2 predecessor experiments.compiler_toolkit (joint-graph export + cudagraph pass) requires "
            f"tensor parallelism > 1: its parallelize_inputs calls ParallelDims.get_mesh('tp'), which raises "
            f"for an FSDP-only run (all its documented configurations use TP)")


def build_graph_trainer(ctx: Ctx) -> Built:
    """Not runnable with the torchtitan release that works on torch 2.11: :class:`NotRun`
    with :func:`graph_trainer_reason`."""
    raise NotRun(graph_trainer_reason())


TORCHTITAN_BUILDERS = {
    "simplefsdp": build_simplefsdp,
    "graph_trainer": build_graph_trainer,
}
