"""graphcomp: a torch.compile backend for sharded (ZeRO-3 / FSDP-style) training.

    import torch, graphcomp
    graphcomp.shard(model)
    model = torch.compile(model, backend="graphcomp", options={"passes": {...}})

``backend="graphcomp"`` also works without importing graphcomp (entry point group
``torch_dynamo_backends``).
"""

from __future__ import annotations

import importlib.util as _util
import logging as _logging
import pathlib as _pathlib
import sys as _sys


class _CheckoutPassesFinder:
    """``graphcomp.passes`` is the top-level ``passes/`` directory of the checkout this
    ``graphcomp`` package was imported from (an installed wheel ships it as
    ``graphcomp/passes``, and nothing here applies). Without this, a source checkout on
    ``sys.path`` beside another checkout's editable install would import *that*
    checkout's passes, silently; and a checkout that is not installed would not find
    ``graphcomp.passes`` at all."""

    def __init__(self, root: _pathlib.Path) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 - importlib protocol
        if fullname != "graphcomp.passes":
            return None
        return _util.spec_from_file_location(
            fullname, self.root / "__init__.py", submodule_search_locations=[str(self.root)]
        )


def _bind_checkout_passes() -> None:
    here = _pathlib.Path(__file__).resolve().parent
    src = here.parent / "passes"
    if (here / "passes").is_dir() or not (src / "__init__.py").is_file():
        return  # an installed package (graphcomp/passes), or no checkout layout
    if "shipped as ``graphcomp.passes``" not in (src / "__init__.py").read_text():
        return  # some other top-level "passes" package beside us: not ours
    if not any(isinstance(f, _CheckoutPassesFinder) for f in _sys.meta_path):
        _sys.meta_path.insert(0, _CheckoutPassesFinder(src))


_bind_checkout_passes()

from . import _compat
from . import env as _env
from . import optim
from .config import Config
from .sharding import shard
from .guard_filter import guard_filter
from .step_capture import capture_step
from . import runtime as _runtime  # noqa: F401 (attaches the CUDA-graph runtime to the session)
from .session import SESSION as _SESSION

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


# the submodule graphcomp.backend is loaded first, so that the name `backend` below
# (the callable) is what the package exports: a later `import graphcomp.backend` finds
# the module in sys.modules and does not rebind the package attribute
from . import backend as _backend_module  # noqa: E402


def backend(gm, example_inputs, **kwargs):  # noqa: ANN001 - Dynamo's backend signature
    """The Dynamo backend callable, the same as ``backend="graphcomp"``:
    ``torch.compile(model, backend=graphcomp.backend)`` (options through
    ``functools.partial(graphcomp.backend, options={...})``)."""
    return _backend_module.graphcomp_backend(gm, example_inputs, **kwargs)


_log = _logging.getLogger("graphcomp")
if _env.log_level():
    _log.setLevel(_env.log_level())
_compat.graph_logger()  # registers the "graphcomp_graphs" artifact of torch._logging.set_logs

__all__ = ["Config", "backend", "capture_step", "counters", "frame_summaries", "guard_filter", "optim", "reset", "shard",
           "__version__"]
