"""``graphcomp.counters``: what graphcomp did, counted, for tests, logs and benchmarks.

One :class:`Counters` object lives in the session (``graphcomp.session.SESSION``);
``graphcomp.counters`` is that object and ``graphcomp.reset()`` zeroes it. Every
counter is a declared field with a docstring: reading a name that does not exist
(a typo) raises ``KeyError`` naming the valid ones, instead of reading 0.

Reading (it is a read-only mapping of the counters that are not zero)::

    graphcomp.counters["captures"]               # 0 until something was captured
    graphcomp.counters["bytes_gathered:bfloat16"]   # a keyed family: bytes_gathered:<dtype>
    dict(graphcomp.counters)                     # every non-zero counter
    graphcomp.counters.expect(captures=2, cudagraph_fallbacks=0)   # tests: AssertionError listing misses

Writing is graphcomp's own business: ``counters.add(name, n)`` (passes count through
their ``PassContext``; the pipeline adds those up after the pass).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

# keyed families: "<prefix>:<key>" (bytes_gathered:<dtype>) or "pass:<name>:changed"
_FAMILIES = {"bytes_gathered": "bytes_gathered", "pass_changed": "pass"}


@dataclass
class Counters(Mapping):
    """Every counter graphcomp keeps (all start at 0)."""

    # ---- compile (backend, pipeline, passes)
    frames_compiled: int = 0
    """Dynamo frames compiled by the backend (one per graph break / recompile)."""
    recompiles: int = 0
    """Frames that were recompiles of an already compiled frame (guards failed)."""
    passes_run: int = 0
    """Pass runs over a stage graph (enabled passes only)."""
    passes_changed: int = 0
    """Pass runs that reported a change."""
    silent_noop_passes: int = 0
    """Pass runs that neither changed anything nor said why (a graphcomp bug)."""
    embedding_lookups_exchanged: int = 0
    """Embedding lookups that exchange tokens and rows instead of gathering the table
    (embedding_exchange; ``shard(..., embedding="auto" | "exchange")``)."""
    gathers_fused: int = 0
    """Parameter all-gathers whose downcast moved onto the shard (fuse_allgather_downcast)."""
    fp8_gathers: int = 0
    """Parameter all-gathers that move FP8 bytes, their weight cast to FP8 on the shard
    (fp8_allgather; a rowwise weight counts two: its row- and column-scaled casts)."""
    fp8_amax_all_reduces: int = 0
    """All-reduces (MAX) of the shards' amaxes that fp8_allgather emitted: one per process
    group and graph, for every FP8 weight whose scale reads every row."""
    grad_upcasts_fused: int = 0
    """Gradient upcasts (bf16 -> fp32 before the reduce-scatter) fused into the matmul that
    makes the gradient, which then writes fp32, or into an embedding's table gradient,
    then computed from the fp32 output gradient (fuse_grad_upcast, CUDA)."""
    gathers_prefetched_across_steps: int = 0
    """Forward gathers the prefetch_across_steps pass let the previous optimizer step issue
    (graph rewrites: each becomes ``graphcomp::prefetched_gather``)."""
    prefetches_issued: int = 0
    """Gathers an optimizer step (graphcomp.optim.capture) issued for the next forward."""
    prefetches_taken: int = 0
    """Prefetched gathers a forward used."""
    prefetch_misses: int = 0
    """Forward gathers that found no prefetch (first step, no optimizer step since) and gathered."""
    prefetches_discarded: int = 0
    """Prefetched gathers not used (the shard written since, never taken before the next
    step's, a whole step being captured); the forward gathered instead."""
    reduce_scatters_averaged: int = 0
    """Gradient reduce-scatters that average in the collective (NCCL ``avg``) instead of a
    sum and a division kernel after it (avg_reduce_scatter; power-of-two NCCL groups)."""
    collective_buckets: int = 0
    """Flat buckets made by bucket_collectives (all-gather and reduce-scatter)."""
    gathers_resharded: int = 0
    """Gathers schedule_free tagged to be freed after forward and re-gathered in backward."""
    weight_grad_nodes_deferred: int = 0
    """Backward nodes defer_weight_grads moved after the last gradient reduce-scatter (the
    weight-gradient compute that collective's inputs do not need, and its reduce-scatters)."""
    activations_recomputed: int = 0
    """Saved activations remat's plan recomputes in backward to fit memory_budget (its additions; under
    remat="auto" also the user-region activations it left recomputed)."""
    user_checkpoint_saved: int = 0
    """Activations of user torch.utils.checkpoint regions that remat (remat="auto") saved instead of recomputing."""
    memory_budget_infeasible: int = 0
    """Stage graphs whose estimated peak could not be brought under memory_budget."""
    lm_losses_chunked: int = 0
    """Language-model losses rewritten into the chunked op (chunk_lm_loss)."""
    pieces_not_inductor: int = 0
    """Split pieces run as FX graphs because Inductor cannot bind their scalar inputs."""
    regions: int = 0
    """Compile regions cut by partition_graph (Config.compile_regions)."""
    region_cuts_in_flight: int = 0
    """Region cuts inside captured pieces that leave a collective in flight (its wait
    in the next region): the cuts moved to where the fewest bytes cross."""
    regions_compiled: int = 0
    """Compile regions (or pieces) compiled by Inductor, with compile_regions on."""
    regions_reused: int = 0
    """Compile regions that reused the compiled function of an identical region."""
    region_pieces_compiled_whole: int = 0
    """Captured pieces that compile_regions="auto" had divided into regions but
    compiled whole: more than half of their regions would have been compiled (too
    little reuse to pay for the fusions lost at the cuts)."""
    regions_not_reusable: int = 0
    """Compile regions that no other region may reuse (symbolic shapes, submodules,
    large constants); with compile_regions on, INFO logs say why each region was
    compiled again."""
    inductor_memory_reorders: int = 0
    """Graphs (or pieces) with graphcomp's collectives whose node order Inductor's
    reorder_for_peak_memory replaced (Config.inductor_memory_reorder)."""
    inductor_memory_orders_kept: int = 0
    """Graphs (or pieces) with graphcomp's collectives whose order Inductor's
    reorder_for_peak_memory looked at and kept."""
    rank_agreement_checks: int = 0
    """Stage graphs whose collective sequence was compared with the other ranks' (Config.rank_agreement)."""
    rank_divergences: int = 0
    """Rank-agreement checks that found ranks about to issue different collectives (each raised)."""
    collectives_verified: int = 0
    """Pass runs whose result the collective verifier checked (Config.verify_collectives)."""
    bytes_gathered: dict[str, int] = field(default_factory=dict)
    """``bytes_gathered:<dtype>``: bytes all-gathered per compiled fwd/bwd graph run, by dtype."""
    pass_changed: dict[str, int] = field(default_factory=dict)
    """``pass:<name>:changed``: runs in which pass <name> reported a change."""

    # ---- CUDA-graph runtime
    pieces_captured: int = 0
    """Split pieces wrapped in a CUDA-graph runner."""
    pieces_eager: int = 0
    """Pieces that run eagerly (cut by partition_graph, or turned eager at run time)."""
    captures: int = 0
    """CUDA graphs captured for pieces (every shape, every re-capture)."""
    recaptures: int = 0
    """Re-captures forced by a changed address, a demoted input or a new copied input."""
    replays: int = 0
    """CUDA-graph replays of pieces."""
    cudagraph_fallbacks: int = 0
    """Calls of a captured piece run eagerly because of a runtime hazard (see README)."""
    cudagraph_output_copy_bytes: int = 0
    """Bytes of outputs copied out of the CUDA-graph pool after replays."""
    hazard_recaptures: int = 0
    """Re-captures around tensors still held in the pool (gradient accumulation, ...)."""
    hazard_gc_collects: int = 0
    """``gc.collect()`` runs before a hazard decision (at most once per capture: a
    compile's reference cycles can hold the first call's outputs)."""
    warmup_collectives_stood_in: int = 0
    """Collectives a CUDA-graph warm-up recorded without running them (zeros of their shape), so a
    capture call issues each collective once, as a replay call does (a rank capturing alone stays in
    step with its peers)."""
    capture_failures: int = 0
    """Pieces whose warm-up, trial capture or capture raised: they run eagerly for good."""
    pieces_turned_eager: int = 0
    """Pieces that could not settle (repeated fallbacks, data-dependent shapes): eager for good."""
    pieces_eager_calls: int = 0
    """Calls with a shape beyond max_captures, run eagerly (a configured limit, not a fallback)."""

    # ---- graphcomp.optim.capture
    optimizer_steps_captured: int = 0
    """Optimizer steps run as a replay of the captured clip + step."""
    optimizer_steps_eager: int = 0
    """Optimizer steps run eagerly (warm-up, fallbacks)."""
    optimizer_steps_skipped_nonfinite: int = 0
    """Steps skipped because the global gradient norm was not finite."""
    optimizer_captures: int = 0
    """Captures of the optimizer step."""
    optimizer_recaptures: int = 0
    """Re-captures of the optimizer step (changed hyper-parameters, state, gradients)."""
    optimizer_fallbacks: int = 0
    """Optimizers that run eagerly for good (unsupported optimizer or option)."""
    optimizer_grad_copy_bytes: int = 0
    """Bytes of gradients copied into the captured step's static buffers."""
    optimizer_clip_folds: int = 0
    """Times a captured step switched to the exact clip fold (graphcomp/optim/clip_fold.py: the clip
    coefficient applied inside one fused Adam/AdamW kernel, bitwise clip_grads_with_norm_ + opt.step())."""
    optimizer_steps_in_step_graph: int = 0
    """Optimizer steps recorded inline into a whole-step graph (graphcomp.capture_step), once per capture."""

    # ---- graphcomp.capture_step
    step_captures: int = 0
    """Captures of a whole training step (graphcomp.capture_step)."""
    step_replays: int = 0
    """Training steps run as one replay of the whole-step graph."""
    step_calls_uncaptured: int = 0
    """Calls of a capture_step step that ran the step function as it is (warm-up, changed inputs, fallbacks)."""
    step_recaptures: int = 0
    """Whole-step graphs dropped because something a replay cannot see changed (re-captured on the next call)."""
    step_capture_failures: int = 0
    """Whole-step captures that raised (the step then runs uncaptured for good, or raises with 'require')."""
    step_capture_fallbacks: int = 0
    """Steps that run uncaptured for good (a failed capture, too many re-captures)."""
    train_step_whole: int = 0
    """``graphcomp.train_step`` steps that decided to capture the whole step as one CUDA graph."""
    train_step_pieces: int = 0
    """``graphcomp.train_step`` steps that decided to run as compiled pieces (the reason is logged
    and in ``TrainStep.stats()``)."""

    # ----------------------------------------------------------- writing
    def add(self, name: str, n: int | float = 1) -> None:
        """Add ``n`` to counter ``name`` (a field, or a family key such as
        ``bytes_gathered:bfloat16``); an unknown name raises ``KeyError``."""
        fam, key = self._resolve(name)
        if fam is None:
            setattr(self, name, getattr(self, name) + n)
        else:
            d = getattr(self, fam)
            d[key] = d.get(key, 0) + n

    def reset(self) -> None:
        """Every counter back to 0."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)

    # ----------------------------------------------------------- reading
    @classmethod
    def names(cls) -> list[str]:
        """The counter names (family fields as ``<prefix>:<key>`` patterns)."""
        out = []
        for f in dataclasses.fields(cls):
            if f.name in _FAMILIES:
                out.append("pass:<name>:changed" if f.name == "pass_changed" else f"{f.name}:<dtype>")
            else:
                out.append(f.name)
        return out

    def _resolve(self, name: str) -> tuple[str | None, str]:
        if not isinstance(name, str):
            raise KeyError(f"graphcomp counter names are strings, got {name!r}")
        if name.startswith("pass:") and name.endswith(":changed") and name.count(":") == 2:
            return "pass_changed", name.split(":")[1]
        if name.startswith("bytes_gathered:"):
            return "bytes_gathered", name.split(":", 1)[1]
        if name in _FIELD_NAMES and name not in _FAMILIES:
            return None, name
        raise KeyError(f"no graphcomp counter named {name!r}; valid counters: {', '.join(self.names())}")

    def __getitem__(self, name: str) -> int:
        fam, key = self._resolve(name)
        return getattr(self, name) if fam is None else getattr(self, fam).get(key, 0)

    def get(self, name: str, default: int | None = None) -> int | None:  # type: ignore[override]
        """Like ``self[name]``, ``default`` when that counter is 0; an unknown name
        still raises ``KeyError`` (a typo never reads 0)."""
        v = self[name]
        return v if v else default

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and bool(self[name])

    def _items(self) -> Iterator[tuple[str, int]]:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "pass_changed":
                yield from ((f"pass:{k}:changed", n) for k, n in sorted(v.items()) if n)
            elif f.name in _FAMILIES:
                yield from ((f"{f.name}:{k}", n) for k, n in sorted(v.items()) if n)
            elif v:
                yield f.name, v

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items())

    def __len__(self) -> int:
        return sum(1 for _ in self._items())

    def __repr__(self) -> str:
        return f"Counters({dict(self._items())})"

    def expect(self, **counts: int) -> None:
        """Assert counter values (tests): ``counters.expect(captures=2, replays=10)``.
        Family keys go through a dict: ``expect(**{"bytes_gathered:float32": 0})``.
        Raises ``AssertionError`` listing every mismatch."""
        bad = [f"{k}: expected {v}, got {self[k]}" for k, v in counts.items() if self[k] != v]
        if bad:
            raise AssertionError("graphcomp counters differ: " + "; ".join(bad))

    __hash__ = None  # type: ignore[assignment]  (mutable)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(Counters))
