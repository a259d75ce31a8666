"""``graphcomp.optim.capture``: gradient clipping and the optimizer step as one CUDA graph.

::

    step = graphcomp.optim.capture(opt, max_norm=1.0)   # once, after building opt
    for batch in data:
        loss = model(*batch); loss.backward()
        norm = step()               # clip_grad_norm_(..., 1.0) + opt.step(), captured
        opt.zero_grad(); sched.step()

What one step is (the same code warms up, is captured, and runs when eager)::

    total = get_total_norm([p.grad ...], norm_type)     # per-shard norms, torch's own code
    total -> replicated (the DTensor all-reduce: one collective, in the graph)
    finite = isfinite(total); skipped += !finite        # all on the device
    IF finite:                                          # a conditional graph node
        clip_grads_with_norm_(params, max_norm, total)  # grads *= min(1, max_norm/(total+1e-6))
        opt.step()                                      # lr read from a device tensor

It runs torch's own clipping and optimizer code on the user's optimizer (DTensor
shards and all); only the kernels are replayed, so the Python and DTensor dispatch
cost, which grows with the number of shards, is paid at capture only, and the update
is the update eager ``opt.step()`` makes with the same settings.

Steps. The first call is an eager warm-up step (it creates the optimizer's state and
initialises NCCL, under ``graphcomp.runtime.is_capturing()``); the next call captures
(on the runtime's capture stream, into a private pool) and replays; later calls replay.
Until a step has actually updated every parameter that has a gradient (a skipped first
step, a parameter that gets its first gradient late), calls stay eager. Eager steps
decide the skip on the host (one sync each); replays never sync.

Graph-safe settings. At the first step the optimizer is switched to torch's graph-safe
form, in place: Adam/AdamW groups get ``capturable=True`` (``state['step']`` on the
device); while the step runs, each group's ``lr`` is a float32 device tensor that the
host refreshes from ``group['lr']`` (a float, as schedulers write it) when it changes
(one small copy, no sync, no re-capture). torch's kernels compute with a tensor lr in
float32 where a Python lr is used in double, so results match eager ``opt.step()``
bitwise when that also runs with a tensor lr (``lr=torch.tensor(lr, device=...)``,
``capturable=True`` for foreach), and to the last bits otherwise. SGD cannot take a
tensor lr here (foreach SGD reads it with a host sync; DTensor has no tensor-lr fused
SGD): its lr is a constant of the graph and a changed lr re-captures, so a per-step
schedule ends eager after ``max_recaptures``.

Non-finite norm. The update (clipping included) runs in an IF node: a step whose
global norm is inf/NaN leaves parameters, gradients and optimizer state untouched on
every rank, and counts itself on the device. ``sync_counters()`` (one sync) adds the
count to ``graphcomp.counters['optimizer_steps_skipped_nonfinite']``; eager steps fold
it in as they go. ``error_if_nonfinite=True`` syncs once per step to raise after the
skipped update.

Gradients at fixed addresses. The graph reads each gradient's local shard where it
was at capture. With graphcomp's CUDA graphs that is the backward's pool memory,
the same every step (``copy_outputs="auto"``), and with ``zero_grad(set_to_none=False)``
it is the persistent ``param.grad``: no copy, no extra memory, and clipping scales
``param.grad`` in place as ``clip_grad_norm_`` does. Before every replay the host
compares the gradients' addresses (a pointer read and comparison per parameter): a
gradient that moved (a re-captured backward, eager gradients the allocator placed
elsewhere) re-captures the step; after ``_MOVES_BEFORE_COPY`` such moves the step
switches to static gradient buffers, one ``torch._foreach_copy_`` of the local gradients
per step (memory: one more copy of the local gradient shards; ``param.grad`` then keeps
the unclipped values after the step). Any change in which parameters have a gradient
re-captures.

Memory. The graph allocates from a private pool, so its temporaries stay reserved:
8 bytes per parameter for fused AdamW (per-shard norms), one copy of the local
parameter shards for foreach Adam(W) (its ``exp_avg_sq.sqrt()``), counted on the CPU. Warm-up
and eager steps run on the current stream (their temporaries go back to the
caching allocator).

Host work per replay: refresh changed lrs, compare the hyper-parameters the graph
holds as constants (a change re-captures), compare every gradient's address, and (on
the first replays, or always with ``check_static_inputs="always"``) the parameters' and
the optimizer state's addresses; ``load_state_dict`` / ``add_param_group`` (new state
objects) re-capture. For sequences of replays without Python between them,
``step.ready()`` does this work ahead and says whether ``step.replay()``, the bare
replay, may run (the norm is then in ``step.last_norm``). ``graphcomp.runtime.teardown()``
releases the graph (it holds an NCCL collective); later calls run eagerly.

When it cannot capture (optimizer other than Adam/AdamW/SGD, ``differentiable=True``,
step hooks, no CUDA, no conditional graph nodes with ``skip_nonfinite``) it runs
``get_total_norm`` + ``clip_grads_with_norm_`` + ``opt.step()`` eagerly (same skip
semantics, with a host sync), with one warning and ``optimizer_fallbacks``;
``cudagraphs="require"`` raises instead. Counters: ``optimizer_steps_captured``,
``optimizer_steps_eager``, ``optimizer_steps_skipped_nonfinite``, ``optimizer_captures``,
``optimizer_recaptures``, ``optimizer_fallbacks``, ``optimizer_grad_copy_bytes``.
"""

