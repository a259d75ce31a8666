"""The pass pipeline: the pass order, toggles, timing, records and dumps.

A pass is ``fn(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult`` over
aten-level FX (``joint``, ``fwd``, ``bwd``, ``inference``), or over the torch-level
graph Dynamo hands the backend (``dynamo``: before AOTAutograd, for passes that must
change what gets differentiated, e.g. swap a loss for a custom op with its own
autograd formula). It returns ``ctx.changed(gm)`` or ``ctx.unchanged(gm, why)``: the
pass says what it did, the pipeline does not guess from the code text (a pass that
only tags nodes for the partitioner changed the plan, not the code).

**Adding a pass**: write ``graphcomp/passes/<name>.py`` with one function decorated
``@register_pass("<name>", stages=(...), after=(...))``, add ``"<name>"`` to
:data:`PASS_ORDER` below, and a test file (``docs/architecture.md`` walks through it).

The order is written once, here. Each pass also declares its requirements
(``after=`` / ``before=`` other passes, ``last=True``); the order is checked against
them when the pipeline is first used, and a violation is an error naming the rule.

The pipeline owns the per-pass enable flags (``Config.passes``), wall time,
before/after dumps, and one :class:`PassRecord` per pass and stage saying what the
pass changed or why it changed nothing (a pass that does neither is flagged). Passes
count through ``ctx.counter(name, n)``; the pipeline adds those to
``graphcomp.counters`` after the pass returns.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.fx as fx

from graphcomp import _compat
from graphcomp.analysis import graph_utils
from graphcomp.analysis import verify
from graphcomp.compiler.compile_env import CompileEnv
from graphcomp.compiler.plan import FramePlan
from graphcomp.session import SESSION

log = logging.getLogger(__name__)

STAGES = ("dynamo", "joint", "fwd", "bwd", "inference")

PASS_ORDER: tuple[str, ...] = (
    "embedding_exchange",       # dynamo: sharded embedding lookups exchange tokens (ranks agree)
    "chunk_lm_loss",            # dynamo: linear + cross-entropy -> chunked op
    "fuse_allgather_downcast",  # joint: cast shards before gathering
    "fp8_allgather",            # joint: cast FP8 layers' weight shards to FP8 before gathering
    "fuse_grad_upcast",         # joint: weight-gradient matmuls write fp32 (CUDA)
    "avg_reduce_scatter",       # joint: the gradient average inside the reduce-scatter (NCCL)
    "bucket_collectives",       # joint: pack gathers / reduce-scatters into buckets
    "remat",                    # joint: recompute activations to fit memory_budget (tags)
    "schedule_free",            # joint: reshard after forward, keep gathers in the room remat left (tags)
    "defer_weight_grads",       # bwd: the last reduce-scatter's inputs first, weight gradients after it
    "schedule_prefetch",        # fwd, bwd: move gathers early, waits late
    "prefetch_across_steps",    # fwd: the table gather taken from the previous optimizer step
    "zero_copy_buckets",        # fwd, bwd: buckets as grouped collectives (no copy-out, no pack)
    "partition_graph",          # fwd, bwd: cut where CUDA graphs cannot go
    "cudagraphs",               # fwd, bwd: plan a runner per capturable piece (last)
)
"""Every pass, in the order it runs (each in the stages it declares); the module
``graphcomp/passes/<name>.py`` defines it. Inference frames run the joint passes under the
stage name ``inference``."""

PassFn = Callable[[fx.GraphModule, "PassContext"], "PassResult"]


@dataclass(frozen=True)
class PassSpec:
    name: str
    fn: PassFn
    stages: frozenset[str]
    default: bool = True
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    last: bool = False
    doc: str = ""  # the pass module's docstring (the pattern it matches); `graphcomp passes` shows it


def register_pass(
    name: str,
    *,
    stages: tuple[str, ...],
    default: bool = True,
    after: tuple[str, ...] = (),
    before: tuple[str, ...] = (),
    last: bool = False,
) -> Callable[[PassFn], PassFn]:
    """Decorator: declare ``fn`` as pass ``name`` (its stages, default, and order
    requirements). Nothing global changes: the pipeline finds the pass through
    :data:`PASS_ORDER` and its module ``graphcomp.passes.<name>``."""
    bad = sorted(set(stages) - set(STAGES))
    if bad or not stages:
        raise ValueError(f"pass {name!r}: invalid stages {list(stages)}; valid stages: {list(STAGES)}")

    def deco(fn: PassFn) -> PassFn:
        mod = inspect.getmodule(fn)
        doc = ((mod.__doc__ if mod is not None else None) or fn.__doc__ or "").strip()
        fn.pass_spec = PassSpec(name, fn, frozenset(stages), default, tuple(after), tuple(before), last, doc)  # type: ignore[attr-defined]
        return fn

    return deco


def _load_spec(name: str) -> PassSpec:
    mod = importlib.import_module(f"graphcomp.passes.{name}")
    specs = [v.pass_spec for v in vars(mod).values() if callable(v) and getattr(v, "pass_spec", None) is not None
             and v.pass_spec.name == name]
    if len(specs) != 1:
        raise ValueError(f"graphcomp.passes.{name} must define exactly one function decorated "
                         f"@register_pass({name!r}, ...); found {len(specs)}")
    return specs[0]


def _sorted_by_rules(specs: dict[str, PassSpec]) -> list[str]:
    """A stable topological sort of ``specs`` (dict order breaks ties) by their
    ``after`` / ``before`` / ``last`` rules."""
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
    return order


class PassRegistry:
    """The passes the pipeline runs, in order (immutable once built)."""

    def __init__(self, specs: list[PassSpec]) -> None:
        names = [s.name for s in specs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"pass(es) listed twice: {dup}")
        self._given = {s.name: s for s in specs}
        self._order: list[str] | None = None

    @property
    def order(self) -> list[str]:
        """Pass names in run order (rules checked here, on first use: a broken rule
        raises a ValueError naming it)."""
        if self._order is None:
            self._order = _sorted_by_rules(self._given)
        return self._order

    @property
    def specs(self) -> dict[str, PassSpec]:
        return {n: self._given[n] for n in self.order}

    @classmethod
    def from_pass_order(cls) -> PassRegistry:
        """The product pipeline: :data:`PASS_ORDER`, checked against each pass's rules."""
        reg = cls([_load_spec(n) for n in PASS_ORDER])
        if reg.order != list(PASS_ORDER):
            i = next(k for k, (a, b) in enumerate(zip(reg.order, PASS_ORDER)) if a != b)
            moved = reg.order[i]
            s = reg.specs[moved]
            raise ValueError(
                f"PASS_ORDER {list(PASS_ORDER)} breaks the rules of pass {moved!r} (after={list(s.after)}, "
                f"before={list(s.before)}, last={s.last}) or of a pass it must precede; an order that keeps "
                f"every rule: {reg.order}")
        return reg


