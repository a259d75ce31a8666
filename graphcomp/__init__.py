"""graphcomp: a torch.compile backend for sharded (ZeRO-3 / FSDP-style) training.

    import torch, graphcomp
    graphcomp.shard(model)
    model = torch.compile(model, backend="graphcomp", options={"passes": {...}})

``backend="graphcomp"`` also works without importing graphcomp (entry point group
``torch_dynamo_backends``).
"""

from __future__ import annotations

import logging as _logging

from . import env as _env
from .config import Config
from .sharding import shard
from .state import STATE as _STATE

__version__ = "0.1.0"

counters = _STATE.counters
"""Process-wide counters (a ``collections.Counter``); see ``graphcomp.state``."""


def reset() -> None:
    """Clear counters, frame ids and recorded frame summaries, and tear down the
    CUDA-graph runtime (every captured graph released, a fresh pool and capture
    stream on next use). Functions compiled before keep working, eagerly."""
    from .runtime import manager as _manager

    _STATE.reset()
    _manager.reset()


def backend(gm, example_inputs, **kwargs):  # noqa: ANN001 - Dynamo's backend signature
    """The Dynamo backend callable (same as ``backend="graphcomp"``)."""
    from .backend import graphcomp_backend

    return graphcomp_backend(gm, example_inputs, **kwargs)


_log = _logging.getLogger("graphcomp")
if _env.log_level():
    _log.setLevel(_env.log_level())

__all__ = ["Config", "backend", "counters", "reset", "shard", "__version__"]