from __future__ import annotations

import math

import torch

from graphcomp.optim.captured_step import SUPPORTED, CapturedStep, fused_adam

__all__ = ["SUPPORTED", "CapturedStep", "capture"]


def capture(
    optimizer: torch.optim.Optimizer,
    *,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    skip_nonfinite: bool = True,
    foreach: bool | None = None,
    cudagraphs: str = "auto",
    check_static_inputs: str = "first",
    max_recaptures: int = 8,
    fold_clip: bool | str = "auto",
    prefetch: bool = True,
) -> "CapturedStep":
    """Return a step callable: ``step() -> Tensor`` clips the gradients of
    ``optimizer``'s parameters by their global norm and runs ``optimizer.step()``,
    captured as one CUDA graph (see the module docstring).

    ``max_norm``: clip to this global norm (``clip_grad_norm_`` semantics); None: no
    clipping (the norm is still computed for ``skip_nonfinite``). ``norm_type``: p of
    the p-norm (> 0, or ``inf``). ``error_if_nonfinite``: raise ``RuntimeError`` on a
    non-finite norm (after skipping the update; one host sync per step).
    ``skip_nonfinite``: a non-finite norm skips the update on the device (False:
    the update runs with the non-finite norm, as eager ``clip_grad_norm_`` + ``step()``).
    ``foreach``: passed to torch's norm and clipping. ``cudagraphs``: ``"auto"``
    (capture, fall back to eager with a warning), ``"require"`` (raise instead of
    falling back), ``"off"`` (always eager, same semantics). ``check_static_inputs``:
    compare parameter and optimizer-state addresses on the first replays
    (``"first"``) or every replay (``"always"``); gradient addresses are compared
    every replay. ``max_recaptures``: re-captures (hyper-parameter, state or
    gradient-address changes) after which the step stays eager, with a warning.
    ``fold_clip``: where the clip coefficient is applied. ``"auto"`` (default): for a
    fused Adam/AdamW (``fused=True``, float32 parameters and state, no ``amsgrad``)
    on CUDA with Triton, inside one kernel that multiplies each gradient by the
    coefficient, stores it and makes torch's fused update
    (``graphcomp/optim/clip_fold.py``): bitwise ``clip_grads_with_norm_`` +
    ``opt.step()``, one read and write of all gradients fewer per step. Before its
    first use a probe checks, on random tensors with the group's hyper-parameters,
    that the kernel is bitwise torch's; anything else (another optimizer, a probe
    that does not match, step hooks) clips apart, and ``decisions`` says why.
    ``True`` (fused Adam/AdamW only): the coefficient as the fused kernel's
    ``grad_scale`` (dividing by ``1 / coefficient``): not bitwise equal to eager
    clipping when clipping is active (parameters agree to rounding), bitwise when it
    is not. ``False``: clip apart. ``param.grad`` holds the clipped gradients after
    the step in every mode, as after ``clip_grad_norm_``.

    ``prefetch``: issue the next forward's input-embedding table gather during this
    step (cross-step prefetch, ``graphcomp/sharding/prefetch.py``): the step updates the
    shards whose gathers the compiled forwards take from it (the
    ``prefetch_across_steps`` pass rewrites them while such a step exists) first,
    then the others while those gathers run; the forward then finds its table
    gathered. Each parameter's update is unchanged (two ``opt.step()`` calls over
    disjoint parameters; none when the optimizer has step hooks). False: no prefetch,
    and the forwards compiled afterwards gather the table themselves.

    The call returns the global norm as a new 0-dim tensor (a plain tensor, the same
    value on every rank) on the parameters' device."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"graphcomp.optim.capture: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not any(len(g["params"]) for g in optimizer.param_groups):
        raise ValueError("graphcomp.optim.capture: the optimizer has no parameters (optimizer.param_groups is empty)")
    from graphcomp.sharding.shard import stale_optimizer_error

    err = stale_optimizer_error(optimizer, "graphcomp.optim.capture")
    if err is not None:
        raise err
    if max_norm is not None:
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not (math.isfinite(max_norm) and max_norm > 0):
            raise ValueError(f"graphcomp.optim.capture: max_norm must be a finite number > 0 or None, got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not (norm_type > 0):
        raise ValueError(f"graphcomp.optim.capture: norm_type must be a number > 0 or float('inf'), got {norm_type!r}")
    for name, val in (("error_if_nonfinite", error_if_nonfinite), ("skip_nonfinite", skip_nonfinite)):
        if not isinstance(val, bool):
            raise ValueError(f"graphcomp.optim.capture: {name} must be True or False, got {val!r}")
    if foreach is not None and not isinstance(foreach, bool):
        raise ValueError(f"graphcomp.optim.capture: foreach must be None, True or False, got {foreach!r}")
    if cudagraphs not in ("auto", "require", "off"):
        raise ValueError(f"graphcomp.optim.capture: cudagraphs must be one of 'auto', 'require', 'off', got {cudagraphs!r}")
    if check_static_inputs not in ("first", "always"):
        raise ValueError(f"graphcomp.optim.capture: check_static_inputs must be 'first' or 'always', got {check_static_inputs!r}")
    if isinstance(max_recaptures, bool) or not isinstance(max_recaptures, int) or max_recaptures < 0:
        raise ValueError(f"graphcomp.optim.capture: max_recaptures must be an int >= 0, got {max_recaptures!r}")
    if not isinstance(prefetch, bool):
        raise ValueError(f"graphcomp.optim.capture: prefetch must be True or False, got {prefetch!r}")
    if fold_clip not in ("auto", True, False) or not isinstance(fold_clip, (bool, str)):
        raise ValueError(f"graphcomp.optim.capture: fold_clip must be 'auto', True or False, got {fold_clip!r}")
    if fold_clip is True:
        if not fused_adam(optimizer):
            raise ValueError(f"graphcomp.optim.capture: fold_clip=True needs a fused Adam or AdamW (fused=True), whose "
                             f"kernel takes the coefficient as grad_scale; got {type(optimizer).__name__} with fused="
                             f"{[g.get('fused') for g in optimizer.param_groups]}")
        if max_norm is None:
            raise ValueError("graphcomp.optim.capture: fold_clip=True needs max_norm (there is no clip coefficient to fold)")
    return CapturedStep(optimizer, max_norm=None if max_norm is None else float(max_norm), norm_type=float(norm_type),
                        error_if_nonfinite=error_if_nonfinite, skip_nonfinite=skip_nonfinite, foreach=foreach,
                        cudagraphs=cudagraphs, check_always=check_static_inputs == "always", max_recaptures=max_recaptures,
                        fold_clip=fold_clip, prefetch=prefetch)
