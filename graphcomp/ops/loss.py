"""``graphcomp::`` ops that compute a language-model loss ``C`` tokens at a time.

Pass ``chunk_lm_loss`` (``graphcomp/passes/chunk_lm_loss.py``) puts them in place of
``linear -> [cast] -> [view] -> cross_entropy`` so the ``[tokens, vocab]`` logits,
their fp32 copy, the log-probabilities and their gradient never exist whole: each
chunk of ``C = Config.loss_chunk_tokens`` rows does its matmul, upcast,
log-softmax and gradient, and only ``[C, vocab]`` buffers are live at a time.

``linear_cross_entropy(hidden [N, D], weight [V, D], target [N], ...)``
    ``-> (loss, grad_hidden [N, D], grad_weight [V, D] in fp32)``. The loss of
    ``cross_entropy((hidden @ weight.T).to(loss_dtype), target)``; in the same chunk
    loop it computes the gradients of that loss for an upstream gradient of 1
    (``grad_hidden`` row by row in the model's dtype, ``grad_weight`` summed over
    chunks in fp32). Its autograd formula only scales them by the real upstream
    gradient (and rounds ``grad_weight`` to the weight's dtype, once), so the
    backward recomputes nothing and needs neither the logits nor the weight (a
    sharded weight is not gathered again for it). ``grad_hidden`` /
    ``grad_weight`` are empty when not asked for (inference, a frozen head).

``cross_entropy(logits [N, V], target [N], ...) -> loss``
    For logits that must exist anyway (a model that returns them, as Hugging Face
    models do): the upcast copy, the log-probabilities and their gradient are
    chunked. Its backward, ``cross_entropy_backward``, recomputes each chunk's
    softmax from the saved logits and writes the gradient in the logits' dtype.

Numerics: the per-chunk math is the unfused graph's (``log_softmax`` in
``loss_dtype``, the picked log-probabilities summed and divided by the number of
non-ignored targets for ``"mean"``, gradient ``(softmax - onehot) * scale``), so
fp32 results equal the reference up to summation order. In low precision the
per-chunk logits and gradient are rounded as the reference rounds them, and
``grad_weight`` is rounded once, after the fp32 sum over chunks (as the
reference's single matmul does). One rounding moves: ``linear_cross_entropy``
computes the gradient for an upstream gradient of 1 and scales the bf16
``grad_hidden`` afterwards, which is exact when the upstream gradient is a power
of two (1, or ``1 / micro_batches`` for 2, 4, 8...).

All ops return fresh tensors (no aliasing) and have fake (meta) implementations,
so Dynamo, AOTAutograd and Inductor trace them; Inductor runs them as extern
kernels. Nothing here syncs the host: chunk bounds depend only on shapes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from graphcomp import _compat

REDUCTIONS = ("mean", "sum")


# ------------------------------------------------------------------ checks
def _check(hidden: Tensor | None, weight: Tensor | None, logits: Tensor | None, target: Tensor,
           reduction: str, chunk_tokens: int, loss_dtype: torch.dtype) -> None:
    """Argument checks shared by the real and the fake implementations."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"graphcomp chunked loss: reduction={reduction!r} is not supported; valid: {list(REDUCTIONS)}")
    if chunk_tokens < 1:
        raise ValueError(f"graphcomp chunked loss: chunk_tokens must be >= 1, got {chunk_tokens}")
    if not loss_dtype.is_floating_point:
        raise ValueError(f"graphcomp chunked loss: loss_dtype must be a floating dtype, got {loss_dtype}")
    if hidden is not None:
        assert weight is not None
        if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
            raise ValueError(f"graphcomp.linear_cross_entropy: hidden must be [N, D] and weight [V, D], got "
                             f"hidden {list(hidden.shape)} and weight {list(weight.shape)}")
        if hidden.dtype != weight.dtype:
            raise ValueError(f"graphcomp.linear_cross_entropy: hidden ({hidden.dtype}) and weight ({weight.dtype}) "
                             "must have one dtype")
        rows = hidden.shape[0]
    else:
        assert logits is not None
        if logits.dim() != 2:
            raise ValueError(f"graphcomp.cross_entropy: logits must be [N, V], got {list(logits.shape)}")
        rows = logits.shape[0]
    if target.dim() != 1 or target.shape[0] != rows or target.dtype != torch.int64:
        raise ValueError(f"graphcomp chunked loss: target must be int64 [N] with N={rows}, got "
                         f"{target.dtype} {list(target.shape)}")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of sums (the loss total, the weight gradient): at least fp32."""
    return torch.promote_types(dtype, torch.float32)


# ------------------------------------------------------------- chunk math
def _targets(target: Tensor, ignore_index: int, reduction: str,
             dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(valid rows, target with ignored rows pointing at class 0, per-row gradient
    scale for an upstream gradient of 1, mean divisor or None)."""
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros((), dtype=target.dtype, device=target.device))
    if reduction == "mean":
        denom = valid.sum().to(dtype)
        # a batch with every target ignored: loss 0/0 = nan (as torch), gradient 0
        scale = torch.where(valid, denom.reciprocal(), torch.zeros((), dtype=dtype, device=target.device))
        return valid, safe, scale, denom
    return valid, safe, valid.to(dtype), None


