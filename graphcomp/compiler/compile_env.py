"""What a pass may know beyond its graph and the config: ``PassContext.env``.

Passes read no process-global state. The backend builds one :class:`CompileEnv` per
compiled frame from the session (the one owned runtime object) and hands it to every
pass through its context:

* the process groups ``graphcomp.shard`` shards over, and the token-exchange groups
  of ``shard(embedding="exchange")`` (which collectives are graphcomp's and which are
  tensor parallel's or activations');
* the plans agreed across ranks at a function's first compile, reused by its
  recompiles (:meth:`CompileEnv.prior_plan` / :meth:`CompileEnv.keep_plan`), and the
  bytes of gathered parameters other compiled graphs keep;
* the agreement client (:meth:`CompileEnv.agree_kept`);
* what the runtime offers: a cross-step prefetch provider, serial gloo groups;
* the cost model's row for the compile's device.

A pass that decides something every rank must decide alike::

    plan = ctx.env.prior_plan("keep", key)          # a recompile: the first compile's plan
    if plan is None:
        plan = ctx.env.agree_kept(...)              # the first: this rank's plan, agreed
        ctx.env.keep_plan("keep", key, plan)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from graphcomp.analysis import cost_model


@dataclass
class CompileEnv:
    shard_groups: Mapping[str, bool] = field(default_factory=dict)
    """Process-group names ``graphcomp.shard`` shards over -> True when sharded beside
    tensor parallelism (``shard(mesh=...)``); while such a group exists, a collective on
    any other group is tensor parallel's."""
    exchange_groups: frozenset[str] = frozenset()
    """Groups of ``shard(embedding="exchange")``'s token exchanges (activations)."""
    plans: dict[str, dict[Any, Any]] = field(default_factory=dict)
    """Plan kind -> key (a function and a digest of its graph) -> the plan its first
    compile agreed on. Shared by the frames of the process, so recompiles find it."""
    kept_gather_bytes: dict[Any, int] = field(default_factory=dict)
    """Per graph of a step: the gathered-parameter bytes it keeps from forward to
    backward (``reshard_after_forward="auto"`` leaves room for the others')."""
    epoch: int = 0
    """The agreement epoch (Dynamo numbers functions from 0 again after
    ``torch._dynamo.reset()``; keys of plans carry it)."""
    cross_step_prefetch: bool = False
    """Whether a ``graphcomp.optim.capture`` step with ``prefetch=True`` exists to issue
    the next forward's table gather (pass ``prefetch_across_steps``)."""
    costs: cost_model.DeviceCosts = cost_model.REFERENCE
    """The cost model's row for the device this compile plans for
    (``graphcomp.analysis.cost_model``)."""
    is_serial_group: Callable[[str], bool] = lambda name: False
    """Whether the live process group ``name`` is a gloo group with one worker thread
    (its collectives run one at a time: a CPU graph may keep several in flight)."""

    @classmethod
    def of_session(cls, session: Any) -> CompileEnv:
        """The environment of a compile in this process (its stores are the session's)."""
        from graphcomp.sharding import gloo_groups
        from graphcomp.sharding.prefetch import PREFETCH

        return cls(shard_groups=dict(session.shard_groups), exchange_groups=frozenset(session.exchange_groups),
                   plans=session.plans, kept_gather_bytes=session.kept_gather_bytes,
                   epoch=session.agree_seq.get("epoch", 0), cross_step_prefetch=PREFETCH.enabled(),
                   costs=cost_model.current(), is_serial_group=gloo_groups.is_serial)

    def prior_plan(self, kind: str, key: Any) -> Any:
        """The plan of ``kind`` recorded for ``key`` at the function's first compile, or
        None. Recompiles reuse it, so a rank that recompiles alone for a new input shape
        issues the same collectives as its peers."""
        return self.plans.get(kind, {}).get(key)

    def keep_plan(self, kind: str, key: Any, plan: Any) -> None:
        """Record the plan of ``kind`` for ``key`` (agreed with the peers) for the
        function's recompiles."""
        self.plans.setdefault(kind, {})[key] = plan

    def agree_kept(self, group: str | None, function: str, digest: str, kept: list[int], n_groups: int, cfg: Any,
                   **kw: Any) -> list[int]:
        """The indices every member of ``group`` keeps of this rank's ``kept`` (their
        intersection; see :func:`graphcomp.compiler.agreement.agree_kept`)."""
        from graphcomp.compiler import agreement

        return agreement.agree_kept(group, function, digest, kept, n_groups, cfg, **kw)

    def is_foreign_group(self, name: str | None) -> bool:
        """Whether a collective on group ``name`` is not graphcomp's (tensor parallel's,
        or a token exchange's): the passes leave those alone."""
        if name is not None and name in self.exchange_groups:
            return True
        if not any(self.shard_groups.values()):
            return False
        return name is not None and name not in self.shard_groups
