"""Typed objects that flow between the stages of one compiled frame.

The backend, the passes and the runtime hand each other these, never string keys::

    FramePlan                      one per compiled frame (PassContext.frame)
      .inputs[stage]  StageInputs  set by the backend before the stage passes run:
                                   which inputs are static, which outputs reach user code
      .splits[stage]  SplitPlan    returned by partition_graph: the split graph, the graph
                                   it was split from, its Pieces and the SplitReasons
          .pieces     [Piece]      mode and reason (partition_graph), input kinds and
                                   outputs to clone (cudagraphs pass), and the runner's
                                   PieceStats (captures, pool bytes, turned eager at run time)

Frame summaries (``summary.json``, ``graphcomp inspect``) are rendered from these
objects when they are written (:meth:`SplitPlan.rows`), so what a runner learns at
run time shows without anyone writing into a summary row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch.fx as fx

PieceMode = Literal["cudagraph", "eager"]
InputKind = Literal["param", "saved", "piece_output", "copy", "scalar"]


@dataclass(frozen=True)
class SplitReason:
    """Why one node runs outside CUDA graphs (``kind``: one of ``REASON_KINDS``)."""

    node: str
    kind: str
    detail: str


REASON_KINDS = (
    "cpu", "host_sync", "data_dependent", "device_copy", "cudagraph_unsafe", "unbacked_shape",
    "user_split_op", "rng", "collective_pair", "too_small", "prefetched",
)

# node.meta key: a pass asks partition_graph to run this node eagerly (the value says
# why; SplitReason kind "prefetched": prefetch_across_steps' gather and its lookups)
EAGER_META = "graphcomp_eager"


@dataclass(frozen=True)
class StageInputs:
    """What the backend knows about a stage graph's inputs and outputs before its
    passes run: the indices of static inputs (parameters, buffers; in the backward
    the saved activations) and, for the forward, the outputs that reach user code
    (None: all of them)."""

    static_idxs: tuple[int, ...] = ()
    user_visible: tuple[int, ...] | None = None


@dataclass
class PieceStats:
    """What a piece's runner learned at run time (owned by the runner, read by the
    frame summary): captures made, pool bytes they hold, and why the piece turned
    eager for good (``"<kind>: <reason>"``), if it did."""

    runner: str | None = None
    captures: int = 0
    pool_bytes: int = 0
    turned_eager: str | None = None
    # host seconds of the capture calls' phases, summed over captures: "warmup" (the
    # WARMUP_ITERS eager runs: on a first call also Inductor's kernel loading and
    # autotuning), "trial_capture", "capture"
    capture_seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class Piece:
    """One piece of a split stage graph (submodule ``piece_<index>``)."""

    index: int
    mode: PieceMode
    nodes: int
    reason: str = ""  # why it runs eagerly ("" for a cudagraph piece)
    # the cudagraphs pass's runner plan (cudagraph pieces only)
    input_kinds: list[str] | None = None
    clone_outputs: frozenset[int] = frozenset()
    stats: PieceStats = field(default_factory=PieceStats)
    # compile regions inside the piece (Config.compile_regions on a captured graph:
    # compiled apart, run in order, captured as one graph); 1 otherwise
    regions: int = 1

    @property
    def name(self) -> str:
        return f"piece_{self.index}"

    @property
    def captured(self) -> bool:
        return self.mode == "cudagraph"

    def row(self) -> dict[str, Any]:
        """The JSON row of ``summary.json`` / ``graphcomp inspect``."""
        r: dict[str, Any] = {"piece": self.index, "mode": self.mode, "nodes": self.nodes, "reason": self.reason}
        if self.regions > 1:
            r["regions"] = self.regions
        if self.input_kinds is not None:
            r["static_inputs"] = sum(1 for k in self.input_kinds if k not in ("copy", "scalar"))
            r["copy_inputs"] = self.input_kinds.count("copy")
        st = self.stats
        if st.runner:
            r["runner"] = st.runner
        if st.captures:
            r["captures"] = st.captures
            r["pool_bytes"] = st.pool_bytes
        if st.capture_seconds:
            r["capture_seconds"] = {k: round(v, 4) for k, v in st.capture_seconds.items()}
        if st.turned_eager:
            r["mode"] = "eager"
            r["reason"] = st.turned_eager
        return r


@dataclass
class SplitPlan:
    """``partition_graph``'s result for one stage: ``split`` (a glue graph calling
    ``piece_<i>`` submodules), the unsplit graph it came from, the pieces in order and
    every node's reason for running outside CUDA graphs."""

    stage: str
    split: fx.GraphModule
    source: fx.GraphModule
    pieces: list[Piece]
    reasons: list[SplitReason]

    def piece(self, name: str) -> Piece:
        for p in self.pieces:
            if p.name == name:
                return p
        raise KeyError(f"no piece {name!r} in the {self.stage} split (pieces: {[p.name for p in self.pieces]})")

    def captured(self) -> list[Piece]:
        return [p for p in self.pieces if p.captured]

    def rows(self) -> list[dict[str, Any]]:
        return [p.row() for p in self.pieces]


@dataclass
class FramePlan:
    """Everything the stages of one frame hand each other (``PassContext.frame``)."""

    inputs: dict[str, StageInputs] = field(default_factory=dict)
    splits: dict[str, SplitPlan] = field(default_factory=dict)
    prefetch_cpu_graphs: bool = False
    """Let ``schedule_prefetch`` reorder graphs without CUDA tensors (CPU / gloo). Off by
    default: with several gloo collectives in flight the heap gets corrupted, rarely
    (under CPU contention) but reproducibly, also with raw functional collectives and
    no graphcomp graph (``docs/heap-corruption.md``). Tests and
    ``tests/stress/gloo_stress.py --prefetch-cpu on`` set it."""

    zero_copy_cpu_graphs: bool = False
    """Let ``zero_copy_buckets`` regroup the buckets of graphs without CUDA tensors
    (CPU / gloo). Off by default: gloo runs a grouped reduce-scatter as one collective
    per member, each bound by per-call latency, so on CPU the flat bucket is faster.
    Tests set it to check the pass's numerics on gloo."""

    code_id: int | None = None
    """Dynamo's id of the function this frame compiles (the same for its recompiles);
    None outside Dynamo (hand-built graphs)."""

    def stage_inputs(self, stage: str) -> StageInputs:
        return self.inputs.get(stage, StageInputs())

    def split_of(self, gm: fx.GraphModule, stage: str) -> SplitPlan | None:
        """The split plan whose split graph is ``gm`` (None: ``gm`` was not split)."""
        plan = self.splits.get(stage)
        return plan if plan is not None and plan.split is gm else None
