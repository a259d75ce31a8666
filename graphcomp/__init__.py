"""graphcomp: a torch.compile backend for sharded (ZeRO-3 / FSDP-style) training.

    import torch, graphcomp
    graphcomp.shard(model)
    model = torch.compile(model, backend="graphcomp", options={"passes": {...}})

``backend="graphcomp"`` also works without importing graphcomp (entry point group
``torch_dynamo_backends``).
"""

from __future__ import annotations

import logging as _logging

from graphcomp import _compat
from graphcomp import env as _env
from graphcomp import fp8
from graphcomp import optim
from graphcomp.config import Config
from graphcomp.sharding.shard import full_state_dict, shard
from graphcomp.compiler.guard_filter import guard_filter
from graphcomp.runtime.whole_step import capture_step
from graphcomp.train import TrainStep, train_step
from graphcomp import runtime as _runtime  # noqa: F401 (attaches the CUDA-graph runtime to the session)
from graphcomp.session import SESSION as _SESSION
from graphcomp.compiler import backend as _backend_module

__version__ = "0.1.0"

counters = _SESSION.counters
"""What graphcomp did, counted (:class:`graphcomp.counters.Counters`: a read-only
mapping of the non-zero counters; an unknown name raises ``KeyError``)."""


def reset() -> None:
    """Zero the counters, forget frame ids and recorded frame summaries, and tear down
    the CUDA-graph runtime (every captured graph released, a fresh pool and capture
    stream on next use). Functions compiled before keep working, eagerly."""
    _SESSION.reset()


def frame_summaries() -> list[dict]:
    """The summary of every frame compiled since the last ``reset()`` (the most recent
    1000), as written to ``summary.json``: per stage the passes' records, collectives,
    memory estimate and the pieces of split graphs with what their runners did."""
    return _SESSION.frames.to_json()


def backend(gm, example_inputs, **kwargs):  # noqa: ANN001 - Dynamo's backend signature
    """The Dynamo backend callable, the same as ``backend="graphcomp"``:
    ``torch.compile(model, backend=graphcomp.backend)`` (options through
    ``functools.partial(graphcomp.backend, options={...})``)."""
    return _backend_module.graphcomp_backend(gm, example_inputs, **kwargs)


_log = _logging.getLogger("graphcomp")
if _env.log_level():
    _log.setLevel(_env.log_level())
_compat.graph_logger()  # registers the "graphcomp_graphs" artifact of torch._logging.set_logs

__all__ = ["Config", "backend", "capture_step", "counters", "fp8", "frame_summaries", "full_state_dict", "guard_filter", "optim", "reset", "shard", "train_step", "TrainStep",
           "__version__"]
