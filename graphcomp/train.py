"""``graphcomp.train_step``: the whole training step, at graphcomp's fastest safe plan.

::

    graphcomp.shard(model, param_dtype=torch.bfloat16)     # shards, in place
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    step = graphcomp.train_step(model, opt, max_norm=1.0, scheduler=sched, grad_accum=4)
    for batch in data:
        loss = step(**batch)        # forward, backward, clip, optimizer step, scheduler step

One call is one optimizer step:

* the forward and the loss run compiled (``torch.compile(..., backend="graphcomp")``
  over a module that returns only the loss, so the logits never leave the graph);
* with ``grad_accum=N`` every tensor argument is split into ``N`` micro-batches along
  dim 0, each micro-batch's loss is divided by ``N`` before its backward, and the call
  returns the mean of the ``N`` losses;
* gradient clipping and the optimizer step run as :func:`graphcomp.optim.capture`
  (one CUDA graph, no host sync; a non-finite norm skips the update on the device);
* after the first two calls in this process, on CUDA, the whole of the above is
  captured as one CUDA graph (:func:`graphcomp.capture_step`: the third call warms
  it up, the fourth captures it, later calls replay it) when that is safe: the
  captured optimizer step is itself captured, no frame compiled for the step has
  dynamic shapes, and twice the step's peak memory fits the memory budget (the whole
  step's graph has its own memory pool). Otherwise the step keeps running as
  compiled pieces and the reason is logged and kept in :meth:`TrainStep.stats`;
* the scheduler steps on the host, after the optimizer (the captured optimizer reads
  the new learning rate without a re-capture).

The returned loss is this rank's (a detached 0-dim tensor; reading it syncs the
host). The lower-level pieces (``shard``, ``torch.compile(backend="graphcomp")``,
``graphcomp.optim.capture``, ``graphcomp.capture_step``) stay public for loops this
does not fit.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from graphcomp.config import Config
from graphcomp.errors import OptimizerParamsError
from graphcomp.session import SESSION

log = logging.getLogger(__name__)

__all__ = ["TrainStep", "train_step"]

_WHOLE_STEP = ("auto", True, False)


class _LossModule(nn.Module):
    """What is compiled: the model's forward and the loss, returning the loss only."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(self.model, *args, **kwargs)
        return _loss_of(self.model(*args, **kwargs))


