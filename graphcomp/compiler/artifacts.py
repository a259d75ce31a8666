"""Compile once, load everywhere: Inductor's compiled stage graphs shared across the
ranks of a job and kept on disk across runs.

Inductor turns each stage graph (forward, backward, inference; after graphcomp's
passes, every CUDA-graph piece included) into FX-graph-cache entries: the generated
wrapper and, on CUDA, the Triton kernels bundled with it. This module moves those
entries, keyed by :func:`stage_key`:

* **across ranks** (``Config.compile_once``, default on): a leader compiles and
  publishes its key, then its entries, through the default process group's store.
  Every rank it leads whose key is the same waits for them, installs them in its
  local Inductor cache and compiles with cache hits; a rank whose graph differs (a
  rank-dependent constant, another path) compiles its own, logged at INFO. On CPU
  rank 0 leads every rank; on GPUs Inductor's code names its device, so rank ``i``
  leads the ranks on device ``i`` of the other machines (:func:`leader_of`).
* **across runs** (``Config.cache_dir`` / ``$GRAPHCOMP_CACHE_DIR``): one checksummed
  file per stage graph, ``<key>.gcart``. A file that does not verify is ignored with
  a warning (and replaced after the compile).

The key covers the graph code of every piece, the graph's constants, the inputs'
shapes, strides and dtypes, graphcomp's config and source, torch and Triton versions,
the device and the world size. It only decides what to load: Inductor still looks a
loaded entry up by its own key, so an entry that does not fit is a cache miss (a
compile), never a wrong program.

A rank waiting for its leader logs every ``POLL_S`` seconds and gives up after
``LEADER_WAIT_S`` (then compiles its own, with a warning); when the leader's compile
raises, the others compile their own at once.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import pathlib
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from graphcomp import _compat, env
from graphcomp._compat import compile_cache
from graphcomp.config import Config

log = logging.getLogger(__name__)

MAGIC = b"graphcomp-artifacts 1\n"
SUFFIX = ".gcart"
POLL_S = 10.0
"""Seconds between two progress lines of a rank waiting for its leader's compile."""
LEADER_WAIT_S = 1800.0
"""At most this long a rank waits for its leader to compile a graph equal to its own."""
HASHED_CONSTANT_BYTES = 1 << 20
"""Of a constant tensor in the graph, the key hashes at most this many bytes (plus its metadata)."""


def cache_dir(cfg: Config) -> pathlib.Path | None:
    d = cfg.cache_dir if cfg.cache_dir is not None else env.cache_dir()
    return pathlib.Path(d).expanduser() if d else None


_INDUCTOR_DIR: list[str] = []  # where this process pointed Inductor's cache (point_inductor_cache)


def point_inductor_cache(d: pathlib.Path) -> None:
    """Inductor's own cache (its C++ kernels, Triton's cache, autotuning results) under
    ``d/inductor``, so that the cache directory holds everything a later run needs;
    not when the user set ``TORCHINDUCTOR_CACHE_DIR``. Once per process: a later
    compile with another ``cache_dir`` keeps the first (said once)."""
    want = str((d / "inductor").resolve())
    if env.user_inductor_cache_dir() is not None:
        return
    if _INDUCTOR_DIR:
        if _INDUCTOR_DIR[0] != want:
            log.warning("graphcomp: Inductor's cache stays in %s (the first cache_dir of this process), not %s",
                        _INDUCTOR_DIR[0], want)
            _INDUCTOR_DIR.append(want)
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = want  # (Inductor reads it at every use)
    _INDUCTOR_DIR.append(want)
    log.info("graphcomp: Inductor's cache (C++ and Triton kernels) goes to %s (Config.cache_dir)", want)


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except Exception:  # noqa: BLE001 - absent or broken: the key says so
        return None


def _cuda_index(example_inputs: Any) -> int | None:
    for v in example_inputs or ():
        if isinstance(v, torch.Tensor) and v.device.type == "cuda":
            return v.device.index if v.device.index is not None else torch.cuda.current_device()
    return None


