"""The ``graphcomp`` Dynamo backend: the only place that wires AOTAutograd.

Flow of one compiled frame (``Config.codegen == "inductor"``)::

    Dynamo FX graph ─► inductor.compile_fx(inner_compile=ours, joint_custom_pre_pass=ours)
        joint graph   ─► our JOINT passes ─► Inductor joint passes ─► min-cut partition
        fwd / bwd     ─► our STAGE passes ─► compile_fx_inner (Inductor codegen)

With every pass switched off this is exactly ``backend="inductor"``, so results are
bitwise equal. ``codegen="eager"`` goes through ``aot_autograd`` with our own
partition function (same min-cut partitioner) and runs the FX graphs as they are.

Frames without autograd (inference, ``torch.no_grad``) have no joint graph: the
joint passes run on the forward graph under the stage name ``inference``, then the
forward passes under ``fwd``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

import torch
import torch.fx as fx

from . import _compat, dump, graph_utils
from .config import Config
from .pipeline import PassContext, run_stage
from .state import STATE

log = logging.getLogger(__name__)


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class FrameCompiler:
    """Compiles one Dynamo frame: runs the passes of each stage, records and dumps."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any], cfg: Config):
        self.cfg = cfg
        self.frame_id = STATE.next_frame_id()
        self.rank, self.world_size = _rank_world()
        self.dumper = dump.Dumper(cfg.dump_dir, self.rank, self.frame_id)
        self.frame_data: dict[str, Any] = {}
        self.recompile = _compat.is_recompile()
        self.summary: dict[str, Any] = {
            "frame": self.frame_id,
            "compile_id": _compat.current_compile_id(),
            "recompile": self.recompile,
            "codegen": cfg.codegen,
            "world_size": self.world_size,
            "config": cfg.to_json(),
            "num_inputs": len(example_inputs),
            "input_shapes": [list(t.shape) if isinstance(t, torch.Tensor) else repr(t) for t in example_inputs],
            "stages": {},
            "compile_seconds": None,
        }
        STATE.frames.append(self.summary)
        STATE.counters["frames_compiled"] += 1
        if self.recompile:
            STATE.counters["recompiles"] += 1
        self.dumper.graph(self.frame_id, "dynamo", "input", gm)

    # ---------------------------------------------------------------- stages
    def run(self, stage: str, gm: fx.GraphModule, example_inputs: Any = None) -> fx.GraphModule:
        ctx = PassContext(
            config=self.cfg,
            frame_id=self.frame_id,
            stage=stage,
            rank=self.rank,
            world_size=self.world_size,
            frame_data=self.frame_data,
            example_inputs=example_inputs,
        )
        ops_in = graph_utils.op_counts(gm)
        nodes_in = len(gm.graph.nodes)
        gm, records = run_stage(gm, ctx, self.dumper)
        colls = graph_utils.collectives(gm)
        self.summary["stages"][stage] = {
            "nodes_in": nodes_in,
            "nodes_out": len(gm.graph.nodes),
            "ops_in": dict(ops_in),
            "ops_out": dict(graph_utils.op_counts(gm)),
            "passes": [r.to_json() for r in records],
            "collectives": colls,
            "bytes_by_dtype": graph_utils.collective_bytes_by_dtype(colls),
            "partitions": self.frame_data.get(f"partitions:{stage}", []),
        }
        if stage in ("fwd", "bwd"):
            for dtype, b in graph_utils.collective_bytes_by_dtype(colls, "all_gather").items():
                STATE.counters[f"bytes_gathered:{dtype}"] += b
        self._flush()
        changed = [r.name for r in records if r.changed]
        log.info(
            "graphcomp frame %d %s: %d -> %d nodes; passes changed: %s",
            self.frame_id, stage, nodes_in, len(gm.graph.nodes), ", ".join(changed) or "none",
        )
        return gm

    def _flush(self) -> None:
        dump.write_summary(self.cfg.dump_dir, self.rank, [f for f in STATE.frames])

    def joint_hook(self, gm: fx.GraphModule) -> fx.GraphModule:
        stage = "joint" if _compat.is_joint_graph(gm) else "inference"
        return self.run(stage, gm)

    def inner_compile(self, gm: fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        stage = "bwd" if kwargs.get("is_backward") else "fwd"
        gm = self.run(stage, gm, example_inputs)
        return _compat.compile_fx_inner(gm, example_inputs, **kwargs)

    # ------------------------------------------------------------- eager path
    def eager_partition(self, joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        joint = self.run("joint", joint)
        return _compat.min_cut_partition(joint, joint_inputs, **kwargs)

    def eager_compiler(self, stage: str) -> Any:
        def compiler(gm: fx.GraphModule, example_inputs: Any) -> Any:
            if stage == "inference":
                gm = self.run("inference", gm)
            gm = self.run("bwd" if stage == "bwd" else "fwd", gm, example_inputs)
            return _compat.make_boxed_func(gm.forward)

        return compiler

    # ---------------------------------------------------------------- compile
    def compile(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        t0 = time.perf_counter()
        try:
            if self.cfg.codegen == "inductor":
                uuid = hashlib.sha256(json.dumps(self.cfg.to_json(), sort_keys=True, default=str).encode()).hexdigest()
                hook = _compat.make_joint_hook(self.joint_hook, f"graphcomp-{uuid}")
                with _compat.inductor_patches(hook):
                    return _compat.inductor_compile_fx(gm, example_inputs, inner_compile=self.inner_compile)
            backend = _compat.aot_autograd(
                fw_compiler=self.eager_compiler("fwd"),
                bw_compiler=self.eager_compiler("bwd"),
                inference_compiler=self.eager_compiler("inference"),
                partition_fn=self.eager_partition,
                keep_inference_input_mutations=True,
            )
            return backend(gm, example_inputs)
        finally:
            self.summary["compile_seconds"] = time.perf_counter() - t0
            self._flush()


def graphcomp_backend(gm: fx.GraphModule, example_inputs: list[Any], *, options: Any = None, mode: str | None = None) -> Any:
    """Dynamo backend entry point (``torch.compile(model, backend="graphcomp")``).

    ``options`` is a mapping of :class:`graphcomp.Config` field names (or a Config)."""
    if mode is not None:
        raise ValueError(
            f"graphcomp does not take torch.compile(mode={mode!r}); pass options={{...}} with "
            "graphcomp.Config fields instead (valid: mode=None)"
        )
    cfg = Config.from_options(options)
    return FrameCompiler(gm, example_inputs, cfg).compile(gm, example_inputs)
