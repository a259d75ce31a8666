"""The shared CUDA-graph pool: captures, the outputs they hand out, and the ledger.

Every graph graphcomp captures for a compiled piece allocates from one memory pool
(the runtime's ``pool``). A capture (:class:`Capture`) remembers its graph, its static
inputs and the outputs it handed out; internal outputs are *released*
(:class:`Released`: handed out without the runner keeping them, rebuilt on the same
pool memory each replay). The :class:`PoolLedger` numbers captures in capture order
and knows, before every replay, which handed-out tensors that replay could overwrite
(see its docstring). The runner (``runner.py``) decides when to capture, replay or
run eagerly; this module only answers what a replay would overwrite.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from graphcomp import _compat
from graphcomp.runtime import capture
from graphcomp.session import SESSION


class PoolLedger:
    """Which pool tensors are handed out, and who may overwrite them.

    Every capture gets a sequence number (``seq``) in capture order. A graph's
    replay writes only pool memory that was free while it was captured; memory
    of tensors that were alive then is never touched. So a replay of capture ``c``
    can overwrite

    * the outputs of captures with ``seq >= c`` (itself included: its own previous
      outputs): their memory may have been free while ``c`` was captured;
    * released outputs (``runner.Released``: internal outputs the runner does not
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

    def conflicts(self, cap: Any, args: Sequence[Any]) -> list[tuple[Any, list[int]]]:
        """(capture, live output indices) a replay of ``cap`` would overwrite;
        forgets captures whose outputs are all dead. ``args``: this call's inputs
        (their storages are consumed by the call, not overwritten under a reader)."""
        out, keep = [], []
        consumed: set[int] | None = None
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
                if consumed is None:
                    consumed = {_storage_ptr(a) for a in args if isinstance(a, torch.Tensor)}
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


def describe_holders(cap: Any, idxs: Sequence[int], limit: int = 3) -> str:
    """Who holds the storages of ``cap``'s outputs ``idxs`` (the INFO log of a hazard:
    why a replay found them "still referenced"). Walks the Python heap once: the
    tensors on each storage and what refers to them (a parameter's ``.grad``, a list,
    a dict, a frame); a storage no Python tensor shares is held from C++ (the
    autograd graph, a collective's work registry)."""
    import gc

    want: dict[int, list[int]] = {}
    for h, base, tidxs in cap.tracked:
        hit = [i for i in tidxs if i in idxs]
        if hit:
            want.setdefault(h, hit)
    if not want:
        return "no tracked storage"
    found: dict[int, list[str]] = {h: [] for h in want}
    owned = {id(o) for o in cap.outputs if isinstance(o, torch.Tensor)}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor) or id(obj) in owned:  # (type(): no __class__ lookups)
            continue
        try:
            h = _storage_id(obj)
        except (RuntimeError, NotImplementedError):
            continue
        if h in found and len(found[h]) < limit:
            kinds = sorted({type(r).__name__ for r in gc.get_referrers(obj)} - {"list"} or {"list"})
            found[h].append(f"tensor {tuple(obj.shape)} {obj.dtype} referred to by {kinds}")
        g = obj.grad if isinstance(obj, torch.nn.Parameter) else None
        if isinstance(g, torch.Tensor) and _storage_id(g) in found and len(found[_storage_id(g)]) < limit:
            found[_storage_id(g)].append(f".grad of a parameter {tuple(obj.shape)}")
    parts = []
    for (h, base, tidxs) in cap.tracked:
        if h in want:
            held = "; ".join(found[h]) or "no Python tensor: held from C++ (autograd graph, a collective's work)"
            parts.append(f"outputs {want[h]}: {_compat.storage_refs(h)} refs vs {base} at capture; {held}")
    return " | ".join(parts[:limit])


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _storage_id(t: torch.Tensor) -> int:
    """The StorageImpl's identity (not its address: an input freed inside a capture
    leaves its address to a new buffer, which is not an alias of that input)."""
    return int(t.untyped_storage()._cdata)


class Released:
    """One pool storage of internal outputs the runner hands out without keeping.

    ``owner`` is a weak reference to the storage of the tensors the capture
    allocated (the allocator counts the block as used while it lives); once it has
    died it stays dead, and is dropped. After the first hand-out, each call's
    tensors are built on ``st``, one storage over the same memory that owns nothing,
    kept for the capture's life: a hand-out costs one tensor per view, and "does
    anyone still hold this call's outputs" is one use count (``st`` alone counts 1)."""

    __slots__ = ("ptr", "nbytes", "device", "owner", "st", "idxs", "views")

    def __init__(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        self.ptr, self.nbytes, self.device = st.data_ptr(), st.nbytes(), t.device
        self.owner: Any = _compat.storage_weakref(t)  # the tensor the capture allocated (owns the block)
        self.st: Any = None  # the non-owning storage hand-outs are built on (after the first)
        self.idxs: list[int] = []  # the output indices on this storage, and their views:
        self.views: list[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]] = []  # (offset, size, stride, dtype)

    def owner_alive(self) -> bool:
        if self.owner is None:
            return False
        if self.owner.expired():
            self.owner = None  # (a storage never comes back)
            return False
        return True

    def recon_alive(self) -> bool:
        """A tensor built on ``st`` (by this or an earlier hand-out) is referenced."""
        return self.st is not None and _compat.storage_refs(self.st._cdata) > 1

    def alive(self) -> bool:
        return self.owner_alive() or self.recon_alive()

    def unsafe(self) -> bool:
        """Held by a user while the allocator counts its memory as free."""
        return self.recon_alive() and not self.owner_alive()

    def handout(self) -> list[torch.Tensor]:
        if self.st is None:
            self.st = _compat.pool_storage(self.ptr, self.nbytes, self.device)
        return _compat.pool_views(self.st, self.device, self.views)