def _device(example_inputs: Any) -> str:
    idx = _cuda_index(example_inputs)
    if idx is not None:  # (the index too: Inductor's code names its device)
        p = torch.cuda.get_device_properties(idx)
        return f"cuda:{idx}:{p.name}:{p.major}.{p.minor}:{torch.version.cuda}"
    return "cpu"


def leader_of(world_size: int, cuda_index: int | None, local_world_size: int | None) -> tuple[int, int]:
    """(the rank that compiles for the ranks on ``cuda_index``, how many other ranks load from it).

    Inductor's generated code names its CUDA device, so only ranks on the same device
    index share it: the leader of device ``i`` is rank ``i`` (the first machine's rank
    on that device, as ``torchrun`` lays ranks out), its followers the ranks on device
    ``i`` of the other machines. On CPU every rank shares rank 0's. A leader without
    followers (one machine of GPUs) publishes nothing."""
    if cuda_index is None:
        return 0, world_size - 1
    local = local_world_size or world_size
    leader = cuda_index if cuda_index < world_size else 0
    return leader, max(0, world_size // local - 1)


def _tensor_meta(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)}/{tuple(t.stride())}/{t.dtype}/{t.device.type}/{t.requires_grad}"


_SCALARS = (bool, int, float, str, type(None), torch.SymInt, torch.SymFloat, torch.SymBool)


def _input_meta(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return _tensor_meta(v)
    if isinstance(v, _SCALARS):
        return f"{type(v).__name__}:{v}"
    return type(v).__name__  # (an opaque object: its repr names its address)


def _hash_constant(h: Any, t: torch.Tensor) -> None:
    h.update(_tensor_meta(t).encode())
    if t.is_meta or compile_cache.is_fake(t):
        return
    h.update(compile_cache.constant_bytes(t, HASHED_CONSTANT_BYTES))


def _attr(m: Any, target: str) -> Any:
    for part in target.split("."):
        m = getattr(m, part, None)
    return m


def stage_key(gm: fx.GraphModule, example_inputs: Any, uuid: str, world_size: int, stage: str) -> str:
    """The key of a stage graph's compiled artifacts (see the module docstring);
    ``uuid`` covers graphcomp's config and source (``backend.cache_uuid``)."""
    h = hashlib.sha256()
    h.update(json.dumps({"uuid": uuid, "torch": torch.__version__, "triton": _triton_version(),
                         "device": _device(example_inputs), "world_size": world_size, "stage": stage},
                        sort_keys=True, default=str).encode())
    for name, m in gm.named_modules():  # a split graph's pieces are its submodules
        if not isinstance(m, fx.GraphModule):
            continue
        h.update(name.encode() + b"\0" + m.code.encode())
        for n in m.graph.nodes:
            if n.op == "get_attr":
                obj = _attr(m, str(n.target))
                if isinstance(obj, torch.Tensor):
                    h.update(str(n.target).encode())
                    _hash_constant(h, obj)
    for v in example_inputs or ():
        h.update(_input_meta(v).encode() + b"\0")
    return h.hexdigest()


def _opaque_inputs_unread(gm: fx.GraphModule, example_inputs: Any) -> bool:
    """Whether no node reads an input that is neither a tensor nor a number (the
    device meshes a sharded parameter carries into the graph; returning one, for the
    backward, is not reading it): then Inductor's key
    may leave out the mesh's rank-dependent fields (``rank_free_mesh_keys``)."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return not any(not isinstance(v, (torch.Tensor, *_SCALARS)) and any(u.op != "output" for u in ph.users)
                   for ph, v in zip(phs, example_inputs or ()))


# --------------------------------------------------------------------- disk
def read_entry(path: pathlib.Path, key: str) -> bytes | None:
    """The artifacts stored at ``path`` for ``key``; None when absent, or (with a
    warning) when the file does not verify."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        warnings.warn(f"graphcomp: cannot read the compile cache entry {path} ({e}); compiling instead",
                      RuntimeWarning, stacklevel=2)
        return None
    why = None
    if not data.startswith(MAGIC):
        why = "not a graphcomp cache entry"
    else:
        head, sep, payload = data[len(MAGIC):].partition(b"\n")
        try:
            meta = json.loads(head) if sep else None
        except ValueError:
            meta = None
        if not isinstance(meta, dict):
            why = "unreadable header"
        elif meta.get("key") != key:
            why = f"written for key {str(meta.get('key'))[:16]}..., not {key[:16]}..."
        elif meta.get("bytes") != len(payload) or meta.get("sha256") != hashlib.sha256(payload).hexdigest():
            why = f"checksum mismatch ({len(payload)} bytes, {meta.get('bytes')} written)"
        else:
            return payload
    warnings.warn(f"graphcomp: ignoring the corrupt compile cache entry {path}: {why}; compiling instead "
                  "(the entry is rewritten after the compile)", RuntimeWarning, stacklevel=2)
    return None


