"""The one owned session object: counters, frame summaries, eager gather scopes and
the CUDA-graph runtime, all reset together by ``graphcomp.reset()``.

``SESSION`` is graphcomp's only process-wide mutable object. Its parts:

* ``counters`` -- :class:`graphcomp.counters.Counters` (``graphcomp.counters``);
* ``frames`` -- a bounded log of :class:`FrameRecord` (one per compiled frame), what
  ``summary.json`` and ``graphcomp.frame_summaries()`` render;
* ``scopes`` -- open eager gather scopes (``graphcomp.sharding.gather_scope``);
* ``pass_registry`` -- the passes the pipeline runs (built once from
  ``graphcomp.compiler.pipeline.PASS_ORDER``; kept by ``reset()``);
* ``shard_groups`` -- the groups ``graphcomp.shard`` shards over (kept by ``reset()``);
* ``exchange_groups`` -- the groups of ``shard(embedding="auto" | "exchange")``'s token
  exchange (kept by ``reset()``; not parameter collectives: the passes leave them alone);
* ``shape_following_code`` -- Dynamo ids of functions compiled with dynamic shapes;
* ``kept_gather_bytes``, ``keep_plans`` -- gathered bytes each compiled function keeps
  for its backward, and which (``schedule_free``'s ``reshard_after_forward="auto"``);
* ``exchange_plans`` -- the token counts whose embedding lookups exchange in each
  function (``embedding_exchange``: agreed at its first compile, reused by its recompiles);
* ``defer_plans`` -- how many reduce-scatters ``defer_weight_grads`` moves in each
  function's backward (agreed at its first compile, reused by its recompiles);
* ``agree_seq`` -- rank-agreement numbering (``graphcomp.compiler.agreement``; kept by ``reset()``);
* ``runtime`` -- the CUDA-graph runtime (``graphcomp.runtime.manager.Runtime``: pool,
  capture stream, runners, ledger). The runtime package creates it and attaches it here
  when it is imported, so this module imports nothing of graphcomp.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from graphcomp.counters import Counters

FRAME_LOG_LIMIT = 1000
"""Frame summaries kept per process; older ones are dropped (and counted)."""


@dataclass
class FrameRecord:
    """The summary of one compiled frame. ``info`` and ``stages`` hold what the
    backend recorded at compile time; ``plan`` (a :class:`graphcomp.compiler.plan.FramePlan`)
    renders each stage's pieces when the record is written, so runner statistics
    gathered at run time show up."""

    info: dict[str, Any]
    plan: Any
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def frame_id(self) -> int:
        return self.info["frame"]

    def to_json(self) -> dict[str, Any]:
        out = dict(self.info)
        stages = {}
        for name, st in self.stages.items():
            split = self.plan.splits.get(name) if self.plan is not None else None
            stages[name] = {**st, "partitions": split.rows() if split is not None else []}
        out["stages"] = stages
        return out


class FrameLog:
    """The last ``FRAME_LOG_LIMIT`` frame records, in compile order."""

    def __init__(self, limit: int = FRAME_LOG_LIMIT) -> None:
        self._records: collections.deque[FrameRecord] = collections.deque(maxlen=limit)
        self.dropped = 0

    def append(self, rec: FrameRecord) -> None:
        if len(self._records) == self._records.maxlen:
            self.dropped += 1
        self._records.append(rec)

    def __iter__(self) -> Iterator[FrameRecord]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def clear(self) -> None:
        self._records.clear()
        self.dropped = 0

    def to_json(self) -> list[dict[str, Any]]:
        return [r.to_json() for r in self._records]


class Session:
    def __init__(self) -> None:
        self.counters = Counters()
        self.frames = FrameLog()
        # open eager gather scopes: id(module) -> {name: gathered tensor} (graphcomp.sharding.gather_scope)
        self.scopes: dict[int, dict[str, Any]] = {}
        self.runtime: Any = None  # attached by graphcomp.runtime.manager
        # the pass registry (graphcomp.compiler.pipeline builds it on first use; reset() keeps it)
        self.pass_registry: Any = None
        # process-group names graphcomp.shard() shards over -> True when sharded by
        # shard(mesh=...) beside tensor parallelism. While such a sharding exists, a
        # collective on any other group is tensor parallel's: the passes leave it alone
        # (graph_utils.is_foreign_collective). Kept by reset() (it describes sharded
        # models, not compiles); emptied when the process group is destroyed
        self.shard_groups: dict[str, bool] = {}
        # shard(embedding="exchange"): the groups its token exchanges run on (their
        # collectives are activations', not parameters': graph_utils.is_foreign_collective)
        self.exchange_groups: set[str] = set()
        self._frame_ids = itertools.count()
        # rank agreement (graphcomp.compiler.agreement): "epoch" (Dynamo restarts of frame ids)
        # and "eager:<group>" (eager checks made on a group). Kept by reset(): the store
        # keys they number outlive a reset, so numbering must not restart (a stale key
        # of an earlier check would be read as this one's)
        self.agree_seq: dict[str, int] = {}
        self.agree_compile: Any = None  # the Dynamo compile agreement last saw (agreement.note_frame)
        # Dynamo ids of the functions (code objects) compiled at least once with dynamic
        # shapes: every CUDA-graph piece of such a function, fixed-shape
        # specializations included, follows the data (CudaGraphRunner.follows_data)
        self.shape_following_code: set[int] = set()
        # reshard_after_forward="auto" under the default budget: gathered bytes each
        # compiled graph ((Dynamo code id or "frame <id>", digest of its gathers' sizes))
        # keeps from its forward to its backward; a graph's keep decision leaves room
        # for the others' (the graphs of one step hold theirs at the same time)
        self.kept_gather_bytes: dict[Any, int] = {}
        # plans agreed across ranks at a function's first compile and reused by its
        # recompiles, per kind ("keep": schedule_free's kept gathers; "exchange": the
        # embedding lookups that exchange tokens; "defer": defer_weight_grads' count),
        # then per (function, digest of its graph). Passes reach it through
        # PassContext.env (graphcomp.compiler.compile_env.CompileEnv)
        self.plans: dict[str, dict[Any, Any]] = {}
        # graphcomp.shard's global optimizer step pre-hook (each optimizer's first step
        # checks it holds no parameter shard() replaced) and the optimizers it checked
        self.optimizer_hook: Any = None
        self.optimizers_checked: "weakref.WeakSet[Any]" = weakref.WeakSet()
        # where the backend writes its dumps (Config.dump_dir, rank): graphcomp.runtime's
        # teardown writes the run-time record (captured steps, counters) there too
        self.dump_target: tuple[str, int] | None = None

    def next_frame_id(self) -> int:
        return next(self._frame_ids)

    def reset(self) -> None:
        """Zero the counters, forget frame summaries and scopes, and tear the runtime
        down (every captured graph released; a fresh pool and stream on next use).
        The runtime goes first: with dumps on it writes ``runtime.json`` (the counters
        and measured peak as they are) before they are cleared."""
        if self.runtime is not None:
            self.runtime.reset()
        self.counters.reset()
        self._frame_ids = itertools.count()
        self.frames.clear()
        self.scopes.clear()
        self.shape_following_code.clear()
        self.kept_gather_bytes.clear()
        self.plans.clear()
        self.dump_target = None


SESSION = Session()
