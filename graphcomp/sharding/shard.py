"""``graphcomp.shard(model)``: dim-0 parameter shards, gathered on use.

Layout. A parameter of logical shape ``[N, *rest]`` (a 0-dim parameter counts as
``[1]``) becomes, in place and under the same name, an ``nn.Parameter`` holding a
``DTensor`` on a 1-D mesh of the group, placement ``Shard(0)``, *padded* global
shape ``[W*c, *rest]`` with ``c = ceil(N / W)``: every rank holds exactly
``[c, *rest]`` (rank ``r`` holds logical rows ``r*c .. r*c+c-1``; rows ``>= N`` are
zero padding). Equal local shapes on every rank mean every rank traces the same
graph. The optimizer is built on these shards (``model.parameters()``).

Gather on use. The class of every module owning a sharded parameter is swapped
for a cached subclass with a ``property`` per sharded name, so ``module.weight``
(eager, or traced by Dynamo) returns the gathered full tensor::

    shard (DTensor) -> to_local [c, *rest] -> all_gather_into_tensor -> wait_tensor
        -> narrow(0, 0, N) -> reshape(logical) -> to(param_dtype)      (forward)
    grad -> to(reduce_dtype) -> pad to [W*c, *rest] -> reduce_scatter_tensor(sum)
        -> wait_tensor -> / W -> to(param dtype) -> to_local's backward
        -> DTensor grad on the shard (AccumulateGrad accumulates micro-batches)

The collectives are ``_c10d_functional`` ops called with the group *name*, so
they reach the joint graph as functional collectives (one gather per parameter
access, one reduce-scatter per access of a trainable parameter). Dynamo records each
gather as one ``graphcomp::gather_shard`` op, which AOTAutograd decomposes into the
collectives and views above (``shard_gather.gather_shard``). With
a world size of 1 there is no collective: narrow, reshape and cast only.

``state_dict()`` presents each sharded parameter as a DTensor of the *logical*
shape ``[N, *rest]`` with ``Shard(0)`` (torch.chunk layout, which is the padded
layout without its padding), viewing the shard's storage, so
``torch.distributed.checkpoint`` saves and loads in place and ``.full_tensor()``
assembles the full value. ``load_state_dict`` takes such DTensors, DTensors of
any other layout, or plain full tensors (e.g. from an unsharded model), and
copies into the existing shards (the Parameter objects, hence the optimizer,
stay valid).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from graphcomp import _compat
from graphcomp.errors import OptimizerParamsError, ShardedModelError
from graphcomp.fp8 import linear as fp8_linear
from graphcomp.sharding import embedding_exchange
from graphcomp.sharding import gather_scope
from graphcomp.sharding import gloo_groups
from graphcomp.compiler import guard_filter
from graphcomp.sharding import mesh as mesh_sharding
from graphcomp.sharding.gather import _GatherParam, gather, gather_local, reduce_grad  # noqa: F401 (re-exported)
from graphcomp.sharding.layout import _INFO_ATTR, ShardInfo, _contiguous_strides, _dtensor_cls, _padded_local, _row_slice

log = logging.getLogger(__name__)

__all__ = ["ShardInfo", "shard", "gather", "is_sharded", "shard_info", "full_state_dict"]

def _mark_eager_frames() -> None:
    """Reads from eager code stay eager Python (see graphcomp.sharding.gather_scope)."""
    _compat.skip_top_level_frames(_make_property("_").fget, gather, mesh_sharding.for_module)


# -------------------------------------------------------- module class swapping
def _make_property(name: str) -> property:
    def getter(self: nn.Module) -> torch.Tensor:
        scoped = gather_scope.cached(self, name)  # eager: gathered when the module's forward began
        if scoped is not None:
            return scoped
        return gather(self._parameters[name], self._graphcomp_shard_info[name])

    getter.__name__ = name
    getter.__doc__ = f"The gathered (full) value of sharded parameter {name!r} (graphcomp.shard)."
    return property(getter)


@functools.lru_cache(maxsize=None)
def _sharded_class(base: type, names: tuple[str, ...], exchange: bool = False) -> type:
    """``base`` plus a gather-on-use property per sharded parameter name. Cached,
    so modules of one class share one subclass (stable for Dynamo's caches).
    ``exchange``: an ``nn.Embedding`` whose compiled lookups exchange tokens
    (``graphcomp.sharding.embedding_exchange``)."""

    def __setattr__(self: nn.Module, name: str, value: Any) -> None:
        if name in names:
            info = self.__dict__[_INFO_ATTR][name]
            if isinstance(value, nn.Parameter) and _is_shard_of(value, info, self._parameters[name]):
                self._parameters[name] = value  # a shard in the same layout (load_state_dict(assign=True))
                return
            raise AttributeError(
                f"cannot assign to {info.fqn!r}: it is sharded by graphcomp.shard() (reading it gathers the full "
                "tensor). Load new values with model.load_state_dict(...) (full tensors or DTensors), or write "
                f"the local shard module._parameters[{name!r}].to_local() under torch.no_grad()"
            )
        base.__setattr__(self, name, value)

    def _apply(self: nn.Module, fn: Any, *args: Any, **kwargs: Any) -> nn.Module:
        # model.to(device) / .cuda() / .cpu() / to_empty(device=...) after shard: the shards
        # would leave the device their process group and mesh are bound to. Probed on an
        # empty tensor of each shard's local dtype and device, before anything moves.
        # (A dtype change, model.to(torch.bfloat16), is allowed: shards change dtype as a
        # plain model's parameters would.)
        for n in names:
            p = self._parameters.get(n)
            if p is None:
                continue
            local = p.to_local() if hasattr(p, "to_local") else p
            probe = fn(torch.empty(0, dtype=local.dtype, device=local.device))
            if isinstance(probe, torch.Tensor) and probe.device != local.device:
                raise ShardedModelError(
                    f"cannot move sharded parameter {self.__dict__[_INFO_ATTR][n].fqn!r} from {local.device} to "
                    f"{probe.device}: graphcomp.shard bound its shards to the process group and device mesh of "
                    f"{local.device}. Move the model before sharding: model.to(device), then graphcomp.shard(model)")
        return base._apply(self, fn, *args, **kwargs)

    def extra_repr(self: nn.Module) -> str:
        # print(model) must not gather (a collective on one rank hangs the job):
        # render the base class's repr with the shards visible instead
        sharded_cls = self.__class__
        self.__class__ = base
        try:
            return base.extra_repr(self)
        finally:
            self.__class__ = sharded_cls

    ns: dict[str, Any] = {n: _make_property(n) for n in names}
    if exchange:
        def forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
            if torch.compiler.is_compiling():
                # the table gather, as an op the pass embedding_exchange may turn into the exchange
                w = embedding_exchange.table(self, *self.__dict__["_graphcomp_exchange"])
                return F.embedding(input, w, self.padding_idx)
            return base.forward(self, input)

        ns["forward"] = forward
    ns.update(
        __setattr__=__setattr__,
        _apply=_apply,
        extra_repr=extra_repr,
        __module__=base.__module__,
        __qualname__=base.__qualname__,
        _graphcomp_base_class=base,
        _graphcomp_sharded_names=frozenset(names),
    )
    return type(base.__name__, (base,), ns)


def _is_shard_of(value: torch.Tensor, info: ShardInfo, current: torch.Tensor) -> bool:
    D = _dtensor_cls()
    if not isinstance(value, D) or not isinstance(current, D):
        return False
    return (
        tuple(value.shape) == tuple(current.shape)
        and value.placements == current.placements
        and value.device_mesh == current.device_mesh
    )


def _iter_owners(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Parameter]]:
    """(module fqn, module, attribute name, parameter) for every parameter slot,
    tied parameters and shared modules included (each module object once)."""
    for mname, mod in model.named_modules():
        for pname, p in mod._parameters.items():
            if p is not None:
                yield mname, mod, pname, p


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def is_sharded(model: nn.Module) -> bool:
    """True when ``model`` (or a submodule) was sharded by :func:`shard`."""
    return any(_INFO_ATTR in m.__dict__ for m in model.modules())


def shard_info(module: nn.Module, name: str) -> ShardInfo:
    """The :class:`ShardInfo` of sharded parameter ``name`` of ``module``."""
    try:
        return module.__dict__[_INFO_ATTR][name]
    except KeyError:
        raise KeyError(f"{type(module).__name__} has no parameter {name!r} sharded by graphcomp.shard()") from None


# ------------------------------------------------- optimizers built too early
_REPLACED = "_graphcomp_replaced_by_shard"  # on a parameter shard() replaced: the fqn of its shard


def replaced_parameters(params: Any) -> list[tuple[torch.Tensor, str]]:
    """The tensors of ``params`` that :func:`shard` replaced with shards, with the name
    of the parameter that replaced each."""
    return [(p, p.__dict__[_REPLACED]) for p in params if isinstance(p, torch.Tensor) and _REPLACED in p.__dict__]


def stale_optimizer_error(opt: torch.optim.Optimizer, where: str) -> OptimizerParamsError | None:
    """The error for an optimizer that holds parameters ``shard`` replaced (None: it
    holds none): stepping it would update tensors the model no longer uses."""
    stale = replaced_parameters(p for g in opt.param_groups for p in g["params"])
    if not stale:
        return None
    return OptimizerParamsError(
        f"{where}: {type(opt).__name__} holds {len(stale)} parameter(s) that graphcomp.shard replaced with shards "
        f"(the first: {stale[0][1]!r}), so its steps would update tensors the model no longer uses and training "
        f"would change nothing: build the optimizer after graphcomp.shard(model), from model.parameters()")


def _check_optimizer_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook (registered by the first :func:`shard`): each
    optimizer's first step checks once that it holds no replaced parameter."""
    from graphcomp.session import SESSION

    if opt in SESSION.optimizers_checked:
        return
    err = stale_optimizer_error(opt, "graphcomp.shard")
    if err is not None:
        raise err
    SESSION.optimizers_checked.add(opt)


_check_optimizer_step._graphcomp_own = True  # (not a user hook: captured steps ignore it)


def _watch_optimizers() -> None:
    from graphcomp.session import SESSION

    if SESSION.optimizer_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        SESSION.optimizer_hook = register_optimizer_step_pre_hook(_check_optimizer_step)


# ---------------------------------------------------------------- validation
def _validate(
    model: nn.Module, group: Any, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype, allow_dtensor: bool = False
) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"graphcomp.shard expects an nn.Module, got {type(model).__name__}")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"graphcomp.shard: group must be a torch.distributed.ProcessGroup or None (the world), "
                        f"got {type(group).__name__} {group!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "graphcomp.shard needs an initialized process group: call "
            "torch.distributed.init_process_group(backend='nccl' (GPU) or 'gloo' (CPU)) first "
            "(under torchrun, or with world_size=1 for a single process)"
        )
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError("graphcomp.shard: this process is not a member of the given process group")
    for mname, mod in model.named_modules():
        if _INFO_ATTR in mod.__dict__:
            where = f"module {mname!r}" if mname else "the model"
            raise RuntimeError(
                f"graphcomp.shard: {where} is already sharded (by an earlier graphcomp.shard call); "
                "call shard() once per model, on its root module"
            )
        if isinstance(mod, nn.RNNBase):
            raise NotImplementedError(
                f"graphcomp.shard: {mname or 'the model'} is a {type(mod).__name__}, which keeps its own references "
                "to its weights (_flat_weights) and would bypass the gather; shard the other modules only"
            )
        if torch.nn.utils.parametrize.is_parametrized(mod):
            raise NotImplementedError(
                f"graphcomp.shard: module {mname!r} has parametrizations (torch.nn.utils.parametrize); "
                "remove them (parametrize.remove_parametrizations) before sharding"
            )
    for dname, d in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if d is None and dname == "param_dtype":
            continue
        if not isinstance(d, torch.dtype) or not d.is_floating_point:
            raise ValueError(f"graphcomp.shard: {dname} must be a floating-point torch.dtype, got {d!r}")
    owners = list(_iter_owners(model))
    first_dev: tuple[str, torch.device] | None = None
    D = _dtensor_cls()
    for mname, _mod, pname, p in owners:
        fqn = _join(mname, pname)
        if isinstance(p, D) and not allow_dtensor:
            raise RuntimeError(
                f"graphcomp.shard: parameter {fqn!r} is already a DTensor (sharded by graphcomp, FSDP2 or "
                "tensor parallelism); graphcomp.shard takes a model of plain parameters, or, for tensor "
                "parallelism on a mesh dimension, shard(model, mesh=mesh, dp_dim=<the other dimension>)"
            )
        if first_dev is None:
            first_dev = (fqn, p.device)
        elif p.device != first_dev[1]:
            raise ValueError(
                f"graphcomp.shard: parameters on mixed devices: {first_dev[0]!r} is on {first_dev[1]} but "
                f"{fqn!r} is on {p.device}; move the model to one device (model.to(device)) before sharding"
            )
        if p.device.type == "meta":
            raise NotImplementedError(
                f"graphcomp.shard: parameter {fqn!r} is on the meta device; materialize the model "
                "(model.to_empty(device=...) and initialize it) before sharding"
            )
        if param_dtype is not None and p.is_floating_point():
            if torch.finfo(param_dtype).bits > torch.finfo(p.dtype).bits:
                raise ValueError(
                    f"graphcomp.shard: param_dtype={param_dtype} is wider than parameter {fqn!r} "
                    f"({p.dtype}); param_dtype may only keep or narrow a parameter's dtype"
                )
    return owners