def write_entry(path: pathlib.Path, key: str, payload: bytes) -> None:
    """Write ``payload`` for ``key`` at ``path`` atomically (a reader sees the old file or the new one)."""
    meta = {"key": key, "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
            "torch": torch.__version__, "written": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(MAGIC + json.dumps(meta).encode() + b"\n" + payload)
    os.replace(tmp, path)


# ------------------------------------------------------------------ ranks
class StageArtifacts:
    """One frame's compile-once and cache-dir logic (``FrameCompiler`` owns one)."""

    def __init__(self, cfg: Config, rank: int, world_size: int, store_id: str, first_compile: bool = True):
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.store_id = store_id  # names this frame's entries in the store (same on every rank)
        self.first_compile = first_compile  # Dynamo's first compile of this code (not a recompile)
        self.dir = cache_dir(cfg)
        self.store = _compat.default_store() if cfg.compile_once and world_size > 1 else None
        self.active = (self.dir is not None or self.store is not None) and compile_cache.available()
        if self.active and self.dir is not None:
            point_inductor_cache(self.dir)

    def compile(self, stage: str, gm: fx.GraphModule, example_inputs: Any, uuid: str,
                compile_fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
        """``compile_fn()`` (Inductor's compile of the stage graph), with the stage's
        artifacts loaded first where the cache directory or the leader has them; returns
        its result and a record for the frame summary (``source``: ``"compiled"``,
        ``"cache_dir"`` or ``"rank N"``, the leader; Inductor's cache hits and misses)."""
        if not self.active:
            return compile_fn(), {"source": "compiled"}
        t0 = time.perf_counter()
        key = stage_key(gm, example_inputs, uuid, self.world_size, stage)
        rec: dict[str, Any] = {"key": key[:16]}
        path = self.dir / f"{key}{SUFFIX}" if self.dir is not None else None
        lead, followers = leader_of(self.world_size, _cuda_index(example_inputs), env.local_world_size())
        base = f"graphcomp/compile_once/{self.store_id}/{stage}/{lead}"
        sharing = self.store is not None and followers > 0
        leader = sharing and self.rank == lead
        source, blob = None, None
        if path is not None:
            blob = read_entry(path, key)
            source = "cache_dir" if blob is not None else None
        if leader:
            self._set(f"{base}/key", key.encode())
        elif sharing and blob is None:
            blob, why = self._from_leader(base, key, stage, lead, followers)
            source = f"rank {lead}" if blob is not None else None
            if why:
                rec["note"] = why
        if blob:
            try:
                rec["entries_loaded"] = compile_cache.load(blob)
            except Exception as e:  # noqa: BLE001 - unreadable artifacts: compile instead
                warnings.warn(f"graphcomp: could not load the compiled artifacts of the {stage} graph from "
                              f"{source} ({type(e).__name__}: {e}); compiling instead", RuntimeWarning, stacklevel=2)
                source = None
        rec["key_seconds"] = round(time.perf_counter() - t0, 3)
        hits0, miss0 = compile_cache.fx_graph_cache_counts()
        rank_free = _opaque_inputs_unread(gm, example_inputs)
        try:
            with compile_cache.recording() as box, \
                    (compile_cache.rank_free_mesh_keys() if rank_free else contextlib.nullcontext()):
                out = compile_fn()
        except BaseException as e:
            if leader:
                self._set(f"{base}/status", f"failed: {type(e).__name__}".encode())
            raise
        hits1, miss1 = compile_cache.fx_graph_cache_counts()
        rec.update(source=source or "compiled", fx_graph_cache_hits=hits1 - hits0, fx_graph_cache_misses=miss1 - miss0)
        made = box[0] if box else b""
        if leader:
            self._set(f"{base}/blob", made)
            self._set(f"{base}/status", b"ok" if made else b"empty")
        if path is not None and source is None and made:  # (compiled here; loaded entries are on disk already)
            try:
                write_entry(path, key, made)
                rec["written"] = str(path)
            except OSError as e:
                warnings.warn(f"graphcomp: cannot write the compile cache entry {path} ({e})", RuntimeWarning,
                              stacklevel=2)
        if source is not None and rec["fx_graph_cache_misses"]:
            log.info("graphcomp: the %s graph's artifacts from %s left %d Inductor cache miss(es): compiled those",
                     stage, source, rec["fx_graph_cache_misses"])
        return out, rec

    def _set(self, key: str, value: bytes) -> None:
        try:
            self.store.set(key, value)
        except Exception as e:  # noqa: BLE001 - a closed store: the others compile their own after a wait
            log.warning("graphcomp: compile_once: cannot publish %s (%s: %s)", key, type(e).__name__, e)

    def _has(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception:  # noqa: BLE001 - a store gone with rank 0
            return False

    def _wait(self, key: str, seconds: float) -> bool:
        try:
            self.store.wait([key], datetime.timedelta(seconds=seconds))
            return True
        except Exception:  # noqa: BLE001 - DistStoreError (timeout), or a store gone with rank 0
            return False

    def _from_leader(self, base: str, key: str, stage: str, lead: int, followers: int
                     ) -> tuple[bytes | None, str | None]:
        """Rank ``lead``'s artifacts for this stage when its key is ``key`` (None, and why
        not, otherwise); the last of its ``followers`` to read them drops them from the store."""
        # A first compile (every rank runs the same code) waits for the leader's key; a
        # recompile need not happen on the leader at all (a rank that met a new input shape
        # alone), so it only takes a key already there.
        wait_key = self.cfg.rank_agreement_timeout if self.first_compile else 0.0
        if not (self._has(f"{base}/key") or (wait_key and self._wait(f"{base}/key", wait_key))):
            log.info("graphcomp: rank %d published no %s graph for %s within %g s: compiling here",
                     lead, stage, base, wait_key)
            return None, f"rank {lead} published no graph within {wait_key:g} s"
        try:
            theirs = self.store.get(f"{base}/key").decode()
            if theirs != key:
                log.info("graphcomp: rank %d's %s graph differs from rank %d's (key %s... vs %s...): compiling its own",
                         self.rank, stage, lead, key[:12], theirs[:12])
                return None, f"graph differs from rank {lead}'s"
            t0 = time.perf_counter()
            while not self._wait(f"{base}/status", POLL_S):
                waited = time.perf_counter() - t0
                if waited >= LEADER_WAIT_S:
                    warnings.warn(f"graphcomp: rank {lead} did not finish compiling the {stage} graph within "
                                  f"{LEADER_WAIT_S:g} s; compiling it here", RuntimeWarning, stacklevel=3)
                    return None, f"rank {lead}'s compile timed out"
                log.info("graphcomp: rank %d waiting %.0f s for rank %d's compile of the %s graph", self.rank,
                         waited, lead, stage)
            status = self.store.get(f"{base}/status").decode()
            if status != "ok":
                return None, f"rank {lead}: {status}"
            blob = self.store.get(f"{base}/blob")
        except Exception as e:  # noqa: BLE001 - the store went away (its host, rank 0, died): compile here
            return None, f"store: {type(e).__name__}: {e}"
        finally:
            with contextlib.suppress(Exception):
                if self.store.add(f"{base}/acks", 1) >= followers:
                    self.store.delete_key(f"{base}/blob")  # every other rank has read it
        return blob, None
