"""The one owned runtime object: shared CUDA-graph pool, capture stream, runners.

``RUNTIME`` is the runtime part of the session (``graphcomp.session.SESSION.runtime``,
the same object; ``graphcomp.reset()`` resets it in place). It holds:

* the memory pool every captured graph allocates from (``torch.cuda.graph_pool_handle()``),
* the side stream every warm-up and capture runs on,
* weak references to every :class:`~graphcomp.runtime.runner.CudaGraphRunner`, so
  :func:`teardown` can release all graphs,
* the capture depth behind :func:`is_capturing`, and the captures in progress
  (:func:`graphcomp.runtime.capture.recording`),
* the pool's output ledger (:class:`PoolLedger`): which captured graphs handed
  out tensors that live in the pool, in capture order, so a replay never
  overwrites one that is still referenced.

Counters go to ``graphcomp.counters`` (``pieces_captured``, ``pieces_eager``,
``captures``, ``recaptures``, ``replays``, ``cudagraph_fallbacks``,
``cudagraph_output_copy_bytes``, ``hazard_recaptures``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from graphcomp.session import SESSION
from graphcomp.runtime.device import CudaDevice
from graphcomp.runtime.pool import PoolLedger

log = logging.getLogger(__name__)

__all__ = ["RUNTIME", "CudaDevice", "PoolLedger", "Runtime", "check_nccl_env", "is_capturing",
           "nccl_env_problem", "reset", "teardown"]


class Runtime:
    def __init__(self) -> None:
        self.device: Any = CudaDevice()
        self._lock = threading.Lock()
        self.pool: Any = None
        self.stream: Any = None
        self.runners: "weakref.WeakSet[Any]" = weakref.WeakSet()
        # other owners of captured graphs (graphcomp.optim's captured steps): teardown
        # calls their release(final=True); they allocate from pools of their own
        self.owners: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._capturing = 0
        self.recordings: list[Any] = []  # the captures in progress (capture.Recording), innermost last
        self._setup_done = False
        self.ledger = PoolLedger()
        self.warmed_groups: set[str] = set()  # process groups whose first collective ran in a warm-up
        self.static_storages: set[int] = set()  # storage pointers of "param" inputs seen at capture
        self.pinned: list[tuple[Any, Any, list[Any]]] = []  # (pool, token, captures) kept alive by teardown
        self._pool_pin: Any = None  # (pool, token): the shared pool's own use while graphs may capture into it

    # ------------------------------------------------------------- set-up
    def ensure(self) -> None:
        """Create pool and stream on first use; install the teardown hooks and
        check the NCCL / expandable-segments setting once."""
        if self._setup_done:
            return
        with self._lock:
            if self._setup_done:
                return
            self.pool = self.device.pool_handle()
            self.stream = self.device.new_stream()
            check_nccl_env()
            from graphcomp import _compat

            _compat.wrap_destroy_process_group()
            _register_atexit()
            self._setup_done = True

    def keep_pool(self) -> None:
        """Before a capture into the shared pool: hold one use of it for as long as
        pieces may capture into it (until teardown). torch's allocator asserts
        (``use_count > 0`` in ``beginAllocateToPool``) when a capture reuses a pool
        whose graphs were all reset while its blocks are still held: a piece that is
        the only graph in the pool, re-captured while a user holds its outputs."""
        if self._pool_pin is None and self.pool is not None:
            self._pool_pin = (self.pool, self.device.pin_pool(self.pool))

    def _drop_pool_pin(self) -> None:
        if self._pool_pin is not None:
            pool, token = self._pool_pin
            self._pool_pin = None
            try:
                self.device.unpin_pool(pool, token)
            except Exception as e:  # pragma: no cover
                log.warning("graphcomp: releasing the CUDA-graph pool's own use failed: %s", e)

    def register(self, runner: Any) -> None:
        self.runners.add(runner)

    def register_owner(self, owner: Any) -> None:
        """Another owner of captured graphs (``owner.release(final=True) -> int``
        releases them): torn down with the runners."""
        self.owners.add(owner)

    def all_captures(self) -> list[Any]:
        """Every capture of a live runner, and the ledger's orphans."""
        caps = [c for r in list(self.runners) for c in r.captures.values()]
        seen = {id(c) for c in caps}
        return caps + [c for c in self.ledger.entries if id(c) not in seen]

    def pool_storages(self) -> set[int]:
        """Storage pointers of every output a captured piece holds or released."""
        out: set[int] = set()
        for c in self.all_captures():
            out.update(c.released)
            out.update(o.untyped_storage().data_ptr() for o in c.outputs if isinstance(o, torch.Tensor))
        return out

    # ---------------------------------------------------------- capturing
    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        self._capturing += 1
        try:
            yield
        finally:
            self._capturing -= 1

    def is_capturing(self) -> bool:
        if self._capturing > 0:
            return True
        try:
            return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        except RuntimeError:  # CPU-only build
            return False

    # ----------------------------------------------------------- teardown
    def teardown(self) -> int:
        """Release every captured graph and static buffer; returns how many graphs.
        While a released output (a saved activation whose backward has not run) is
        still referenced, the pool it lives in is kept from being freed until it dies."""
        self._unpin_dead()
        held = self.ledger.unsafe()
        if held and self.pool is not None:
            try:
                # the pool's own use (keep_pool) now keeps it for the held outputs
                pool, token = self._pool_pin or (self.pool, self.device.pin_pool(self.pool))
                self._pool_pin = None
                self.pinned.append((pool, token, held))
                log.info("graphcomp: teardown: %d piece(s) still have outputs referenced in the CUDA-graph pool; "
                         "the pool's memory stays reserved until they die", len(held))
            except Exception as e:  # pragma: no cover
                log.warning("graphcomp: could not keep the CUDA-graph pool alive at teardown: %s", e)
        n = 0
        for r in [*self.runners, *self.owners]:
            try:
                n += r.release(final=True)
            except Exception as e:  # never let teardown fail the exit path
                log.warning("graphcomp: releasing CUDA graphs of %s failed: %s", getattr(r, "name", r), e)
        if n:
            try:
                self.device.synchronize()
            except Exception:  # pragma: no cover
                pass
        if n:
            log.info("graphcomp: released %d CUDA graph(s)", n)
        self._drop_pool_pin()  # (unless held outputs took it over, above)
        self.ledger.clear()
        return n

    def owner_stats(self) -> list[dict[str, Any]]:
        """``stats()`` of every other owner of captured graphs (whole-step and
        optimizer-step captures), in a stable order."""
        out = []
        for o in list(self.owners):
            try:
                out.append(o.stats())
            except Exception as e:  # noqa: BLE001 - a report must not fail teardown
                out.append({"name": getattr(o, "name", type(o).__name__), "error": f"{type(e).__name__}: {e}"})
        return sorted(out, key=lambda st: str(st.get("name")))

    def _unpin_dead(self) -> None:
        keep = []
        for pool, token, caps in self.pinned:
            if any(c.unsafe_storages() for c in caps):
                keep.append((pool, token, caps))
            else:
                try:
                    self.device.unpin_pool(pool, token)
                except Exception as e:  # pragma: no cover
                    log.warning("graphcomp: releasing a kept CUDA-graph pool failed: %s", e)
        self.pinned = keep

    def teardown_and_record(self) -> int:
        """:meth:`teardown`, then (dumps on) ``runtime.json`` with what the owners did
        before it; returns how many graphs were released."""
        owners = self.owner_stats()
        n = self.teardown()
        _write_runtime_record(owners)
        return n

    def reset(self) -> None:
        """``graphcomp.reset()``'s part: :meth:`teardown_and_record` (the session clears
        its dump target and counters after this), then forget every runner, owner and
        the pool."""
        self.teardown_and_record()
        self.runners = weakref.WeakSet()
        self.owners = weakref.WeakSet()
        self.pool = None
        self.stream = None
        self._capturing = 0
        self.recordings = []
        self._setup_done = False
        self.ledger = PoolLedger()
        self.warmed_groups = set()
        self.static_storages = set()