def _active() -> PassRegistry:
    """The registry in use: built from PASS_ORDER on first use and kept in the session
    (``temporary_registry`` swaps it in tests)."""
    if SESSION.pass_registry is None:
        SESSION.pass_registry = PassRegistry.from_pass_order()
    return SESSION.pass_registry


def registered_passes() -> dict[str, PassSpec]:
    """Every pass, by name, in run order."""
    return dict(_active().specs)


def get_pass(name: str) -> PassSpec:
    specs = _active().specs
    if name not in specs:
        raise ValueError(f"unknown pass {name!r}; valid passes: {sorted(specs)}")
    return specs[name]


@contextlib.contextmanager
def temporary_registry(*specs: PassSpec, replace: bool = True) -> Iterator[None]:
    """Tests: run with exactly ``specs`` (or the product passes plus ``specs``,
    ``replace=False``), ordered by their rules (ties: the order given)."""
    saved = _active()
    base = [] if replace else list(saved._given.values())
    SESSION.pass_registry = PassRegistry(base + list(specs))
    try:
        yield
    finally:
        SESSION.pass_registry = saved


def pass_order(stage: str | None = None) -> list[str]:
    """Pass names in run order (all stages, or those of ``stage``)."""
    reg = _active()
    return [n for n in reg.order if stage is None or stage in reg.specs[n].stages]


@dataclass
class PassRecord:
    """What one pass did to one stage graph of one frame."""

    name: str
    stage: str
    enabled: bool
    changed: bool = False
    seconds: float = 0.0
    verify_seconds: float = 0.0  # the collective verifier's time on this pass's result (graphcomp.analysis.verify)
    nodes_before: int = 0
    nodes_after: int = 0
    reason: str | None = None  # why nothing changed / why the pass refused
    counts: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    op_diff: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PassResult:
    """What a pass returns: the graph (possibly a new GraphModule) and whether the
    pass changed it or the plan it carries (node tags read by the partitioner count)."""

    gm: fx.GraphModule
    changed: bool


