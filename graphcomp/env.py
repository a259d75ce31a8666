"""The one module that reads graphcomp's environment variables.

| variable | effect |
|---|---|
| ``GRAPHCOMP_DUMP_DIR`` | default for ``Config.dump_dir`` |
| ``GRAPHCOMP_DEBUG`` | ``1`` turns on ``Config.debug`` by default |
| ``GRAPHCOMP_LOG`` | log level of the ``graphcomp`` logger (``INFO``, ``DEBUG``, ...) |
"""

from __future__ import annotations

import os


def dump_dir() -> str | None:
    v = os.environ.get("GRAPHCOMP_DUMP_DIR", "").strip()
    return v or None


def debug() -> bool:
    return os.environ.get("GRAPHCOMP_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def log_level() -> str | None:
    v = os.environ.get("GRAPHCOMP_LOG", "").strip().upper()
    return v or None
