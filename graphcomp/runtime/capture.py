"""The one way graphcomp captures a CUDA graph: :func:`capture`.

Three owners hold captured graphs: a compiled piece's runner
(:mod:`graphcomp.runtime.runner`), the optimizer step of :func:`graphcomp.optim.capture`
(:mod:`graphcomp.optim.captured_step`) and the whole step of
:func:`graphcomp.capture_step` (:mod:`graphcomp.runtime.whole_step`). Each decides
*when* to capture and what to do when a capture fails (run eagerly, raise under
``cudagraphs="require"``); all of them capture through :func:`capture`, which does
the part that must be the same for all:

* the runtime's capture stream, entered after the current stream's work and left
  with the current stream waiting for it, on success and on failure alike;
* the memory pool: the pieces' shared pool (``pool=SHARED``, held alive until
  teardown) or a new private one (``pool=PRIVATE``: the optimizer and whole-step
  graphs, whose temporaries must never overlap the pieces' tensors);
* :func:`graphcomp.runtime.is_capturing` true for the duration;
* the :class:`Recording` in progress (:func:`recording`): code running inside the
  capture asks it which graph it records into (the optimizer step builds its IF
  node there) and whether a whole step is being recorded (the optimizer step then
  records inline; a prefetched gather is not taken), and registers host work that
  every replay of that graph needs (:meth:`Recording.add_hook`).

Releasing a graph goes through :func:`release` (refused while another graph is
being captured: see ``CudaDevice.reset_graph``).

(The runtime is reached as ``SESSION.runtime``, the same object as
``graphcomp.runtime.manager.RUNTIME``: ``pool.py``, which the manager imports,
releases its graphs here too.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from graphcomp.session import SESSION

__all__ = ["PRIVATE", "SHARED", "Recording", "capture", "recording", "release", "trial_capture"]

SHARED = "shared"  # the pieces' pool (RUNTIME.pool)
PRIVATE = "private"  # a new pool for this graph alone

KINDS = ("piece", "optimizer", "step")


@dataclass
class Recording:
    """A graph being captured (and, once :func:`capture` returns, the captured one):
    the graph, its pool, what ``fn`` returned, and the host work each replay needs."""

    kind: str  # "piece" | "optimizer" | "step" (a whole training step)
    graph: Any
    pool: Any
    outputs: Any = None
    hooks: list[Callable[[], Any]] = field(default_factory=list)

    def add_hook(self, hook: Callable[[], Any]) -> None:
        """Host work to run before each replay of this graph (the owner runs them);
        a hook added twice runs once."""
        if hook not in self.hooks:
            self.hooks.append(hook)


def recording(kind: str | None = None) -> Recording | None:
    """The capture in progress (the innermost); with ``kind``, the innermost of that
    kind. None when nothing is being captured through :func:`capture`."""
    for rec in reversed(SESSION.runtime.recordings):
        if kind is None or rec.kind == kind:
            return rec
    return None


def capture(kind: str, fn: Callable[[list[Any]], Any], inputs: list[Any] | None = None,
            replay_inputs: list[Any] | None = None, *, pool: str = PRIVATE) -> Recording:
    """Capture ``fn(inputs)`` (``inputs`` boxed: ``fn`` may clear it to free what it
    consumed) into a new graph on the runtime's capture stream; returns the
    :class:`Recording` with the graph and ``fn``'s outputs. ``replay_inputs``: the
    static input list the stand-in device's replay passes to ``fn`` (a CUDA graph
    reads addresses, not this list). ``pool``: :data:`SHARED` or :data:`PRIVATE`.
    A failure re-raises after the capture ended and the current stream waits for the
    capture stream again: the process stays usable for eager execution, and the
    owner decides what runs instead."""
    if kind not in KINDS:
        raise ValueError(f"graphcomp: capture kind {kind!r}; valid: {', '.join(map(repr, KINDS))}")
    if pool not in (SHARED, PRIVATE):
        raise ValueError(f"graphcomp: capture pool {pool!r}; valid: {SHARED!r}, {PRIVATE!r}")
    rt = SESSION.runtime
    rt.ensure()
    dev = rt.device
    if pool == SHARED:
        rt.keep_pool()
        handle = rt.pool
    else:
        handle = dev.pool_handle()
    rec = Recording(kind, dev.new_graph(), handle)
    stream = rt.stream
    dev.wait(stream, dev.current_stream())
    rt.recordings.append(rec)
    try:
        with rt.capturing():
            rec.outputs = dev.capture(rec.graph, handle, stream, fn, inputs if inputs is not None else [],
                                      replay_inputs if replay_inputs is not None else [])
    finally:
        rt.recordings.remove(rec)
        dev.wait(dev.current_stream(), stream)
    return rec


def trial_capture(fn: Callable[[list[Any]], Any], inputs: list[Any]) -> None:
    """Capture ``fn`` on a copy of ``inputs`` into a throwaway graph and pool, replay it
    once and free it: whatever the real capture would raise (capture, instantiation,
    first replay) raises here while the caller still holds every input."""
    rt = SESSION.runtime
    with rt.capturing():
        rt.device.trial_capture(rt.stream, fn, inputs)


def release(graph: Any) -> None:
    """Free a captured graph (None: nothing to free)."""
    if graph is not None:
        SESSION.runtime.device.reset_graph(graph)