class Capture:
    def __init__(self, runner: Any, ledger: "PoolLedger") -> None:
        self.runner = weakref.ref(runner)
        self.ledger = ledger
        self.seq = ledger.next_seq()  # capture order (see PoolLedger)
        self.graph: Any = None
        self.inputs: list[Any] = []  # static input objects (buffers for "copy" inputs)
        self.bases: dict[int, torch.Tensor] = {}  # input index -> flat memory of its static buffer ("copy")
        # outputs that are views of a (non-copied) input: output index -> (input index,
        # storage_offset, size, stride, dtype), rebuilt from that call's input
        self.alias: dict[int, tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]] = {}
        self.ptrs: list[int | None] = []  # captured data_ptr per tensor input
        self.outputs: list[Any] = []  # None at released output indices
        # per pool storage the owned outputs live in: (storage handle, use count with
        # only the runner's references, output indices on it)
        self.tracked: list[tuple[int, int, list[int]]] = []
        # released outputs: storage ptr -> Released; output index -> its storage ptr
        self.released: dict[int, Released] = {}
        self.released_outs: dict[int, int] = {}
        self.first: dict[int, torch.Tensor] | None = None  # the capture's own released tensors, handed out once
        # released storages of other captures this one may overwrite (freed by the end of its capture call)
        self.overwrites: "weakref.WeakKeyDictionary[Capture, set[int]]" = weakref.WeakKeyDictionary()
        self.replays = 0
        self.collected = False  # a hazard on this capture's outputs ran gc.collect() once (runner._hazard)
        self.orphan = False  # released, but a user still holds some of its outputs

    def track_outputs(self, exclude_storages: set[int]) -> None:
        """Track the kept outputs, except those on ``exclude_storages`` (storage ids)."""
        by_storage: dict[int, list[int]] = {}
        for i, o in enumerate(self.outputs):
            if isinstance(o, torch.Tensor) and _storage_id(o) not in exclude_storages:
                by_storage.setdefault(_compat.storage_handle(o), []).append(i)
        self.tracked = [(h, _compat.storage_refs(h), idxs) for h, idxs in by_storage.items()]

    def release_outputs(self, outs: list[Any], visible: set[int], inputs: dict[int, int], buffers: set[int]) -> None:
        """Split the capture's outputs: internal pool tensors are released (handed
        out once as they are, then rebuilt on each replay); views of a non-copied
        input (``inputs``: storage id -> input index; a parameter, a saved
        activation, another piece's output) are rebuilt from that call's input and
        never held (holding one would keep the producing piece's output alive: its
        next replay would see it "still referenced"); the rest is kept (visible
        outputs, aliases of our own static buffers, ``buffers``: tracked)."""
        keep_st = {_storage_id(o) for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and i in visible}
        keep_st |= buffers
        first = {}
        for i, o in enumerate(outs):
            if not isinstance(o, torch.Tensor):
                continue
            src = inputs.get(_storage_id(o))
            if src is not None:
                self.alias[i] = (src, o.storage_offset(), tuple(o.shape), tuple(o.stride()), o.dtype)
                continue
            if i in visible or _storage_id(o) in keep_st:
                continue
            key = _storage_ptr(o)
            rel = self.released.get(key)
            if rel is None:
                rel = self.released[key] = Released(o)
            rel.idxs.append(i)
            rel.views.append((o.storage_offset(), tuple(o.shape), tuple(o.stride()), o.dtype))
            self.released_outs[i] = key
            first[i] = o
        self.first = {**first, **{i: outs[i] for i in self.alias}}
        self.outputs = [None if i in first or i in self.alias else o for i, o in enumerate(outs)]
        self.track_outputs(set(inputs))

    def aliases(self, args: Sequence[Any]) -> dict[int, torch.Tensor]:
        """The outputs that are views of this call's inputs, rebuilt on them."""
        out = {}
        for i, (src, off, size, stride, dt) in self.alias.items():
            a = args[src]
            out[i] = torch.empty((0,), dtype=dt, device=a.device).set_(a.untyped_storage(), off, size, stride)
        return out

    def handout_released(self) -> dict[int, torch.Tensor]:
        """Released outputs for this call: the capture's own tensors the first time,
        then tensors rebuilt on the same pool memory (owning nothing)."""
        if self.first is not None:
            first, self.first = self.first, None
            return first
        out: dict[int, torch.Tensor] = {}
        for rel in self.released.values():
            out.update(zip(rel.idxs, rel.handout()))
        return out

    def alive_outputs(self) -> list[int]:
        """Indices of handed-out outputs something outside the runner still holds."""
        alive = [i for h, base, idxs in self.tracked if _compat.storage_refs(h) > base for i in idxs]
        for rel in self.released.values():
            if rel.alive():
                alive += rel.idxs
        return alive

    def unsafe_storages(self) -> list[int]:
        return [k for k, r in self.released.items() if r.unsafe()]

    def orphan_done(self) -> None:
        """The ledger stopped tracking this capture; an orphan drops what it kept."""
        if self.orphan:
            self.outputs, self.tracked, self.orphan = [], [], False

    def release(self, keep_live_outputs: bool = True) -> None:
        capture.release(self.graph)
        self.graph = None
        self.inputs = []
        self.first = None
        if self.ledger.forget(self, keep_live_outputs):
            # an orphan: keep only the storages a user still holds (their handles must
            # stay valid until they die); every other pool output is freed now
            self.orphan = True
            alive = set(self.alive_outputs())
            self.tracked = [t for t in self.tracked if alive.intersection(t[2])]
            self.outputs = [o if i in alive else None for i, o in enumerate(self.outputs)]
        else:
            self.outputs, self.tracked = [], []
