"""The pass pipeline: registry, order rules, toggles, timing, records and dumps.

A pass is ``fn(gm: torch.fx.GraphModule, ctx: PassContext) -> GraphModule`` over
aten-level FX (``joint``, ``fwd``, ``bwd``, ``inference``), or over the torch-level
graph Dynamo hands the backend (``dynamo``: before AOTAutograd, for passes that must
change what gets differentiated, e.g. swap a loss for a custom op with its own
autograd formula). It is registered with :func:`register_pass`, which declares the
stages it runs in, whether it is on by default, and its order rules (``after=`` / ``before=`` other passes, or ``last=True``).

The pipeline owns the order (a stable topological sort of the rules; ties keep
registration order), the per-pass enable flags (``Config.passes``), wall time,
before/after dumps, and one :class:`PassRecord` per pass and stage saying what the
pass changed or why it changed nothing. A pass that leaves the graph unchanged
must say why (``ctx.nothing(reason)``); the pipeline flags a silent no-op.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.fx as fx

from . import graph_utils
from .state import STATE

log = logging.getLogger(__name__)

STAGES = ("dynamo", "joint", "fwd", "bwd", "inference")
PassFn = Callable[[fx.GraphModule, "PassContext"], fx.GraphModule]


@dataclass(frozen=True)
class PassSpec:
    name: str
    fn: PassFn
    stages: frozenset[str]
    default: bool = True
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    last: bool = False
    doc: str = ""


_REGISTRY: dict[str, PassSpec] = {}


def register_pass(
    name: str,
    *,
    stages: tuple[str, ...],
    default: bool = True,
    after: tuple[str, ...] = (),
    before: tuple[str, ...] = (),
    last: bool = False,
) -> Callable[[PassFn], PassFn]:
    """Decorator: register ``fn`` as pass ``name``. Order rules name other passes;
    a rule naming a pass that is not registered is an error when the order is built."""
    bad = sorted(set(stages) - set(STAGES))
    if bad or not stages:
        raise ValueError(f"pass {name!r}: invalid stages {list(stages)}; valid stages: {list(STAGES)}")

    def deco(fn: PassFn) -> PassFn:
        if name in _REGISTRY and _REGISTRY[name].fn is not fn:
            raise ValueError(f"pass {name!r} is registered twice")
        doc = (fn.__doc__ or "").strip() or (getattr(__import__(fn.__module__), "__doc__", "") or "")
        _REGISTRY[name] = PassSpec(name, fn, frozenset(stages), default, tuple(after), tuple(before), last, doc)
        return fn

    return deco


def _ensure_loaded() -> None:
    # importing the passes package registers every pass
    from . import passes  # noqa: F401


def registered_passes() -> dict[str, PassSpec]:
    _ensure_loaded()
    return dict(_REGISTRY)


def get_pass(name: str) -> PassSpec:
    specs = registered_passes()
    if name not in specs:
        raise ValueError(f"unknown pass {name!r}; valid passes: {sorted(specs)}")
    return specs[name]


@contextlib.contextmanager
def temporary_registry(*specs: PassSpec, replace: bool = True) -> Iterator[None]:
    """Tests: run with exactly ``specs`` registered (or added, ``replace=False``)."""
    _ensure_loaded()
    saved = dict(_REGISTRY)
    if replace:
        _REGISTRY.clear()
    for s in specs:
        _REGISTRY[s.name] = s
    try:
        yield
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(saved)


def pass_order(stage: str | None = None) -> list[str]:
    """Registered pass names in run order (all stages, or those of ``stage``).

    Rules: ``after``/``before`` edges between registered passes; ``last=True``
    passes come after every other pass (two ``last`` passes are an error).
    Ties keep registration order, so the order is stable."""
    specs = registered_passes()
    names = list(specs)
    edges: dict[str, set[str]] = {n: set() for n in names}  # n -> passes that must precede n
    lasts = [n for n in names if specs[n].last]
    if len(lasts) > 1:
        raise ValueError(f"more than one pass declares last=True: {lasts}")
    for n, s in specs.items():
        for a in s.after:
            if a not in specs:
                raise ValueError(f"pass {n!r} declares after={a!r}, which is not a registered pass")
            edges[n].add(a)
        for b in s.before:
            if b not in specs:
                raise ValueError(f"pass {n!r} declares before={b!r}, which is not a registered pass")
            edges[b].add(n)
        if lasts and n != lasts[0]:
            edges[lasts[0]].add(n)
    order: list[str] = []
    done: set[str] = set()
    while len(order) < len(names):
        ready = [n for n in names if n not in done and edges[n] <= done]
        if not ready:
            cyc = sorted(n for n in names if n not in done)
            raise ValueError(f"pass order rules form a cycle among {cyc}")
        order.append(ready[0])
        done.add(ready[0])
    if stage is not None:
        order = [n for n in order if stage in specs[n].stages]
    return order


@dataclass
class PassRecord:
    """What one pass did to one stage graph of one frame."""

    name: str
    stage: str
    enabled: bool
    changed: bool = False
    seconds: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    reason: str | None = None  # why nothing changed / why the pass refused
    counts: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    op_diff: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PassContext:
    """Everything a pass may read, and the place it records what it did."""

    config: Any  # graphcomp.Config
    frame_id: int
    stage: str
    rank: int = 0
    world_size: int = 1
    record: PassRecord | None = None
    # shared between the passes and stages of one frame (e.g. joint-pass decisions
    # the fwd/bwd passes need, split reasons, runtime plans)
    frame_data: dict[str, Any] = field(default_factory=dict)
    example_inputs: Any = None

    def count(self, key: str, n: float = 1) -> None:
        assert self.record is not None
        self.record.counts[key] = self.record.counts.get(key, 0) + n

    def note(self, msg: str) -> None:
        assert self.record is not None
        self.record.notes.append(msg)
        log.debug("[frame %s %s %s] %s", self.frame_id, self.stage, self.record.name, msg)

    def nothing(self, reason: str) -> None:
        """Declare that the pass found nothing to do (or refused), and why."""
        assert self.record is not None
        self.record.reason = reason


def run_stage(gm: fx.GraphModule, ctx: PassContext, dumper: Any = None) -> tuple[fx.GraphModule, list[PassRecord]]:
    """Run every registered pass of ``ctx.stage`` over ``gm`` in order."""
    cfg = ctx.config
    records: list[PassRecord] = []
    if dumper is not None:
        dumper.graph(ctx.frame_id, ctx.stage, "input", gm)
    for idx, name in enumerate(pass_order(ctx.stage)):
        spec = _REGISTRY[name]
        enabled = cfg.pass_enabled(name)
        rec = PassRecord(name=name, stage=ctx.stage, enabled=enabled)
        records.append(rec)
        if not enabled:
            rec.reason = "disabled in Config.passes"
            continue
        before_counts = graph_utils.op_counts(gm)
        before_code = gm.code
        rec.nodes_before = len(gm.graph.nodes)
        ctx.record = rec
        if dumper is not None:
            dumper.pass_graph(ctx.frame_id, ctx.stage, idx, name, "before", gm)
        t0 = time.perf_counter()
        out = spec.fn(gm, ctx)
        rec.seconds = time.perf_counter() - t0
        if not isinstance(out, fx.GraphModule):
            raise TypeError(f"pass {name!r} returned {type(out).__name__}, expected torch.fx.GraphModule (graphcomp bug)")
        gm = out
        gm.recompile()
        if cfg.debug:
            try:
                gm.graph.lint()
            except Exception as e:  # a pass broke the graph: say which one
                raise RuntimeError(f"graphcomp pass {name!r} produced an invalid graph ({ctx.stage}): {e}") from e
        after_counts = graph_utils.op_counts(gm)
        rec.nodes_after = len(gm.graph.nodes)
        rec.op_diff = graph_utils.count_diff(before_counts, after_counts)
        rec.changed = gm.code != before_code
        if not rec.changed and rec.reason is None:
            rec.reason = "no change and no reason given (graphcomp bug: a pass must say why it did nothing)"
            log.warning("graphcomp pass %r left the %s graph unchanged without saying why", name, ctx.stage)
            STATE.counters["silent_noop_passes"] += 1
        STATE.counters["passes_run"] += 1
        if rec.changed:
            STATE.counters["passes_changed"] += 1
            STATE.counters[f"pass:{name}:changed"] += 1
        if dumper is not None:
            dumper.pass_graph(ctx.frame_id, ctx.stage, idx, name, "after", gm)
        lvl = logging.INFO if cfg.debug else logging.DEBUG
        log.log(
            lvl,
            "[frame %s %s] pass %s: %s in %.1f ms, nodes %d -> %d%s%s",
            ctx.frame_id, ctx.stage, name,
            "changed" if rec.changed else "no change",
            rec.seconds * 1e3, rec.nodes_before, rec.nodes_after,
            f", ops {rec.op_diff}" if rec.op_diff else "",
            f" ({rec.reason})" if rec.reason else "",
        )
        ctx.record = None
    if dumper is not None:
        dumper.graph(ctx.frame_id, ctx.stage, "output", gm)
    return gm, records