def _chunk(make_x: Callable[[], Tensor], safe: Tensor, valid: Tensor, scale: Tensor | None,
           loss_dtype: torch.dtype, compiled: bool, grad_out: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """One chunk of rows: (sum of the non-ignored rows' losses at >= fp32, gradient).

    ``make_x()`` gives the chunk's logits [c, V] in the model's dtype (a callable, so
    the buffer is dropped as soon as its upcast copy exists). With ``scale`` given,
    the gradient ``(softmax(x) - onehot) * scale[:, None]`` is written in the
    logits' dtype (into ``grad_out`` if given). ``compiled`` (CUDA): the arithmetic
    runs as one Inductor-compiled function (:func:`_chunk_math`), which holds only
    the logits and the gradient; otherwise as eager kernels, at most two ``[c, V]``
    buffers at once (see :func:`workspace_bytes`)."""
    x = make_x()
    if _use_compiled(compiled, x):
        return _compiled_chunk_math()(x, safe, valid, scale, loss_dtype, grad_out)
    dtype, device, rows = x.dtype, x.device, x.shape[0]
    xl = x if x.dtype == loss_dtype else x.to(loss_dtype)
    del x
    logp = torch.log_softmax(xl, dim=1)
    del xl
    acc = _acc_dtype(loss_dtype)
    zero = torch.zeros((), dtype=acc, device=device)
    picked = logp.gather(1, safe[:, None]).squeeze(1)
    nll = -torch.where(valid, picked.to(acc), zero).sum()
    if scale is None:
        return nll, None
    p = logp.exp_() if logp.dtype == acc else logp.to(acc).exp_()
    del logp
    p.scatter_add_(1, safe[:, None], torch.full((rows, 1), -1.0, dtype=acc, device=device))
    s = scale.to(acc)[:, None]
    if grad_out is None and dtype == acc:
        return nll, p.mul_(s)
    out = grad_out if grad_out is not None else torch.empty(p.shape, dtype=dtype, device=device)
    torch.mul(p, s, out=out)
    return nll, out


def _chunk_math(x: Tensor, safe: Tensor, valid: Tensor, scale: Tensor | None, loss_dtype: torch.dtype,
                out: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The eager path's arithmetic as one traceable function (Inductor fuses it into
    a row reduction and an elementwise pass; the one-hot is a select, not a scatter).
    With ``out``, the gradient is written there (Inductor stores into it directly)."""
    acc = _acc_dtype(loss_dtype)
    logp = torch.log_softmax(x.to(loss_dtype), dim=1)
    picked = logp.gather(1, safe[:, None]).squeeze(1)
    nll = -torch.where(valid, picked.to(acc), torch.zeros((), dtype=acc, device=x.device)).sum()
    if scale is None:
        return nll, None
    p = logp.to(acc).exp()
    cols = torch.arange(x.shape[1], device=x.device)
    p = torch.where(cols[None, :] == safe[:, None], p - 1, p)
    g = (p * scale.to(acc)[:, None]).to(x.dtype)
    if out is None:
        return nll, g
    out.copy_(g)
    return nll, out


@functools.cache
def _compiled_chunk_math() -> Callable[..., tuple[Tensor, Tensor | None]]:
    """:func:`_chunk_math` under ``torch.compile`` (Inductor), built on first use.
    It compiles at the first call of each shape (in a training loop: the full chunk
    and the last one, during the first step, before any CUDA-graph capture)."""
    return torch.compile(_chunk_math, backend="inductor", fullgraph=True)


def _use_compiled(compiled: bool, t: Tensor) -> bool:
    """The compiled chunk math runs on CUDA only (CPU: eager kernels)."""
    return compiled and t.device.type == "cuda"


def _bounds(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(n, s + chunk)) for s in range(0, n, chunk)]


# ------------------------------------------------------ linear + cross-entropy
@torch.library.custom_op("graphcomp::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, reduction: str,
                         chunk_tokens: int, loss_dtype: torch.dtype, grad_hidden: bool, grad_weight: bool,
                         compiled: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``cross_entropy((hidden @ weight.T).to(loss_dtype), target)`` in chunks of
    ``chunk_tokens`` rows, plus the gradients for an upstream gradient of 1."""
    _check(hidden, weight, None, target, reduction, chunk_tokens, loss_dtype)
    acc = _acc_dtype(loss_dtype)
    want = grad_hidden or grad_weight
    valid, safe, scale, denom = _targets(target, ignore_index, reduction, acc)
    total = torch.zeros((), dtype=acc, device=hidden.device)
    gh = torch.empty_like(hidden) if grad_hidden else hidden.new_empty(0)
    gw_acc = None
    if grad_weight:  # summed over chunks at >= fp32; rounded to the weight's dtype in the backward
        gw_acc = torch.zeros(weight.shape, dtype=_acc_dtype(weight.dtype), device=weight.device)
    wt = weight.t()
    for s, e in _bounds(hidden.shape[0], chunk_tokens):
        hc = hidden[s:e]
        nll, g = _chunk(lambda hc=hc: torch.mm(hc, wt), safe[s:e], valid[s:e], scale[s:e] if want else None, loss_dtype,
                        compiled)
        total += nll
        if g is None:
            continue
        if grad_hidden:
            torch.mm(g, weight, out=gh[s:e])
        if gw_acc is not None:
            _compat.addmm_accumulate_(gw_acc, g.t(), hc)
        del g
    loss = (total / denom if denom is not None else total).to(loss_dtype)
    return loss, gh, gw_acc if gw_acc is not None else weight.new_empty(0, dtype=_acc_dtype(weight.dtype))


@linear_cross_entropy.register_fake
def _linear_cross_entropy_fake(hidden, weight, target, ignore_index, reduction, chunk_tokens, loss_dtype,
                               grad_hidden, grad_weight, compiled):
    _check(hidden, weight, None, target, reduction, chunk_tokens, loss_dtype)
    acc = _acc_dtype(weight.dtype)
    return (hidden.new_empty((), dtype=loss_dtype),
            torch.empty_like(hidden) if grad_hidden else hidden.new_empty(0),
            torch.empty_like(weight, dtype=acc) if grad_weight else weight.new_empty(0, dtype=acc))


def _lce_setup(ctx, inputs, output):
    _, gh, gw = output
    ctx.mark_non_differentiable(gh, gw)
    ctx.save_for_backward(gh, gw)
    ctx.flags = (inputs[7], inputs[8])
    ctx.weight_dtype = inputs[1].dtype


def _lce_backward(ctx, grad_loss, _gh, _gw):
    gh, gw = ctx.saved_tensors
    want_h, want_w = ctx.flags
    # gh: a 0-dim fp32 factor keeps its dtype; gw: the fp32 sum is scaled, then
    # rounded to the weight's dtype once (what the reference's matmul output is)
    return (gh * grad_loss if want_h else None, (gw * grad_loss).to(ctx.weight_dtype) if want_w else None,
            None, None, None, None, None, None, None, None)


linear_cross_entropy.register_autograd(_lce_backward, setup_context=_lce_setup)


# --------------------------------------------------- cross-entropy on logits
@torch.library.custom_op("graphcomp::cross_entropy", mutates_args=())
def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int, reduction: str, chunk_tokens: int,
                  loss_dtype: torch.dtype, compiled: bool) -> Tensor:
    """``cross_entropy(logits.to(loss_dtype), target)`` in chunks of rows."""
    _check(None, None, logits, target, reduction, chunk_tokens, loss_dtype)
    acc = _acc_dtype(loss_dtype)
    valid, safe, _, denom = _targets(target, ignore_index, reduction, acc)
    total = torch.zeros((), dtype=acc, device=logits.device)
    for s, e in _bounds(logits.shape[0], chunk_tokens):
        total += _chunk(lambda s=s, e=e: logits[s:e], safe[s:e], valid[s:e], None, loss_dtype, compiled)[0]
    return (total / denom if denom is not None else total).to(loss_dtype)


