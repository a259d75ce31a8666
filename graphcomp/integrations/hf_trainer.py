"""Hugging Face ``Trainer`` on graphcomp: :class:`GraphcompTrainer`.

::

    from transformers import TrainingArguments
    from graphcomp.integrations.hf_trainer import GraphcompTrainer

    args = TrainingArguments(output_dir="out", bf16=True, per_device_train_batch_size=4,
                             gradient_accumulation_steps=4, max_grad_norm=1.0, lr_scheduler_type="cosine")
    trainer = GraphcompTrainer(model=model, args=args, train_dataset=ds, graphcomp_options={})
    trainer.train()            # torchrun --nproc-per-node N train.py
    trainer.save_model()       # on every rank (the weights are assembled with collectives)

The training loop is Trainer's own (data, gradient accumulation, loss normalisation,
logging, callbacks, evaluation, checkpoints); the subclass changes these hooks:

* ``__init__``: after Trainer's setup (which, under ``torchrun``, starts the process
  group through accelerate) the model is sharded in place with :func:`graphcomp.shard`
  (``param_dtype=torch.bfloat16`` when ``args.bf16``, fp32 master weights) when the job
  has more than one rank, before any optimizer exists. Configurations that would
  train wrong raise :class:`graphcomp.errors.TrainerConfigError`.
* ``create_optimizer``: Trainer's optimizer (``args.optim`` with its parameter groups,
  ``optimizer_cls_and_kwargs=``, or one passed in ``optimizers=`` that was built on
  the sharded model) becomes the ``.optimizer`` of a :class:`GraphcompOptimizer`, whose
  ``step()`` is :func:`graphcomp.optim.capture` ``(opt, max_norm=args.max_grad_norm)``:
  clipping and the update in one CUDA graph on GPUs, no host sync. ``create_scheduler``
  builds the scheduler on the torch optimizer.
* ``_wrap_model``: the model compiled with ``backend="graphcomp"`` instead of
  Trainer's DataParallel / ``accelerator.prepare(model)``, which would wrap it in DDP
  (graphcomp reduce-scatters every gradient itself; DDP would all-reduce them again,
  and accelerate refuses DTensor parameters for DDP anyway).
* ``_clip_grad_norm`` / ``_get_grad_norm``: clipping happens inside the optimizer
  step; both return a 0-dim tensor that the step fills with the global norm, which
  Trainer logs as ``grad_norm`` after the step.
* ``save_model``: the full weights (:func:`graphcomp.full_state_dict`, a collective
  on every rank) go to ``save_pretrained`` on rank 0, so checkpoints load with
  ``from_pretrained`` at any world size. ``_save_optimizer_and_scheduler`` /
  ``_load_optimizer_and_scheduler``: the sharded optimizer state with
  ``torch.distributed.checkpoint`` in ``<checkpoint>/optimizer_dcp`` (Trainer's
  ``optimizer.pt`` from rank 0 would hold rank 0's shards only); resuming it needs
  the same number of ranks.

Why not ``graphcomp.train_step``: Trainer calls ``training_step`` (forward and
backward) once per micro-batch and steps the optimizer, the scheduler and
``zero_grad`` from its own loop; ``train_step`` takes all micro-batches of a step in
one call (split evenly along dim 0, each loss divided by their number), while Trainer
normalises the loss by the label tokens of all micro-batches on all ranks
(``num_items_in_batch``). The integration uses the pieces ``train_step`` is made of:
the forward compiled with graphcomp (returning only the loss when Trainer's loss is
the model's own, so the logits never leave the graph) and the captured optimizer
step. What it lacks is ``train_step``'s whole-step CUDA graph.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer

from graphcomp import env
from graphcomp.config import Config
from graphcomp.errors import OptimizerParamsError, TrainerConfigError
from graphcomp.train import _check_optimizer, _loss_of

log = logging.getLogger(__name__)

__all__ = ["GraphcompOptimizer", "GraphcompTrainer", "TrainerConfigError"]

OPTIMIZER_DIR = "optimizer_dcp"
"""Where in a checkpoint directory the sharded optimizer state is saved (a
``torch.distributed.checkpoint`` directory)."""
_META = "graphcomp_trainer.json"
_SCHEDULER = "scheduler.pt"  # transformers.trainer.SCHEDULER_NAME
_OPTIMIZER_PT = "optimizer.pt"  # transformers.trainer.OPTIMIZER_NAME


class GraphcompOptimizer:
    """The optimizer a :class:`GraphcompTrainer` holds (``trainer.optimizer``): the torch
    optimizer is ``.optimizer``; ``step()`` clips the gradients to ``max_norm`` by their
    global norm and updates, through :func:`graphcomp.optim.capture` (``.update``).
    ``param_groups``, ``state``, ``state_dict``, ``load_state_dict``, ``zero_grad`` are
    the torch optimizer's. Not a ``torch.optim.Optimizer`` on purpose: accelerate then
    leaves it unwrapped (its ``AcceleratedOptimizer`` would call the torch optimizer's
    own ``step``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, max_norm: float | None, cudagraphs: str = "auto"):
        from graphcomp import optim

        self.optimizer = optimizer
        self.max_norm = max_norm
        self.update = optim.capture(optimizer, max_norm=max_norm, cudagraphs=cudagraphs)
        self.last_norm: torch.Tensor | None = None
        self._norm_out: torch.Tensor | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def norm_slot(self, device: torch.device) -> torch.Tensor:
        """The 0-dim tensor the next ``step()`` writes the global gradient norm into
        (NaN until then); the same tensor until that step."""
        if self._norm_out is None:
            self._norm_out = torch.full((), float("nan"), dtype=torch.float32, device=device)
        return self._norm_out

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("GraphcompOptimizer.step: a closure is not supported (the step is captured)")
        norm = self.update()
        self.last_norm = norm
        if self._norm_out is not None:
            self._norm_out.copy_(norm.detach())
            self._norm_out = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(group)

    def stats(self) -> dict[str, Any]:
        """The captured step's record (mode, decisions, counts)."""
        return self.update.stats()

    def __getattr__(self, name: str) -> Any:  # anything else: the torch optimizer's
        inner = self.__dict__.get("optimizer")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def __repr__(self) -> str:
        return f"GraphcompOptimizer({type(self.optimizer).__name__}, max_norm={self.max_norm})"


