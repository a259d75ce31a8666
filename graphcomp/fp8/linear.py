"""The FP8 linear layer and the conversion that swaps it in.

:class:`Float8Linear` is an ``nn.Linear`` (same parameters, state dict and
checkpoints) whose forward runs the three matmuls of training in FP8 through
``torch._scaled_mm`` with dynamic scales (:mod:`graphcomp.fp8.scaling` for the
arithmetic and the recipes)::

    forward   y      = x8 @ w8.T          x: input cast, w: weight cast
    backward  grad_x = g8 @ w8'           tensorwise: w8' is the forward's w8 (e4m3);
                                          rowwise: w by columns
              grad_w = g8'.T @ x8'        tensorwise: the forward's x8; rowwise: x
                                          and grad_y by columns

Tensorwise saves the FP8 input and weight for the backward (one byte per value);
rowwise saves the high-precision ones, which it casts again along the other dimension.
Master weights stay what they are (fp32 shards under ``graphcomp.shard``); the output
is in the compute dtype (the autocast dtype, else the input's; rowwise computes in bf16).
The forward is one ``torch.autograd.Function`` of plain tensor ops, which Dynamo and
AOTAutograd trace into graphcomp's joint graph, where ``fp8_allgather`` moves the
weight's cast in front of its all-gather.

Numerics: each layer keeps a ``fp8_stats`` buffer written by its forward (no host
sync): the input's and the weight's scale and how many input values saturated, last
step and in total; :func:`stats` reads them all at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from graphcomp import _compat
from graphcomp.fp8 import scaling
from graphcomp.fp8.scaling import RECIPES, Cast, Recipe

log = logging.getLogger(__name__)

__all__ = ["Float8Linear", "RECIPE_NAMES", "convert", "default_filter", "stats"]

RECIPE_NAMES = tuple(RECIPES)
DEFAULT_MIN_FEATURES = 2048
"""The default filter's smallest ``min(in_features, out_features)``: below it the
matmul is too small for FP8 to pay for its casts (docs/fp8.md)."""
HEAD_NAMES = frozenset({"lm_head", "head", "output", "embed_out"})
"""Module names the default filter treats as a language-model head and leaves in
high precision (the logits are the most sensitive matmul; torchtitan skips ``output``)."""
_STATS = ("input_scale", "weight_scale", "input_saturated", "input_saturated_total")


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same ``[r, c]`` tensor laid out column-major (``torch._scaled_mm``'s second operand)."""
    return t.t().contiguous().t()


def _pad_rows(t8: torch.Tensor, rows: int) -> torch.Tensor:
    """An FP8 ``[m, k]`` tensor padded with zero rows to ``[rows, k]`` (through its bytes:
    zero bytes are +0.0 in both FP8 formats)."""
    if t8.shape[0] == rows:
        return t8
    b = t8.view(torch.uint8)
    return torch.cat([b, b.new_zeros((rows - t8.shape[0], t8.shape[1]))]).view(t8.dtype)