RUNTIME = Runtime()
SESSION.runtime = RUNTIME  # owned by the session: graphcomp.reset() resets it


@functools.lru_cache(None)
def _register_atexit() -> None:
    """Once per process: tear down at interpreter exit."""
    atexit.register(teardown)


def _teardown_before_destroy(name: str | None = None) -> None:
    """Before any ``destroy_process_group``, a subgroup's too: a captured graph may
    hold NCCL work on the group being destroyed (the data-parallel group, or a tensor
    parallel group DTensor used inside it), and which groups a graph uses is not
    recorded, so every graph is released; the pieces are captured again at their
    next calls (``recaptures``)."""
    # looked up at call time: graphcomp.runtime.teardown (tests replace it)
    import graphcomp.runtime as _rt

    _rt.teardown()


def _register_destroy_hook() -> None:
    from graphcomp import _compat

    _compat.before_destroy_process_group(_teardown_before_destroy)


_register_destroy_hook()


def is_capturing() -> bool:
    """True while a graphcomp runner warms up or captures a piece (warm-up takes
    the same code path as capture), or while any CUDA stream capture is running
    on the current stream. Capture-aware ops branch on this."""
    return RUNTIME.is_capturing()


def teardown() -> int:
    """Release every CUDA graph graphcomp captured (and their static buffers).

    Call it before ``torch.distributed.destroy_process_group()``: a process that
    still holds graphs with captured collectives hangs there. graphcomp also runs
    it at interpreter exit (``atexit``) and from ``destroy_process_group`` itself
    once a graph was captured (``graphcomp._compat.wrap_destroy_process_group``).
    Compiled functions keep working afterwards, running their pieces eagerly.

    With dumps on (``Config.dump_dir`` / ``GRAPHCOMP_DUMP_DIR``) it first writes
    ``DIR/rank<R>/runtime.json``: every whole-step and optimizer-step capture (mode,
    calls, replays, re-captures, decisions), the counters and, on CUDA, the measured
    peak memory (:func:`measured_memory`), which ``graphcomp inspect DIR`` shows
    beside the graphs' estimated peaks."""
    return RUNTIME.teardown_and_record()


