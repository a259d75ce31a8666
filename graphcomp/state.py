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
        # process-group names of mesh dimensions graphcomp.shard(mesh=...) does not
        # shard over (tensor parallel): the passes leave their collectives alone.
        # Kept by reset() (it describes sharded models, not compiles); emptied when
        # the process group is destroyed (graphcomp.mesh_sharding)
        self.foreign_groups: set[str] = set()

    def next_frame_id(self) -> int:
        return next(self._frame_ids)

    def reset(self) -> None:
        self.counters.reset()
        self._frame_ids = itertools.count()
        self.frames.clear()
        self.scopes.clear()


STATE = _State()
