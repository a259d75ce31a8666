"""graphcomp runtime: CUDA-graph runners, memory pool and teardown.

* :func:`is_capturing` -- True while graphcomp warms up or captures a piece (warm-up
  runs the same code path as capture), or any stream capture is in progress.
* :func:`teardown` -- release every captured graph; call it before
  ``torch.distributed.destroy_process_group()``. It also runs at exit (``atexit``)
  and from ``destroy_process_group`` once graphcomp captured a graph
  (``graphcomp._compat.wrap_destroy_process_group``).
* :func:`reset` -- teardown and forget runners, pool and stream (tests).

Modules, by concept: ``manager`` (the one owned ``RUNTIME``: pool, stream, runners,
teardown), ``device`` (the CUDA seam the CPU tests replace), ``pool`` (captures, the
outputs they hand out, the ledger of what a replay may overwrite), ``runner`` (one
compiled piece: decide replay / capture / eager, then act), ``static`` (input kinds
and layout-exact static buffers), ``codegen`` (compile a split graph's pieces and
run its glue).
"""

from graphcomp.runtime.manager import RUNTIME, check_nccl_env, is_capturing, nccl_env_problem, reset, teardown
from graphcomp.runtime.runner import CudaGraphRunner, EagerPiece, StaticAddressError

__all__ = [
    "RUNTIME", "CudaGraphRunner", "EagerPiece", "StaticAddressError", "check_nccl_env",
    "is_capturing", "nccl_env_problem", "reset", "teardown",
]