@cross_entropy.register_fake
def _cross_entropy_fake(logits, target, ignore_index, reduction, chunk_tokens, loss_dtype, compiled):
    _check(None, None, logits, target, reduction, chunk_tokens, loss_dtype)
    return logits.new_empty((), dtype=loss_dtype)


@torch.library.custom_op("graphcomp::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(grad_loss: Tensor, logits: Tensor, target: Tensor, ignore_index: int, reduction: str,
                           chunk_tokens: int, loss_dtype: torch.dtype, compiled: bool) -> Tensor:
    """Gradient of :func:`cross_entropy` w.r.t. ``logits`` (in their dtype), one
    chunk of rows at a time: the softmax is recomputed from the logits."""
    _check(None, None, logits, target, reduction, chunk_tokens, loss_dtype)
    acc = _acc_dtype(loss_dtype)
    valid, safe, scale, _ = _targets(target, ignore_index, reduction, acc)
    scale = scale * grad_loss.to(acc)
    out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    for s, e in _bounds(logits.shape[0], chunk_tokens):
        _chunk(lambda s=s, e=e: logits[s:e], safe[s:e], valid[s:e], scale[s:e], loss_dtype, compiled, grad_out=out[s:e])
    return out


@cross_entropy_backward.register_fake
def _cross_entropy_backward_fake(grad_loss, logits, target, ignore_index, reduction, chunk_tokens, loss_dtype,
                                 compiled):
    _check(None, None, logits, target, reduction, chunk_tokens, loss_dtype)
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _ce_setup(ctx, inputs, output):
    logits, target, *args = inputs
    ctx.save_for_backward(logits, target)
    ctx.args = tuple(args)  # ignore_index, reduction, chunk_tokens, loss_dtype, compiled