@dataclass
class PassContext:
    """Everything a pass may read, and the place it records what it did."""

    config: Any  # graphcomp.Config
    frame_id: int
    stage: str
    rank: int = 0
    world_size: int = 1
    record: PassRecord | None = None
    frame: FramePlan = field(default_factory=FramePlan)  # what the stages of this frame hand each other
    example_inputs: Any = None
    env: CompileEnv = field(default_factory=lambda: CompileEnv.of_session(SESSION))  # groups, agreed plans, agreement
    _session_counts: dict[str, float] = field(default_factory=dict)

    def count(self, key: str, n: float = 1) -> None:
        """A number in this pass's record (``graphcomp inspect`` shows it)."""
        assert self.record is not None
        self.record.counts[key] = self.record.counts.get(key, 0) + n

    def counter(self, name: str, n: float = 1) -> None:
        """Add ``n`` to the session counter ``name`` (``graphcomp.counters``) once the
        pass has returned."""
        self._session_counts[name] = self._session_counts.get(name, 0) + n

    def note(self, msg: str) -> None:
        assert self.record is not None
        self.record.notes.append(msg)
        log.debug("[frame %s %s %s] %s", self.frame_id, self.stage, self.record.name, msg)

    def rewrite_each(self, nodes: list[fx.Node], rewrite: Callable[[fx.Node], str | None]) -> int:
        """Call ``rewrite(node)`` for each node: it rewrites and returns None, or returns
        why not, counted in this pass's record as ``skipped:<why>``. Returns how many
        were rewritten."""
        done = 0
        for n in nodes:
            why = rewrite(n)
            if why is None:
                done += 1
            else:
                self.count(f"skipped:{why}")
        return done

    def nothing(self, reason: str) -> None:
        """Record why the pass found nothing to do (or refused)."""
        assert self.record is not None
        self.record.reason = reason

    def unchanged(self, gm: fx.GraphModule, reason: str) -> PassResult:
        """``return ctx.unchanged(gm, why)``: nothing changed, and why."""
        self.nothing(reason)
        return PassResult(gm, False)

    def changed(self, gm: fx.GraphModule, note: str | None = None) -> PassResult:
        """``return ctx.changed(gm)``: the graph (or its tags) changed."""
        if note:
            self.note(note)
        return PassResult(gm, True)


def _check_result(name: str, out: Any) -> PassResult:
    if isinstance(out, PassResult) and isinstance(out.gm, fx.GraphModule):
        return out
    raise TypeError(f"pass {name!r} returned {type(out).__name__}, expected a PassResult "
                    f"(return ctx.changed(gm) or ctx.unchanged(gm, reason)) (graphcomp bug)")


def run_stage(gm: fx.GraphModule, ctx: PassContext, dumper: Any = None) -> tuple[fx.GraphModule, list[PassRecord]]:
    """Run every pass of ``ctx.stage`` over ``gm`` in order."""
    cfg = ctx.config
    records: list[PassRecord] = []
    counters = SESSION.counters
    gm = _compat.lazy_graph_module(gm)  # (each pass's recompile below then costs nothing until the code is used)
    graph_utils.mark_foreign(gm, ctx.env.is_foreign_group)  # (tensor parallel's and token exchanges' collectives)
    if dumper is not None:
        dumper.graph(ctx.frame_id, ctx.stage, "input", gm)
    checking = verify.enabled(cfg, ctx.stage)
    inv = verify.inventory(gm) if checking else None  # what the next pass must keep (graphcomp.analysis.verify)
    for idx, name in enumerate(pass_order(ctx.stage)):
        spec = get_pass(name)
        enabled = cfg.pass_enabled(name)
        rec = PassRecord(name=name, stage=ctx.stage, enabled=enabled)
        records.append(rec)
        if not enabled:
            rec.reason = "disabled in Config.passes"
            continue
        before_counts = graph_utils.op_counts(gm)
        before_code = gm.code if cfg.debug else None
        rec.nodes_before = len(gm.graph.nodes)
        ctx.record = rec
        ctx._session_counts = {}
        if dumper is not None:
            dumper.pass_graph(ctx.frame_id, ctx.stage, idx, name, "before", gm)
        t0 = time.perf_counter()
        res = _check_result(name, spec.fn(gm, ctx))
        rec.seconds = time.perf_counter() - t0
        gm = res.gm
        gm.recompile()
        rec.changed = res.changed
        if cfg.debug:
            try:
                gm.graph.lint()
            except Exception as e:  # a pass broke the graph: say which one
                raise RuntimeError(f"graphcomp pass {name!r} produced an invalid graph ({ctx.stage}): {e}") from e
            if not res.changed and gm.code != before_code:
                raise RuntimeError(f"graphcomp pass {name!r} reported no change but rewrote the {ctx.stage} graph "
                                   f"(graphcomp bug: a pass must report what it changed)")
        if inv is not None:
            t1 = time.perf_counter()
            after_inv = verify.inventory(gm)
            if after_inv is not None:
                verify.check(inv, after_inv, name, ctx.stage, ctx.frame_id)
                counters.add("collectives_verified")
            else:
                rec.notes.append("collective verifier: split graph (pieces), not inventoried")
            inv = after_inv
            rec.verify_seconds = time.perf_counter() - t1
        after_counts = graph_utils.op_counts(gm)
        rec.nodes_after = len(gm.graph.nodes)
        rec.op_diff = graph_utils.count_diff(before_counts, after_counts)
        if not rec.changed and rec.reason is None:
            rec.reason = "no change and no reason given (graphcomp bug: a pass must say why it did nothing)"
            log.warning("graphcomp pass %r left the %s graph unchanged without saying why", name, ctx.stage)
            counters.add("silent_noop_passes")
        for k, n in ctx._session_counts.items():
            counters.add(k, n)
        counters.add("passes_run")
        if rec.changed:
            counters.add("passes_changed")
            counters.add(f"pass:{name}:changed")
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