def _write_runtime_record(owners: list[dict[str, Any]]) -> None:
    target = SESSION.dump_target
    if target is None:
        return
    from graphcomp.compiler import dump

    try:
        rec = {"owners": owners, "counters": dict(SESSION.counters)}
        mem = measured_memory()
        if mem is not None:
            rec["memory"] = mem
        dump.write_runtime(target[0], target[1], rec)
    except Exception as e:  # noqa: BLE001 - never fail the exit path over a report
        log.warning("graphcomp: writing %s/rank%d/runtime.json failed: %s", target[0], target[1], e)


def measured_memory() -> dict[str, Any] | None:
    """The CUDA caching allocator's peaks on the current device (``torch.cuda.
    max_memory_allocated`` / ``max_memory_reserved``: since the process started or the
    user's last ``reset_peak_memory_stats``), for ``runtime.json``; None when CUDA was
    never initialized in this process (CPU runs)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    dev = torch.cuda.current_device()
    return {"device": f"cuda:{dev}", "max_allocated_bytes": int(torch.cuda.max_memory_allocated(dev)),
            "max_reserved_bytes": int(torch.cuda.max_memory_reserved(dev))}


def reset() -> None:
    """Tear down and forget every runner, the pool and the stream (tests)."""
    RUNTIME.reset()


def nccl_env_problem(environ: Any = None) -> str | None:
    """The warning text when expandable segments are on without
    ``NCCL_GRAPH_REGISTER=0`` (NCCL + CUDA graphs + expandable segments crash
    with an illegal memory access), else None."""
    env = os.environ if environ is None else environ
    conf = env.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + env.get("PYTORCH_ALLOC_CONF", "")
    opts = {}
    for part in conf.split(","):
        if ":" in part:
            k, v = part.split(":", 1)
            opts[k.strip()] = v.strip()
    if opts.get("expandable_segments", "").lower() == "true" and env.get("NCCL_GRAPH_REGISTER", "") != "0":
        return (
            "graphcomp: PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True but NCCL_GRAPH_REGISTER is not 0; "
            "NCCL collectives captured in CUDA graphs can crash (illegal memory access). "
            "Set NCCL_GRAPH_REGISTER=0 before NCCL initialises, or turn expandable segments off."
        )
    return None


def check_nccl_env() -> bool:
    msg = nccl_env_problem()
    if msg:
        log.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return False
    return True
