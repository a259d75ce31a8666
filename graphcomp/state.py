"""The one owned runtime object: process-wide counters and ids, with ``reset()``.

``graphcomp.counters`` is ``STATE.counters``: a ``collections.Counter`` keyed by
name (``frames_compiled``, ``recompiles``, ``passes_run``, ``passes_changed``,
``pass:<name>:changed``, ``gathers_fused``, ``bytes_gathered:<dtype>``, ...).
Missing keys read as 0. ``graphcomp.reset()`` clears everything here.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any


class Counters(collections.Counter):
    """A Counter with ``reset()``; tests assert on it."""

    def reset(self) -> None:
        self.clear()


class _State:
    def __init__(self) -> None:
        self.counters = Counters()
        self._frame_ids = itertools.count()
        # rank -> list of frame summaries, written to summary.json by graphcomp.dump
        self.frames: list[dict[str, Any]] = []
        # open eager gather scopes: id(module) -> {name: gathered tensor} (graphcomp.gather_scope)
        self.scopes: dict[int, dict[str, Any]] = {}
        # process-group names graphcomp.shard() shards over -> True when sharded by
        # shard(mesh=...) beside tensor parallelism. While such a sharding exists, a
        # collective on any other group is tensor parallel's: the passes leave it alone
        # (graph_utils.is_foreign_collective). Kept by reset() (it describes sharded
        # models, not compiles); emptied when the process group is destroyed
        self.shard_groups: dict[str, bool] = {}

    def next_frame_id(self) -> int:
        return next(self._frame_ids)

    def reset(self) -> None:
        self.counters.reset()
        self._frame_ids = itertools.count()
        self.frames.clear()
        self.scopes.clear()


STATE = _State()
