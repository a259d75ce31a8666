"""FP8 scaling arithmetic: amax -> scale, the saturated cast, the recipes.

Dynamic scaling, as torchao's float8 training does it: a tensor (or each row, or each
column) is scaled by ``scale = fp8_max / max(amax, EPS)``, computed in float64 and
rounded to float32, so that its largest magnitude lands on the largest finite FP8
value; the cast multiplies in float32, clamps to ``[-fp8_max, fp8_max]`` (saturates)
and rounds to the FP8 dtype (round to nearest even). The matmul takes the inverse
scales (``1 / scale``) and dequantizes in its accumulator. Rowwise scales are rounded
down to a power of two (exactly: the float32 exponent bits are kept), so rescaling is
exact and nothing saturates.

Every function here is plain tensor code: the FP8 linear (``graphcomp.fp8.linear``)
calls it eagerly or under Dynamo, and the ``fp8_allgather`` pass traces the same
functions onto a parameter's shard, so the fused cast is bitwise the cast it replaces.
:func:`quantize_weight` marks the nodes it traces (``torch.fx.traceback.annotate``,
key :data:`ANNOTATION`) so that the pass can find a gathered weight's cast in the
joint graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from graphcomp import _compat

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
EPS = 1e-12
"""The smallest amax a scale is computed from (an all-zero tensor gets a finite scale)."""

ANNOTATION = "graphcomp_fp8"
"""The annotation key on the nodes of a weight's FP8 cast (:func:`quantize_weight`):
``"<cast key>"`` on the arithmetic, ``"<cast key>/data"`` on the FP8 output and
``"<cast key>/scale"`` on its inverse scale."""

Axis = Literal["tensor", "row", "col"]
_DTYPES = {"e4m3": E4M3, "e5m2": E5M2}


@dataclass(frozen=True)
class Cast:
    """One dynamic cast to FP8 of a 2-D tensor ``[rows, cols]``.

    ``axis``: ``"tensor"`` one scale (amax over the whole tensor); ``"row"`` one scale
    per row (amax over the last dimension: ``[rows, 1]``); ``"col"`` one per column
    (amax over dimension 0: ``[1, cols]``). ``dtype``: ``float8_e4m3fn`` or
    ``float8_e5m2``. ``pow2``: scales rounded down to a power of two."""

    axis: Axis
    dtype: torch.dtype
    pow2: bool = False

    def __post_init__(self) -> None:
        if self.axis not in ("tensor", "row", "col"):
            raise ValueError(f"Cast.axis: {self.axis!r}; valid: 'tensor', 'row', 'col'")
        if self.dtype not in _DTYPES.values():
            raise ValueError(f"Cast.dtype: {self.dtype}; valid: {list(_DTYPES.values())}")

    @property
    def fp8_max(self) -> float:
        return float(torch.finfo(self.dtype).max)

    @property
    def saturation_bound(self) -> float:
        """The smallest scaled magnitude the clamp changes by more than rounding: half
        an FP8 step above ``fp8_max`` (448 + 16 for e4m3, 57344 + 4096 for e5m2); a value
        there or beyond would round past the largest finite value (NaN for e4m3fn)."""
        fi = torch.finfo(self.dtype)
        return float(fi.max) + 2.0 ** math.floor(math.log2(fi.max)) * float(fi.eps) / 2

    @property
    def global_rows(self) -> bool:
        """Whether a scale reads more than one row (tensor, col): on a dim-0 shard its
        amax needs the other ranks' (an all-reduce); a row's scale is its owner's."""
        return self.axis != "row"

    def key(self) -> str:
        """``"<axis>:<e4m3|e5m2>:<0|1>"``, the annotation value (:meth:`parse` reads it)."""
        name = next(k for k, v in _DTYPES.items() if v == self.dtype)
        return f"{self.axis}:{name}:{int(self.pow2)}"

    @classmethod
    def parse(cls, key: str) -> Cast:
        axis, name, pow2 = key.split(":")
        return cls(axis, _DTYPES[name], pow2 == "1")  # type: ignore[arg-type]


@dataclass(frozen=True)
class Recipe:
    """The casts of one FP8 linear ``y = x @ w.T`` and its two backward matmuls
    (``grad_x = grad_y @ w``, ``grad_w = grad_y.T @ x``)."""

    name: str
    input: Cast
    """``x`` in the forward (rowwise: also ``x`` by columns for ``grad_w``)."""
    weight: Cast
    """``w`` in the forward."""
    weight_t: Cast
    """``w`` in ``grad_x`` (tensorwise: the forward's cast, reused)."""
    grad: Cast
    """``grad_y`` in ``grad_x`` (rowwise: by columns in ``grad_w``)."""

    @property
    def reuses_weight(self) -> bool:
        """The backward reuses the forward's FP8 weight (one cast, one gather)."""
        return self.weight_t == self.weight


