"""CudaGraphRunner: warm up, capture and replay one compiled piece.

Per input-shape signature (shapes, strides, dtypes, devices of tensor inputs and
the values of scalar inputs), up to ``Config.max_captures`` captures; beyond that
the piece runs eagerly with a warning. For each capture::

    warm-up  : the compiled piece runs ``WARMUP_ITERS`` times on the capture stream
               with is_capturing() True (the same code path as capture); its
               collectives are recorded, not run (``_compat.collectives_not_run``:
               zeros of their shape; a process group's first collective runs),
               and so are the trial capture's (its throwaway graph is replayed
               once): a capture call issues each collective once (the replay of
               the real capture), as a replay call does
    capture  : captured (runtime.capture.capture) on the capture stream into the
               shared pool (RUNTIME.pool)
    replay   : copy "copy" inputs into static buffers (one torch._foreach_copy_),
               check static addresses, replay, hand outputs back

(Just over graphcomp's ~500-line guideline: the decisions of one call (replay,
capture, eager with a reason) read together; the pool's bookkeeping lives in
``pool.py``, input kinds and static buffers in ``static.py``.)

Output safety (never silent stale data). Outputs are handed out as aliases of
the pool tensors; ``RUNTIME.ledger`` (:class:`~graphcomp.runtime.manager.PoolLedger`)
knows, by capture order, which handed-out tensors a replay could overwrite (its
own previous outputs, those of pieces captured after it, and pool memory that was
free when it was captured) and checks them before every replay. When one is
still referenced:

* a *visible* output (``clone_outputs``: the loss, logits, every backward output =
  gradients bound for ``param.grad``) held by user code: its piece copies that
  output out of the pool from then on, and the piece about to replay is captured
  again around the live tensor (``hazard_recaptures``); with
  ``Config.copy_outputs="always"`` visible outputs are always copied, and visible
  outputs of at most ``copy_below`` bytes (the forward's loss) always are. Before
  deciding, ``gc.collect()`` runs once per capture involved: a compile's reference
  cycles hold the first call's outputs until the cyclic collector runs;
* this piece's own internal output (a saved activation whose backward has not
  run: two forwards before one backward), or a released output (below) in memory
  this piece was captured over: this call runs eagerly instead
  (``cudagraph_fallbacks``, one warning per runner);
* an internal output of a piece captured after this one (it was re-captured, so
  this piece's inputs now come from it): this piece is captured again.

Released outputs (memory). A runner keeps no reference to its *internal*
outputs (saved activations, values for the next piece): the capture call hands
out the tensors the capture allocated, later replays hand out new tensors built
on the same pool memory without owning it (``_compat.pool_storage``, ``_compat.pool_views``). So when the
consumer (the backward) is captured, the activations it frees are free in the
pool and its own buffers (gradients, scratch) reuse them, as they would without
CUDA graphs. A replay of the consumer overwrites that memory after its last read;
the ledger allows it only for tensors passed to that very call. A capture never
runs while such a tensor is alive over memory the allocator considers free (it
could be allocated again): that call runs eagerly (``cudagraph_fallbacks``).
Inputs are taken boxed (``call(list)``; the list is cleared) so a consumed input
is freed inside the capture.
"""

from __future__ import annotations

import gc
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphcomp.errors import CaptureFailed as _CaptureFailed
from graphcomp.errors import CudaGraphsRequired, StaticAddressError, failing_source as _failing_source
from graphcomp.compiler.plan import PieceStats
from graphcomp.session import SESSION
from graphcomp.runtime import capture
from graphcomp.runtime.manager import RUNTIME
from graphcomp.runtime.pool import Capture, _storage_id, _storage_ptr, describe_holders
from graphcomp.runtime.static import memory_of, static_buffer

log = logging.getLogger(__name__)

WARMUP_ITERS = 2
REENTRY_LIMIT = 3  # a piece that falls back this often turns eager for good (see CudaGraphRunner._miss)


