"""The one module that reads graphcomp's environment variables.

| variable | effect |
|---|---|
| ``GRAPHCOMP_DUMP_DIR`` | default for ``Config.dump_dir`` |
| ``GRAPHCOMP_CACHE_DIR`` | default for ``Config.cache_dir`` (the compile cache kept across runs) |
| ``GRAPHCOMP_DEBUG`` | ``1`` turns on ``Config.debug`` by default |
| ``GRAPHCOMP_AGREE_TIMEOUT`` | seconds the eager ``GRAPHCOMP_DEBUG`` rank-agreement check waits for the other ranks (default 60) |
| ``GRAPHCOMP_LOG`` | log level of the ``graphcomp`` logger (``INFO``, ``DEBUG``, ...) |

It also reads the launcher's ``WORLD_SIZE`` (``torchrun``), with which
``graphcomp.integrations.hf_trainer`` tells a job of several ranks that ``Trainer``
would run as one process, its ``LOCAL_WORLD_SIZE`` (ranks per machine: compile once
shares a GPU's compiled code with the ranks of the other machines), and ``TORCHINDUCTOR_CACHE_DIR`` as it was when graphcomp was
imported (``Config.cache_dir`` moves Inductor's cache only when the user set none).
"""

from __future__ import annotations

import os

_INDUCTOR_CACHE_DIR_AT_IMPORT = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def dump_dir() -> str | None:
    v = os.environ.get("GRAPHCOMP_DUMP_DIR", "").strip()
    return v or None


def cache_dir() -> str | None:
    v = os.environ.get("GRAPHCOMP_CACHE_DIR", "").strip()
    return v or None


def debug() -> bool:
    return os.environ.get("GRAPHCOMP_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def log_level() -> str | None:
    v = os.environ.get("GRAPHCOMP_LOG", "").strip().upper()
    return v or None


def agree_timeout() -> float:
    v = os.environ.get("GRAPHCOMP_AGREE_TIMEOUT", "").strip()
    if not v:
        return 60.0
    try:
        t = float(v)
    except ValueError:
        raise ValueError(f"GRAPHCOMP_AGREE_TIMEOUT: expected a number of seconds > 0, got {v!r}") from None
    if not 0 < t < float("inf"):
        raise ValueError(f"GRAPHCOMP_AGREE_TIMEOUT: expected a number of seconds > 0, got {v!r}")
    return t


def local_world_size() -> int | None:
    """The number of ranks the launcher started on this machine (``LOCAL_WORLD_SIZE``,
    set by ``torchrun``); None when unset or not a number."""
    v = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    try:
        return max(1, int(v)) if v else None
    except ValueError:
        return None


def launched_world_size() -> int:
    """The number of ranks the launcher (``torchrun``) started, from ``WORLD_SIZE``; 1
    when unset or not a number."""
    v = os.environ.get("WORLD_SIZE", "").strip()
    try:
        return max(1, int(v)) if v else 1
    except ValueError:
        return 1


def user_inductor_cache_dir() -> str | None:
    """``TORCHINDUCTOR_CACHE_DIR`` as the user set it (read when graphcomp was imported:
    Inductor writes its default there on first use)."""
    return _INDUCTOR_CACHE_DIR_AT_IMPORT