def _ce_backward(ctx, grad_loss):
    logits, target = ctx.saved_tensors
    g = torch.ops.graphcomp.cross_entropy_backward(grad_loss, logits, target, *ctx.args)
    return g, None, None, None, None, None, None


cross_entropy.register_autograd(_ce_backward, setup_context=_ce_setup)


OPS = {
    "linear_cross_entropy": torch.ops.graphcomp.linear_cross_entropy.default,
    "cross_entropy": torch.ops.graphcomp.cross_entropy.default,
    "cross_entropy_backward": torch.ops.graphcomp.cross_entropy_backward.default,
}


# ------------------------------------------------------------ memory model
def workspace_bytes(target: object, args: tuple, vals: list[object]) -> int:
    """Bytes one of these ops allocates internally beyond its outputs while it runs
    (the memory model adds them at the op, whose outputs it counts from the op's
    start), from its arguments (``args``) and their fake values (``vals``, the
    tensors in argument order); 0 for any other op or for symbolic sizes.

    Per chunk of ``c`` rows and ``V`` classes (:func:`_chunk`), eager kernels: at
    most two ``[c, V]`` buffers at once, the logits beside their upcast copy, that
    copy beside the log-probabilities, or the probabilities beside the gradient in
    the model's dtype; compiled (CUDA): the logits and the gradient, both in the
    model's dtype (the fp32 weight-gradient sum is an output). Where no
    fp32-output matmul exists (CPU), ``linear_cross_entropy`` with a weight
    narrower than fp32 also makes fp32 copies of each chunk's matmul operands."""
    ops = (OPS["linear_cross_entropy"], OPS["cross_entropy"], OPS["cross_entropy_backward"])
    if target not in ops:
        return 0
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    lce = target is OPS["linear_cross_entropy"]
    try:
        if lce:
            weight = tensors[1]
            n, v, model = tensors[0].shape[0], weight.shape[0], tensors[0].element_size()
            chunk, loss_dtype, grads, want_w = args[5], args[6], bool(args[7] or args[8]), bool(args[8])
            compiled = _use_compiled(bool(args[9]), tensors[0])
        else:
            logits = tensors[0] if target is OPS["cross_entropy"] else tensors[1]
            n, v, model = logits.shape[0], logits.shape[1], logits.element_size()
            chunk, loss_dtype = args[4], args[5]
            grads, want_w = target is OPS["cross_entropy_backward"], False
            compiled = _use_compiled(bool(args[6]), logits)
    except IndexError:  # unexpected arguments: unknown
        return 0
    dims = [n, v, chunk] + ([tensors[1].shape[1]] if want_w else [])
    if not all(type(x) is int for x in dims):  # symbolic sizes (never turned into ints: that would guard)
        return 0
    c = min(n, chunk)
    loss, acc = loss_dtype.itemsize, _acc_dtype(loss_dtype).itemsize
    if compiled:
        # the matmul's logits (cross_entropy* read views of their input) and the gradient
        per_row = (model if lce else 0) + (model if grads else 0)
    else:
        upcast = loss != model
        per_row = max(model + loss if upcast else 0, 2 * loss if upcast else model + loss)
        if grads:
            # the gradient goes into the output for cross_entropy_backward; it is a new
            # chunk buffer (kept through the chunk's matmuls) for linear_cross_entropy
            own_grad = lce and model != acc
            per_row = max(per_row, acc + (model if own_grad else 0))
    loop = c * v * per_row
    wdt = tensors[1].dtype if want_w else None
    if wdt is not None and _acc_dtype(wdt) != wdt and not _compat.has_fp32_out_addmm(tensors[1]):
        loop += (c * v + c * tensors[1].shape[1]) * _acc_dtype(wdt).itemsize
    return loop
