"""``graphcomp.guard_filter``: drop Dynamo's per-call DTensor guards on the parameters
``graphcomp.shard`` owns (opt-in)::

    model = torch.compile(model, backend="graphcomp",
                          options={"guard_filter_fn": graphcomp.guard_filter})

Why. Every sharded parameter is a DTensor, and Dynamo guards each DTensor graph input
with a Python lambda comparing its spec (mesh and placements), plus an identity guard
per parameter pair sharing a mesh. Python guards cost microseconds each, on every call
of the compiled function: with hundreds of sharded parameters the guard check takes
milliseconds per call, most of it these guards, many times the check of the
unsharded model. That is host time a step spends before any kernel runs.

Why it is safe for these parameters. graphcomp's traced code never reads a sharded
parameter's spec: gathers, reduce-scatters and the module code's view of the parameter
come from the :class:`~graphcomp.sharding.layout.ShardInfo` that ``shard`` recorded, and
``shard`` creates the DTensor once and never replaces it (optimizer steps and
``load_state_dict`` write it in place). Only specs and meshes of parameters ``shard``
sharded over 1-D meshes are recognized, by identity: every other guard is kept, the
spec guards of any other DTensor (tensor parallelism's, the user's) included. Guards
on the parameters' tensor metadata (shape, stride, dtype, device, requires_grad) stay.

Unsafe only if user code swaps a sharded parameter's ``_spec`` for another one behind
graphcomp's back, which ``shard``'s docs rule out.

``torch.compile`` pops ``guard_filter_fn`` from ``options`` before the backend sees the
rest; to combine with another filter, ``and`` their flags.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

_SPECS: dict[int, weakref.ref] = {}
_MESHES: dict[int, weakref.ref] = {}

# the guard types Dynamo (torch 2.11, 2.13) installs on a DTensor parameter's spec and
# on two sources reaching the same DeviceMesh
_SPEC_GUARD = "DTENSOR_SPEC_MATCH"
_ALIAS_GUARD = "DUPLICATE_INPUT"


def own(param: Any) -> None:
    """Record a parameter ``shard`` created (a 1-D ``Shard(0)`` DTensor): its spec and
    mesh, by identity (weak references: nothing is kept alive)."""
    spec = param._spec
    _SPECS[id(spec)] = weakref.ref(spec)
    mesh = spec.mesh
    _MESHES[id(mesh)] = weakref.ref(mesh)


def _owned(table: dict[int, weakref.ref], value: Any) -> bool:
    ref = table.get(id(value))
    return ref is not None and ref() is value


def guard_filter(entries: Sequence[Any]) -> list[bool]:
    """Dynamo's ``guard_filter_fn``: False (drop) for the spec guard of a parameter
    ``graphcomp.shard`` sharded and for an aliasing guard on its mesh, True (keep)
    for every other guard."""
    return [not ((e.guard_type == _SPEC_GUARD and _owned(_SPECS, e.value))
                 or (e.guard_type == _ALIAS_GUARD and _owned(_MESHES, e.value)))
            for e in entries]
