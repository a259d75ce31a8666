"""The one owned runtime object: shared CUDA-graph pool, capture stream, runners.

``RUNTIME`` is the only module-level mutable object of the runtime (``reset()``
drops everything). It holds:

* the memory pool every captured graph allocates from (``torch.cuda.graph_pool_handle()``),
* the side stream every warm-up and capture runs on,
* weak references to every :class:`~graphcomp.runtime.runner.CudaGraphRunner`, so
  :func:`teardown` can release all graphs,
* the capture depth behind :func:`is_capturing`,
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
import logging
import os
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)


class CudaDevice:
    """The CUDA calls the runner makes, in one place (tests swap in a CPU stand-in)."""

    def pool_handle(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def new_stream(self) -> Any:
        return torch.cuda.Stream()

    def current_stream(self) -> Any:
        return torch.cuda.current_stream()

    def wait(self, waiter: Any, on: Any) -> None:
        waiter.wait_stream(on)

    def stream(self, s: Any) -> Any:
        return torch.cuda.stream(s)

    def new_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def capture(self, g: Any, pool: Any, stream: Any, fn: Any, inputs: list[Any], replay_inputs: list[Any]) -> Any:
        """Capture ``fn(inputs)`` into ``g`` on ``stream`` in ``pool``; returns its
        outputs. ``fn`` consumes ``inputs`` (boxed). ``replay_inputs`` is the
        runner's static input list (a CUDA graph reads addresses, not this list).
        As ``torch.cuda.graph`` (synchronize and free cached blocks first), except
        that a failure always ends the capture and restores the current stream, so
        the process stays usable for eager execution."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        with torch.cuda.stream(stream):
            g.capture_begin(pool=pool)
            try:
                out = fn(inputs)
            except BaseException:
                try:
                    g.capture_end()
                except Exception:  # noqa: BLE001 - the capture is invalid anyway
                    pass
                raise
            g.capture_end()
        return out

    def trial_capture(self, stream: Any, fn: Any, inputs: list[Any]) -> None:
        """Capture ``fn`` on a copy of ``inputs`` (nothing consumed) into a
        throwaway graph and pool, instantiate and replay it once, then free it all:
        whatever capture, instantiation or the first replay would raise, raises here
        while the caller still holds every input (it can run the call eagerly).
        Costs one more run of the piece and a capture, at capture time only."""
        g = torch.cuda.CUDAGraph()
        outs = self.capture(g, torch.cuda.graph_pool_handle(), stream, fn, list(inputs), [])
        with torch.cuda.stream(stream):
            g.replay()
        stream.synchronize()
        del outs
        g.reset()
        del g
        torch.cuda.empty_cache()

    def pin_pool(self, pool: Any) -> Any:
        from .. import _compat

        dev = torch.cuda.current_device()
        _compat.pin_pool(dev, pool)
        return dev

    def unpin_pool(self, pool: Any, token: Any) -> None:
        from .. import _compat

        _compat.unpin_pool(token, pool)

    def synchronize(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def available(self) -> bool:
        return torch.cuda.is_available()

    device_type = "cuda"
    """The tensors' device type graphs are captured for (a stand-in device says "cpu")."""

    def supports_if_nodes(self) -> bool:
        """Whether a capture can contain a conditional (IF) node (CUDA >= 12.4)."""
        from .. import _compat

        return _compat.cuda_graph_if_supported()

    def run_if(self, g: Any, pred: Any, fn: Any) -> None:
        """Inside the capture of ``g``: capture ``fn()`` into an IF node that runs
        at replay only while ``pred`` (a 0-dim bool device tensor) is true."""
        from .. import _compat

        with _compat.cuda_graph_if(g, pred):
            fn()


class PoolLedger:
    """Which pool tensors are handed out, and who may overwrite them.

    Every capture gets a sequence number (``seq``) in capture order. A graph's
    replay writes only pool memory that was free while it was captured; memory
    of tensors that were alive then is never touched. So a replay of capture ``c``
    can overwrite

    * the outputs of captures with ``seq >= c`` (itself included: its own previous
      outputs): their memory may have been free while ``c`` was captured;
    * released outputs (``runner._Released``: internal outputs the runner does not
      keep) of older captures whose capture-time tensor had died by the end of
      ``c``'s capture call (``c.overwrites``): ``c`` may have reused that memory. A
      tensor passed to the very call (a saved activation the backward consumes) is
      overwritten only after its last read, as in the capture: not a conflict.

    ``entries`` are the captures (and ``orphans``: released captures whose outputs
    a user still holds) whose handed-out outputs have not yet been seen dead;
    ``conflicts`` lists the live ones a replay would overwrite."""

    def __init__(self) -> None:
        self.seq = 0
        self.entries: list[Any] = []

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def handed_out(self, cap: Any) -> None:
        if (cap.tracked or cap.released) and cap not in self.entries:
            self.entries.append(cap)

    def conflicts(self, cap: Any, consumed: set[int]) -> list[tuple[Any, list[int]]]:
        """(capture, live output indices) a replay of ``cap`` would overwrite;
        forgets captures whose outputs are all dead. ``consumed``: storage pointers of
        the tensors passed to this call."""
        out, keep = [], []
        for c in self.entries:
            if c.seq < cap.seq and not c.orphan and not c.released:
                keep.append(c)  # owned outputs of an older capture: never in this replay's way
                continue
            alive = c.alive_outputs()
            if not alive:
                c.orphan_done()
                continue
            keep.append(c)
            if c.seq >= cap.seq:
                out.append((c, alive))
                continue
            hit = cap.overwrites.get(c)
            if hit:
                bad = [i for i in alive if c.released_outs.get(i) in hit and c.released_outs[i] not in consumed]
                if bad:
                    out.append((c, bad))
        self.entries = keep
        return out

    def unsafe(self) -> list[Any]:
        """Captures with a released output still referenced over memory the allocator
        counts as free (no capture may run while there is one)."""
        return [c for c in self.entries if c.released and c.unsafe_storages()]

    def freed_storages(self, cap: Any, captures: list[Any]) -> "weakref.WeakKeyDictionary[Any, set[int]]":
        """Released storages of ``captures`` (but ``cap``) whose capture-time tensor is
        dead now (called at the end of ``cap``'s capture call: ``cap`` may have reused them)."""
        out: "weakref.WeakKeyDictionary[Any, set[int]]" = weakref.WeakKeyDictionary()
        for c in captures:
            if c is cap or not c.released:
                continue
            dead = {k for k, r in c.released.items() if not r.owner_alive()}
            if dead:
                out[c] = dead
        return out

    def forget(self, cap: Any, keep_if_alive: bool) -> bool:
        """A capture is released. Its outputs a user still holds stay tracked (an
        orphan: older pieces' replays must not overwrite them; dropped once dead)
        unless ``keep_if_alive`` is False (teardown). True when it stays tracked."""
        if cap in self.entries:
            if keep_if_alive and cap.alive_outputs():
                return True
            self.entries.remove(cap)
        return False

    def clear(self) -> None:
        for cap in self.entries:
            cap.orphan_done()
        self.entries = []


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
        self._setup_done = False
        self.ledger = PoolLedger()
        self.static_storages: set[int] = set()  # storage pointers of "param" inputs seen at capture
        self.pinned: list[tuple[Any, Any, list[Any]]] = []  # (pool, token, captures) kept alive by teardown

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
            from .. import _compat

            _compat.wrap_destroy_process_group()
            global _ATEXIT_REGISTERED
            if not _ATEXIT_REGISTERED:
                atexit.register(teardown)
                _ATEXIT_REGISTERED = True
            self._setup_done = True

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
                token = self.device.pin_pool(self.pool)
                self.pinned.append((self.pool, token, held))
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
        self.ledger.clear()
        return n

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

    def reset(self) -> None:
        self.teardown()
        self.runners = weakref.WeakSet()
        self.owners = weakref.WeakSet()
        self.pool = None
        self.stream = None
        self._capturing = 0
        self._setup_done = False
        self.ledger = PoolLedger()
        self.static_storages = set()


RUNTIME = Runtime()
_ATEXIT_REGISTERED = False


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
    Compiled functions keep working afterwards, running their pieces eagerly."""
    return RUNTIME.teardown()


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