def signature(args: Sequence[Any]) -> tuple[Any, ...]:
    """The key of a call's capture: per tensor its shape, strides, dtype, device and
    requires_grad; per other value its type and value (run before every replay:
    kept to attribute reads, no conversions)."""
    sig = []
    Tensor = torch.Tensor
    for a in args:
        if isinstance(a, Tensor):
            sig.append((a.shape, a.stride(), a.dtype, a.device, a.requires_grad))
        elif isinstance(a, (int, float, bool, str, type(None))):
            sig.append(("s", type(a).__name__, a))
        else:
            sig.append(("s", type(a).__name__, repr(a)))
    return tuple(sig)


class CudaGraphRunner:
    """Callable that replaces one compiled piece: ``runner(*args) -> tuple``."""

    def __init__(
        self,
        name: str,
        fn: Callable[[list[Any]], Any],
        input_kinds: Sequence[str],
        *,
        clone_outputs: set[int] | None = None,
        copy_outputs: str = "auto",
        copy_below: int = 0,
        max_captures: int = 8,
        check_static_inputs: str = "first",
        on_address_change: str = "error",
        input_names: Sequence[str] | None = None,
        stats: PieceStats | None = None,
        require: bool = False,
        dynamic: bool = False,
        code: int | None = None,
        mutated_inputs: Sequence[int] = (),
    ):
        self.name = name
        self.require = require  # Config.cudagraphs == "require": a capture failure raises
        self.dynamic = dynamic  # traced with symbolic shapes: its input shapes may follow the data
        self.code = code  # Dynamo's id of the function (code object) this piece's frame compiles
        # inputs the piece writes in place (functionalized input mutations: BatchNorm's
        # running statistics). A capture call runs the piece WARMUP_ITERS times, then a
        # trial replay, before its real replay: their writes are undone (_capture), and
        # a copied input's write goes back to the caller's tensor after each replay
        self.mutated = list(mutated_inputs)
        self.disabled: str | None = None  # why this piece runs eagerly for good (a failed capture)
        self.fn = fn  # boxed: fn(list) -> sequence of outputs
        self.kinds = list(input_kinds)
        self.visible = set(clone_outputs or ())  # outputs that leave graphcomp (user code, param.grad)
        # visible outputs copied out of the pool after each replay: all of them with
        # copy_outputs="always"; with "auto" the ones seen still held at a later replay
        self.copy_now = set(self.visible) if copy_outputs == "always" else set()
        # visible outputs of at most this many bytes are always copied (the forward's
        # loss and metrics: small, and often kept for logging; handing them out of the
        # pool would re-capture the forward around a kept loss)
        self.copy_below = copy_below
        self.hazard_recaptures = 0
        self.misses = 0  # calls run eagerly because of a hazard (see _miss)
        self.max_captures = max_captures
        self.check_always = check_static_inputs == "always"
        self.recapture = on_address_change == "recapture"
        self.input_names = list(input_names) if input_names else [f"input {i}" for i in range(len(self.kinds))]
        self.captures: dict[tuple[Any, ...], Capture] = {}
        self._warned: set[str] = set()
        self._static_slots: list[int] = []
        # what this runner learns at run time (its piece's row in summaries and `graphcomp inspect`)
        self.stats = stats if stats is not None else PieceStats()
        self.stats.runner = type(self).__name__
        self.released = False  # set by teardown(): from then on every call runs eagerly
        RUNTIME.ensure()
        RUNTIME.register(self)
        SESSION.counters.add("pieces_captured")

    # ------------------------------------------------------------ helpers
    @property
    def follows_data(self) -> str | None:
        """Why this piece's call pattern follows the data (None when it does not):
        traced with symbolic shapes, or one fixed-shape specialization of a function
        Dynamo also compiled with dynamic shapes (tokens per expert in a Python MoE
        loop: such a frame runs only in steps where that exact size comes up, so its
        calls land at unpredictable points of a step). Such a piece turns eager at
        its first hazard instead of falling back ``REENTRY_LIMIT`` times."""
        if self.dynamic:
            return "dynamic shapes"
        if self.code is not None and self.code in SESSION.shape_following_code:
            return "one shape of a function Dynamo also compiled with dynamic shapes"
        return None

    def _warn(self, key: str, msg: str, fallback: bool = True) -> None:
        """Log ``msg`` (warn once per key); ``fallback``: this call runs eagerly
        because of a runtime hazard (``cudagraph_fallbacks``)."""
        if fallback:
            SESSION.counters.add("cudagraph_fallbacks")
        if key in self._warned:
            log.debug(msg)
            return
        self._warned.add(key)
        log.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)

    def _eager(self, args: list[Any]) -> tuple[Any, ...]:
        return tuple(self.fn(args))

    def release(self, final: bool = False) -> int:
        """Drop every capture; ``final`` (teardown) also makes later calls eager."""
        n = sum(1 for c in self.captures.values() if c.graph is not None)
        for c in self.captures.values():
            c.release(keep_live_outputs=not final)
        self.captures.clear()
        self.released = self.released or final
        return n

    def stats(self) -> dict[str, Any]:
        return {"name": self.name, "captures": len(self.captures), "input_kinds": list(self.kinds)}

    # ------------------------------------------------------------ capture
    def _classify_at_capture(self, args: list[Any]) -> None:
        """Parameters are remembered as static storages; a ``saved`` / ``piece_output``
        input that is neither pool memory of a captured piece nor a parameter (a user
        tensor the forward saved, an eager piece's output) arrives at a new address
        every step: it becomes a copied input now, before the first capture, rather
        than after a second capture."""
        pool = None
        changed = False
        for i, kind in enumerate(self.kinds):
            a = args[i]
            if not isinstance(a, torch.Tensor):
                continue
            if kind == "param":
                RUNTIME.static_storages.add(_storage_ptr(a))
            elif kind in ("saved", "piece_output"):
                if pool is None:
                    pool = RUNTIME.pool_storages()
                ptr = _storage_ptr(a)
                if ptr not in pool and ptr not in RUNTIME.static_storages:
                    log.info("graphcomp: piece %s: input %s is not pool memory of a captured piece nor a "
                             "parameter; copying it into a static buffer", self.name, self.input_names[i])
                    self.kinds[i] = "copy"
                    changed = True
        if changed and self.captures:  # captures of other shapes have no buffer for that input
            self.release()
            SESSION.counters.add("recaptures")

    def _capture(self, args: list[Any]) -> Capture:
        """Warm up, trial-capture, then capture on ``args``, which the real capture
        consumes (clears): an input the piece frees after its last use (a saved
        activation) is freed in the capture, so the graph's own buffers may reuse
        its memory. Warm-up and the trial capture run while every input is still
        held: a failure there raises :class:`_CaptureFailed` with ``args`` intact (the
        caller runs the call eagerly)."""
        self._classify_at_capture(args)
        cap = Capture(self, RUNTIME.ledger)
        static_in: list[Any] = []
        for i, kind in enumerate(self.kinds):
            a = args[i]
            if isinstance(a, torch.Tensor) and kind == "copy":
                view, cap.bases[i] = static_buffer(a)  # every layout: expanded, overlapping, offset, empty
                static_in.append(view)
            else:
                static_in.append(a)
        a = None  # (the loop variable must not keep the last input alive through the capture)
        cap.inputs = static_in
        cap.ptrs = [x.data_ptr() if isinstance(x, torch.Tensor) else None for x in static_in]
        from graphcomp import _compat

        dev = RUNTIME.device
        stream = RUNTIME.stream
        phase = "warm-up"
        secs = self.stats.capture_seconds
        t0 = time.perf_counter()
        # the values of written inputs before the warm-ups: put back before the real
        # capture (its replay is this call's one write) or before the eager fallback
        undo = [(static_in[i], static_in[i].clone()) for i in self.mutated if isinstance(static_in[i], torch.Tensor)]
        try:
            dev.wait(stream, dev.current_stream())
            with RUNTIME.capturing():
                # collectives recorded, not run: this call issues each once (its replay), as a
                # replay call does, so a rank capturing alone stays in step with its peers
                with dev.stream(stream), _compat.collectives_not_run(RUNTIME.warmed_groups) as not_run:
                    for _ in range(WARMUP_ITERS):
                        self.fn(list(static_in))
                SESSION.counters.add("warmup_collectives_stood_in", not_run.stood_in)
                t1 = time.perf_counter()
                secs["warmup"] = secs.get("warmup", 0.0) + t1 - t0
                phase = "trial capture"
                # the trial graph is replayed once: captured without its collectives, so
                # that replay issues none (a capture call's one issue is the real replay)
                with _compat.collectives_not_run(None):
                    capture.trial_capture(self.fn, static_in)
                secs["trial_capture"] = secs.get("trial_capture", 0.0) + time.perf_counter() - t1
            dev.wait(dev.current_stream(), stream)
        except Exception as e:  # noqa: BLE001 - any failure: the piece runs eagerly (or "require" raises)
            dev.wait(dev.current_stream(), stream)
            _undo_writes(undo)
            cap.inputs = []
            raise _CaptureFailed(phase, e) from e
        _undo_writes(undo)
        del undo
        # inputs by weak reference: one freed inside the capture (consumed) is not
        # aliased by an output that the allocator placed at its old address
        in_refs = [(i, _compat.storage_weakref(x)) for i, (x, k) in enumerate(zip(static_in, self.kinds))
                   if isinstance(x, torch.Tensor) and k != "copy"]
        buf_storages = {_storage_id(x) for x, k in zip(static_in, self.kinds) if isinstance(x, torch.Tensor) and k == "copy"}
        t2 = time.perf_counter()
        # hold only our own static buffers: a non-copy input (a saved activation,
        # another piece's output) must not be kept alive by this capture
        self._static_slots = [i for i, (x, k) in enumerate(zip(static_in, self.kinds)) if isinstance(x, torch.Tensor) and k != "copy"]
        ins = list(static_in)
        for i in self._static_slots:
            static_in[i] = None
        args.clear()
        try:
            rec = capture.capture("piece", self.fn, ins, static_in, pool=capture.SHARED)
        except Exception as e:  # noqa: BLE001
            self._disable(f"capture failed after a successful trial capture: {type(e).__name__}: {e}")
            raise RuntimeError(
                f"graphcomp: capturing CUDA-graph piece {self.name} failed after its trial capture succeeded "
                f"({type(e).__name__}: {e}); this call's inputs were consumed by the capture and cannot be "
                f"recomputed. The piece runs eagerly from the next call on; compile with cudagraphs='off' to "
                f"avoid capture altogether."
            ) from e
        del ins
        outs = rec.outputs
        secs["capture"] = secs.get("capture", 0.0) + time.perf_counter() - t2
        cap.graph = rec.graph
        del rec
        in_index = {r.cdata: i for i, r in in_refs if not r.expired()}
        del in_refs
        # internal outputs are released (see the module docstring); views of a non-copied
        # input are rebuilt from each call's input; an alias of a static buffer of ours
        # is kept and tracked (the next copy overwrites it)
        if self.copy_below:
            self.copy_now.update(i for i in self.visible if i < len(outs) and isinstance(outs[i], torch.Tensor)
                                 and outs[i].numel() * outs[i].element_size() <= self.copy_below)
        cap.release_outputs(list(outs), self.visible, in_index, buf_storages)
        del outs
        SESSION.counters.add("captures")
        pool = sum(rel.nbytes for rel in cap.released.values())
        pool += sum(o.numel() * o.element_size() for o in cap.outputs if isinstance(o, torch.Tensor))
        pool += sum(b.numel() * b.element_size() for b in cap.bases.values())
        self.stats.captures += 1
        self.stats.pool_bytes += pool  # outputs + buffers
        log.info("graphcomp: captured %s (%d capture(s))", self.name, len(self.captures) + 1)
        return cap

    def _disable(self, reason: str, kind: str = "capture_failed") -> None:
        """This piece runs eagerly for good (its graphs are released), with
        ``kind: reason`` recorded on its row of the frame summary (``graphcomp
        inspect``): a failed capture (``capture_failures``), or a call pattern its
        graph cannot serve (``pieces_turned_eager``). Later calls are not counted as
        fallbacks: the piece is eager by decision, as if partition_graph had cut it."""
        self.disabled = reason
        self.release()
        self.stats.turned_eager = f"{kind}: {reason}"
        SESSION.counters.add("capture_failures" if kind == "capture_failed" else "pieces_turned_eager")
        SESSION.counters.add("pieces_eager")
        if kind == "capture_failed":
            msg = (f"graphcomp: CUDA-graph piece {self.name} cannot be captured ({reason}); it runs eagerly from now "
                   f"on. Ops that synchronize with the host or allocate host memory cannot be captured: move them "
                   f"out of the compiled region, list them in Config.split_ops, or use cudagraphs='off'.")
        else:
            msg = (f"graphcomp: CUDA-graph piece {self.name} {reason}; it runs eagerly from now on "
                   f"(graphcomp.counters['pieces_turned_eager']; see 'graphcomp inspect' for the piece).")
        log.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)

    def _capture_failed(self, e: "_CaptureFailed") -> None:
        cause = e.__cause__
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        reason = f"{e.phase}: {type(cause).__name__}: {first}"[:500]
        where = _failing_source(cause)
        if where:
            reason += f" (at {where})"
        if self.require:
            self.disabled = reason
            raise CudaGraphsRequired(
                f"graphcomp: Config.cudagraphs='require' but CUDA-graph piece {self.name} failed to capture: {reason}. "
                f"Remove that op from the compiled region, list it in Config.split_ops, or use cudagraphs='auto'."
            ) from cause
        self._disable(reason)

    def _blocked(self) -> bool:
        """True (and this call runs eagerly) while a released output is held over pool
        memory the allocator counts as free: a capture now could allocate it."""
        held = RUNTIME.ledger.unsafe()
        if not held:
            return False
        names = sorted({c.runner().name if c.runner() is not None else "?" for c in held})
        data = self.follows_data
        if data and self.captures:
            # its shapes follow the data (tokens per expert in a Python MoE loop) and it
            # needs a (re-)capture in the middle of a step: it would miss again
            self._disable(f"needed a capture while other pieces' outputs were held in the pool, with input shapes "
                          f"that follow the data ({data}, e.g. tokens per expert in a Python MoE loop); "
                          f"pad such inputs to a few sizes to keep it captured", kind="unsettled")
            return True
        self._miss("blocked", f"graphcomp: piece {self.name} needs a capture while outputs of {', '.join(names)} "
                              f"handed out of the CUDA-graph pool are still referenced (a forward whose backward "
                              f"has not run yet); running this call eagerly, capturing later",
                   "needed a capture each time outputs of other pieces were still held over free pool memory")
        return True

    def _miss(self, key: str, msg: str, why: str) -> None:
        """This call runs eagerly because of a runtime hazard (a fallback). A piece
        that misses ``REENTRY_LIMIT`` times turns eager for good: a call pattern its
        graphs cannot serve (a Python loop calling the compiled region several times
        per step, shapes that follow the data) would otherwise fall back every step."""
        self.misses += 1
        data = self.follows_data
        if (self.misses >= REENTRY_LIMIT or data) and self.disabled is None:
            # (shapes that follow the data: the call pattern follows the data, it would miss again)
            self._disable(f"{why} ({self.misses} call(s){', ' + data if data else ''})", kind="unsettled")
            return
        self._warn(key, msg)

    def _check_static(self, cap: Capture, args: Sequence[Any]) -> tuple[str | None, list[int]]:
        """(None, []) when every static address matches; ("demote", slots) when
        saved activations / piece outputs arrived at new addresses (those slots
        become copied inputs); ("recapture", [i]) or a raise for parameters."""
        # the capture call's own replay trivially matches; "first" means the first
        # replay with the caller's next inputs, so check the first two replays
        first = cap.replays < 2
        moved: list[int] = []
        for i, (a, kind) in enumerate(zip(args, self.kinds)):
            if not isinstance(a, torch.Tensor) or kind in ("copy", "scalar"):
                continue
            if kind == "param" and not (first or self.check_always):
                continue
            if a.data_ptr() == cap.ptrs[i]:
                continue
            if kind == "param":
                if self.recapture:
                    return "recapture", [i]
                raise StaticAddressError(
                    f"graphcomp: the address of static input {self.input_names[i]!r} (a parameter/buffer) of "
                    f"CUDA-graph piece {self.name} changed since capture. Keep parameters in place (update them "
                    f"with .copy_() / in-place optimizer steps, never reassign .data or replace the tensor), or "
                    f"compile with options={{'on_address_change': 'recapture'}} (re-captures, slower), or "
                    f"cudagraphs='off'."
                )
            moved.append(i)
        return ("demote", moved) if moved else (None, [])

    def _hazard(self, cap: Capture, args: list[Any]) -> str | None:
        """None when replaying ``cap`` overwrites nothing still referenced; else
        "eager" (its own internal outputs are alive, or a released output in memory it
        was captured over) or "recapture" (see the module docstring; visible outputs
        found alive switch their piece to copying)."""
        conflicts = RUNTIME.ledger.conflicts(cap, args)
        if conflicts and not all(c.collected for c, _ in conflicts):
            # Dynamo's compile leaves the first call's outputs in reference cycles
            # (a graph break's partial graph runs while compiling) until the cyclic
            # collector runs: collect once per capture before calling them held
            # (without it a Hugging Face model's logits read as "held" at the second
            # step, and every piece would be captured again)
            for c, _ in conflicts:
                c.collected = True
            gc.collect()
            SESSION.counters.add("hazard_gc_collects")
            conflicts = RUNTIME.ledger.conflicts(cap, args)
        if not conflicts:
            return None
        for c, alive in conflicts:
            if c.seq < cap.seq or (c is cap and any(i not in self.visible for i in alive)):
                return "eager"
        for c, alive in conflicts:
            r = c.runner()
            if r is None:
                continue
            new = sorted(i for i in alive if i in r.visible and i not in r.copy_now)
            if new:
                r.copy_now.update(new)
                log.info("graphcomp: piece %s: output(s) %s handed out of the CUDA-graph pool are still referenced "
                         "when %s replays (gradient accumulation, a kept loss); copying them out of the pool from "
                         "now on%s", r.name, new, self.name,
                         f" ({describe_holders(c, new)})" if log.isEnabledFor(logging.INFO) else "")
        return "recapture"

    # ------------------------------------------------------------- call
    def __call__(self, *args: Any) -> tuple[Any, ...]:
        return self.call(list(args))

    def call(self, args: list[Any]) -> tuple[Any, ...]:
        """Run the piece on ``args`` (boxed: the list is consumed): decide (replay
        a capture, capture, or run eagerly with a reason), then act."""
        if self.released or self.disabled is not None or RUNTIME.is_capturing():
            return self._eager(args)
        # written inputs as the caller passed them (a copied one gets its buffer's write back)
        written = [(i, args[i]) for i in self.mutated if isinstance(args[i], torch.Tensor)] if self.mutated else ()
        cap, fresh = self._decide(args)
        if cap is None:
            return self._eager(args)
        if not fresh:  # (a capture took the copies; it consumed args)
            dst = [cap.bases[i] for i, k in enumerate(self.kinds) if k == "copy" and isinstance(args[i], torch.Tensor)]
            src = [memory_of(args[i]) for i, k in enumerate(self.kinds) if k == "copy" and isinstance(args[i], torch.Tensor)]
            if dst:
                torch._foreach_copy_(dst, src)
            del dst, src
            for i in self._static_slots:
                cap.inputs[i] = args[i]  # (a stand-in device in the CPU tests reads them; a CUDA graph reads the address)
        aliased = {} if fresh else cap.aliases(args)
        args.clear()
        try:
            cap.graph.replay()
        finally:
            for i in self._static_slots:
                cap.inputs[i] = None
        cap.replays += 1
        SESSION.counters.add("replays")
        for i, t in written:
            if self.kinds[i] == "copy":  # the graph wrote the static buffer, the caller's tensor must change
                t.copy_(cap.inputs[i])
        del written
        if fresh:
            # memory of other pieces' released outputs that was free by the end of this
            # capture: this graph may write it (checked before each replay)
            cap.overwrites = RUNTIME.ledger.freed_storages(cap, RUNTIME.all_captures())
        handed = cap.handout_released()
        handed.update(aliased)
        RUNTIME.ledger.handed_out(cap)
        out = []
        for i, o in enumerate(cap.outputs):
            if i in handed:
                out.append(handed[i])
            elif not isinstance(o, torch.Tensor):
                out.append(o)
            elif i in self.copy_now:
                out.append(o.clone())
                SESSION.counters.add("cudagraph_output_copy_bytes", o.numel() * o.element_size())
            else:
                out.append(o.detach())
        return tuple(out)

    def _decide(self, args: list[Any]) -> tuple[Capture | None, bool]:
        """(capture to replay, whether it was captured by this call), or (None, _)
        when this call runs eagerly (the reason is logged and counted)."""
        sig = signature(args)
        cap = self.captures.get(sig)
        if cap is None:
            if len(self.captures) >= self.max_captures:
                # a configured limit, not a hazard: counted apart from cudagraph_fallbacks
                self._warn("max", f"graphcomp: piece {self.name} has reached max_captures={self.max_captures} "
                                  f"input-shape signatures; running new shapes eagerly (inputs whose shapes vary "
                                  f"with the data: pad them to a few sizes, or raise max_captures)", fallback=False)
                SESSION.counters.add("pieces_eager_calls")
                return None, False
            return self._new_capture(sig, args, None)
        hazard = self._hazard(cap, args)
        if hazard == "recapture" and self.hazard_recaptures >= 2 * self.max_captures:
            hazard = "eager"  # never loop on re-captures: a pattern the ledger cannot settle
        if hazard == "eager":
            self._miss("alive", f"graphcomp: piece {self.name}: outputs of an earlier replay are still referenced "
                                f"(e.g. two forwards before one backward); running this call eagerly instead of "
                                f"overwriting them",
                       "called while outputs of its previous replay were still referenced (a Python loop calling "
                       "this compiled region several times per step, or several forwards before one backward)")
            return None, False
        if hazard == "recapture":
            log.info("graphcomp: piece %s: capturing again around tensors still referenced in the pool", self.name)
            return self._new_capture(sig, args, "hazard")
        what, slots = self._check_static(cap, args)
        if what == "demote":
            # a saved activation / piece output produced outside a stable graph (an eager
            # piece, or an eager fallback): copy those inputs from now on, re-capture
            names = ", ".join(self.input_names[i] for i in slots)
            log.info("graphcomp: piece %s: input(s) %s arrive at changing addresses; copying them "
                     "into static buffers from now on (re-capture)", self.name, names)
            return self._new_capture(sig, args, "demote", slots)
        if what == "recapture":
            return self._new_capture(sig, args, "address")
        return cap, False

    def _new_capture(self, sig: tuple[Any, ...], args: list[Any], why: str | None,
                     slots: Sequence[int] = ()) -> tuple[Capture | None, bool]:
        """Capture for ``sig`` (``why``: None for a new signature, else what forces a
        re-capture); (None, False) when this call must run eagerly instead."""
        if self._blocked():
            return None, False
        if why == "demote":
            for i in slots:
                self.kinds[i] = "copy"
            self.release()
        elif why is not None:
            self.captures.pop(sig).release()
        if why == "hazard":
            self.hazard_recaptures += 1
            SESSION.counters.add("hazard_recaptures")
        elif why is not None:
            SESSION.counters.add("recaptures")
        try:
            cap = self._capture(args)
        except _CaptureFailed as e:
            self._capture_failed(e)
            return None, False
        self.captures[sig] = cap
        return cap, True


def _undo_writes(undo: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Put written inputs back to the values saved before a capture's warm-ups."""
    for t, saved in undo:
        t.copy_(saved)


class EagerPiece:
    """An eager piece: ``piece(*args) -> tuple`` (counts its calls)."""

    def __init__(self, name: str, fn: Callable[[list[Any]], Any]):
        self.name = name
        self.fn = fn
        SESSION.counters.add("pieces_eager")

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        return self.call(list(args))

    def call(self, args: list[Any]) -> tuple[Any, ...]:
        return tuple(self.fn(args))
