"""``graphcomp.shard(model, mesh=...)``: shard over one dimension of a DeviceMesh a
model that tensor parallelism placed on another (2-D: data parallel x tensor parallel).

Input. ``parallelize_module(model, mesh["tp"], plan)`` has made some parameters
DTensors on the 1-D ``tp`` mesh (``Shard(0)``: column-wise, ``Shard(1)``: row-wise,
``Replicate()``: ``SequenceParallel`` norms); the others are plain tensors.
``shard(model, mesh=mesh, dp_dim="dp")`` (or ``mesh=mesh["dp"]``) then shards every
parameter over the ``dp`` dimension exactly as the 1-D path does (graphcomp/sharding/shard.py),
with the *tp-local* tensor in the role of the parameter::

    TP DTensor [N, K] (Shard(0) on tp)   tp-local [N/tp, K]   dp shard [c, K], c = ceil(N/tp / dp)
                                          = rows t*N/tp ..    = rows d*c .. of the tp-local (zero-padded)

and the parameter becomes, in place, a DTensor on the 2-D mesh ``(dp, tp)``:
placement ``Shard(0)`` on dp (``_StridedShard(0, split_factor=tp)`` when tp also shards
dim 0 and dp comes first in the mesh: the rows are split over tp first, then over dp)
and the TP placement on tp; plain parameters get ``Replicate()`` on tp (TP code computes
the same value for them on every tp rank). Padded, so every rank holds one shape.

Gather on use (traced into the graph like the 1-D gather)::

    dp shard -> all_gather over dp (graphcomp's, fused/bucketed/scheduled by the passes)
        -> narrow -> reshape -> cast -> DTensor.from_local(tp mesh, TP placement)
        -> the module's TP code (DTensor ops: TP collectives over tp, left alone)
    backward: DTensor grad -> to_local (a Partial grad of a Replicate weight is
        all-reduced over tp here, by DTensor) -> reduce-scatter over dp, / dp

``state_dict()`` holds DTensors of the TP *global* shape on the 2-D mesh with the same
placements, viewing the shards (``torch.distributed.checkpoint`` saves and loads them in
place); ``clip_grad_norm_`` reduces its norm over both dimensions (every gradient is a
DTensor on the one 2-D mesh). The dp group goes to ``SESSION.shard_groups`` marked 2-D:
from then on the passes leave collectives on every other group (TP's) alone.

Equal meshes are interchangeable to DTensor: it may hand back a DTensor on an
earlier, structurally equal mesh object (its caches key meshes by value), whose
groups have other names. So nothing here identifies a dimension by its group name:
the dp dimension is ``ShardInfo.mesh_dim``, and TP collectives are recognized as
"not graphcomp's group" rather than "the tp group".
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from graphcomp import _compat
from graphcomp.session import SESSION
from graphcomp.sharding.layout import _INFO_ATTR, _contiguous_strides, _dtensor_cls, _padded_local, _row_slice

log = logging.getLogger(__name__)

__all__ = ["MeshPlan", "TPLayout", "resolve", "register", "shard_groups"]


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """How module code sees a parameter tensor parallelism placed: the gathered
    tp-local tensor becomes ``DTensor.from_local(t, mesh, placements, shape=..., stride=...)``."""

    mesh: Any
    """The 1-D tensor-parallel DeviceMesh (``mesh["tp"]``)."""
    placements: tuple[Any, ...]
    """Its placement there: ``Shard(d)`` or ``Replicate()``."""
    shape: tuple[int, ...]
    """Global (TP) shape of the parameter."""
    stride: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """Where ``shard(model, mesh=...)`` shards (identical on every rank)."""

    dp_mesh: Any
    """The 1-D mesh of the sharded dimension."""
    dp_name: str | None
    group: Any
    """Its process group (the gathers' and reduce-scatters' group)."""
    param_mesh: Any = None
    """The 2-D mesh the parameters live on (dp + tp, in the root mesh's order); None
    when no parameter is a DTensor (then this is the 1-D path over ``group``)."""
    dp_index: int = 0
    tp_index: int = 1
    tp_mesh: Any = None

    @property
    def tp_size(self) -> int:
        return 1 if self.tp_mesh is None else self.tp_mesh.size()


def _dims(mesh: Any) -> tuple[str, ...] | None:
    names = getattr(mesh, "mesh_dim_names", None)
    return tuple(names) if names else None


def _describe(mesh: Any) -> str:
    names = _dims(mesh)
    ranks = mesh.mesh.tolist()
    return f"DeviceMesh(dims={names}, ranks={ranks})"


# ------------------------------------------------------------------ resolve
def resolve(model: nn.Module, group: Any, mesh: Any, dp_dim: str | None,
            owners: list[tuple[str, nn.Module, str, nn.Parameter]]) -> MeshPlan:
    """Check ``shard(model, group, mesh=mesh, dp_dim=dp_dim)``'s mesh arguments and
    the model's DTensor parameters (``owners``: (module fqn, module, name, param)),
    and say where to shard. Every problem is a ``ValueError`` naming it."""
    from torch.distributed.device_mesh import DeviceMesh

    if group is not None:
        raise ValueError("graphcomp.shard: pass either group= or mesh=, not both (the mesh names the group)")
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(
            f"graphcomp.shard: mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    names = _dims(mesh)
    if dp_dim is None:
        if mesh.ndim != 1:
            raise ValueError(
                f"graphcomp.shard: a {mesh.ndim}-D mesh needs dp_dim= (the dimension to shard over); "
                f"its dimensions are {names}"
            )
        dp_mesh = mesh
    else:
        if not isinstance(dp_dim, str):
            raise ValueError(f"graphcomp.shard: dp_dim must be a mesh dimension name (str), got {dp_dim!r}")
        if names is None or dp_dim not in names:
            raise ValueError(
                f"graphcomp.shard: the mesh has no dimension {dp_dim!r}; its dimensions are {names} "
                "(name them with init_device_mesh(..., mesh_dim_names=...))"
            )
        dp_mesh = mesh if mesh.ndim == 1 else mesh[dp_dim]
    dp_name = (_dims(dp_mesh) or (None,))[0]
    dp_group = dp_mesh.get_group()
    dp_group_name = _compat.process_group_name(dp_group)
    root = _compat.root_mesh(dp_mesh)
    _check_not_sharded(model, dp_group_name, dp_name)

    D = _dtensor_cls()
    tp_mesh, tp_fqn = None, None
    for mname, _mod, pname, p in owners:
        if not isinstance(p, D):
            continue
        fqn = f"{mname}.{pname}" if mname else pname
        pm = p.device_mesh
        same_root = _compat.root_mesh(pm) == root
        if same_root and dp_name is not None and _dims(pm) is not None:
            twice = dp_name in _dims(pm)
        else:  # unnamed or unrelated meshes: the same process group (of more than one rank) is the same dimension
            twice = dp_mesh.size() > 1 and any(
                _compat.process_group_name(pm.get_group(i)) == dp_group_name for i in range(pm.ndim))
        if twice:
            raise ValueError(
                f"graphcomp.shard: parameter {fqn!r} is already sharded over the mesh dimension graphcomp would "
                f"shard over ({dp_name or dp_group_name!r}): it is a DTensor on {_describe(pm)} with placements "
                f"{tuple(p.placements)}. Sharding twice over the same dimension is not supported: apply the "
                "tensor-parallel plan on another dimension (mesh['tp']) and shard over this one once"
            )
        if pm.ndim != 1:
            raise ValueError(
                f"graphcomp.shard: parameter {fqn!r} is a DTensor on a {pm.ndim}-D mesh {_describe(pm)}; "
                "graphcomp.shard(mesh=...) takes tensor-parallel DTensors on one (1-D) mesh dimension"
            )
        if not same_root:
            raise ValueError(
                f"graphcomp.shard: parameter {fqn!r} is a DTensor on {_describe(pm)}, which is not a dimension of "
                f"the mesh graphcomp shards over ({_describe(root)}); the tensor-parallel plan must place every "
                "parameter on a dimension of that same mesh (parallelize_module(model, mesh['tp'], plan))"
            )
        if tp_mesh is None:
            tp_mesh, tp_fqn = pm, fqn
        elif pm != tp_mesh:
            raise ValueError(
                f"graphcomp.shard: the tensor-parallel plan leaves parameter {fqn!r} on a different mesh "
                f"({_describe(pm)}) than {tp_fqn!r} ({_describe(tp_mesh)}); graphcomp.shard takes one "
                "tensor-parallel mesh dimension for every parameter"
            )
        _check_placements(fqn, p)
    root_names = _dims(root)
    tp_name = (_dims(tp_mesh) or (None,))[0] if tp_mesh is not None else None
    _check_other_dims(root, dp_name, tp_name, tp_mesh is not None)
    if tp_mesh is None:
        return MeshPlan(dp_mesh=dp_mesh, dp_name=dp_name, group=dp_group)
    if root_names is None or dp_name is None or tp_name is None:
        raise ValueError(
            "graphcomp.shard: 2-D sharding needs named mesh dimensions "
            "(init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))); "
            f"got {_describe(root)}"
        )
    order = sorted((dp_name, tp_name), key=root_names.index)
    param_mesh = root if root_names == tuple(order) else root[tuple(order)]
    return MeshPlan(
        dp_mesh=dp_mesh, dp_name=dp_name, group=dp_group, param_mesh=param_mesh,
        dp_index=order.index(dp_name), tp_index=order.index(tp_name), tp_mesh=tp_mesh,
    )


def _check_other_dims(root: Any, dp_name: str | None, tp_name: str | None, has_tp: bool) -> None:
    """Every dimension of the mesh but dp (and tp) must have size 1: graphcomp reduces
    gradients over dp only (and DTensor over tp), so ranks along any other dimension
    would silently train apart (data-parallel replicas of HSDP, context parallelism).
    Pipeline stages, which hold different parameters, have no mesh here to pass."""
    if root.ndim == 1:
        return
    names = _dims(root) or tuple(str(i) for i in range(root.ndim))
    extra = [(n, root.size(i)) for i, n in enumerate(names) if n not in (dp_name, tp_name) and root.size(i) > 1]
    if not extra:
        return
    what = ("the tensor-parallel dimension " + repr(tp_name)) if has_tp else "no tensor-parallel parameter"
    raise ValueError(
        f"graphcomp.shard: the mesh {_describe(root)} has dimension(s) {extra} besides {dp_name!r} (sharded) and "
        f"{what}; graphcomp reduces gradients over the sharded dimension only, so ranks along the others would "
        "train apart. Replicating over another dimension (HSDP) is not supported: shard over all the "
        "data-parallel ranks (one dimension), with tensor parallelism on the other"
    )


def _check_not_sharded(model: nn.Module, dp_group_name: str, dp_name: str | None) -> None:

    for mname, mod in model.named_modules():
        infos = mod.__dict__.get(_INFO_ATTR)
        if not infos:
            continue
        info = next(iter(infos.values()))
        where = f"module {mname!r}" if mname else "the model"
        if info.group_name == dp_group_name:
            raise ValueError(
                f"graphcomp.shard: {where} is already sharded over the mesh dimension "
                f"{dp_name or dp_group_name!r} (by an earlier graphcomp.shard call); sharding twice over the "
                "same dimension is not supported"
            )
        raise ValueError(
            f"graphcomp.shard: {where} is already sharded by graphcomp.shard over another group "
            f"({info.group_name!r}); graphcomp shards over one mesh dimension: call shard() once, on the root module"
        )


def _check_placements(fqn: str, p: torch.Tensor) -> None:
    from torch.distributed.tensor import Replicate, Shard

    (pl,) = p.placements
    if _compat.is_strided_shard(pl) or not isinstance(pl, (Shard, Replicate)):
        raise ValueError(
            f"graphcomp.shard: parameter {fqn!r} has placement {pl} on its tensor-parallel mesh; "
            "graphcomp.shard(mesh=...) takes Shard(dim) or Replicate() (a Partial parameter has no value to shard)"
        )
    if isinstance(pl, Shard):
        d = pl.dim % max(p.dim(), 1)
        n, size = p.shape[d], p.device_mesh.size()
        if n % size:
            raise ValueError(
                f"graphcomp.shard: parameter {fqn!r} (shape {tuple(p.shape)}) is sharded unevenly by tensor "
                f"parallelism: dim {d} of size {n} over {size} ranks. graphcomp needs every rank to hold the same "
                "shape (one graph, the same collectives on every rank): make that size divisible by the "
                "tensor-parallel degree (e.g. pad the vocabulary)"
            )


# ------------------------------------------------------------------ layout
def tp_layout(p: torch.Tensor) -> TPLayout:
    """The TP view of DTensor parameter ``p`` (module code sees this)."""
    return TPLayout(mesh=p.device_mesh, placements=tuple(p.placements), shape=tuple(p.shape), stride=tuple(p.stride()))


def _shard_dim(info: Any) -> int | None:
    """The tensor dimension tensor parallelism shards (None: replicated or plain)."""
    from torch.distributed.tensor import Shard

    if info.tp is None:
        return None
    (pl,) = info.tp.placements
    return pl.dim % len(info.tp.shape) if isinstance(pl, Shard) else None


def placements(info: Any, plan: MeshPlan) -> list[Any]:
    """The parameter's placements on ``plan.param_mesh`` (see the module docstring)."""
    from torch.distributed.tensor import Replicate, Shard

    out: list[Any] = [Replicate(), Replicate()]
    out[plan.tp_index] = info.tp.placements[0] if info.tp is not None else Replicate()
    if _shard_dim(info) == 0 and plan.dp_index < plan.tp_index:
        out[plan.dp_index] = _compat.strided_shard(0, plan.tp_size)
    else:
        out[plan.dp_index] = Shard(0)
    return out


def _global(local_shape: tuple[int, ...], info: Any, tp_size: int) -> tuple[int, ...]:
    """A tp-local shape -> the global shape (the TP-sharded dimension times tp)."""
    d = _shard_dim(info)
    out = list(local_shape)
    if d is not None:
        out[d] *= tp_size
    return tuple(out)


def make_param(local: torch.Tensor, info: Any, plan: MeshPlan) -> torch.Tensor:
    """The padded dp shard ``local`` ([c, *rest]) as a DTensor on the 2-D mesh."""
    from torch.distributed.tensor import DTensor


    shape = _global(info.padded_shape, info, plan.tp_size)
    return DTensor.from_local(local, plan.param_mesh, placements(info, plan), run_check=False,
                              shape=torch.Size(shape), stride=_contiguous_strides(shape))


def for_module(t: torch.Tensor, info: Any) -> torch.Tensor:
    """A gathered tp-local tensor as module code sees it: the TP DTensor (or ``t``
    for a plain parameter); differentiable."""
    if info.tp is None:
        return t
    from torch.distributed.tensor import DTensor

    tp = info.tp
    return DTensor.from_local(t, tp.mesh, tp.placements, run_check=False, shape=torch.Size(tp.shape), stride=tp.stride)


def register(group_name: str, two_d: bool) -> None:
    """Record that ``graphcomp.shard`` shards over ``group_name`` (``two_d``: beside
    tensor parallelism, so collectives on other groups are left alone)."""
    SESSION.shard_groups[group_name] = SESSION.shard_groups.get(group_name, False) or two_d
    _compat.before_destroy_process_group(_forget_groups)
    _compat.wrap_destroy_process_group()


def _forget_groups(name: str | None = None) -> None:
    """Before ``destroy_process_group``: group names are reused by the next process
    groups, so forget the destroyed group's (every group's when ``name`` is None).
    Destroying an unrelated subgroup leaves the sharded groups known."""
    if name is None:
        SESSION.shard_groups.clear()
        SESSION.exchange_groups.clear()
        return
    SESSION.shard_groups.pop(name, None)
    SESSION.exchange_groups.discard(name)


def shard_groups() -> dict[str, bool]:
    """Process-group names graphcomp shards over -> sharded beside tensor parallelism."""
    return dict(SESSION.shard_groups)


# ---------------------------------------------------------------- state dict
def _dp_rank(param: torch.Tensor, info: Any) -> int:
    return param.device_mesh.get_local_rank(info.mesh_dim)


def logical_dtensor(param: torch.Tensor, info: Any) -> torch.Tensor:
    """The 2-D parameter as a DTensor of its global (TP) shape, same placements,
    viewing the shard's storage (the padding rows left out)."""
    from torch.distributed.tensor import DTensor, Replicate


    mesh = param.device_mesh
    local = param.detach().to_local()
    if not info.shape:
        val = local.narrow(0, 0, 1).reshape(())
        if info.world_size > 1:
            val = _compat.funcol_broadcast(val.contiguous(), 0, info.group_name)
        return DTensor.from_local(val, mesh, [Replicate()] * mesh.ndim, run_check=False)
    piece = local.narrow(0, 0, info.local_rows(_dp_rank(param, info)))
    shape = info.tp.shape if info.tp is not None else info.shape
    return DTensor.from_local(piece, mesh, param.placements, run_check=False,
                              shape=torch.Size(shape), stride=_contiguous_strides(shape))


def _tp_slice(full: torch.Tensor, info: Any, param: torch.Tensor) -> torch.Tensor:
    """This rank's tp-local part of a full (global-shape) value."""
    d = _shard_dim(info)
    if d is None:
        return full
    mesh = param.device_mesh
    tp_index = 1 - info.mesh_dim
    size, r = mesh.size(tp_index), mesh.get_local_rank(tp_index)
    n = full.shape[d] // size
    return full.narrow(d, r * n, n)


def to_padded(value: Any, param: torch.Tensor, info: Any, key: str) -> torch.Tensor:
    """A checkpoint value -> a DTensor in ``param``'s padded 2-D layout: a DTensor
    in that layout, one in the :func:`logical_dtensor` layout, any other DTensor
    (assembled: a collective) or a plain full tensor."""
    from torch.distributed.tensor import DTensor


    mesh = param.device_mesh
    rank = _dp_rank(param, info)
    glob = info.tp.shape if info.tp is not None else info.shape
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{key}: expected a tensor in the state dict, got {type(value).__name__}")
    rows = None
    if isinstance(value, DTensor):
        same = value.device_mesh == mesh and tuple(value.placements) == tuple(param.placements)
        if same and value.shape == param.shape:
            return value  # already in the padded layout
        if same and tuple(value.shape) == glob and glob and value.to_local().shape[0] == info.local_rows(rank):
            rows = value.to_local()
        else:
            value = value.full_tensor()
    if rows is None:
        if tuple(value.shape) != glob:
            raise ValueError(
                f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from checkpoint, "
                f"the (unsharded) shape in current model is {glob}"
            )
        rows = _row_slice(_tp_slice(value, info, param), info, rank)
    local = _padded_local(rows, info, param.to_local())
    return DTensor.from_local(local, mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride())