class _LossOnly(nn.Module):
    """What is compiled for training when Trainer's loss is the model's own output:
    the model's forward returning ``{"loss": loss}`` only (Trainer reads
    ``outputs["loss"]``), so the ``[tokens, vocab]`` logits never leave the graph."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        return {"loss": _loss_of(self.model(*args, **kwargs))}


def _refuse_args(args: Any) -> None:
    """TrainingArguments that would make another system shard, wrap or scale the
    model, checked before Trainer sets them up."""
    if args is None:
        return
    if getattr(args, "deepspeed", None):
        raise TrainerConfigError(
            "GraphcompTrainer: TrainingArguments(deepspeed=...) is set. DeepSpeed would partition and wrap the model "
            "that graphcomp shards (two systems reducing the same gradients); drop deepspeed= (graphcomp.shard is "
            "the ZeRO-3 here)")
    if getattr(args, "fsdp", None):
        raise TrainerConfigError(
            f"GraphcompTrainer: TrainingArguments(fsdp={args.fsdp!r}) is set. FSDP would wrap and shard the model "
            "that graphcomp shards (gradients reduced twice, parameters sharded twice); drop fsdp= and fsdp_config= "
            "(graphcomp.shard is the FSDP here)")
    if getattr(args, "fp16", False):
        raise TrainerConfigError(
            "GraphcompTrainer: TrainingArguments(fp16=True) needs a loss scaler, which this path does not run "
            "(gradients would underflow or be left scaled). Use bf16=True (bf16 compute over fp32 master weights)")


class GraphcompTrainer(Trainer):
    """``transformers.Trainer`` that trains the model sharded and compiled by graphcomp
    (see the module docstring). Arguments: those of ``Trainer``, plus
    ``graphcomp_options``: :class:`graphcomp.Config` fields for the compile
    (``torch.compile(..., options=...)``), e.g. ``{"codegen": "eager"}``.

    Attributes beyond Trainer's: ``graphcomp_config`` (the validated Config),
    ``sharded`` (whether the model is sharded), ``compiled`` (the compiled training
    module, once ``train()`` started)."""

    def __init__(self, *args: Any, graphcomp_options: Any = None, **kwargs: Any):
        self.graphcomp_config = Config.from_options(graphcomp_options)
        _refuse_args(kwargs["args"] if "args" in kwargs else (args[1] if len(args) > 1 else None))
        self.compiled: nn.Module | None = None
        self.sharded = False
        super().__init__(*args, **kwargs)
        self._refuse()
        self._setup_sharding()

    # ------------------------------------------------------------------ setup
    def _refuse(self) -> None:
        """Configurations that would train wrong or differently than asked: a named
        error (those that only lose an effect: a warning)."""
        a = self.args
        _refuse_args(a)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise TrainerConfigError(
                "GraphcompTrainer: accelerate is configured for "
                f"{'DeepSpeed' if self.is_deepspeed_enabled else 'FSDP'} (accelerate launch config or "
                "ACCELERATE_USE_* environment): it would wrap the model graphcomp shards; launch with torchrun or a "
                "plain multi-process accelerate config")
        if getattr(a, "parallelism_config", None) is not None:
            raise TrainerConfigError(
                "GraphcompTrainer: TrainingArguments(parallelism_config=...) asks accelerate for tensor/context/"
                "sequence parallelism, which would re-wrap the model graphcomp shards; for tensor parallelism use "
                "graphcomp.shard(model, mesh=..., dp_dim=...) before the Trainer and pass the sharded model")
        if a.n_gpu > 1:
            raise TrainerConfigError(
                f"GraphcompTrainer: one process sees {a.n_gpu} GPUs, for which Trainer would use nn.DataParallel "
                "(not supported with graphcomp); launch one process per GPU with torchrun")
        if self.model_init is not None:
            raise TrainerConfigError(
                "GraphcompTrainer: model_init= re-creates the model in train(), after the model was sharded; pass "
                "model= (hyper-parameter search with model_init is not supported)")
        if str(getattr(a.optim, "value", a.optim)) in ("lomo", "adalomo"):
            raise TrainerConfigError(
                f"GraphcompTrainer: optim={a.optim!r} updates parameters inside the backward, outside graphcomp's "
                "captured optimizer step; choose another optimizer")
        launched = env.launched_world_size()
        ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if a.world_size == 1 and max(launched, ranks) > 1:
            raise TrainerConfigError(
                f"GraphcompTrainer: this job has {max(launched, ranks)} ranks but Trainer runs as one process "
                "(args.world_size == 1): every rank would train on the whole dataset. accelerate sets up a "
                "multi-process job from the launcher's environment (launch with torchrun: LOCAL_RANK, WORLD_SIZE), "
                "and on CPU ranks only with TrainingArguments(use_cpu=True)")
        if getattr(a, "torch_compile", False) and (a.torch_compile_backend or "inductor") != "graphcomp":
            warnings.warn(f"GraphcompTrainer: torch_compile_backend={a.torch_compile_backend!r} is not used: the "
                          "model is compiled with backend='graphcomp' (graphcomp_options= sets its options)",
                          stacklevel=3)

    def _setup_sharding(self) -> None:
        from graphcomp.sharding.shard import is_sharded, shard

        a = self.args
        if a.world_size > 1 and not dist.is_initialized():
            # accelerate starts the group for torchrun jobs; start it here if it did not
            backend = a.ddp_backend or ("nccl" if a.device.type == "cuda" else "gloo")
            dist.init_process_group(backend=backend)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world > 1 and not is_sharded(self.model):
            if self.optimizer is not None:
                raise OptimizerParamsError(
                    "GraphcompTrainer: optimizers=(optimizer, ...) was built on the unsharded model; graphcomp.shard "
                    "replaces every parameter with its shard, so that optimizer would update tensors the model no "
                    "longer uses. Pass optimizer_cls_and_kwargs=(cls, kwargs) (built after sharding), or call "
                    "graphcomp.shard(model) before building the optimizer and the Trainer")
            shard(self.model, param_dtype=torch.bfloat16 if a.bf16 else None)
        self.sharded = is_sharded(self.model)
        if self.sharded:
            if a.fp16_full_eval or a.bf16_full_eval:
                raise TrainerConfigError(
                    "GraphcompTrainer: fp16_full_eval / bf16_full_eval cast the model in place, which would turn the "
                    "sharded fp32 master weights into half precision; with bf16=True evaluation already computes "
                    "in bf16")
            log.info("GraphcompTrainer: the model is sharded over %d ranks (param_dtype=%s)", world,
                     "bfloat16" if a.bf16 else "the parameters' own")
        elif a.bf16:
            log.info("GraphcompTrainer: one rank, model not sharded; bf16=True runs the forward under torch.autocast")
        for name in ("ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_static_graph"):
            if getattr(a, name, None) is not None and world > 1:
                warnings.warn(f"GraphcompTrainer: {name} has no effect: the model is not wrapped in DDP (graphcomp "
                              "reduce-scatters the gradients of the sharded model)", stacklevel=3)
        # accelerate must never prepare the model: for training, _wrap_model below keeps it
        # out of accelerator.prepare; for evaluation Trainer calls
        # accelerator.prepare_model(model, evaluation_mode=True), which would patch
        # model.forward with autocast (changing the graphs compiled for training after the
        # first evaluation). accelerate skips a model it marks as prepared.
        self.model._is_accelerate_prepared = True

    # -------------------------------------------------------------- optimizer
    @property
    def torch_optimizer(self) -> torch.optim.Optimizer | None:
        """The torch optimizer inside ``self.optimizer`` (None before it is created)."""
        opt = self.optimizer
        return opt.optimizer if isinstance(opt, GraphcompOptimizer) else opt

    def create_optimizer(self, model: nn.Module | None = None) -> GraphcompOptimizer:
        if isinstance(self.optimizer, GraphcompOptimizer):
            return self.optimizer
        opt = super().create_optimizer(model)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TrainerConfigError(f"GraphcompTrainer: the optimizer is a {type(opt).__name__}, not a "
                                     "torch.optim.Optimizer; graphcomp.optim.capture steps torch optimizers only")
        _check_optimizer(self.model, opt)
        mn = self.args.max_grad_norm
        max_norm = float(mn) if mn is not None and mn > 0 and math.isfinite(mn) else None
        self.optimizer = GraphcompOptimizer(opt, max_norm=max_norm, cudagraphs=self.graphcomp_config.cudagraphs)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        inner = self.torch_optimizer
        if self.lr_scheduler is not None and getattr(self.lr_scheduler, "optimizer", inner) is not inner:
            raise TrainerConfigError("GraphcompTrainer: the lr scheduler passed in optimizers= belongs to another "
                                     "optimizer than the one passed with it")
        return super().create_scheduler(num_training_steps, optimizer=optimizer if optimizer is not None else inner)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        # Trainer clips here, then calls optimizer.step(): GraphcompOptimizer.step clips and
        # updates in one (captured) step and writes the norm into this tensor
        return self._norm_slot()

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        return self._norm_slot() if grad_norm is None else grad_norm

    def _norm_slot(self) -> torch.Tensor:
        opt = self.optimizer
        if not isinstance(opt, GraphcompOptimizer):
            raise RuntimeError("GraphcompTrainer: the optimizer was replaced after create_optimizer (it is a "
                               f"{type(opt).__name__}); its step would skip clipping")
        return opt.norm_slot(self.args.device)

    # ------------------------------------------------------------------ model
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        # Trainer's version wraps in nn.DataParallel, and Trainer then passes the model to
        # accelerator.prepare, which wraps it in DistributedDataParallel. graphcomp
        # reduce-scatters each gradient itself, so DDP would reduce them a second time
        # (and accelerate refuses DTensor parameters for DDP). Returning a module other than
        # self.model makes Trainer._prepare_for_training skip accelerator.prepare(model) and
        # prepare the optimizer only (which GraphcompOptimizer passes through unwrapped).
        if not training:
            return self.model  # evaluation: the sharded model, eager (parameters gathered on use)
        if self.compiled is None:
            from graphcomp.compiler.backend import graphcomp_backend

            target: nn.Module = _LossOnly(self.model) if self._loss_is_models_own() else self.model
            self.compiled = torch.compile(target, backend=graphcomp_backend, options=self.graphcomp_config)
        return self.compiled

    def _loss_is_models_own(self) -> bool:
        """Trainer's loss is ``outputs["loss"]`` (no label smoothing, no
        ``compute_loss_func``, ``compute_loss`` not overridden): then only the loss
        leaves the compiled graph."""
        return (self.label_smoother is None and self.compute_loss_func is None
                and type(self).compute_loss is Trainer.compute_loss)

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> Any:
        # Trainer leaves autocast to accelerator.prepare(model), which is not called here.
        # A sharded model computes in shard()'s param_dtype; an unsharded one with bf16=True
        # runs under torch.autocast.
        if self.args.bf16 and not self.sharded:
            return torch.autocast(self.args.device.type, dtype=torch.bfloat16, cache_enabled=cache_enabled)
        return contextlib.nullcontext()

    # ------------------------------------------------------------ checkpoints
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the full weights with ``save_pretrained`` (loadable with
        ``from_pretrained``). With a sharded model the weights are assembled with
        collectives: call it on every rank (Trainer's checkpoints do)."""
        if not self.sharded:
            return super().save_model(output_dir, _internal_call)
        from graphcomp.sharding.shard import full_state_dict

        output_dir = output_dir if output_dir is not None else self.args.output_dir
        sd = full_state_dict(self.model, rank0_only=not self.args.save_on_each_node)
        if self.args.should_save:
            self._save(output_dir, state_dict=sd)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
        return None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.sharded:
            return super()._save_optimizer_and_scheduler(output_dir)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        os.makedirs(output_dir, exist_ok=True)
        osd = get_optimizer_state_dict(self.model, self.torch_optimizer)
        path = os.path.join(output_dir, OPTIMIZER_DIR)
        # (a resumed run re-saves the checkpoints after its start: overwrite, as Trainer does its files)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
            dcp.save({"optimizer": osd}, checkpoint_id=path, storage_writer=dcp.FileSystemWriter(path, overwrite=True))
        if self.args.should_save:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*save or load the state of the optimizer.*")
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))
            with open(os.path.join(output_dir, _META), "w") as f:
                json.dump({"world_size": dist.get_world_size(), "optimizer": type(self.torch_optimizer).__name__}, f)
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return None
        if not self.sharded:
            return super()._load_optimizer_and_scheduler(checkpoint)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        path = os.path.join(checkpoint, OPTIMIZER_DIR)
        if not os.path.isdir(path):
            what = ("Trainer's optimizer.pt (written unsharded: rank 0's state only)"
                    if os.path.isfile(os.path.join(checkpoint, _OPTIMIZER_PT)) else "no optimizer state")
            warnings.warn(f"GraphcompTrainer: checkpoint {checkpoint!r} has {what}, not {OPTIMIZER_DIR}/: resuming "
                          "with a fresh optimizer state and learning-rate schedule position", stacklevel=2)
            return None
        meta_path = os.path.join(checkpoint, _META)
        if os.path.isfile(meta_path):
            with open(meta_path) as f:
                meta = json.load(f)
            if meta.get("world_size") != dist.get_world_size():
                raise TrainerConfigError(
                    f"GraphcompTrainer: checkpoint {checkpoint!r} holds optimizer state of {meta.get('world_size')} "
                    f"ranks and this job has {dist.get_world_size()}: graphcomp's shards are padded per world size. "
                    "Resume with the same number of ranks (the model weights in model.safetensors load at any size)")
        opt = self.torch_optimizer
        osd = get_optimizer_state_dict(self.model, opt)  # (creates the state to load into)
        state = {"optimizer": osd}
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(self.model, opt, state["optimizer"])
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*save or load the state of the optimizer.*")
            self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, _SCHEDULER), weights_only=True))
        return None
