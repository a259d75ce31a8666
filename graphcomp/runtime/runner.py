"""CudaGraphRunner: warm up, capture and replay one compiled piece.

Per input-shape signature (shapes, strides, dtypes, devices of tensor inputs and
the values of scalar inputs), up to ``Config.max_captures`` captures; beyond that
the piece runs eagerly with a warning. For each capture::

    warm-up  : the compiled piece runs ``WARMUP_ITERS`` times on the capture stream
               with is_capturing() True (the same code path as capture)
    capture  : torch.cuda.CUDAGraph captured on the capture stream into the
               shared pool (RUNTIME.pool)
    replay   : copy "copy" inputs into static buffers (one torch._foreach_copy_),
               check static addresses, replay, hand outputs back

Output safety (never silent stale data):

* outputs named in ``clone_outputs`` (user-visible forward outputs such as the loss
  and logits, and every backward output = gradients that land in ``param.grad``)
  are cloned out of the pool after each replay;
* every other output (saved activations, values passed to the next piece) is
  handed out as an alias of the pool tensor; before the next replay the runner
  checks the storage use count of those tensors. If anything outside the runner
  still holds one (the backward of the previous forward has not run yet: two
  forwards before one backward), the call runs eagerly instead of overwriting it
  (``cudagraph_fallbacks`` counter, one warning per runner).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..state import STATE
from .manager import RUNTIME

log = logging.getLogger(__name__)

WARMUP_ITERS = 2


class StaticAddressError(RuntimeError):
    pass


def signature(args: Sequence[Any]) -> tuple[Any, ...]:
    sig = []
    for a in args:
        if isinstance(a, torch.Tensor):
            sig.append((tuple(a.shape), tuple(a.stride()), a.dtype, a.device, a.requires_grad))
        elif isinstance(a, (int, float, bool, str, type(None))):
            sig.append(("s", type(a).__name__, a))
        else:
            sig.append(("s", type(a).__name__, repr(a)))
    return tuple(sig)


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _use_count(t: torch.Tensor) -> int:
    from .. import _compat

    return _compat.storage_use_count(t)


class _Capture:
    def __init__(self) -> None:
        self.graph: Any = None
        self.inputs: list[Any] = []  # static input objects (buffers for "copy" inputs)
        self.ptrs: list[int | None] = []  # captured data_ptr per tensor input
        self.outputs: list[Any] = []
        self.live_check: list[tuple[int, int]] = []  # (output idx, baseline use count)
        self.replays = 0

    def release(self) -> None:
        if self.graph is not None:
            try:
                self.graph.reset()
            except Exception:  # pragma: no cover
                pass
        self.graph = None
        self.inputs = []
        self.outputs = []
        self.live_check = []


class CudaGraphRunner:
    """Callable that replaces one compiled piece: ``runner(*args) -> tuple``."""

    def __init__(
        self,
        name: str,
        fn: Callable[[list[Any]], Any],
        input_kinds: Sequence[str],
        *,
        clone_outputs: set[int] | None = None,
        max_captures: int = 8,
        check_static_inputs: str = "first",
        on_address_change: str = "error",
        input_names: Sequence[str] | None = None,
        stats_row: dict[str, Any] | None = None,
    ):
        self.name = name
        self.fn = fn  # boxed: fn(list) -> sequence of outputs
        self.kinds = list(input_kinds)
        self.clone_outputs = set(clone_outputs or ())
        self.max_captures = max_captures
        self.check_always = check_static_inputs == "always"
        self.recapture = on_address_change == "recapture"
        self.input_names = list(input_names) if input_names else [f"input {i}" for i in range(len(self.kinds))]
        self.captures: dict[tuple[Any, ...], _Capture] = {}
        self._warned: set[str] = set()
        self._static_slots: list[int] = []
        # the piece's row in the frame summary (graphcomp inspect): captures, pool bytes
        self.stats_row = stats_row if stats_row is not None else {}
        self.released = False  # set by teardown(): from then on every call runs eagerly
        RUNTIME.ensure()
        RUNTIME.register(self)
        STATE.counters["pieces_captured"] += 1

    # ------------------------------------------------------------ helpers
    def _warn(self, key: str, msg: str) -> None:
        STATE.counters["cudagraph_fallbacks"] += 1
        if key in self._warned:
            log.debug(msg)
            return
        self._warned.add(key)
        log.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)

    def _eager(self, args: Sequence[Any]) -> tuple[Any, ...]:
        return tuple(self.fn(list(args)))

    def release(self, final: bool = False) -> int:
        """Drop every capture; ``final`` (teardown) also makes later calls eager."""
        n = sum(1 for c in self.captures.values() if c.graph is not None)
        for c in self.captures.values():
            c.release()
        self.captures.clear()
        self.released = self.released or final
        return n

    def stats(self) -> dict[str, Any]:
        return {"name": self.name, "captures": len(self.captures), "input_kinds": list(self.kinds)}

    # ------------------------------------------------------------ capture
    def _capture(self, args: Sequence[Any]) -> _Capture:
        cap = _Capture()
        static_in: list[Any] = []
        for a, kind in zip(args, self.kinds):
            if isinstance(a, torch.Tensor) and kind == "copy":
                buf = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                buf.copy_(a)
                static_in.append(buf)
            else:
                static_in.append(a)
        cap.inputs = static_in
        cap.ptrs = [a.data_ptr() if isinstance(a, torch.Tensor) else None for a in static_in]
        dev = RUNTIME.device
        stream = RUNTIME.stream
        dev.wait(stream, dev.current_stream())
        with RUNTIME.capturing():
            with dev.stream(stream):
                for _ in range(WARMUP_ITERS):
                    self.fn(list(static_in))
            dev.wait(dev.current_stream(), stream)
            g = dev.new_graph()
            outs = dev.capture(g, RUNTIME.pool, stream, self.fn, static_in)
        dev.wait(dev.current_stream(), stream)
        cap.graph = g
        cap.outputs = list(outs)
        in_storages = {_storage_ptr(a) for a, k in zip(static_in, self.kinds) if isinstance(a, torch.Tensor) and k != "copy"}
        for i, o in enumerate(cap.outputs):
            if isinstance(o, torch.Tensor) and i not in self.clone_outputs and _storage_ptr(o) not in in_storages:
                cap.live_check.append((i, 0))
        cap.live_check = [(i, _use_count(cap.outputs[i])) for i, _ in cap.live_check]
        # hold only our own static buffers: a non-copy input (a saved activation,
        # another piece's output) must not be kept alive by this capture
        self._static_slots = [i for i, (a, k) in enumerate(zip(static_in, self.kinds)) if isinstance(a, torch.Tensor) and k != "copy"]
        for i in self._static_slots:
            static_in[i] = None
        STATE.counters["captures"] += 1
        pool = sum(o.numel() * o.element_size() for o in cap.outputs if isinstance(o, torch.Tensor))
        pool += sum(b.numel() * b.element_size() for b in static_in if isinstance(b, torch.Tensor))
        self.stats_row["captures"] = self.stats_row.get("captures", 0) + 1
        self.stats_row["pool_bytes"] = self.stats_row.get("pool_bytes", 0) + pool  # static outputs + buffers
        log.info("graphcomp: captured %s (%d capture(s))", self.name, len(self.captures) + 1)
        return cap

    def _check_static(self, cap: _Capture, args: Sequence[Any]) -> tuple[str | None, list[int]]:
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

    def _outputs_alive(self, cap: _Capture) -> bool:
        return any(_use_count(cap.outputs[i]) > base for i, base in cap.live_check)

    # ------------------------------------------------------------- call
    def __call__(self, *args: Any) -> tuple[Any, ...]:
        if self.released or RUNTIME.is_capturing():
            return self._eager(args)
        sig = signature(args)
        cap = self.captures.get(sig)
        if cap is None:
            if len(self.captures) >= self.max_captures:
                self._warn("max", f"graphcomp: piece {self.name} has reached max_captures={self.max_captures} "
                                  f"input-shape signatures; running new shapes eagerly")
                STATE.counters["pieces_eager_calls"] += 1
                return self._eager(args)
            cap = self._capture(args)
            self.captures[sig] = cap
        elif self._outputs_alive(cap):
            self._warn("alive", f"graphcomp: piece {self.name}: outputs of its previous replay are still referenced "
                                f"(e.g. two forwards before one backward); running this call eagerly instead of "
                                f"overwriting them")
            return self._eager(args)
        what, slots = self._check_static(cap, args)
        if what == "demote":
            # a saved activation / piece output produced outside a stable graph (an eager
            # piece, or an eager fallback): copy those inputs from now on, re-capture
            names = ", ".join(self.input_names[i] for i in slots)
            log.info("graphcomp: piece %s: input(s) %s arrive at changing addresses; copying them "
                     "into static buffers from now on (re-capture)", self.name, names)
            for i in slots:
                self.kinds[i] = "copy"
            self.release()
            STATE.counters["recaptures"] += 1
            cap = self._capture(args)
            self.captures[sig] = cap
        elif what == "recapture":
            cap.release()
            STATE.counters["recaptures"] += 1
            cap = self._capture(args)
            self.captures[sig] = cap
        dst = [cap.inputs[i] for i, k in enumerate(self.kinds) if k == "copy" and isinstance(args[i], torch.Tensor)]
        src = [args[i] for i, k in enumerate(self.kinds) if k == "copy" and isinstance(args[i], torch.Tensor)]
        if dst:
            torch._foreach_copy_(dst, src)
        for i in self._static_slots:
            cap.inputs[i] = args[i]  # (a stand-in device in the CPU tests reads them; a CUDA graph reads the address)
        try:
            cap.graph.replay()
        finally:
            for i in self._static_slots:
                cap.inputs[i] = None
        cap.replays += 1
        STATE.counters["replays"] += 1
        out = []
        for i, o in enumerate(cap.outputs):
            if not isinstance(o, torch.Tensor):
                out.append(o)
            elif i in self.clone_outputs:
                out.append(o.clone())
                STATE.counters["cudagraph_output_copy_bytes"] += o.numel() * o.element_size()
            else:
                out.append(o.detach())
        return tuple(out)


class EagerPiece:
    """An eager piece: ``piece(*args) -> tuple`` (counts its calls)."""

    def __init__(self, name: str, fn: Callable[[list[Any]], Any]):
        self.name = name
        self.fn = fn
        STATE.counters["pieces_eager"] += 1

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        return tuple(self.fn(list(args)))
