"""``graphcomp.Config``: every option of the backend, in one dataclass.

``torch.compile(model, backend="graphcomp", options={...})`` takes the field names
below as keys. ``Config.from_options`` validates them: an unknown key or pass name,
a wrong type or a value outside a closed set is a ``ValueError`` that names the
field and the valid choices.

Environment variables are read in one place only, ``graphcomp/env.py``.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from graphcomp import env

Codegen = Literal["inductor", "eager"]
CudaGraphsMode = Literal["off", "auto", "require"]
StaticCheck = Literal["first", "always"]
AddressChange = Literal["error", "recapture"]
OutputCopy = Literal["auto", "always"]
LossKernels = Literal["inductor", "eager"]
RematMode = Literal["respect_user", "auto"]
FusionSearch = Literal["fast", "inductor"]

AUTO_BUDGET_FRACTION = 0.9
"""``memory_budget="auto"``: this fraction of the CUDA device's total memory."""


@dataclass(kw_only=True)
class Config:
    passes: dict[str, bool] = field(default_factory=dict)
    """Per-pass enable flags, ``{pass_name: bool}``, over the registered passes
    (``graphcomp.compiler.pipeline.registered_passes()``). A pass not named keeps its default
    (see the pass table in the README). Unknown pass names are a ``ValueError``."""

    codegen: Codegen = "inductor"
    """How each stage graph (forward, backward, inference) is turned into code after
    the passes ran: ``"inductor"`` compiles it with TorchInductor; ``"eager"`` runs
    the FX graph as it is (useful to debug a pass without Inductor in the way)."""

    dump_dir: str | None = None
    """Directory for graph dumps: per rank, frame and stage, the readable graph
    before and after every pass plus a ``summary.json``; read them with
    ``graphcomp inspect DIR``. Defaults to ``$GRAPHCOMP_DUMP_DIR``; ``None`` writes
    nothing. Graphs also go to torch's structured trace (``TORCH_TRACE``) either way."""

    bucket_bytes: int = 64 * 2**20
    """Largest bucket for ``bucket_collectives``, in bytes on the wire (gathered
    output bytes for all-gathers, input bytes for reduce-scatters). Consecutive
    collectives are packed until the next one would pass this. Larger buckets mean
    fewer, more efficient collectives but more memory held by gathered parameters
    early (a bucket is gathered at its first use). Must be >= 0; 0 disables bucketing.
    W2 (2 H200s, one run): 256 MiB gave 137.7 against 140.5 ms per step, from fewer
    gradient reduce-scatters (the default issues 67 per step, FSDP2 17)."""

    reduce_bucket_bytes: int | None = None
    """Largest bucket of gradient reduce-scatters for ``bucket_collectives``, in input
    bytes (the full gradients packed into one collective); ``None`` (default) uses
    ``bucket_bytes``. Gathers and reduce-scatters trade differently: a larger gather
    bucket holds more gathered parameters earlier (memory, and a later first use),
    while a larger reduce-scatter bucket only holds one packed send buffer a little
    longer and issues fewer, larger collectives. Must be >= 0; 0 disables
    reduce-scatter bucketing only. W2 on 2 H200s: 256 MiB was 2.3 ms per step faster
    before ``defer_weight_grads``, 0.2-0.5 ms with it (within the noise), so the
    default stays ``None``."""

    collective_bytes_per_s: float | None = None
    """The bandwidth (bytes per second of a reduce-scatter's input, times ``(W-1)/W``)
    that ``defer_weight_grads`` models the wire at when it decides how much weight-
    gradient compute must move to cover the last reduce-scatter. ``None`` (default):
    250e9, W2's table gradient on 2 H200s over NVLink. A slower interconnect (PCIe,
    several nodes) wants a smaller value (more compute moved, a little more memory);
    must be > 0."""

    reshard_after_forward: bool | Literal["auto", "except_last"] = "auto"
    """Pass ``schedule_free``: whether a gathered parameter is released after its
    last use in forward and gathered again in backward. ``True``: reshard every
    gathered parameter (least memory, one more gather per parameter); ``False``:
    keep every gathered parameter for backward (no re-gather, most memory);
    ``"auto"`` (default): keep the parameters whose re-gather costs most per byte
    held (small gathers: latency-bound; then in graph order) while the estimated
    peak of the joint graph stays under ``memory_budget``; under the default budget
    (``"auto"``) it also leaves room for the optimizer state outside the graph (2x
    the parameter shards' bytes) and for what other compiled frames keep. The choice
    is made at a function's first compile (every rank keeps what all ranks' estimates
    keep) and reused by its recompiles, so ranks with different input shapes issue
    the same gathers. So on CUDA the memory sharding saved buys the
    backward's re-gathers back while it fits (W2 on 2 H100s: 3.4% faster, 2.4 GiB
    more); without a budget (the CPU default) "auto" reshards everything;
    ``"except_last"``: reshard every gathered parameter but the gather (bucket) the
    backward reads first -- the last block's, which the backward would otherwise
    wait for at its very start with nothing to overlap; FSDP2 users get the same by
    not resharding the last block. Costs that bucket's bytes (at most
    ``bucket_bytes``) held from the forward's end into the backward."""

    memory_budget: int | float | Literal["auto"] | None = "auto"
    """Peak-memory budget for the scheduling passes: ``int`` bytes, or a ``float``
    in (0, 1] as a fraction of the device's memory (CUDA only; a fraction on a CPU
    graph is a ValueError at compile time). ``"auto"`` (default): 0.9
    (``config.AUTO_BUDGET_FRACTION``) of the device's memory for CUDA graphs, no
    budget for any other device (CPU memory is the host's). The budget bounds the
    static estimate of one graph's peak (``graphcomp/analysis/memory.py``): memory held
    outside the compiled graphs is not in it. Under ``"auto"``, ``remat`` and
    ``reshard_after_forward="auto"`` leave room for the optimizer state (2x the
    parameter shards) and the gathers other compiled functions keep; an explicit
    budget is used as given, so leave room in it for what lives outside. Used by ``remat`` (recompute activations until
    the joint graph fits), ``reshard_after_forward="auto"`` and to bound
    ``schedule_prefetch`` (a gather is not issued earlier when that would push the
    estimated peak over it). A budget below the estimated peak with everything
    resharded is infeasible: a warning is logged and recorded, every parameter is
    resharded and prefetch is limited by ``prefetch_bytes`` only. ``None``: no budget."""

    remat: RematMode = "respect_user"
    """Pass ``remat``: what the memory-budgeted rematerialization may do with the
    user's ``torch.utils.checkpoint`` regions. ``"respect_user"`` (default): they
    are recomputed as written; graphcomp adds recomputation of other activations
    only when the joint graph's estimated peak is over ``memory_budget``.
    ``"auto"``: they are candidates, not orders: with a budget, graphcomp saves
    every activation that fits and recomputes the ones cheapest to recompute per
    byte until the estimate is under it (faster when memory is left: W3 on 4 H100s,
    1026 -> 890 ms per step; the estimate sees memory outside the graph only as the
    default budget's reserve, see ``memory_budget``). Either way ``remat`` plans before
    ``schedule_free``: saved activations come before kept gathered parameters. Without a budget
    (CPU default) both modes leave every tag as it is. ``passes={"remat": False}``
    switches the pass off."""

    inductor_memory_reorder: bool = False
    """``codegen="inductor"``: whether Inductor's ``reorder_for_peak_memory`` (a
    scheduler pass that replaces a graph's node order with a topological order of
    lower estimated peak, when it finds one) may run on graphs that hold graphcomp's
    gathers and reduce-scatters. Such an order knows nothing of communication. On
    the tiny Llama (2 CPU ranks, small buckets, every gather prefetched) it put each
    forward gather back next to its use and moved every backward reduce-scatter to
    the end of the backward, each waited at once. On the W1 model at its benchmark
    size (4 x 1024 tokens, 2 CPU ranks) it kept the forward's order and replaced the
    backward's with a breadth-first order of 3.4% lower estimated peak (1.87 vs 1.93
    GB) in which each of the backward's first four gathers is waited right after it
    is issued, behind the head gradient's reduce-scatter: the W1 trace on 2 H200s
    (0dea721) shows that reduce-scatter and three gathers exposed in a row at the
    backward's start. ``False`` (default) keeps the order ``schedule_prefetch``
    chose, as torchtitan's SimpleFSDP does; that order's estimated peak is the one
    graphcomp plans with (``memory_budget``). Graphs without graphcomp's collectives
    are left to Inductor either way. Each graph with them counts
    ``inductor_memory_reorders`` when Inductor replaced its order and
    ``inductor_memory_orders_kept`` when it looked and kept it (with ``True``)."""

    prefetch_bytes: int = 128 * 2**20
    """Pass ``schedule_prefetch``: most bytes of all-gather outputs in flight
    (issued but not yet waited) at any point of a forward or backward graph.
    Gathers are issued early (in program order) until this cap; a single gather
    larger than the cap (an embedding or LM-head table) is issued early only while
    the other gathers in flight hold at most half the cap. The same cap bounds the
    reduce-scatter inputs in flight (the oldest is waited when a new one would pass
    it), not counting one reduce-scatter larger than the cap on its own. Must be
    >= 0; 0 disables prefetching (waits still sink to their first use)."""
    inductor_fusion_search: FusionSearch = "fast"
    """``codegen="inductor"``: how widely Inductor's scheduler searches for fusions
    in the graphs graphcomp compiles. ``"fast"`` (default) sets Inductor's
    ``max_fusion_buffer_group_pairwise_attempts`` to 16 (Inductor: 64) and
    ``loop_ordering_after_fusion`` to False for those graphs only; ``"inductor"``
    leaves both as Inductor (or the user) set them. Inductor pairs every node with
    the next 64 nodes that read the same buffer, in each of up to 10 fusion rounds,
    and retries a pair that shares little data after reordering its loops. A deep
    model's whole-graph compile has buffers read by every block (RoPE tables: W3's
    forward, recomputation and backward read them in about 200 nodes), so most
    pairs are nodes of different blocks that cannot fuse: on W3 (2 H200s) the
    search took 16 s of the cold compile, about half of it in loop reordering.
    Measured on the CPU (8 checkpointed blocks of W3's structure, 2 gloo ranks):
    the same fusions (455 of the pairs tried, 837 kernels from 998 nodes), 8063
    instead of 15438 pairs tried. On 2 H200s (4c5e8ae): W3's cold first step
    104.1 s against 123.8 s with ``"inductor"``; W2 steps 129.7-131.3 ms either way
    in three A/B pairs (README, Known issues, "Cold compile")."""

    cudagraphs: CudaGraphsMode = "auto"
    """CUDA-graph capture of the forward/backward graphs (passes ``partition_graph``
    and ``cudagraphs``): ``"off"`` never captures (graphs run as compiled);
    ``"auto"`` cuts each graph at ops CUDA graphs cannot capture, captures the
    pieces that can be and runs the rest eagerly, logging each reason;
    ``"require"`` raises if any piece cannot be captured. Graphs without CUDA
    tensors (CPU) are never split. ``passes={"cudagraphs": False}`` also turns
    capture off; ``cudagraphs="require"`` together with ``passes={"cudagraphs":
    False}`` (or ``"partition_graph": False``) is a contradiction: ``ValueError``."""

    split_ops: list[str] = field(default_factory=list)
    """Extra op names that always run outside CUDA graphs (a cut around each):
    ``"aten.nonzero"``, ``"aten.nonzero.default"``, ``"aten::nonzero"`` or a bare
    ``"nonzero"``; custom ops as ``"ns.op"``. Each entry must be a non-empty string."""

    min_piece_nodes: int = 3
    """A capturable piece with fewer compute nodes than this is not worth a CUDA
    graph (launch savings below replay overhead): it joins its eager neighbours.
    Must be >= 1."""

    compile_regions: bool | Literal["auto"] = "auto"
    """Regional compilation (pass ``partition_graph``, Inductor codegen only): cut the
    forward and backward graphs into regions near block boundaries (each region holds
    at least ``region_min_nodes`` compute nodes; in a sharded transformer one region
    per block, cut where the fewest bytes of values cross) and compile each distinct
    region once: regions whose graphs and input shapes, strides and dtypes are the
    same reuse one compiled function. Cuts the cold compile of deep models
    (Inductor's time grows with the graph's size). With CUDA graphs the regions are
    compiled apart and run in order inside their piece, which is captured whole;
    without them they are eager pieces, each compiled.

    ``"auto"`` (the default): on for a stage graph whose pieces are captured (CUDA
    graphs), compiled by Inductor, with static shapes, and that cuts into at least
    ``region_auto_min`` regions (a deep model); otherwise the graph compiles whole. A
    piece whose regions would mostly be compiled anyway (more than half of them: blocks
    that differ) also compiles whole (counter ``region_pieces_compiled_whole``).
    W3 (32 blocks) on 2 H200s, 2026-11-28, one machine: cold first step 86.5 s
    against 133.5 s whole, steps 977.7 ms either way. ``True``: always (also without
    CUDA graphs); ``False``: never. ``graphcomp.counters``: ``regions``,
    ``regions_compiled``, ``regions_reused``, ``regions_not_reusable``,
    ``region_cuts_in_flight``, ``region_pieces_compiled_whole``; with ``GRAPHCOMP_LOG=INFO``
    ``partition_graph`` says what ``"auto"`` decided and the codegen why a region was
    compiled again."""

    region_min_nodes: int = 64
    """``compile_regions``: the fewest compute nodes a region holds before the next
    cut (smaller regions merge with the next). Must be >= 1."""

    region_auto_min: int = 16
    """``compile_regions="auto"``: the fewest regions a stage graph must cut into for
    regional compilation to be used (a transformer of N blocks cuts into about N + 1).
    Must be >= 1."""

    max_captures: int = 8
    """CUDA graphs per piece: one capture per input-shape signature (shapes,
    strides, dtypes and scalar values of the inputs), up to this many; a piece seen
    with more signatures runs eagerly with a warning. Must be >= 1."""

    check_static_inputs: StaticCheck = "first"
    """When static inputs (parameters, buffers) of a captured piece are checked
    for a changed address: ``"first"`` on the first replay of each capture,
    ``"always"`` on every replay (a few microseconds per piece). Saved activations
    and outputs of other captured pieces are checked on every replay regardless."""

    on_address_change: AddressChange = "error"
    """What a changed parameter/buffer address does: ``"error"`` raises naming the
    input and the fix (keep parameters in place: ``copy_`` into them, never
    reassign ``.data``); ``"recapture"`` captures the piece again (counted in
    ``graphcomp.counters['recaptures']``)."""

    copy_outputs: OutputCopy = "auto"
    """How captured pieces hand out what leaves graphcomp: the gradients bound for
    ``param.grad`` and forward outputs over 1 MiB (logits; tensors handed across a
    graph break). They live in the shared CUDA-graph pool, which later replays
    overwrite. ``"always"`` copies them out of the pool after every replay (costs their
    size in memory and a copy per step). ``"auto"`` hands them out without a copy;
    before every replay graphcomp checks (storage use counts, after one
    ``gc.collect()`` per capture) that nothing it could overwrite is still referenced.
    The first time one is (gradient accumulation, ``zero_grad(set_to_none=False)``,
    a loop that keeps the model's output until the next forward), its piece copies
    it from then on and the piece about to replay is captured again around the live
    tensor (``graphcomp.counters['hazard_recaptures']``); it is never overwritten.
    Forward outputs up to 1 MiB (the loss, metrics) are always copied: they are
    often kept for logging (``graphcomp.compiler.codegen.FORWARD_COPY_BELOW``)."""

    loss_chunk_tokens: int = 1024
    """Pass ``chunk_lm_loss``: rows (tokens) per chunk of the chunked language-model
    loss. Each chunk holds at most two ``[loss_chunk_tokens, vocab]`` buffers at once
    (its logits, their fp32 copy, log-probabilities or gradient), instead of the
    whole ``[tokens, vocab]`` logits in fp32 and their gradient; a linear head's
    weight gradient (``vocab x hidden``, fp32) is summed over the chunks and kept
    for the backward. Smaller chunks use less memory and launch more, smaller kernels (each
    chunk is one matmul of ``loss_chunk_tokens`` rows per product). Must be >= 1."""

    loss_chunk_kernels: LossKernels = "inductor"
    """Pass ``chunk_lm_loss``: how each chunk's softmax and gradient arithmetic runs
    on CUDA. ``"inductor"``: one function compiled by Inductor at its first call
    (a row reduction and one elementwise pass; it holds only the chunk's logits and
    gradient); ``"eager"``: about six eager kernels per chunk, each reading and
    writing the chunk in fp32. On other devices it always runs eagerly."""

    rank_agreement: bool = True
    """Compile-time rank agreement: after the passes, each rank publishes the
    collective sequence its forward/backward graph will issue on each process group
    (kind, dtype, bytes, order, bucket, reshard and prefetch decisions, source line)
    through the default process group's store, and compares it with every other
    member's. A mismatch raises ``graphcomp.errors.RankDivergence`` on every rank,
    naming the first differing collective and its source line, instead of hanging
    until the process-group timeout. Frames without collectives and single-rank
    groups are not checked. ``False`` skips the exchange."""

    rank_agreement_timeout: float = 60.0
    """Seconds a rank waits for the other members of a group to publish their
    collective sequence (compile-time agreement, and the eager per-gather check of
    ``GRAPHCOMP_DEBUG=1``). A rank that never compiles the matching graph (it took
    another path, recompiled alone, or died) turns into a ``RankDivergence`` after
    this long. Must be > 0; keep it above the slowest rank's compile time."""

    verify_collectives: bool | Literal["debug"] = True
    """The collective verifier: after every pass, check against the graph before it
    that each parameter is still gathered as often, on the same group, in its
    dtype or the dtype it is cast to right after (fused downcast), and each
    gradient is reduce-scattered exactly once in the same dtype and group (fused and
    bucketed forms included). A violation raises
    ``graphcomp.errors.CollectiveVerifyError`` naming the pass. ``"debug"``: only
    when ``debug`` is on; ``False``: never."""

    debug: bool = False
    """Extra checks and logging: lint every graph after every pass (a pass that
    breaks the graph fails at once, naming the pass) and log the op-count diff of
    each pass at INFO. Defaults to ``$GRAPHCOMP_DEBUG``."""

    # ------------------------------------------------------------------ helpers
    @classmethod
    def from_options(cls, options: Mapping[str, Any] | "Config" | None) -> "Config":
        """Build a validated Config from ``torch.compile``'s ``options`` mapping
        (or pass a Config through). Env defaults apply to fields not given."""
        if isinstance(options, Config):
            cfg = dataclasses.replace(options)
        else:
            if options is not None and not isinstance(options, Mapping):
                raise TypeError(f"graphcomp options: expected a mapping of graphcomp.Config field names (or a "
                                f"graphcomp.Config), got {type(options).__name__} {options!r}")
            options = dict(options or {})
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(options) - names)
            if unknown:
                raise ValueError(
                    f"unknown graphcomp option(s) {unknown}; valid options: {sorted(names)}"
                )
            kwargs = dict(options)
            if "dump_dir" not in kwargs and env.dump_dir() is not None:
                kwargs["dump_dir"] = env.dump_dir()
            if "debug" not in kwargs and env.debug():
                kwargs["debug"] = True
            cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Check every field's type and value; raise ValueError naming the field."""
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), hints[f.name])
        if self.bucket_bytes < 0:
            raise ValueError(f"Config.bucket_bytes: must be >= 0, got {self.bucket_bytes}")
        cb = self.collective_bytes_per_s
        if cb is not None and (isinstance(cb, bool) or not isinstance(cb, (int, float)) or not cb > 0
                               or cb == float("inf")):
            raise ValueError(f"Config.collective_bytes_per_s: must be a finite number > 0 (bytes per second) or "
                             f"None, got {cb!r}")
        if self.reduce_bucket_bytes is not None and self.reduce_bucket_bytes < 0:
            raise ValueError(f"Config.reduce_bucket_bytes: must be >= 0 or None, got {self.reduce_bucket_bytes}")
        if self.prefetch_bytes < 0:
            raise ValueError(f"Config.prefetch_bytes: must be >= 0, got {self.prefetch_bytes}")
        mb = self.memory_budget
        if isinstance(mb, bool):
            raise ValueError(f"Config.memory_budget: expected 'auto', int bytes, a float fraction in (0, 1] or None, got {mb!r}")
        if isinstance(mb, float) and not (0.0 < mb <= 1.0):
            raise ValueError(f"Config.memory_budget: a float is a fraction of device memory and must be in (0, 1], got {mb!r}")
        if isinstance(mb, int) and mb <= 0:
            raise ValueError(f"Config.memory_budget: int bytes must be > 0, got {mb!r}")
        if not self.rank_agreement_timeout > 0 or self.rank_agreement_timeout == float("inf"):
            raise ValueError(f"Config.rank_agreement_timeout: must be a finite number of seconds > 0, "
                             f"got {self.rank_agreement_timeout!r}")
        for name in ("min_piece_nodes", "max_captures", "loss_chunk_tokens", "region_min_nodes", "region_auto_min"):
            if getattr(self, name) < 1:
                raise ValueError(f"Config.{name}: must be >= 1, got {getattr(self, name)}")
        for op in self.split_ops:
            if not op.strip() or any(c.isspace() for c in op):
                raise ValueError(f"Config.split_ops: invalid op name {op!r}; use e.g. 'aten.nonzero' or 'aten::nonzero.default'")
        from graphcomp.compiler.pipeline import registered_passes

        valid = registered_passes()
        unknown = sorted(set(self.passes) - set(valid))
        if unknown:
            raise ValueError(
                f"Config.passes: unknown pass name(s) {unknown}; valid passes: {sorted(valid)}"
            )

        if self.cudagraphs == "require":
            off = [p for p in ("cudagraphs", "partition_graph") if p in valid and self.passes.get(p) is False]
            if off:
                raise ValueError(
                    f"Config.cudagraphs: 'require' conflicts with passes={{{', '.join(repr(p) + ': False' for p in off)}}}; "
                    "valid: cudagraphs='off' (or 'auto') with the pass disabled, or enable the pass"
                )

    def pass_enabled(self, name: str) -> bool:
        from graphcomp.compiler.pipeline import get_pass

        return self.passes.get(name, get_pass(name).default)

    def to_json(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v if isinstance(v, (bool, int, float, str, dict, list, type(None))) else repr(v)
        return out


def field_docs() -> dict[str, str]:
    """Field name -> docstring (the string literal under the field), for the
    README table and ``graphcomp inspect``."""
    import ast
    import inspect

    src = inspect.getsource(Config)
    tree = ast.parse(src)
    cls = tree.body[0]
    docs: dict[str, str] = {}
    body = cls.body  # type: ignore[attr-defined]
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and i + 1 < len(body):
            nxt = body[i + 1]
            if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check_type(name: str, value: Any, tp: Any) -> None:
    """Minimal runtime type check for the annotation forms Config uses."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if value not in args:
            raise ValueError(f"Config.{name}: invalid value {value!r}; valid values: {list(args)}")
        return
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        errors = []
        for a in args:
            try:
                _check_type(name, value, a)
                return
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(
            f"Config.{name}: {value!r} does not match {' | '.join(_type_name(a) for a in args)}"
        )
    if tp is type(None):
        if value is not None:
            raise ValueError(f"Config.{name}: expected None, got {value!r}")
        return
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"Config.{name}: expected a list, got {type(value).__name__} {value!r}")
        (et,) = args
        for i, v in enumerate(value):
            _check_type(f"{name}[{i}]", v, et)
        return
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"Config.{name}: expected a mapping, got {type(value).__name__} {value!r}")
        kt, vt = args
        for k, v in value.items():
            _check_type(f"{name}[{k!r}] key", k, kt)
            _check_type(f"{name}[{k!r}]", v, vt)
        return
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"Config.{name}: expected bool, got {type(value).__name__} {value!r}")
        return
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"Config.{name}: expected int, got {type(value).__name__} {value!r}")
        return
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"Config.{name}: expected a number, got {type(value).__name__} {value!r}")
        return
    if isinstance(tp, type):
        if not isinstance(value, tp):
            raise ValueError(f"Config.{name}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
        return
    raise TypeError(f"Config.{name}: unsupported annotation {tp!r} (graphcomp bug)")