RECIPES: dict[str, Recipe] = {
    # torchao's default (Float8LinearConfig()): one dynamic scale per tensor, e4m3 forward,
    # e5m2 gradients (their range matters more than their precision)
    "tensorwise": Recipe("tensorwise", input=Cast("tensor", E4M3), weight=Cast("tensor", E4M3),
                         weight_t=Cast("tensor", E4M3), grad=Cast("tensor", E5M2)),
    # torchao's "rowwise" recipe: a scale per row of each operand along the reduction
    # dimension, e4m3 everywhere (gradients too), scales rounded down to powers of two
    "rowwise": Recipe("rowwise", input=Cast("row", E4M3, True), weight=Cast("row", E4M3, True),
                      weight_t=Cast("col", E4M3, True), grad=Cast("row", E4M3, True)),
}


def amax(x: torch.Tensor, cast: Cast) -> torch.Tensor:
    """The largest magnitude of ``x`` per scale of ``cast``, in float32: ``[]``
    (tensor), ``[rows, 1]`` (row) or ``[1, cols]`` (col). Exact (a max rounds nothing),
    so the max of shards' amaxes is the whole tensor's."""
    a = x.abs()
    if cast.axis == "tensor":
        m = a.amax()
    elif cast.axis == "row":
        m = a.amax(dim=-1, keepdim=True)
    else:
        m = a.amax(dim=0, keepdim=True)
    return m.to(torch.float32)


def pow2_floor(s: torch.Tensor) -> torch.Tensor:
    """The largest power of two <= ``s`` (positive, normal float32), exactly: the
    exponent bits kept, the mantissa cleared."""
    return (s.view(torch.int32) & 0x7F800000).view(torch.float32)


def amax_to_scale(amax: torch.Tensor, cast: Cast) -> torch.Tensor:
    """``fp8_max / max(amax, EPS)`` in float64, rounded to float32 (and down to a power
    of two for ``cast.pow2``): the multiplier that maps ``amax`` onto ``fp8_max``."""
    a = torch.clamp(amax.to(torch.float64), min=EPS)
    s = (torch.full_like(a, cast.fp8_max) / a).to(torch.float32)
    return pow2_floor(s) if cast.pow2 else s


def scaled(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x * scale`` in float32, before the clamp (what saturation is counted on)."""
    return x.to(torch.float32) * scale


def to_fp8(y: torch.Tensor, cast: Cast) -> torch.Tensor:
    """Saturate ``y`` (already scaled) to ``[-fp8_max, fp8_max]`` and round to ``cast.dtype``."""
    m = cast.fp8_max
    return torch.clamp(y, -m, m).to(cast.dtype)


def quantize(x: torch.Tensor, cast: Cast) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x in FP8, inverse scale)`` of ``cast``: what ``torch._scaled_mm`` takes."""
    s = amax_to_scale(amax(x, cast), cast)
    return to_fp8(scaled(x, s), cast), s.reciprocal()


def quantize_counted(x: torch.Tensor, cast: Cast) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize` plus the scale and how many values of ``x`` saturated (scaled to
    :attr:`Cast.saturation_bound` or beyond: the clamp changed them by more than
    rounding), as an int64 0-dim tensor. Dynamic scaling saturates nothing but
    non-finite values; a count says the amax missed them."""
    s = amax_to_scale(amax(x, cast), cast)
    y = scaled(x, s)
    saturated = (y.abs() >= cast.saturation_bound).sum()
    return to_fp8(y, cast), s.reciprocal(), s, saturated


def quantize_weight(w: torch.Tensor, cast: Cast) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` of a weight, its traced nodes annotated (:data:`ANNOTATION`):
    the arithmetic ``"<key>"``, the FP8 output ``"<key>/data"``, the inverse scale
    ``"<key>/scale"``. The ``fp8_allgather`` pass finds a gathered weight's cast by
    these marks and moves it onto the shard."""
    key = cast.key()
    with _compat.fx_annotate({ANNOTATION: key}):
        s = amax_to_scale(amax(w, cast), cast)
        y = torch.clamp(scaled(w, s), -cast.fp8_max, cast.fp8_max)
    with _compat.fx_annotate({ANNOTATION: key + "/data"}):
        data = y.to(cast.dtype)
    with _compat.fx_annotate({ANNOTATION: key + "/scale"}):
        inv = s.reciprocal()
    return data, inv
