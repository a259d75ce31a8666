"""Graph dumps and the per-rank ``summary.json``.

Layout under ``Config.dump_dir`` (one tree per rank, so ranks never collide)::

    DIR/rank0/summary.json
    DIR/rank0/frame000/joint/input.txt
    DIR/rank0/frame000/joint/01-fuse_allgather_downcast.before.txt
    DIR/rank0/frame000/joint/01-fuse_allgather_downcast.after.txt
    DIR/rank0/frame000/joint/output.txt
    DIR/rank0/frame000/fwd/...        (and bwd/, inference/)

Each ``.txt`` is ``GraphModule.print_readable(include_stride=True, include_device=True)``.
``summary.json`` lists frames -> stages -> passes (with their records), op counts,
collectives (dtype, bytes, bucket) and partitions. Whether or not ``dump_dir`` is
set, each stage's input and every changed pass output also go to torch's
structured trace (``TORCH_TRACE=/tmp/t`` then ``tlparse``), named
``graphcomp_frame<F>_<stage>_<NN>_<pass>``, and under the same names to torch's
graph logging (``_compat.log_graph``): ``depyf.prepare_debug`` dump directories
and ``TORCH_LOGS="+graphcomp"``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch.fx as fx

from graphcomp import _compat

log = logging.getLogger(__name__)

SUMMARY_VERSION = 1


def readable(gm: fx.GraphModule) -> str:
    return _compat.print_readable(gm)


class Dumper:
    """Writes the graphs of one frame on one rank; ``root=None`` writes only to
    the structured trace."""

    def __init__(self, root: str | None, rank: int, frame_id: int):
        self.root = Path(root) / f"rank{rank}" if root else None
        self.rank = rank
        self.frame_id = frame_id

    def stage_dir(self, stage: str) -> Path | None:
        if self.root is None:
            return None
        d = self.root / f"frame{self.frame_id:03d}" / stage
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _write(self, stage: str, fname: str, text: str) -> None:
        d = self.stage_dir(stage)
        if d is not None:
            (d / fname).write_text(text)

    def _text(self, gm: fx.GraphModule):
        """``readable(gm)``, formatted once and only when something reads it: the
        dump directory or an enabled structured trace (formatting a deep model's graph
        is slow, and a compile formats a dozen)."""
        cache: list[str] = []

        def get() -> str:
            if not cache:
                cache.append(readable(gm))
            return cache[0]

        return get

    def graph(self, frame_id: int, stage: str, what: str, gm: fx.GraphModule) -> None:
        text = self._text(gm)
        if self.root is not None:
            self._write(stage, f"{what}.txt", text())
        if what == "input":
            name = f"graphcomp_frame{frame_id}_{stage}_input"
            _compat.trace_artifact(name, text)  # (formats only if a trace is being written)
            _compat.log_graph(name, gm)

    def pass_graph(self, frame_id: int, stage: str, idx: int, name: str, when: str, gm: fx.GraphModule) -> None:
        if self.root is None and when == "before":
            return
        text = self._text(gm)
        if self.root is not None:
            self._write(stage, f"{idx:02d}-{name}.{when}.txt", text())
        if when == "after":
            art = f"graphcomp_frame{frame_id}_{stage}_{idx:02d}_{name}"
            _compat.trace_artifact(art, text)
            _compat.log_graph(art, gm)


def _write_rank_json(root: str | None, rank: int, name: str, body: dict[str, Any]) -> Path | None:
    """Atomically (re)write ``DIR/rank<R>/<name>`` with the version and rank, then ``body``."""
    if not root:
        return None
    d = Path(root) / f"rank{rank}"
    d.mkdir(parents=True, exist_ok=True)
    path = d / name
    tmp = d / f".{name}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"version": SUMMARY_VERSION, "rank": rank, **body}, indent=1, default=str))
    os.replace(tmp, path)
    return path


def write_summary(root: str | None, rank: int, frames: list[dict[str, Any]]) -> Path | None:
    """Atomically (re)write ``DIR/rank<R>/summary.json``."""
    return _write_rank_json(root, rank, "summary.json", {"frames": frames})


def write_runtime(root: str | None, rank: int, record: dict[str, Any]) -> Path | None:
    """Atomically (re)write ``DIR/rank<R>/runtime.json``: what ran captured, written by
    ``graphcomp.runtime.teardown()`` (the whole-step and optimizer-step captures with
    their decisions, and the counters then)."""
    return _write_rank_json(root, rank, "runtime.json", record)


def load_runtime(root: str | os.PathLike, rank: int) -> dict[str, Any] | None:
    """``DIR/rank<R>/runtime.json``, or None when no teardown wrote one."""
    p = Path(root) / f"rank{rank}" / "runtime.json"
    return json.loads(p.read_text()) if p.is_file() else None


def load_summaries(root: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """rank -> summary, for every ``rank*/summary.json`` under ``root``."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"dump directory {str(root)!r} does not exist")
    out = {}
    for p in sorted(root.glob("rank*/summary.json")):
        data = json.loads(p.read_text())
        out[int(data["rank"])] = data
    if not out:
        raise ValueError(f"no rank*/summary.json under {str(root)!r}: was it written with Config.dump_dir / GRAPHCOMP_DUMP_DIR?")
    return out
