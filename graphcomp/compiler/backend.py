"""The ``graphcomp`` Dynamo backend: the only place that wires AOTAutograd.

Flow of one compiled frame (``Config.codegen == "inductor"``)::

    Dynamo FX graph ─► our DYNAMO passes (torch-level IR, both codegens)
                    ─► inductor.compile_fx(inner_compile=ours, joint_custom_pre_pass=ours)
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

import functools
import hashlib
import json
import logging
import time
from typing import Any

import torch
import torch.fx as fx

from graphcomp import _compat
from graphcomp.compiler import agreement
from graphcomp.compiler import artifacts
from graphcomp.compiler import dump
from graphcomp.sharding import embedding_exchange
from graphcomp.analysis import graph_utils
from graphcomp.analysis import memory
from graphcomp.sharding import gather as shard_gather
from graphcomp.config import Config
from graphcomp.compiler.compile_env import CompileEnv
from graphcomp.compiler.pipeline import PassContext, run_stage
from graphcomp.compiler.progress import CompileProgress
from graphcomp.compiler.plan import FramePlan, StageInputs
from graphcomp.session import SESSION, FrameRecord

# what AOTAutograd decomposes (both codegens): the gathers into their collectives and views
DECOMPOSITIONS = {**shard_gather.DECOMPOSITIONS, **embedding_exchange.DECOMPOSITIONS}

log = logging.getLogger(__name__)


def drop_unread_gathers(gm: fx.GraphModule) -> int:
    """Erase from a Dynamo graph the parameter gathers (``graphcomp::gather_shard``,
    ``graphcomp::gather_table``) whose value nothing reads, and the nodes only they
    read (the shard's ``to_local``); returns how many gathers it erased.

    Model code that reads only a sharded parameter's dtype, device or shape (ViT's
    ``projection.weight.dtype``, T5's ``wo.weight.dtype`` in every feed-forward; one
    read in BERT's MLM head) still calls the gathering property. Dynamo answers the
    read from the fake value and leaves the call in its graph without users; the
    decomposition of the gather then makes it an all-gather and a wait, which no later
    dead-code elimination may drop (collectives have effects), so the weight crossed
    the wire once more for each such read, every step. The gather ops are pure:
    AOTAutograd without graphcomp's decomposition (``backend="inductor"``) drops them
    the same way."""
    ops = (torch.ops.graphcomp.gather_shard.default, torch.ops.graphcomp.gather_table.default)
    dead = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ops and not n.users]
    erased: set[fx.Node] = set()
    for n in dead:
        stack = [n]
        while stack:
            node = stack.pop()
            if node in erased or node.users or node.op not in ("call_function", "call_method") or node.is_impure():
                continue
            stack.extend(node.all_input_nodes)
            gm.graph.erase_node(node)
            erased.add(node)
    if dead:
        gm.recompile()
    return len(dead)


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class FrameCompiler:
    """Compiles one Dynamo frame: runs the passes of each stage, records and dumps."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any], cfg: Config):
        self.cfg = cfg
        self.frame_id = SESSION.next_frame_id()
        self.rank, self.world_size = _rank_world()
        self.dumper = dump.Dumper(cfg.dump_dir, self.rank, self.frame_id)
        self.plan = FramePlan()  # what this frame's stages hand each other
        self.joint_hook_obj: Any = None
        self.recompile = _compat.is_recompile()
        cid = _compat.dynamo_compile_id()
        self.code_id = None if cid is None else cid[0]  # Dynamo's id of the function compiled
        self.plan.code_id = self.code_id
        if self.code_id is not None and graph_utils.has_symbolic_shapes(example_inputs):
            SESSION.shape_following_code.add(self.code_id)
        agreement.note_frame()
        self.artifacts = artifacts.StageArtifacts(cfg, self.rank, self.world_size,
                                                  agreement.frame_store_id(self.frame_id), not self.recompile)
        self.uuid = ""  # cache_uuid of the config and source (set by compile)
        self.env = CompileEnv.of_session(SESSION)  # what the passes know beyond their graph
        info: dict[str, Any] = {
            "frame": self.frame_id,
            "compile_id": _compat.current_compile_id(),
            "recompile": self.recompile,
            "codegen": cfg.codegen,
            "world_size": self.world_size,
            "config": cfg.to_json(),
            "num_inputs": len(example_inputs),
            "input_shapes": [list(t.shape) if isinstance(t, torch.Tensor) else repr(t) for t in example_inputs],
            "compile_seconds": None,
            "phase_seconds": {},  # the passes of each stage, Inductor's code generation of each stage
        }
        self.record = FrameRecord(info, self.plan)
        self.progress = CompileProgress(self.frame_id, info["phase_seconds"])
        SESSION.frames.append(self.record)
        SESSION.counters.add("frames_compiled")
        if self.recompile:
            SESSION.counters.add("recompiles")

    # ---------------------------------------------------------------- stages
    def run(self, stage: str, gm: fx.GraphModule, example_inputs: Any = None) -> fx.GraphModule:
        ctx = PassContext(
            config=self.cfg,
            frame_id=self.frame_id,
            stage=stage,
            rank=self.rank,
            world_size=self.world_size,
            frame=self.plan,
            example_inputs=example_inputs,
            env=self.env,
        )
        ops_in = graph_utils.op_counts(gm)
        nodes_in = len(gm.graph.nodes)
        with self.progress.phase(f"{stage} passes"):
            gm, records = run_stage(gm, ctx, self.dumper)
        colls = graph_utils.collectives(gm) if stage != "dynamo" else []  # (torch-level ops: counted after AOT)
        self.record.stages[stage] = {
            "nodes_in": nodes_in,
            "nodes_out": len(gm.graph.nodes),
            "ops_in": dict(ops_in),
            "ops_out": dict(graph_utils.op_counts(gm)),
            "passes": [r.to_json() for r in records],
            "collectives": colls,
            "bytes_by_dtype": graph_utils.collective_bytes_by_dtype(colls),
            # ("partitions": rendered from self.plan.splits[stage] when the record is written)
            # static estimate: peak bytes and where (graphcomp/analysis/memory.py); the torch-level
            # Dynamo graph carries no fake values the model reads
            "memory": self._memory_summary(stage, gm) if stage != "dynamo" else None,
        }
        if stage in ("fwd", "bwd"):
            self._flush()  # (the summary on disk shows this graph even if agreement raises)
            t_agree = time.perf_counter()
            agreement.check_compiled(self.frame_id, stage, colls, self.cfg)
            self.record.stages[stage]["rank_agreement_seconds"] = time.perf_counter() - t_agree
            for dtype, b in graph_utils.collective_bytes_by_dtype(colls, "all_gather").items():
                SESSION.counters.add(f"bytes_gathered:{dtype}", b)
        self._flush()
        changed = [r.name for r in records if r.changed]
        log.info(
            "graphcomp frame %d %s: %d -> %d nodes; passes changed: %s",
            self.frame_id, stage, nodes_in, len(gm.graph.nodes), ", ".join(changed) or "none",
        )
        return gm

    def _memory_summary(self, stage: str, gm: fx.GraphModule) -> dict[str, Any]:
        """The memory model on the stage graph as scheduled (before a CUDA-graph split:
        the glue graph of a split one says nothing about memory), with the forward's
        static inputs (parameters, shards) as the only inputs live throughout."""
        split = self.plan.split_of(gm, stage)
        target = split.source if split is not None else gm
        persistent = None
        if stage in ("fwd", "bwd"):
            persistent = memory.persistent_inputs(target, stage, list(self.plan.stage_inputs("fwd").static_idxs))
        return memory.summary(target, persistent=persistent)

    def _flush(self) -> None:
        if self.cfg.dump_dir:
            SESSION.dump_target = (str(self.cfg.dump_dir), self.rank)
        dump.write_summary(self.cfg.dump_dir, self.rank, SESSION.frames.to_json())

    def joint_hook(self, gm: fx.GraphModule) -> fx.GraphModule:
        stage = "joint" if _compat.is_joint_graph(gm) else "inference"
        return self.run(stage, gm)

    def inner_compile(self, gm: fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        stage = "bwd" if kwargs.get("is_backward") else "fwd"
        self._stage_inputs(stage, gm, list(kwargs.get("static_input_idxs") or ()), kwargs.get("is_inference", False))
        gm = self.run(stage, gm, example_inputs)
        ours = any(c["kind"] in ("all_gather", "reduce_scatter") and not c.get("foreign")
                   for c in self.record.stages[stage]["collectives"])
        allow = self.cfg.inductor_memory_reorder or not ours
        replaced: list[bool] = []

        def build() -> Any:
            if self.plan.split_of(gm, stage) is not None:
                return self.compile_pieces(stage, gm, kwargs)
            return _compat.compile_fx_inner(gm, example_inputs, **kwargs)

        with _compat.inductor_cache_key(self.joint_hook_obj), _compat.inductor_memory_reorder(allow, replaced), \
                _compat.inductor_fusion_search(self.cfg.inductor_fusion_search), self.progress.phase(f"Inductor {stage}"):
            out, self.record.stages[stage]["artifacts"] = self.artifacts.compile(
                stage, gm, example_inputs, self.uuid, build)
        if ours:
            self._note_memory_reorder(stage, allow, replaced)
        self._flush()  # (the backward compiles at the first backward, after compile() flushed)
        return out

    def _note_memory_reorder(self, stage: str, allowed: bool, replaced: list[bool]) -> None:
        """Record whether Inductor's peak-memory reorder replaced the order of a graph
        (or its pieces) that holds graphcomp's collectives (``Config.inductor_memory_reorder``)."""
        n = sum(replaced)
        st = self.record.stages[stage]
        st["inductor_memory_reorder"] = {"allowed": allowed, "graphs": len(replaced), "replaced": n}
        if n:
            SESSION.counters.add("inductor_memory_reorders", n)
            log.info("graphcomp frame %d %s: Inductor's reorder_for_peak_memory replaced the node order of %d of "
                     "%d graph(s) holding graphcomp's collectives (prefetch positions may have moved; "
                     "inductor_memory_reorder=False keeps them)", self.frame_id, stage, n, len(replaced))
        if len(replaced) - n:
            SESSION.counters.add("inductor_memory_orders_kept", len(replaced) - n)

    # ------------------------------------------------- split graphs (cudagraphs)
    def _stage_inputs(self, stage: str, gm: fx.GraphModule, static_idxs: list[int], inference: bool) -> None:
        """Record what the cudagraphs pass needs: static input indices and which
        outputs reach user code (None = all)."""
        visible = None
        if stage == "fwd" and not inference:
            out = next((n for n in gm.graph.nodes if n.op == "output"), None)
            idxs = out.meta.get("user_visible_output_idxs") if out is not None else None
            n = _compat.fw_num_user_outputs()
            if n is not None:
                visible = list(range(n))
            elif idxs is not None:
                visible = list(idxs)
        self.plan.inputs[stage] = StageInputs(tuple(static_idxs), None if visible is None else tuple(visible))

    def compile_pieces(self, stage: str, gm: fx.GraphModule, kwargs: dict[str, Any] | None) -> Any:
        """Compile each piece of a split graph (Inductor when ``kwargs`` is given,
        else the FX graph as is) and wrap capturable ones in CUDA-graph runners."""
        from graphcomp.compiler.codegen import compile_pieces

        if kwargs is not None:
            def compile_piece(piece: fx.GraphModule, ins: list[Any], static_idxs: list[int]) -> Any:
                bad = [str(v) for v in ins if isinstance(v, (torch.SymInt, torch.SymFloat)) and not v.node.expr.is_Symbol]
                if bad:  # Inductor cannot bind the symbols of an expression-valued scalar input
                    log.info("graphcomp %s: piece has scalar input(s) %s (expressions): running its FX graph "
                             "without Inductor", stage, bad)
                    SESSION.counters.add("pieces_not_inductor")
                    return _compat.make_boxed_func(piece.forward)
                kw = dict(kwargs)
                kw["static_input_idxs"] = static_idxs
                kw["cudagraphs"] = _compat.boxed_false()  # graphcomp's runners own capture
                # pieces feed each other with the traced layouts: Inductor must keep them
                _compat.mark_outputs_user_visible(piece)
                return _compat.compile_fx_inner_filtered(piece, ins, **kw)
        else:
            def compile_piece(piece: fx.GraphModule, ins: list[Any], static_idxs: list[int]) -> Any:
                return _compat.make_boxed_func(piece.forward)

        return compile_pieces(self.plan.splits[stage], self.plan.stage_inputs(stage), self.cfg, compile_piece,
                              report_strides=kwargs is not None, frame_id=self.frame_id, code=self.code_id)

    # ------------------------------------------------------------- eager path
    def eager_partition(self, joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        joint = self.run("joint", joint)
        return _compat.min_cut_partition(joint, joint_inputs, **kwargs)

    def eager_compiler(self, stage: str) -> Any:
        def compiler(gm: fx.GraphModule, example_inputs: Any) -> Any:
            if stage == "inference":
                gm = self.run("inference", gm)
            st = "bwd" if stage == "bwd" else "fwd"
            if st == "bwd":
                static = list(range(_compat.count_tangents(gm)))
            else:
                static = _compat.fw_static_input_indices() or []
            self._stage_inputs(st, gm, static, stage == "inference")
            gm = self.run(st, gm, example_inputs)
            if self.plan.split_of(gm, st) is not None:
                return self.compile_pieces(st, gm, None)
            return _compat.make_boxed_func(gm.forward)

        return compiler

    # ---------------------------------------------------------------- compile
    def compile(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        t0 = time.perf_counter()
        try:
            dropped = drop_unread_gathers(gm)
            self.record.info["unread_gathers_dropped"] = dropped
            if dropped:
                log.debug("graphcomp frame %d: %d gathers nothing reads erased", self.frame_id, dropped)
            # torch-level passes (dumped as dynamo/input.txt, dynamo/NN-<pass>.*.txt)
            gm = self.run("dynamo", gm, example_inputs)
            if self.cfg.codegen == "inductor":
                captures = self.cfg.cudagraphs != "off" and self.cfg.pass_enabled("cudagraphs")
                self.uuid = cache_uuid(self.cfg, captures)
                hook = _compat.make_joint_hook(self.joint_hook, self.uuid)
                self.joint_hook_obj = hook  # re-installed around every stage compile (cache key)
                with _compat.inductor_patches(hook, no_donated_buffers=captures):
                    _compat.register_inductor_decompositions(DECOMPOSITIONS)
                    return _compat.inductor_compile_fx(gm, example_inputs, inner_compile=self.inner_compile)
            backend = _compat.aot_autograd(
                fw_compiler=self.eager_compiler("fwd"),
                bw_compiler=self.eager_compiler("bwd"),
                inference_compiler=self.eager_compiler("inference"),
                partition_fn=self.eager_partition,
                keep_inference_input_mutations=True,
                decompositions=dict(DECOMPOSITIONS),
            )
            return backend(gm, example_inputs)
        finally:
            self.record.info["compile_seconds"] = time.perf_counter() - t0
            self._flush()


@functools.lru_cache(None)
def _source_digest() -> str:
    """sha256 of graphcomp's own source (every module of the package)."""
    import pathlib

    h = hashlib.sha256()
    root = pathlib.Path(__file__).resolve().parents[1]
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def cache_uuid(cfg: Config, captures: bool) -> str:
    """The id of our joint hook, which Inductor's FX-graph cache hashes into its key.

    It covers the config (the fields that change code), graphcomp's source, and whether AOTAutograd donated
    buffers are off. The last matters: the cache key does not include the donated
    buffer indices, so without it a backward compiled with donation (buffers
    Inductor may overwrite) would be served to a CUDA-graph piece that runs several
    times on the same saved activations, giving wrong first-step gradients."""
    blob = json.dumps({"config": cfg.code_json(), "source": _source_digest(), "no_donated_buffers": captures},
                      sort_keys=True, default=str)
    return "graphcomp-" + hashlib.sha256(blob.encode()).hexdigest()


def graphcomp_backend(gm: fx.GraphModule, example_inputs: list[Any], *, options: Any = None, mode: str | None = None) -> Any:
    """Dynamo backend entry point (``torch.compile(model, backend="graphcomp")``).

    ``options`` is a mapping of :class:`graphcomp.Config` field names (or a Config)."""
    if mode is not None:
        raise ValueError(
            f"graphcomp does not take torch.compile(mode={mode!r}); pass options={{...}} with "
            "graphcomp.Config fields instead (valid: mode=None)"
        )
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"graphcomp.backend: gm must be a torch.fx.GraphModule (what Dynamo hands a backend), got "
                        f"{type(gm).__name__}; use torch.compile(model, backend=graphcomp.backend) or backend='graphcomp'")
    if not isinstance(example_inputs, (list, tuple)):
        raise TypeError(f"graphcomp.backend: example_inputs must be a list of the graph's inputs, got "
                        f"{type(example_inputs).__name__}")
    cfg = Config.from_options(options)
    return FrameCompiler(gm, example_inputs, cfg).compile(gm, example_inputs)
