"""Private torch APIs of FP8 training (re-exported from ``graphcomp._compat``; the same
rules apply: torch 2.11 and 2.13, nothing of graphcomp imported).

* ``torch._scaled_mm`` (private; the signature used here is the same in 2.11 and 2.13:
  ``(mat_a, mat_b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
  use_fast_accum=False)``, one tensor returned). CUDA (sm89+) needs ``mat_a``
  row-major, ``mat_b`` column-major, both inner sizes multiples of 16; a tensorwise
  scale is a 0-dim fp32 tensor, a rowwise one ``[M, 1]`` / ``[1, N]`` fp32 with a
  bf16 output. The CPU kernel (2.13) takes the same arguments: the CPU tests run the
  recipes' arithmetic through it.
* ``torch.fx.traceback.annotate`` (``is_backward_compatible=False``; present with
  Dynamo support in 2.11 and 2.13): nodes traced inside the context carry
  ``node.meta["custom"]``, through Dynamo and AOTAutograd's joint graph (backward
  formulas included). Dynamo runs the context in eager and turns on
  ``preserve_node_meta`` itself; ``make_fx`` needs ``preserve_node_meta`` around it
  (:func:`preserve_node_meta`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

ANNOTATION_META = "custom"
"""The ``node.meta`` key ``annotate`` writes (a dict of the annotations in force)."""


def annotate(values: dict[str, Any]) -> contextlib.AbstractContextManager:
    """``torch.fx.traceback.annotate(values)``, or a context that does nothing where
    torch has none (the graphs then carry no marks: graphcomp's FP8 gather pass finds
    nothing to fuse and says so)."""
    fn = getattr(torch.fx.traceback, "annotate", None)
    return fn(values) if fn is not None else contextlib.nullcontext()


def annotations(node: Any) -> dict[str, Any]:
    """The annotations of an FX node (``{}`` for none)."""
    v = node.meta.get(ANNOTATION_META)
    return v if isinstance(v, dict) else {}


@contextlib.contextmanager
def preserve_node_meta() -> Iterator[None]:
    """``torch.fx.traceback.preserve_node_meta()``: what ``make_fx`` needs to copy the
    annotations in force onto the nodes it creates."""
    with torch.fx.traceback.preserve_node_meta():
        yield


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, use_fast_accum: bool = False) -> torch.Tensor:
    """``a @ b`` of two FP8 tensors, dequantized by their inverse scales, in ``out_dtype``
    (``torch._scaled_mm``; the caller lays the operands out as CUDA requires)."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                            use_fast_accum=use_fast_accum)