def _loss_of(out: Any) -> torch.Tensor:
    """The loss in what a model returned: a tensor, ``out.loss`` (Hugging Face
    outputs) or ``out["loss"]``."""
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"graphcomp.train_step: the model returned a {type(out).__name__} without a loss tensor "
                        f"(neither a tensor, nor .loss, nor ['loss']); pass the labels the model needs to compute "
                        f"its loss, or loss_fn=lambda model, *args, **kwargs: <the loss>")
    return loss


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer must hold the model's current parameters: ``graphcomp.shard``
    replaces every parameter with its shard, so an optimizer built before it would
    update tensors the model no longer uses (training would change nothing)."""
    from graphcomp.sharding.shard import stale_optimizer_error

    err = stale_optimizer_error(optimizer, "graphcomp.train_step")
    if err is not None:
        raise err
    own = {id(p): name for name, p in model.named_parameters()}
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in own]
    if foreign:
        p = foreign[0]
        raise OptimizerParamsError(
            f"graphcomp.train_step: the optimizer holds {len(foreign)} tensor(s) that are not parameters of the model "
            f"(the first: shape {tuple(p.shape)}, {type(p).__name__}). graphcomp.shard(model) replaces every "
            f"parameter with its shard, so an optimizer built before shard() would update tensors the model no "
            f"longer uses: build the optimizer after graphcomp.shard(model), from model.parameters()")
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    left = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if left:
        log.warning("graphcomp.train_step: %d trainable parameter(s) are not in the optimizer (the first: %r); "
                    "they get gradients but are never updated", len(left), left[0])


def _check_unsharded(model: nn.Module) -> None:
    """A sharded model whose trainable parameters are not all shards (a submodule or
    parameter added after ``graphcomp.shard``): their gradients are not reduced
    across ranks, so on several ranks each rank would train its own copy."""
    from graphcomp.errors import ShardedModelError
    from graphcomp.sharding.layout import _INFO_ATTR

    world, left = 1, []
    for mname, mod in model.named_modules():
        infos = mod.__dict__.get(_INFO_ATTR, {})
        for info in infos.values():
            world = max(world, info.world_size)
        for pname, p in mod._parameters.items():
            if p is not None and p.requires_grad and pname not in infos:
                left.append(f"{mname}.{pname}" if mname else pname)
    if not left:
        return
    what = (f"{len(left)} trainable parameter(s) of the sharded model are not sharded (the first: {left[0]!r}), "
            f"typically a module or parameter added after graphcomp.shard(model)")
    fix = ("add every module before graphcomp.shard(model), or freeze them (requires_grad_(False)); then build "
           "the optimizer from model.parameters()")
    if world > 1:
        raise ShardedModelError(f"graphcomp.train_step: {what}: their gradients would not be reduced across the "
                                f"{world} ranks, so each rank would train its own copy. Fix: {fix}")
    log.warning("graphcomp.train_step: %s; harmless on one rank, but on several their gradients would not be "
                "reduced across ranks. Fix: %s", what, fix)


def _split(value: Any, n: int, where: str) -> list[Any]:
    """``n`` micro-batches of one argument: tensors split along dim 0, the rest repeated."""
    if not isinstance(value, torch.Tensor):
        return [value] * n
    if value.dim() == 0 or value.shape[0] % n:
        raise ValueError(f"graphcomp.train_step(grad_accum={n}): argument {where} has shape {tuple(value.shape)}, "
                         f"whose dim 0 does not split into {n} equal micro-batches; pass a batch of a multiple of "
                         f"{n} rows, or grad_accum=1")
    return list(value.chunk(n, dim=0))


class TrainStep:
    """The callable :func:`train_step` returns; ``step(*args, **kwargs)`` runs one
    optimizer step and returns the mean loss. Attributes: ``model``, ``optimizer``,
    ``scheduler``, ``compiled`` (the compiled forward + loss), ``steps`` (optimizer
    steps taken), ``last_norm`` (the latest global gradient norm, a device tensor)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, loss_fn: Callable[..., Any] | None,
                 max_norm: float | None, grad_accum: int, scheduler: Any, autocast: torch.dtype | None,
                 config: Config, whole_step: bool | str, dynamic: bool | None):
        from graphcomp import optim
        from graphcomp.compiler.backend import graphcomp_backend
        from graphcomp.runtime.whole_step import capture_step

        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.grad_accum, self.autocast, self.config = grad_accum, autocast, config
        self.compiled = torch.compile(_LossModule(model, loss_fn), backend=graphcomp_backend, options=config,
                                      dynamic=dynamic)
        self.update = optim.capture(optimizer, max_norm=max_norm, cudagraphs=config.cudagraphs)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._all_params = list(model.parameters())  # (requires_grad changes: _trainable_changed)
        self._trainable = [p.requires_grad for p in self._all_params]
        self.steps = 0
        self._calls = 0  # calls in this process (load_state_dict restores steps, not these)
        self.last_norm: torch.Tensor | None = None
        self._whole_step = whole_step
        self._capture_step = capture_step
        self._whole: Any = None  # the StepCapture, once decided
        self.whole_step_reason: str | None = None  # why the whole step is (not) one graph

    # ------------------------------------------------------------- calling
    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if [p.requires_grad for p in self._all_params] != self._trainable:
            self._trainable_changed()
        if self._whole is None and self._calls >= 2:
            self._decide_whole_step()
        fn = self._whole or self._step
        loss, norm = fn(*args, **kwargs)
        self.last_norm = norm
        if self.scheduler is not None:
            self.scheduler.step()
        self.steps += 1
        self._calls += 1
        return loss

    def _trainable_changed(self) -> None:
        """Parameters frozen or unfrozen (``requires_grad_``) since the last call: the
        compiled frames recompile and the captured optimizer re-plans on their own, but
        a whole-step CUDA graph would keep computing and applying the old set's
        gradients; it is dropped and decided again two calls later."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        changed = [(names.get(id(p), "?"), p.requires_grad) for p, was in zip(self._all_params, self._trainable)
                   if p.requires_grad != was]
        self._trainable = [p.requires_grad for p in self._all_params]
        self.params = [p for p in self._all_params if p.requires_grad]
        dropped = bool(self._whole)
        if dropped:
            self._whole.release()
            self._whole, self._calls = None, 0
        n, grad = changed[0]
        log.warning("graphcomp.train_step: requires_grad changed for %d parameter(s) since the last step (the first: "
                    "%r is now %s); the step recompiles for the new set%s", len(changed), n,
                    "trainable" if grad else "frozen",
                    ", and the whole-step CUDA graph is dropped (decided again after two steps)" if dropped else "")

    def _step(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward over the micro-batches, clip + optimizer step, zero_grad."""
        n = self.grad_accum
        if n == 1:
            micro = [(args, kwargs)]
        else:
            leaves, spec = tree_flatten((args, kwargs))
            cols = [_split(v, n, f"#{i}") for i, v in enumerate(leaves)]
            micro = [tree_unflatten([c[k] for c in cols], spec) for k in range(n)]
        total: torch.Tensor | None = None
        for a, kw in micro:
            with torch.autocast(_device_type(self.params), dtype=self.autocast, enabled=self.autocast is not None):
                loss = self.compiled(*a, **kw)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError(f"graphcomp.train_step: the loss must be a 0-dim tensor, got "
                                 f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}")
            (loss / n if n > 1 else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        norm = self.update()
        self.optimizer.zero_grad(set_to_none=True)
        assert total is not None
        return (total / n if n > 1 else total), norm

    def _decide_whole_step(self) -> None:
        """After two steps (compiled, optimizer state created): capture the whole step
        as one CUDA graph when that is safe, else keep the pieces; log why."""
        why = self._why_not_whole_step()
        if why is None:
            self._whole = self._capture_step(self._step, params=self.params, optimizers=[self.update], warmup=1,
                                             cudagraphs=self.config.cudagraphs,
                                             check_static_inputs=self.config.check_static_inputs)
            self.whole_step_reason = "captured as one CUDA graph (graphcomp.capture_step)"
            log.info("graphcomp.train_step: the whole step is captured as one CUDA graph from the next call")
        else:
            self._whole = False
            self.whole_step_reason = why
            level = logging.WARNING if self._whole_step is True else logging.INFO
            log.log(level, "graphcomp.train_step: the whole step is not captured as one graph: %s", why)
        SESSION.counters.add("train_step_whole" if why is None else "train_step_pieces")

    def _why_not_whole_step(self) -> str | None:
        if self._whole_step is False:
            return "whole_step=False"
        if self.config.cudagraphs == "off":
            return "cudagraphs='off'"
        from graphcomp.runtime.manager import RUNTIME

        if not RUNTIME.device.available():
            return "no CUDA device"
        opt_mode = self.update.stats().get("mode")
        if opt_mode != "captured":
            return (f"the optimizer step is not captured (mode {opt_mode!r}: "
                    f"{(self.update.stats().get('decisions') or ['?'])[-1]})")
        if SESSION.shape_following_code:
            return "a compiled frame has dynamic shapes (each new shape would re-capture the whole step)"
        return self._memory_reason()

    def _memory_reason(self) -> str | None:
        """The whole step's graph allocates from its own pool, beside the pieces' pool:
        about one step's activations and temporaries more. Refused when twice this
        process's peak so far would not fit the memory budget (CUDA parameters only)."""
        dev = self.params[0].device if self.params else None
        if dev is None or dev.type != "cuda":
            return None
        from graphcomp import _compat

        total = _compat.device_memory_bytes(dev)
        return whole_step_memory_reason(torch.cuda.max_memory_allocated(dev), total, self.config.memory_budget)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``{"model", "optim", "scheduler", "steps"}``, ready for
        ``torch.distributed.checkpoint.save`` (the model and optimizer state as
        ``get_state_dict`` gives them: fully-qualified names, sharded tensors)."""
        model_sd, optim_sd = _get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd,
                "scheduler": None if self.scheduler is None else self.scheduler.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (after ``dcp.load`` filled it)."""
        missing = [k for k in ("model", "optim", "steps") if k not in state]
        if missing:
            raise KeyError(f"graphcomp.TrainStep.load_state_dict: missing {missing}; expected the keys of state_dict()")
        _set_state_dict(self.model, self.optimizer, state["model"], state["optim"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.steps = int(state["steps"])

    # -------------------------------------------------------------- reporting
    def stats(self) -> dict[str, Any]:
        """What ran: steps, whether the whole step is one graph (and why), the
        optimizer step's record and the whole step's."""
        out: dict[str, Any] = {"steps": self.steps, "whole_step": self.whole_step_reason,
                               "optimizer": self.update.stats()}
        if self._whole:
            out["whole_step_capture"] = self._whole.stats()
        return out


def whole_step_memory_reason(peak: int, total: int, budget: Any) -> str | None:
    """Why a whole-step graph would not fit (None: it fits): its own pool needs about
    the step's peak again, so ``2 * peak`` must stay within the budget
    (``Config.memory_budget`` on a CUDA device of ``total`` bytes; no budget: all of it)."""
    from graphcomp.analysis.memory import budget_bytes

    limit = budget_bytes(budget, total)
    limit = total if limit is None else limit
    if 2 * peak <= limit:
        return None
    return (f"its own memory pool would need about the step's peak again ({peak / 2**30:.2f} GiB) and twice "
            f"that is over the memory budget ({limit / 2**30:.2f} GiB)")


def _device_type(params: list[torch.Tensor]) -> str:
    return params[0].device.type if params else "cpu"


def _get_state_dict(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The model and optimizer state with every sharded tensor in its logical shape
    (the optimizer's moments as the parameters are), so that a checkpoint loads on
    another world size."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from graphcomp.sharding.shard import optimizer_state_to_logical

    model_sd, optim_sd = get_state_dict(model, opt)
    optimizer_state_to_logical(model, optim_sd)
    return model_sd, optim_sd


def _set_state_dict(model: nn.Module, opt: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from graphcomp.sharding.shard import optimizer_state_to_padded

    optim_sd = {**optim_sd, "state": {k: dict(v) for k, v in (optim_sd.get("state") or {}).items()}}
    optimizer_state_to_padded(model, optim_sd)  # (a copy: the caller's dict keeps what it loaded)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, *, loss_fn: Callable[..., Any] | None = None,
               max_norm: float | None = 1.0, grad_accum: int = 1, scheduler: Any = None,
               autocast: torch.dtype | None = None, options: Mapping[str, Any] | Config | None = None,
               whole_step: bool | str = "auto", dynamic: bool | None = None) -> TrainStep:
    """The training step of ``model`` with ``optimizer``, compiled with graphcomp at
    its defaults; returns a :class:`TrainStep` (``loss = step(*args, **kwargs)``).

    ``model``: sharded with :func:`graphcomp.shard` first when several ranks train it
    (an unsharded model on several ranks is an error: its gradients would not be
    reduced). ``optimizer``: built from ``model.parameters()`` after ``shard`` (an
    optimizer that holds other tensors raises :class:`graphcomp.errors.OptimizerParamsError`).
    ``loss_fn``: ``loss_fn(model, *args, **kwargs) -> loss``; None: the model's own
    output is the loss (a tensor, ``.loss`` or ``["loss"]``, as Hugging Face models
    return with ``labels=``). ``max_norm``: clip the global gradient norm to this
    (None: no clipping). ``grad_accum``: micro-batches per optimizer step (every
    tensor argument is split along dim 0). ``scheduler``: an lr scheduler of
    ``optimizer``, stepped after each optimizer step. ``autocast``: a dtype to run the
    forward under ``torch.autocast`` (for an unsharded model; a sharded one computes in
    ``shard``'s ``param_dtype``). ``options``: :class:`graphcomp.Config` fields (as for
    ``torch.compile(..., options=...)``). ``whole_step``: ``"auto"`` (default) captures
    the whole step as one CUDA graph from the third call when safe, ``True`` the same
    but logs a warning when it is not safe, ``False`` never. ``dynamic``: passed to
    ``torch.compile`` (None, its default: shapes become dynamic after the first change
    of shape; False: one graph per shape)."""
    from graphcomp.sharding.shard import is_sharded

    if not isinstance(model, nn.Module):
        raise TypeError(f"graphcomp.train_step: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"graphcomp.train_step: optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and not is_sharded(model):
        raise ValueError("graphcomp.train_step: the model is not sharded and this job has "
                         f"{dist.get_world_size()} ranks: its gradients would not be reduced across them. Call "
                         "graphcomp.shard(model) first, then build the optimizer from model.parameters()")
    _check_optimizer(model, optimizer)
    if is_sharded(model):
        _check_unsharded(model)
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"graphcomp.train_step: loss_fn must be callable (model, *args, **kwargs) -> loss or None, "
                        f"got {type(loss_fn).__name__}")
    if max_norm is not None and (isinstance(max_norm, bool) or not isinstance(max_norm, (int, float))
                                 or not (math.isfinite(max_norm) and max_norm > 0)):
        raise ValueError(f"graphcomp.train_step: max_norm must be a finite number > 0 or None, got {max_norm!r}")
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"graphcomp.train_step: grad_accum must be an int >= 1, got {grad_accum!r}")
    if scheduler is not None:
        if not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"graphcomp.train_step: scheduler must be an lr scheduler (with .step()), got "
                            f"{type(scheduler).__name__}")
        if getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise ValueError("graphcomp.train_step: the scheduler belongs to another optimizer than the one given")
    if autocast is not None and (not isinstance(autocast, torch.dtype) or not autocast.is_floating_point):
        raise ValueError(f"graphcomp.train_step: autocast must be a floating-point torch.dtype or None, got {autocast!r}")
    if whole_step not in _WHOLE_STEP or not isinstance(whole_step, (bool, str)):
        raise ValueError(f"graphcomp.train_step: whole_step must be one of {list(_WHOLE_STEP)}, got {whole_step!r}")
    cfg = Config.from_options(options)
    return TrainStep(model, optimizer, loss_fn=loss_fn, max_norm=None if max_norm is None else float(max_norm),
                     grad_accum=grad_accum, scheduler=scheduler, autocast=autocast, config=cfg, whole_step=whole_step,
                     dynamic=dynamic)