# --------------------------------------------------------------------- shard
def shard(
    model: nn.Module,
    group: Any = None,
    *,
    mesh: Any = None,
    dp_dim: str | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    embedding: str = "auto",
    fp8: str | None = None,
) -> nn.Module:
    """Shard every parameter of ``model`` along dim 0 over ``group`` (default:
    the world), in place; returns ``model``.

    ``mesh`` (instead of ``group``): shard over one dimension of a ``DeviceMesh``:
    a 1-D mesh (``mesh2d["dp"]``), or a mesh with more dimensions and ``dp_dim``
    naming the one to shard over. Parameters that tensor parallelism made DTensors
    on another dimension of the same mesh (``parallelize_module(model,
    mesh2d["tp"], plan)``) become 2-D DTensors, gathered over ``dp_dim`` only:
    module code still sees its TP DTensor (see ``graphcomp.sharding.mesh``).

    ``param_dtype``: dtype the gathered parameters are cast to for compute
    (floating parameters only; never wider than a parameter). ``reduce_dtype``:
    dtype in which gradients are reduce-scattered (then averaged over ranks and
    cast back to the parameter's dtype). Build the optimizer *after* sharding.
    Reading ``module.weight`` returns the gathered full tensor (a fresh tensor:
    writing into it does not change the shard); see the module docstring.

    ``embedding``: how a compiled ``nn.Embedding`` lookup reaches the table (see
    ``graphcomp.sharding.embedding_exchange``). ``"auto"`` (default): it exchanges tokens and
    rows (activation-sized collectives, no table gather and no table-sized gradient
    reduce-scatter) where every rank's first compile looks up the same static number
    of tokens, on NCCL groups, and gathers the table otherwise; ``"exchange"``: it
    always exchanges (ranks with different token counts raise ``RankDivergence``);
    ``"gather"``: it gathers the table on use like any parameter.

    ``fp8``: ``"tensorwise"`` or ``"rowwise"`` trains the model's large linear layers
    in FP8 (``graphcomp.fp8.convert`` with its default filter, before sharding: the LM
    head and layers narrower than 2048 stay as they are); their weights are then
    gathered as FP8 bytes, cast on the shard. ``None`` (default): no FP8. A model
    converted by ``graphcomp.fp8.convert`` beforehand trains in FP8 with ``fp8=None``.
    Not with tensor parallelism (``mesh`` with a tp dimension).
    """
    if embedding not in embedding_exchange.EMBEDDING_MODES:
        raise ValueError(f"graphcomp.shard: embedding={embedding!r}; valid: "
                         f"{', '.join(repr(m) for m in embedding_exchange.EMBEDDING_MODES)}")
    if fp8 is not None and fp8 not in fp8_linear.RECIPE_NAMES:
        raise ValueError(f"graphcomp.shard: fp8={fp8!r}; valid: None, "
                         f"{', '.join(repr(r) for r in fp8_linear.RECIPE_NAMES)}")
    plan = None
    if mesh is not None or dp_dim is not None:
        if mesh is None:
            raise ValueError(f"graphcomp.shard: dp_dim={dp_dim!r} names a dimension of mesh=, which is missing")
        if not isinstance(model, nn.Module):
            raise TypeError(f"graphcomp.shard expects an nn.Module, got {type(model).__name__}")
        plan = mesh_sharding.resolve(model, group, mesh, dp_dim, list(_iter_owners(model)))
        group = plan.group
    two_d = plan is not None and plan.param_mesh is not None
    owners = _validate(model, group, param_dtype, reduce_dtype, allow_dtensor=two_d)
    if two_d and (fp8 is not None or any(isinstance(m, fp8_linear.Float8Linear) for m in model.modules())):
        raise NotImplementedError(
            "graphcomp.shard: FP8 linear layers with tensor parallelism (a mesh with a tp dimension) are not "
            "supported: their weights reach the layer as tensor-parallel DTensors, which the FP8 matmul does not "
            "take; shard without fp8 (and without graphcomp.fp8.convert), or over a 1-D mesh")
    if fp8 is not None:
        fp8_linear.convert(model, fp8)
    _mark_eager_frames()
    if group is None:
        group = dist.group.WORLD
    if not owners:
        log.warning("graphcomp.shard: %s has no parameters; nothing sharded", type(model).__name__)
        return model
    device = owners[0][3].device
    if plan is None and device.type == "cpu":
        group = gloo_groups.serial_group(group)  # one gloo worker thread (docs/heap-corruption.md)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    group_name = _compat.process_group_name(group)
    _compat.register_fused_optimizer_meta()  # fused optimizers on the DTensor parameters: see _compat
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = plan.dp_mesh if plan is not None else DeviceMesh.from_group(group, device.type)

    new_params: dict[int, tuple[nn.Parameter, ShardInfo]] = {}
    per_module: dict[int, tuple[nn.Module, dict[str, ShardInfo]]] = {}
    n_bytes = local_bytes = pad_bytes = 0
    for mname, mod, pname, p in owners:
        if id(p) not in new_params:
            fqn = _join(mname, pname)
            tp = mesh_sharding.tp_layout(p) if two_d and isinstance(p, DTensor) else None
            src = p.to_local() if tp is not None else p  # 2-D: the tp-local tensor is what is sharded
            shape = tuple(src.shape)
            rows = shape[0] if shape else 1
            row_shape = shape[1:]
            pdt = param_dtype if (param_dtype is not None and p.is_floating_point() and param_dtype != p.dtype) else None
            info = ShardInfo(
                fqn=fqn,
                shape=shape,
                rows=rows,
                chunk=max(1, math.ceil(rows / world)),
                orig_dtype=p.dtype,
                param_dtype=pdt,
                reduce_dtype=reduce_dtype,
                group_name=group_name,
                world_size=world,
                tp=tp,
                mesh_dim=plan.dp_index if two_d else 0,
            )
            with torch.no_grad():
                local = _padded_local(_row_slice(src.detach(), info, rank), info, src)
            if two_d:
                dt = mesh_sharding.make_param(local, info, plan)
            else:
                dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            newp = nn.Parameter(dt, requires_grad=p.requires_grad)
            if not two_d:  # its spec never reaches a traced graph (graphcomp.guard_filter)
                guard_filter.own(newp)
            for k, v in vars(p).items():  # user tags on the parameter (e.g. no-weight-decay flags)
                setattr(newp, k, v)
            new_params[id(p)] = (newp, info)
            row_bytes = math.prod(row_shape) * src.element_size()
            n_bytes += rows * row_bytes
            local_bytes += info.chunk * row_bytes
            pad_bytes += (world * info.chunk - rows) * row_bytes
        newp, info = new_params[id(p)]
        _, infos = per_module.setdefault(id(mod), (mod, {}))
        infos[pname] = info
        mod._parameters[pname] = newp
        p.__dict__[_REPLACED] = info.fqn  # (an optimizer still holding it raises: _check_optimizer_step)

    exchanging, xname = [], None
    for mod, infos in per_module.values():
        mod.__dict__[_INFO_ATTR] = infos
        exchange = False
        if embedding != "gather" and "weight" in infos:
            why = _exchange_refusal(mod, infos["weight"], per_module, two_d, group, embedding)
            exchange = why is None
            if exchange:
                if xname is None:
                    xname = _exchange_group(group, device)
                mod.__dict__["_graphcomp_exchange"] = (rank, xname, embedding)
                exchanging.append(infos["weight"].fqn)
            elif isinstance(mod, nn.Embedding):
                log.info("graphcomp.shard: embedding %s gathers its table (embedding=%r does not apply: %s)",
                         infos["weight"].fqn, embedding, why)
        mod.__class__ = _sharded_class(type(mod), tuple(sorted(infos)), exchange)
        gather_scope.install(mod, infos, exchange)
        mod.register_state_dict_post_hook(_state_dict_post_hook)
        mod.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)
    mesh_sharding.register(group_name, two_d)
    _watch_optimizers()
    if exchanging:
        log.info("graphcomp.shard: embedding=%r: compiled lookups of %s exchange tokens instead of gathering "
                 "the table%s", embedding, ", ".join(exchanging),
                 " where the ranks' first compile agrees on their token counts" if embedding == "auto" else "")

    log.info(
        "graphcomp.shard: %d parameters (%d bytes) sharded over %d ranks of group %s; %d bytes per rank, "
        "%d bytes of padding in all; param_dtype=%s reduce_dtype=%s",
        len(new_params), n_bytes, world, group_name, local_bytes, pad_bytes, param_dtype, reduce_dtype,
    )
    return model