def _mm(a8: torch.Tensor, b8: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, rowwise: bool,
        out_dtype: torch.dtype, fast: bool = False) -> torch.Tensor:
    """``a8 @ b8`` dequantized by ``sa``/``sb``: ``a8`` row-major, ``b8`` column-major.
    Rowwise scaling computes in bf16 (what ``_scaled_mm`` supports on CUDA), then casts."""
    dt = torch.bfloat16 if rowwise else out_dtype
    out = _compat.scaled_mm(a8.contiguous(), b8, sa, sb, dt, fast)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def _wgrad(g8t: torch.Tensor, x8: torch.Tensor, sg: torch.Tensor, sx: torch.Tensor, rowwise: bool,
           out_dtype: torch.dtype) -> torch.Tensor:
    """``grad_w = g8t @ x8`` (``[N, M] @ [M, K]``): the reduction runs over the tokens,
    padded with zeros to a multiple of 16 (CUDA's FP8 matmul needs it; zeros add nothing)."""
    m = x8.shape[0]
    m16 = -(-m // 16) * 16
    if m16 != m:
        g8t = _pad_rows(g8t.t().contiguous(), m16).t()
        x8 = _pad_rows(x8.contiguous(), m16)
    return _mm(g8t.contiguous(), _col_major(x8), sg, sx, rowwise, out_dtype)


class _Fp8LinearFn(torch.autograd.Function):
    """``x @ w.T`` with every matmul in FP8 (see the module docstring). Returns the output
    and a non-differentiable ``[3]`` float32 tensor: the input's scale (its smallest,
    rowwise), the weight's and how many input values saturated."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, recipe: str,  # type: ignore[override]
                out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        r = RECIPES[recipe]
        rowwise = r.input.axis == "row"
        x8, x_inv, x_scale, sat = scaling.quantize_counted(x, r.input)
        w8, w_inv = scaling.quantize_weight(w, r.weight)
        out = _mm(x8, w8.t(), x_inv, w_inv.reshape(1, -1) if rowwise else w_inv, rowwise, out_dtype, fast=True)
        if rowwise:
            ctx.save_for_backward(x, w)
        else:
            ctx.save_for_backward(x8, x_inv, w8, w_inv)
        ctx.recipe, ctx.out_dtype = recipe, out_dtype
        ctx.x_dtype, ctx.w_dtype = x.dtype, w.dtype
        st = torch.stack([x_scale.amin(), w_inv.amax().reciprocal(), sat.to(torch.float32)])
        ctx.mark_non_differentiable(st)
        return out, st

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _grad_stats: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        r: Recipe = RECIPES[ctx.recipe]
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gx = gw = None
        if r.input.axis == "tensor":
            x8, x_inv, w8, w_inv = ctx.saved_tensors
            g8, g_inv = scaling.quantize(grad, r.grad)
            if need_x:
                gx = _mm(g8, _col_major(w8), g_inv, w_inv, False, ctx.out_dtype)
            if need_w:
                gw = _wgrad(g8.t(), x8, g_inv, x_inv, False, ctx.out_dtype)
        else:
            x, w = ctx.saved_tensors
            by_col = Cast("col", r.grad.dtype, r.grad.pow2)
            if need_x:
                g8, g_inv = scaling.quantize(grad, r.grad)                    # [M, 1]
                wt8, wt_inv = scaling.quantize_weight(w, r.weight_t)           # [1, K]
                gx = _mm(g8, _col_major(wt8), g_inv, wt_inv, True, ctx.out_dtype)
            if need_w:
                gc8, gc_inv = scaling.quantize(grad, by_col)                   # [1, N]
                xc8, xc_inv = scaling.quantize(x, Cast("col", r.input.dtype, r.input.pow2))  # [1, K]
                gw = _wgrad(gc8.t(), xc8, gc_inv.reshape(-1, 1), xc_inv, True, ctx.out_dtype)
        if gx is not None and gx.dtype != ctx.x_dtype:
            gx = gx.to(ctx.x_dtype)
        if gw is not None and gw.dtype != ctx.w_dtype:
            gw = gw.to(ctx.w_dtype)
        return gx, gw, None, None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run in FP8 (:attr:`fp8_recipe`: ``"tensorwise"`` or
    ``"rowwise"``). Made by :func:`convert` (which swaps the class of an existing
    ``nn.Linear`` in place: parameters, hooks and state dict keys stay)."""

    fp8_recipe: str = "tensorwise"
    fp8_stats: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight  # (sharded: the gathered weight)
        dt = _compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype != dt:
            x2 = x2.to(dt)
        out, st = _Fp8LinearFn.apply(x2, w, self.fp8_recipe, dt)
        with torch.no_grad():
            prev = self.fp8_stats
            self.fp8_stats.copy_(torch.cat([st, prev[3:] + st[2:]]))
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8_recipe={self.fp8_recipe!r}"


def default_filter(min_features: int = DEFAULT_MIN_FEATURES) -> Callable[[nn.Module, str], bool]:
    """The default choice of layers: an ``nn.Linear`` (the class itself, not a subclass)
    whose ``in_features`` and ``out_features`` are multiples of 16 and at least
    ``min_features``, not named like a language-model head (:data:`HEAD_NAMES`)."""

    def keep(module: nn.Module, fqn: str) -> bool:
        if type(module) is not nn.Linear:
            return False
        i, o = module.in_features, module.out_features
        if i % 16 or o % 16 or min(i, o) < min_features:
            return False
        return fqn.rsplit(".", 1)[-1] not in HEAD_NAMES

    keep.__name__ = f"default_filter(min_features={min_features})"
    return keep


def check_recipe(recipe: Any, where: str) -> str:
    if not isinstance(recipe, str) or recipe not in RECIPES:
        raise ValueError(f"{where}: recipe {recipe!r} is not an FP8 recipe; valid: "
                         f"{', '.join(repr(r) for r in RECIPES)}")
    return recipe


def convert(model: nn.Module, recipe: str = "tensorwise", *,
            module_filter: Callable[[nn.Module, str], bool] | None = None,
            min_features: int = DEFAULT_MIN_FEATURES) -> list[str]:
    """Swap the chosen ``nn.Linear`` layers of ``model`` for :class:`Float8Linear` with
    ``recipe`` (``"tensorwise"`` or ``"rowwise"``), in place, before
    ``graphcomp.shard`` and ``torch.compile``; returns the converted layers' names.

    ``module_filter(module, fqn) -> bool`` chooses the layers (it is asked about every
    ``nn.Linear``); default: :func:`default_filter` with ``min_features``. A layer
    whose weight is shared with another module (a tied head) is never converted. On
    CUDA both feature counts must be multiples of 16. Raises ``ValueError`` when no
    layer is chosen (FP8 asked for and nothing would change)."""
    check_recipe(recipe, "graphcomp.fp8.convert")
    if not isinstance(model, nn.Module):
        raise TypeError(f"graphcomp.fp8.convert expects an nn.Module, got {type(model).__name__}")
    if module_filter is not None and not callable(module_filter):
        raise TypeError(f"graphcomp.fp8.convert: module_filter must be callable (module, fqn) -> bool, "
                        f"got {module_filter!r}")
    if isinstance(min_features, bool) or not isinstance(min_features, int) or min_features < 1:
        raise ValueError(f"graphcomp.fp8.convert: min_features must be an int >= 1, got {min_features!r}")
    if any(isinstance(m, Float8Linear) for m in model.modules()):
        raise ValueError("graphcomp.fp8.convert: the model already holds FP8 linears (converted before); "
                         "convert a model once")
    keep = module_filter or default_filter(min_features)
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    done: list[str] = []
    for fqn, m in model.named_modules():
        if not isinstance(m, nn.Linear) or not keep(m, fqn):
            continue
        if type(m) is not nn.Linear:
            raise ValueError(f"graphcomp.fp8.convert: {fqn!r} is a {type(m).__name__}, a subclass of nn.Linear with "
                             "its own forward; only torch.nn.Linear layers convert (leave it out of module_filter)")
        if owners.get(id(m.weight), 0) > 1:
            log.info("graphcomp.fp8.convert: %s shares its weight with another module (tied): left in high "
                     "precision", fqn)
            continue
        if m.weight.device.type == "cuda" and (m.in_features % 16 or m.out_features % 16):
            raise ValueError(f"graphcomp.fp8.convert: {fqn!r} is {m.in_features} -> {m.out_features}: CUDA's FP8 "
                             "matmul needs both feature counts to be multiples of 16 (leave it out of module_filter)")
        m.__class__ = Float8Linear
        m.fp8_recipe = recipe
        m.register_buffer("fp8_stats", torch.zeros(len(_STATS), device=m.weight.device), persistent=False)
        done.append(fqn)
    if not done:
        why = "module_filter chose none" if module_filter is not None else (
            f"none is an nn.Linear with both feature counts multiples of 16 and at least min_features="
            f"{min_features}, outside {sorted(HEAD_NAMES)}")
        raise ValueError(f"graphcomp.fp8.convert: no layer of {type(model).__name__} converts ({why}); FP8 pays on "
                         "matmul-bound layers (docs/fp8.md): pass min_features=... or module_filter=... to choose")
    log.info("graphcomp.fp8.convert: %d linear layers to FP8 (%s): %s", len(done), recipe,
             ", ".join(done[:8]) + (", ..." if len(done) > 8 else ""))
    return done


def stats(model: nn.Module) -> dict[str, dict[str, float]]:
    """Per FP8 layer (by name), the numerics of its last forward and the running total
    of saturated inputs: ``input_scale`` (the smallest, rowwise), ``weight_scale``,
    ``input_saturated``, ``input_saturated_total``. One device-to-host copy for all."""
    mods = [(n, m) for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    if not mods:
        return {}
    vals = torch.stack([m.fp8_stats.detach() for _, m in mods]).cpu().tolist()
    return {n: dict(zip(_STATS, v)) for (n, _), v in zip(mods, vals)}
