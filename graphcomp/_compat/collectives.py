"""Private torch APIs of the CUDA-graph warm-up: functional collectives recorded,
not run (re-exported from ``graphcomp._compat``; the same rules apply: torch 2.11
and 2.13, nothing of graphcomp imported).

Why. A capture call runs its piece ``WARMUP_ITERS`` times eagerly, then captures it
into a throwaway graph that it replays once (the trial), then captures it for real;
a capture records a collective without running it; the call's one real run is the
replay. Had the warm-up and the trial run the piece's collectives, a capture call
would issue them ``WARMUP_ITERS + 2`` times and a replay call once. Every rank captures at
the same calls only while ranks see the same shapes and make the same decisions; a
rank that captures alone (a sequence length only it sees, a re-capture after a
hazard or a moved address) would then issue collectives its peers never match,
and the job hangs: that rank blocks loading a kernel (a context synchronization
behind an NCCL kernel waiting for its peer), the other in ``synchronize()``.

How. ``torch.utils._python_dispatch.TorchDispatchMode`` (private module, stable
since torch 2.0) sees every op the piece dispatches (eager FX code and Inductor's
wrapper code call collectives through the dispatcher; Triton kernels do not go
through it and need not). For an op of the ``_c10d_functional`` namespace:

* a functional collective returns zeros of its output's shape (from the op's meta
  kernel) on its input's device: zeros, not uninitialized memory, because values
  derived from them (indices after an all-to-all) must stay in range during the
  warm-up, whose results are discarded;
* an in-place form returns the tensor it would write, unchanged (its local
  values); an ``out=`` form returns its ``out`` buffer filled with zeros;
* ``wait_tensor`` returns its input, unless that input came from a collective that
  ran for real (below): then it waits;
* ``warmed``: the first collective on each process group not yet in the set runs
  for real and its group is added (lazy communicator set-up must happen outside a
  capture; every rank reaches its first capture at the same call).

Collectives of the ``c10d`` namespace (``torch.distributed`` called inside a piece,
returning a ``Work``) cannot be stood in for and run for real.

Higher-order operators pass through (``supports_higher_order_operators``; without
it any HOP in a piece raises ``NotImplementedError`` and fails its capture, e.g.
Inductor's ``graphsafe_run_with_rng_state`` around a cuDNN attention that the user's
activation checkpointing recomputes). One that wraps a
functional collective (an op or a subgraph of the ``_c10d_functional`` namespace)
raises instead: the mode cannot reach inside it, and running it would issue a
collective alone; the piece then fails its capture and runs eagerly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only


def _arg(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return kwargs[name] if name in kwargs else (args[i] if i < len(args) else None)
    return None


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            out.append(kwargs[a.name] if a.name in kwargs else args[i])
    return out


def _device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    for t in (*args, *kwargs.values()):
        if isinstance(t, torch.Tensor):
            return t.device
        if isinstance(t, (list, tuple)) and t and isinstance(t[0], torch.Tensor):
            return t[0].device
    return torch.device("cpu")


def _wraps_collective(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """True when a higher-order operator's arguments hold a functional collective:
    an op of that namespace, or a graph module calling one."""
    import torch.fx as fx

    def is_coll(t: Any) -> bool:
        return getattr(t, "namespace", None) == "_c10d_functional"

    for a in (*args, *kwargs.values()):
        if is_coll(a):
            return True
        if isinstance(a, fx.GraphModule) and any(n.op == "call_function" and is_coll(n.target)
                                                 for n in a.graph.nodes):
            return True
    return False


class _CollectivesNotRun(TorchDispatchMode):
    supports_higher_order_operators = True  # HOPs reach __torch_dispatch__ (module docstring)

    def __init__(self, warmed: set[str] | None):
        super().__init__()
        self.warmed = warmed
        self.real: set[int] = set()  # ids of outputs of collectives that ran
        self.stood_in = 0
        self.ran = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            if _wraps_collective(args, kwargs):
                raise NotImplementedError(
                    f"graphcomp: the higher-order operator {func.name()} wraps a functional collective, which "
                    "the CUDA-graph warm-up cannot stand in for (it would run on this rank alone)")
            return func(*args, **kwargs)
        if func.namespace != "_c10d_functional":
            return func(*args, **kwargs)
        base = func._schema.name.split("::", 1)[1]
        if base == "wait_tensor":
            if id(args[0]) in self.real:
                self.real.discard(id(args[0]))
                return func(*args, **kwargs)
            return args[0]
        group = _arg(func, args, kwargs, "group_name")
        if self.warmed is not None and isinstance(group, str) and group not in self.warmed:
            self.warmed.add(group)
            out = func(*args, **kwargs)
            for t in (out if isinstance(out, (list, tuple)) else [out]):
                if isinstance(t, torch.Tensor):
                    self.real.add(id(t))
            self.ran += 1
            return out
        self.stood_in += 1
        if func._schema.is_mutable:
            written = _written(func, args, kwargs)
            out = kwargs.get("out")
            for t in (out if isinstance(out, (list, tuple)) else [out]):
                if isinstance(t, torch.Tensor):
                    t.zero_()  # an out= buffer holds whatever the allocator left: zeros, as above
            return written[0] if len(written) == 1 else written
        dev = _device(args, kwargs)
        meta_args, meta_kwargs = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        out = func(*meta_args, **meta_kwargs)
        return tree_map_only(torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=dev), out)


@contextlib.contextmanager
def collectives_not_run(warmed: set[str] | None = None) -> Iterator[_CollectivesNotRun]:
    """While active, ``_c10d_functional`` collectives are recorded, not run (see
    the module docstring); ``warmed``: process-group names whose first collective
    already ran (updated in place), or None to run none. Yields the mode (its
    ``stood_in`` and ``ran`` counts)."""
    mode = _CollectivesNotRun(warmed)
    with mode:
        yield mode
