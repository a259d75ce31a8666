"""graphcomp's exception types (one module every layer may import)."""

from __future__ import annotations


class CudaGraphsRequired(RuntimeError):
    """``Config.cudagraphs="require"`` and a piece cannot be captured: the message
    names the piece (stage/piece_<i>) and the reason."""
