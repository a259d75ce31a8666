"""Cross-step prefetch: the next forward's table gather, issued during this step's optimizer.

A language model's forward starts with the input embedding's table gather (often
its largest gather) and nothing to overlap it with:
every later op needs the lookup. The table's shard is final once the optimizer has
updated it, while the optimizer still has the other parameters to update. So:

* the ``prefetch_across_steps`` pass (fwd) replaces such a gather in the forward
  graph with :func:`prefetched_gather` (``graphcomp::prefetched_gather``), which
  takes the gathered table from this module when it has a valid one, and gathers
  it itself otherwise;
* ``graphcomp.optim.capture``'s step updates the parameters whose gathers were
  registered here first, marks that point on the device, updates the rest, and
  after the step :meth:`CrossStepPrefetch.issue` launches those gathers on a side
  stream that waits only for the mark: they run while the rest of the optimizer
  step does (inside its CUDA graph, the mark is an external event record node).

A prefetched buffer is valid for the next forward only if the shard was not written
since the gather was issued (its version counter; a replayed optimizer graph does not
bump it, so the comparison is made against the value at issue). A stale or missing
one makes the op gather itself; the decision depends only on what the ranks all
did (the same optimizer steps, the same writes), so every rank issues the same
collectives in the same order. Writing a parameter on some ranks but not others
between the optimizer step and the next forward breaks that (as it breaks the model).

The buffer is allocated on the side stream by the caching allocator: it is live from
the optimizer step to the embedding lookup only, and its block returns to the side
stream's pool afterwards (the next step's prefetch reuses it), so no graph's peak
holds it. :meth:`release` (``graphcomp.runtime.teardown()``, ``graphcomp.reset()``)
waits for gathers in flight and drops them.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from graphcomp import _compat
from graphcomp.runtime import capture
from graphcomp.runtime.manager import RUNTIME
from graphcomp.session import SESSION

log = logging.getLogger(__name__)
c10d = torch.ops._c10d_functional

__all__ = ["PREFETCH", "CrossStepPrefetch", "prefetched_gather"]


def _send_buffer(shard: Tensor, dtype: torch.dtype | None) -> Tensor:
    """The gather's input: the shard cast to ``dtype``, or (no cast) a detached alias of
    it, so that a slot never keeps the parameter object itself alive."""
    return (shard.detach() if dtype is None else shard.to(dtype)).contiguous()


def _gather_now(shard: Tensor, dtype: torch.dtype | None, world: int, group: str) -> Tensor:
    return c10d.wait_tensor(c10d.all_gather_into_tensor(_send_buffer(shard, dtype), world, group))


@dataclass
class _Recipe:
    shard: "weakref.ref[Tensor]"
    dtype: torch.dtype | None
    world: int
    group: str


@dataclass
class _Slot:
    out: Tensor  # the gather's output (its wait not yet taken)
    send: Tensor  # its input, kept alive until the wait
    param: "weakref.ref[Tensor]"  # the optimizer's parameter (a DTensor, or the shard itself)
    version: tuple[int, int]  # its and the shard's version counters when the gather was issued
    recipe: _Recipe


def _versions(param: Tensor | None, shard: Tensor) -> tuple[int, int]:
    """The version counters that a write to the parameter bumps: an in-place op on a
    DTensor bumps the DTensor's own counter, not its local tensor's; one on the local
    tensor bumps only that."""
    return (-1 if param is None else param._version, shard._version)


class CrossStepPrefetch:
    """The process's prefetch state: which gathers a forward takes from here
    (recipes, registered by the op's first call), the gathers in flight (slots), and
    the optimizer steps that issue them (providers)."""

    name = "cross-step prefetch"

    def __init__(self) -> None:
        self.providers: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self.recipes: dict[int, _Recipe] = {}  # id(shard) -> how to gather it (registration order)
        self.slots: dict[int, _Slot] = {}
        self.stream: Any = None

    # ----------------------------------------------------------- set-up
    def add_provider(self, step: Any) -> None:
        """An optimizer step that will issue prefetches (``graphcomp.optim.capture``)."""
        self.providers.add(step)
        RUNTIME.register_owner(self)

    def enabled(self) -> bool:
        """Whether any live optimizer step issues prefetches (the pass rewrites only then)."""
        return len(self.providers) > 0

    def _register(self, shard: Tensor, dtype: torch.dtype | None, world: int, group: str) -> None:
        r = self.recipes.get(id(shard))
        if r is not None and r.shard() is shard:
            return
        self.recipes[id(shard)] = _Recipe(weakref.ref(shard), dtype, world, group)

    def shards_for(self, params: list[Tensor]) -> list[Tensor]:
        """The parameters among ``params`` whose shard (a DTensor's local tensor, the
        value the compiled graphs read) has a registered gather, in ``params``' order."""
        out = []
        for p in params:
            s = _compat.dtensor_local(p)
            r = self.recipes.get(id(s))
            if r is not None and r.shard() is s:
                out.append(p)
        return out

    # --------------------------------------------------------- issuing
    def issue(self, params: list[Tensor], after: Any = None) -> int:
        """Launch the registered gathers of ``params``' shards (on CUDA on the side
        stream, after the device event ``after``, or after the current stream's work
        when None). Returns how many were issued."""
        self._drop_orphans()
        shards = self.shards_for(params)
        if not shards:
            return 0
        dev = RUNTIME.device
        on_cuda = shards[0].device.type == "cuda" and dev.device_type == "cuda"
        if on_cuda:
            if self.stream is None:
                self.stream = dev.new_stream()
            if after is None:
                dev.wait(self.stream, dev.current_stream())
            else:
                dev.wait_event(self.stream, after)
        n = 0
        for p in shards:
            s = _compat.dtensor_local(p)
            old = self.slots.pop(id(s), None)
            if old is not None:  # issued, never taken (no forward since): finish it, then drop it
                c10d.wait_tensor(old.out)
                SESSION.counters.add("prefetches_discarded")
            r = self.recipes[id(s)]
            ctx = dev.stream(self.stream) if on_cuda else contextlib.nullcontext()
            with ctx:
                send = _send_buffer(s, r.dtype)
                out = c10d.all_gather_into_tensor(send, r.world, r.group)
            self.slots[id(s)] = _Slot(out, send, weakref.ref(p), _versions(p, s), r)
            n += 1
        SESSION.counters.add("prefetches_issued", n)
        return n

    def _drop_orphans(self) -> None:
        """Finish and drop the gathers of parameters that no longer exist (a parameter
        object replaced, its model deleted): no forward can take them."""
        for key in [k for k, sl in self.slots.items() if sl.param() is None or sl.recipe.shard() is None]:
            c10d.wait_tensor(self.slots.pop(key).out)
            SESSION.counters.add("prefetches_discarded")
        for key in [k for k, r in self.recipes.items() if r.shard() is None]:
            del self.recipes[key]

    # ---------------------------------------------------------- taking
    def take(self, shard: Tensor, dtype: torch.dtype | None, world: int, group: str) -> Tensor | None:
        """The prefetched gather of ``shard`` (the current stream made to wait for it),
        or None: none issued, the shard written since, or a whole step being captured."""
        self._register(shard, dtype, world, group)
        slot = self.slots.pop(id(shard), None)
        if slot is None:
            SESSION.counters.add("prefetch_misses")
            return None
        out = c10d.wait_tensor(slot.out)
        r = slot.recipe
        why = None
        if r.shard() is not shard or (r.dtype, r.world, r.group) != (dtype, world, group):
            why = "the gather differs from the one prefetched"
        elif _versions(slot.param(), shard) != slot.version:
            why = "the shard was written after the optimizer step (its version changed)"
        elif capture.recording("step") is not None:
            why = "a whole step is being captured (graphcomp.capture_step gathers in its graph)"
        if why is not None:
            log.info("graphcomp: prefetched gather of a %s shard discarded: %s", tuple(shard.shape), why)
            SESSION.counters.add("prefetches_discarded")
            return None
        SESSION.counters.add("prefetches_taken")
        return out

    def release(self, final: bool = False) -> int:
        """Wait for every gather in flight and drop it (teardown, reset). Returns 0
        (no CUDA graph is held)."""
        for slot in self.slots.values():
            try:
                c10d.wait_tensor(slot.out)
            except Exception as e:  # noqa: BLE001 - never let teardown fail the exit path
                log.warning("graphcomp: waiting for a prefetched gather at teardown failed: %s", e)
        self.slots.clear()
        if final:  # (teardown: the optimizer steps are released too; later compiles do not rewrite)
            self.recipes.clear()
            self.providers = weakref.WeakSet()
        return 0

    def stats(self) -> dict[str, Any]:
        return {"name": self.name, "recipes": len(self.recipes), "in_flight": len(self.slots),
                "providers": len(self.providers)}


PREFETCH = CrossStepPrefetch()


@torch.library.custom_op("graphcomp::prefetched_gather", mutates_args=(),
                         **_compat.custom_op_tags(getattr(torch.Tag, "cudagraph_unsafe", None)))
def prefetched_gather(shard: Tensor, dtype: torch.dtype | None, group_size: int, group_name: str) -> Tensor:
    """The all-gather of ``shard`` (cast to ``dtype`` first, when given): the one the
    previous optimizer step prefetched when it is valid (:class:`CrossStepPrefetch`),
    else gathered now. Host logic: never inside a CUDA graph (tagged
    ``cudagraph_unsafe``; ``partition_graph`` runs it eagerly)."""
    got = PREFETCH.take(shard, dtype, group_size, group_name)
    if got is not None:
        return got
    return _gather_now(shard, dtype, group_size, group_name)


@prefetched_gather.register_fake
def _prefetched_gather_fake(shard, dtype, group_size, group_name):  # noqa: ANN001
    return shard.new_empty((group_size * shard.shape[0], *shard.shape[1:]), dtype=dtype or shard.dtype)
