"""Inductor's cache artifacts: record the entries one compile writes or reads, load
entries into this process's local caches, count FX-graph cache hits.

``torch.compiler.save_cache_artifacts`` serializes everything recorded since the
process started; graphcomp needs the entries of one stage compile at a time, so
:func:`recording` opens a fresh recording (``CacheArtifactManager.with_fresh_cache``,
private) and hands what was recorded back to the outer one afterwards, so that a
user's own ``save_cache_artifacts`` still sees every entry.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)


def _manager() -> Any:
    try:
        from torch.compiler._cache import CacheArtifactManager
    except ImportError:
        return None
    needed = ("with_fresh_cache", "serialize", "_new_cache_artifacts", "_seen_artifacts")
    return CacheArtifactManager if all(hasattr(CacheArtifactManager, n) for n in needed) else None


def available() -> bool:
    """Whether this torch can record and load cache artifacts."""
    import torch.compiler

    return _manager() is not None and hasattr(torch.compiler, "load_cache_artifacts")


@contextlib.contextmanager
def recording() -> Iterator[list[bytes]]:
    """Record the cache artifacts written or read inside; on a normal exit the
    yielded list gets one item, their serialized bytes (``b""`` when nothing was
    recorded: Inductor bypassed its cache, or this torch cannot record)."""
    box: list[bytes] = []
    m = _manager()
    if m is None:
        yield box
        box.append(b"")
        return
    with m.with_fresh_cache():
        yield box
        arts = [a for lst in m._new_cache_artifacts.values() for a in lst]
        got = m.serialize() if arts else None
    box.append(got[0] if got else b"")
    for a in arts:  # back into the outer recording (save_cache_artifacts of the user)
        if a not in m._seen_artifacts:
            m._new_cache_artifacts[a.type()].append(a)
            m._seen_artifacts.add(a)


def load(blob: bytes) -> int:
    """Write serialized artifacts into this process's local caches; the number of
    entries written. Raises ``ValueError`` when the bytes do not deserialize."""
    import torch.compiler

    info = torch.compiler.load_cache_artifacts(blob)
    if info is None:
        raise ValueError("torch.compiler.load_cache_artifacts could not read the artifacts")
    arts = getattr(info, "artifacts", None)
    return sum(len(v) for v in arts.values()) if isinstance(arts, dict) else 0


def fx_graph_cache_counts() -> tuple[int, int]:
    """Inductor's FX-graph cache (hits, misses) so far in this process."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return int(c.get("fxgraph_cache_hit", 0)), int(c.get("fxgraph_cache_miss", 0))


def constant_bytes(t: Any, limit: int) -> bytes:
    """The first ``limit`` bytes of a real constant tensor's data, read outside any
    active FakeTensorMode (a compile runs under one)."""
    import torch

    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:
        unset_fake_temporarily = contextlib.nullcontext
    with unset_fake_temporarily(), torch.no_grad():
        flat = t.detach().reshape(-1)
        n = max(1, limit // max(1, t.element_size()))
        return flat[:n].cpu().contiguous().view(torch.uint8).numpy().tobytes()


def is_fake(t: Any) -> bool:
    """Whether ``t`` is a FakeTensor (no data to read)."""
    try:
        from torch._subclasses.fake_tensor import is_fake as _is_fake
    except ImportError:
        return False
    return bool(_is_fake(t))


MESH_RANK_FIELDS = ("_rank", "_coordinate_on_dim", "_hash")
"""The fields of a ``DeviceMesh`` that differ between the ranks of one mesh (its
place in it) or between processes (a cached ``hash()`` of strings, which Python
seeds per process)."""


def _mesh_key(*args: Any) -> Any:
    return args


def _reduce_mesh(mesh: Any) -> Any:
    rv = mesh.__reduce_ex__(2)
    state = rv[2] if len(rv) > 2 else None
    if isinstance(state, dict):
        state = {k: v for k, v in state.items() if k not in MESH_RANK_FIELDS}
    return (_mesh_key, (f"{type(mesh).__module__}.{type(mesh).__qualname__}", state))


@contextlib.contextmanager
def rank_free_mesh_keys() -> Iterator[None]:
    """Inside, Inductor's FX-graph cache key of a graph that takes a ``DeviceMesh``
    input hashes the mesh without this rank's place in it and without its cached
    hash (``MESH_RANK_FIELDS``), so that the ranks of a mesh, and later runs,
    compute one key for one graph. Only for graphs that do
    not read those inputs (the caller checks): the compiled code then cannot depend
    on them."""
    try:
        from torch._inductor.codecache import FxGraphCachePickler
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:
        yield
        return
    orig = FxGraphCachePickler.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        self.dispatch_table[DeviceMesh] = _reduce_mesh

    FxGraphCachePickler.__init__ = init
    try:
        yield
    finally:
        FxGraphCachePickler.__init__ = orig