def _exchange_refusal(mod: nn.Module, info: ShardInfo, per_module: dict[int, tuple[nn.Module, dict[str, ShardInfo]]],
                      two_d: bool, group: Any, mode: str = "exchange") -> str | None:
    """Why ``mod``'s weight (``info``) cannot exchange tokens under ``embedding=mode``,
    or None. A tied weight is one ShardInfo in more than one module."""
    why = embedding_exchange.applies(mod, type(mod))
    if why is None and mode == "auto":
        backend = str(dist.get_backend(group)).lower()  # ("cpu:gloo,cuda:nccl" for a group of two backends)
        if not set(backend.replace(",", ":").split(":")) & set(embedding_exchange.AUTO_BACKENDS):
            why = (f"process-group backend {backend!r} (embedding='auto' exchanges on "
                   f"{', '.join(embedding_exchange.AUTO_BACKENDS)} only)")
    if why is None and two_d:
        why = "2-D (tensor-parallel) sharding"
    if why is None and info.world_size < 2:
        why = "a group of one rank"
    if why is None and sum(i is info for _, infos in per_module.values() for i in infos.values()) > 1:
        why = "its weight is tied to another module's parameter"
    if why is None and dist.get_world_size(group) != dist.get_world_size():
        why = "sharded over a subgroup (its exchange group would need every rank of the job to create it)"
    return why


def _exchange_group(group: Any, device: torch.device) -> str:
    """A group of the same ranks as ``group`` for ``embedding="exchange"``'s collectives
    (on their own group, the passes tell them from parameter collectives:
    ``graph_utils.is_foreign_collective``); gloo: one worker thread, as the parameter
    group. Its communicator is started here, by a one-element all-reduce: a first
    collective inside a CUDA-graph capture could not start it."""
    from graphcomp.session import SESSION

    ranks = dist.get_process_group_ranks(group)
    xg = dist.new_group(ranks=ranks, backend=dist.get_backend(group))
    if device.type == "cpu":
        xg = gloo_groups.serial_group(xg)
    dist.all_reduce(torch.zeros(1, device=device), group=xg)
    name = _compat.process_group_name(xg)
    SESSION.exchange_groups.add(name)
    return name


# ---------------------------------------------------------------- state dict
def _logical_dtensor(param: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """The parameter as a DTensor of its logical shape (Shard(0), torch.chunk
    layout), viewing the shard's storage."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = param.device_mesh
    if mesh.ndim > 1:
        return mesh_sharding.logical_dtensor(param, info)
    local = param.detach().to_local()
    rank = mesh.get_local_rank()
    if not info.shape:
        # a 0-dim parameter lives in rank 0's row 0: present it replicated
        val = local.narrow(0, 0, 1).reshape(())
        if info.world_size > 1:
            val = _compat.funcol_broadcast(val.contiguous(), 0, info.group_name)
        return DTensor.from_local(val, mesh, [Replicate()], run_check=False)
    piece = local.narrow(0, 0, info.local_rows(rank))
    return DTensor.from_local(
        piece, mesh, [Shard(0)], run_check=False, shape=torch.Size(info.shape), stride=_contiguous_strides(info.shape)
    )


def _state_dict_post_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for name, info in module.__dict__[_INFO_ATTR].items():
        key = prefix + name
        if key in state_dict:
            state_dict[key] = _logical_dtensor(module._parameters[name], info)


def _to_padded(value: Any, param: torch.Tensor, info: ShardInfo, key: str) -> torch.Tensor:
    """A checkpoint value -> a DTensor in ``param``'s padded layout (what
    ``_load_from_state_dict`` then copies into the shard)."""
    from torch.distributed.tensor import DTensor, Shard

    mesh = param.device_mesh
    if mesh.ndim > 1:
        return mesh_sharding.to_padded(value, param, info, key)
    rank = mesh.get_local_rank()
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{key}: expected a tensor in the state dict, got {type(value).__name__}")
    if isinstance(value, DTensor):
        if tuple(value.shape) == info.padded_shape and value.placements == param.placements and value.device_mesh == mesh:
            return value  # already in the padded layout
        if (
            tuple(value.shape) == info.shape
            and info.shape
            and value.device_mesh == mesh
            and tuple(value.placements) == (Shard(0),)
            and value.to_local().shape[0] == info.local_rows(rank)
        ):
            rows = value.to_local()
        else:
            value = value.full_tensor()  # another layout: assemble (collective), then take our rows
            rows = None
    else:
        rows = None
    if rows is None:
        if tuple(value.shape) != info.shape:
            raise ValueError(
                f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from checkpoint, "
                f"the (unsharded) shape in current model is {info.shape}"
            )
        rows = _row_slice(value, info, rank)
    return DTensor.from_local(_padded_local(rows, info, param.to_local()), mesh, [Shard(0)], run_check=False)


def _load_state_dict_pre_hook(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    for name, info in module.__dict__[_INFO_ATTR].items():
        key = prefix + name
        if key not in state_dict:
            continue
        param = module._parameters[name]
        try:
            state_dict[key] = _to_padded(state_dict[key], param, info, key)
        except ValueError as e:
            error_msgs.append(str(e))
            state_dict[key] = param.detach()  # loads nothing; the error is raised by load_state_dict


def sharded_parameters(model: nn.Module) -> dict[str, tuple[torch.Tensor, ShardInfo]]:
    """Fully-qualified name -> (parameter, its ShardInfo), for every parameter of
    ``model`` that :func:`shard` sharded."""
    out: dict[str, tuple[torch.Tensor, ShardInfo]] = {}
    for mname, mod in model.named_modules():
        for name, info in (mod.__dict__.get(_INFO_ATTR) or {}).items():
            out[f"{mname}.{name}" if mname else name] = (mod._parameters[name], info)
    return out


def optimizer_state_to_logical(model: nn.Module, optim_sd: dict[str, Any]) -> None:
    """In ``optim_sd`` (``get_state_dict``'s optimizer part), each state tensor of a
    sharded parameter in the parameter's padded layout -> a DTensor of the logical
    shape (as ``model.state_dict()`` presents parameters), so that DCP can load it on
    another world size. Replaces ``optim_sd``'s per-parameter dicts, never the
    optimizer's own."""
    from torch.distributed.tensor import DTensor

    params = sharded_parameters(model)
    states = optim_sd.get("state") or {}
    for fqn, state in list(states.items()):
        if fqn not in params:
            continue
        param, info = params[fqn]
        state = states[fqn] = dict(state)  # (get_state_dict hands out the optimizer's own dicts)
        for k, v in state.items():
            if (isinstance(v, DTensor) and tuple(v.shape) == tuple(param.shape) and v.device_mesh == param.device_mesh
                    and tuple(v.placements) == tuple(param.placements)):
                state[k] = _logical_dtensor(v, info)


def optimizer_state_to_padded(model: nn.Module, optim_sd: dict[str, Any]) -> None:
    """The inverse of :func:`optimizer_state_to_logical`: each state tensor of a
    sharded parameter given in its logical shape (of any layout, or a full tensor) ->
    the parameter's padded layout, ready for ``set_state_dict``. In place."""
    from torch.distributed.tensor import DTensor

    params = sharded_parameters(model)
    for fqn, state in (optim_sd.get("state") or {}).items():
        if fqn not in params:
            continue
        param, info = params[fqn]
        for k, v in state.items():
            # a 0-dim parameter's state is a DTensor too; a plain 0-dim tensor is a step count
            if (isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(info.shape)
                    and (v.dim() > 0 or isinstance(v, DTensor))):
                state[k] = _to_padded(v, param, info, f"optimizer state {fqn}.{k}")


def full_state_dict(model: nn.Module, *, rank0_only: bool = False, cpu: bool = True) -> dict[str, torch.Tensor]:
    """The model's state dict with plain full tensors (sharded parameters
    assembled with all-gathers: every rank must call this). ``rank0_only``:
    ranks other than 0 get ``{}``. ``cpu``: move tensors to the CPU."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"graphcomp.full_state_dict: model must be an nn.Module, got {type(model).__name__}")
    for name, v in (("rank0_only", rank0_only), ("cpu", cpu)):
        if not isinstance(v, bool):
            raise TypeError(f"graphcomp.full_state_dict: {name} must be True or False, got {v!r}")
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    rank = dist.get_rank() if dist.is_initialized() else 0
    for k, v in model.state_dict().items():
        if isinstance(v, DTensor):
            v = v.full_tensor()
        if rank0_only and rank != 0:
            continue
        out[k] = v.detach().cpu() if cpu else v.detach()
    return out
