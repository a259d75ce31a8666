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

# The fields by concern: how the reference (docs/options.md) presents them. Users pass
# the flat keys; every field is in exactly one group (tests/cpu/unit/test_config.py).
GROUPS: dict[str, tuple[str, ...]] = {
    "Passes and code generation": ("passes", "codegen", "inductor_fusion_search", "inductor_memory_reorder"),
    "Communication": ("bucket_bytes", "reduce_bucket_bytes", "collective_bytes_per_s", "prefetch_bytes"),
    "Memory": ("memory_budget", "reshard_after_forward", "remat", "loss_chunk_tokens", "loss_chunk_kernels"),
    "CUDA graphs": ("cudagraphs", "split_ops", "min_piece_nodes", "max_captures", "check_static_inputs",
                    "on_address_change", "copy_outputs"),
    "Compile time": ("compile_regions", "region_min_nodes", "region_auto_min", "compile_once", "cache_dir"),
    "Safety and debugging": ("rank_agreement", "rank_agreement_timeout", "verify_collectives", "debug", "dump_dir"),
}

NOT_IN_CODE = ("cache_dir", "compile_once", "dump_dir", "rank_agreement_timeout", "debug")
"""The fields that never change the code a graph compiles to: left out of the
compile cache's keys (:meth:`Config.code_json`)."""

AUTO_BUDGET_FRACTION = 0.9
"""``memory_budget="auto"``: this fraction of the CUDA device's total memory."""


@dataclass(kw_only=True)
class Config:
    passes: dict[str, bool] = field(default_factory=dict)
    """Per-pass enable flags, ``{pass_name: bool}``, over the registered passes
    (``graphcomp.compiler.pipeline.registered_passes()``). A pass not named keeps its
    default (see the pass table in the README). Unknown pass names are a ``ValueError``."""

    codegen: Codegen = "inductor"
    """How each stage graph (forward, backward, inference) becomes code after the
    passes: ``"inductor"`` (default) compiles it with TorchInductor; ``"eager"`` runs
    the FX graph as it is (to debug a pass without Inductor in the way)."""

    dump_dir: str | None = None
    """Directory for graph dumps: per rank, frame and stage, the readable graph
    before and after every pass plus a ``summary.json``; read them with
    ``graphcomp inspect DIR``. Defaults to ``$GRAPHCOMP_DUMP_DIR``; ``None`` writes
    nothing. Graphs also go to torch's structured trace (``TORCH_TRACE``) either way."""

    bucket_bytes: int = 64 * 2**20
    """Largest bucket of ``bucket_collectives``, in bytes on the wire (gathered output
    bytes for all-gathers, input bytes for reduce-scatters): consecutive collectives
    are packed until the next would pass it. Default 64 MiB. Larger buckets issue
    fewer, larger collectives but hold gathered parameters longer (a bucket is
    gathered at its first member's use); ``reduce_bucket_bytes`` sizes the
    reduce-scatters apart. Must be >= 0; 0 disables bucketing."""

    reduce_bucket_bytes: int | None = None
    """Largest bucket of gradient reduce-scatters for ``bucket_collectives``, in input
    bytes; ``None`` (default) uses ``bucket_bytes``. A larger reduce-scatter bucket
    only holds one packed send buffer a little longer, while a larger gather bucket
    holds gathered parameters earlier: raise this alone for fewer, larger
    reduce-scatters at no cost in gathered memory. Must be >= 0; 0 disables
    reduce-scatter bucketing only."""

    collective_bytes_per_s: float | None = None
    """The collective bus bandwidth the cost model assumes (bytes per second; a ring
    collective moves ``(W-1)/W`` of its input): how much weight-gradient compute
    ``defer_weight_grads`` defers to cover the last reduce-scatter, and which gathers
    ``schedule_free`` keeps. ``None`` (default): the device's row of
    ``graphcomp.analysis.cost_model`` (250e9 on H100 and H200, NVLink). Set a smaller
    value on a slower interconnect (PCIe, several nodes): more compute is deferred, for
    a little more memory. Must be a finite number > 0."""

    reshard_after_forward: bool | Literal["auto", "except_last"] = "auto"
    """Pass ``schedule_free``: whether gathered parameters are released after their
    last forward use and gathered again in backward. ``True``: release all (least
    memory, one more gather each); ``False``: keep all (most memory); ``"auto"``
    (default): keep those whose re-gather costs most per byte while the estimated
    peak fits ``memory_budget`` (no budget, the CPU default: release all), decided at
    a function's first compile, the same on every rank, and kept by its recompiles;
    ``"except_last"``: release all but the bucket the backward reads first (the last
    block's, at most ``bucket_bytes``), so the backward does not start by waiting for
    a gather."""

    memory_budget: int | float | Literal["auto"] | None = "auto"
    """Peak-memory budget of ``remat``, ``reshard_after_forward="auto"`` and
    ``schedule_prefetch``: ``int`` bytes, a ``float`` in (0, 1] of the CUDA device's
    memory (on a CPU graph a ValueError at compile time), or ``None`` (no budget).
    It bounds the static estimate of one graph's peak, which does not see memory
    held outside the compiled graphs. ``"auto"`` (default): ``AUTO_BUDGET_FRACTION``
    (0.9) of the device's memory on CUDA, none elsewhere, and room is left for the
    optimizer state (2x the parameter shards) and other frames' kept gathers; an
    explicit budget is used as given, so leave that room in it. A budget that even
    resharding everything does not fit logs a warning; every parameter is then
    resharded and prefetch is bounded by ``prefetch_bytes`` only."""

    remat: RematMode = "respect_user"
    """Pass ``remat``: what rematerialization under ``memory_budget`` may do with the
    user's ``torch.utils.checkpoint`` regions. ``"respect_user"`` (default): recompute
    them as written, and recompute other activations only while the joint graph's
    estimated peak is over the budget. ``"auto"``: treat them as candidates: save
    every activation that fits and recompute the cheapest per byte until the estimate
    is under the budget (faster when memory is left; it sees memory outside the
    graph only through the default budget's reserve). ``remat`` plans before
    ``schedule_free``: saved activations come before kept gathered parameters. Without
    a budget both modes leave every tag as it is; ``passes={"remat": False}`` turns
    the pass off."""

    inductor_memory_reorder: bool = False
    """``codegen="inductor"``: whether Inductor's ``reorder_for_peak_memory`` may
    reorder graphs that hold graphcomp's gathers and reduce-scatters. It lowers the
    estimated peak but knows nothing of communication: it can move prefetched gathers
    back next to their use and wait collectives right after issuing them, exposing
    them. ``False`` (default) keeps ``schedule_prefetch``'s order (as torchtitan's
    SimpleFSDP does), whose estimated peak is the one ``memory_budget`` plans with.
    Graphs without graphcomp's collectives are left to Inductor either way. With
    ``True`` each such graph counts ``inductor_memory_reorders`` (order replaced) or
    ``inductor_memory_orders_kept``."""

    prefetch_bytes: int = 128 * 2**20
    """Pass ``schedule_prefetch``: most bytes of all-gather outputs in flight (issued,
    not yet waited) at any point of a graph; gathers are issued early, in program
    order, up to this cap and ``memory_budget``. A gather larger than the cap (an
    embedding or LM-head table) is issued early only while the others in flight hold
    at most half of it. The cap also bounds reduce-scatter inputs in flight, not
    counting one larger than the cap. Default 128 MiB; more overlaps more
    communication for more memory. Must be >= 0; 0 disables prefetching (waits still
    sink to their first use)."""

    inductor_fusion_search: FusionSearch = "fast"
    """``codegen="inductor"``: how widely Inductor's scheduler searches for fusions in
    the graphs graphcomp compiles. ``"fast"`` (default) sets
    ``max_fusion_buffer_group_pairwise_attempts`` to 16 (Inductor's default: 64) and
    ``loop_ordering_after_fusion`` to False for those graphs only: in a deep model
    buffers read by every block (RoPE tables) pair nodes of different blocks that
    cannot fuse, so the wider search mostly adds cold-compile time, not fusions.
    ``"inductor"`` leaves both as Inductor (or the user) set them: use it if a kernel
    fusion is missing under ``"fast"``."""

    cudagraphs: CudaGraphsMode = "auto"
    """CUDA-graph capture of the forward/backward graphs (passes ``partition_graph``
    and ``cudagraphs``): ``"off"`` never captures; ``"auto"`` (default) cuts each
    graph at ops CUDA graphs cannot capture, captures the pieces that can be and runs
    the rest eagerly, logging each reason; ``"require"`` raises if any piece cannot
    be captured. Graphs without CUDA tensors are never split.
    ``passes={"cudagraphs": False}`` also turns capture off; with ``"require"`` it
    (or ``"partition_graph": False``) is a ``ValueError``."""

    split_ops: list[str] = field(default_factory=list)
    """Extra op names that always run outside CUDA graphs (a cut around each):
    ``"aten.nonzero"``, ``"aten.nonzero.default"``, ``"aten::nonzero"`` or a bare
    ``"nonzero"``; custom ops as ``"ns.op"``. Each entry must be a non-empty string
    without whitespace. Default: none."""

    min_piece_nodes: int = 3
    """A capturable piece with fewer compute nodes than this (default 3) is not worth
    a CUDA graph (its launch savings are below the replay overhead): it joins its
    eager neighbours. Must be >= 1."""

    compile_regions: bool | Literal["auto"] = "auto"
    """Regional compilation (pass ``partition_graph``, Inductor codegen only): cut the
    forward and backward graphs into regions near block boundaries (at least
    ``region_min_nodes`` compute nodes each, about one per transformer block, cut
    where the fewest bytes cross) and compile each distinct
    region once, reused by regions with the same graph and input shapes, strides and
    dtypes. Cuts the cold compile of deep models. With CUDA graphs the regions run
    in order inside their piece, captured whole; without, each is its own eager piece.
    ``"auto"`` (default): on for a captured, Inductor-compiled, static-shape stage
    graph that cuts into at least ``region_auto_min`` regions, except a piece whose
    regions mostly differ (compiled whole); ``True``: always; ``False``: never.
    Counters ``regions*``, ``region_cuts_in_flight``,
    ``region_pieces_compiled_whole``; ``GRAPHCOMP_LOG=INFO`` logs the decisions."""

    region_min_nodes: int = 64
    """``compile_regions``: the fewest compute nodes a region holds before the next
    cut (smaller regions merge with the next). Default 64. Must be >= 1."""

    region_auto_min: int = 16
    """``compile_regions="auto"``: the fewest regions a stage graph must cut into for
    regional compilation to be used (a transformer of N blocks cuts into about N + 1).
    Default 16. Must be >= 1."""

    compile_once: bool = True
    """Compile each stage graph once per job (default on): a leader runs Inductor and
    the ranks whose graph is the same load its compiled artifacts (through the default
    process group's store) instead; a rank whose graph differs compiles its own
    (logged). On CPU rank 0 leads every rank. Inductor's GPU code names its device, so
    on GPUs rank ``i`` leads the ranks on device ``i`` of the other machines, and a
    single machine shares nothing. Needs a torch that can record cache artifacts;
    Inductor codegen only. ``False``: every rank compiles."""

    cache_dir: str | None = None
    """Directory of the compile cache kept across runs: one checksummed file per
    compiled stage graph, keyed by the graph, its inputs, this config, graphcomp's
    source, torch and Triton versions, the device and the world size. Point every
    run of a job at it (it can be copied to machines of the same kind); a second run
    skips Inductor's code generation. Inductor's own cache (C++ kernels, Triton's
    cache) moves to ``<cache_dir>/inductor`` unless ``TORCHINDUCTOR_CACHE_DIR`` is set.
    A corrupt entry is ignored with a warning. Defaults to ``$GRAPHCOMP_CACHE_DIR``;
    ``None``: no such directory (Inductor's own local cache still applies)."""

    max_captures: int = 8
    """CUDA graphs per piece: one capture per input-shape signature (shapes, strides,
    dtypes and scalar values of the inputs), up to this many (default 8); a piece
    seen with more signatures runs eagerly with a warning. Must be >= 1."""

    check_static_inputs: StaticCheck = "first"
    """When static inputs (parameters, buffers) of a captured piece are checked for a
    changed address: ``"first"`` (default) on the first replay of each capture,
    ``"always"`` on every replay (a few microseconds per piece). Saved activations
    and outputs of other captured pieces are checked on every replay regardless."""

    on_address_change: AddressChange = "error"
    """What a changed parameter/buffer address does: ``"error"`` (default) raises
    naming the input and the fix (keep parameters in place: ``copy_`` into them, never
    reassign ``.data``); ``"recapture"`` captures the piece again (counted in
    ``graphcomp.counters['recaptures']``)."""

    copy_outputs: OutputCopy = "auto"
    """How captured pieces hand out what leaves graphcomp from the shared CUDA-graph
    pool, which later replays overwrite: gradients bound for ``param.grad`` and forward
    outputs over 1 MiB (logits, tensors crossing a graph break). ``"always"``: copy them
    out after every replay (their size in memory, a copy per step). ``"auto"``
    (default): hand them out uncopied; before each replay graphcomp checks that nothing
    it would overwrite is still referenced. When one is (gradient accumulation,
    ``zero_grad(set_to_none=False)``, a kept output), its piece copies it from then on
    and the piece about to replay is captured again (``hazard_recaptures``). Forward
    outputs up to 1 MiB (loss, metrics) are always copied
    (``graphcomp.compiler.codegen.FORWARD_COPY_BELOW``)."""

    loss_chunk_tokens: int = 1024
    """Pass ``chunk_lm_loss``: rows (tokens) per chunk of the chunked language-model
    loss (default 1024). Each chunk holds at most two ``[loss_chunk_tokens, vocab]``
    buffers at once instead of the whole ``[tokens, vocab]`` logits in fp32 and their
    gradient; a linear head's fp32 weight gradient is summed over the chunks. Smaller
    chunks use less memory but launch more, smaller kernels. Must be >= 1."""

    loss_chunk_kernels: LossKernels = "inductor"
    """Pass ``chunk_lm_loss``: how each chunk's softmax and gradient arithmetic runs
    on CUDA. ``"inductor"`` (default): one function compiled by Inductor at its first
    call (a row reduction and one elementwise pass, holding only the chunk's logits
    and gradient); ``"eager"``: about six eager kernels per chunk, each reading and
    writing the chunk in fp32. Other devices always run it eagerly."""

    rank_agreement: bool = True
    """Compile-time rank agreement (default on): after the passes, each rank publishes
    the collective sequence its graph will issue on each process group (kind, dtype,
    bytes, order, bucketing and scheduling decisions, source line) through the default
    group's store and compares it with the other members'. A mismatch raises
    ``graphcomp.errors.RankDivergence`` on every rank, naming the first differing
    collective and its source line, instead of hanging until the process-group
    timeout. Frames without collectives and single-rank groups are not checked."""

    rank_agreement_timeout: float = 60.0
    """Seconds (default 60) a rank waits for the other members of a group to publish
    their collective sequence (compile-time agreement, and the eager per-gather check
    of ``GRAPHCOMP_DEBUG=1``). A rank that never compiles the matching graph (it took
    another path, recompiled alone, or died) turns into a ``RankDivergence`` after
    this long. Must be > 0; keep it above the slowest rank's compile time."""

    verify_collectives: bool | Literal["debug"] = True
    """The collective verifier: after every pass, check against the graph before it
    that each parameter is still gathered as often, on the same group, in its dtype
    or the dtype it is cast to right after (fused downcast), and each gradient is
    reduce-scattered exactly once in the same dtype and group (fused and bucketed
    forms included); a violation raises ``graphcomp.errors.CollectiveVerifyError``
    naming the pass. ``True`` (default): always; ``"debug"``: only with ``debug``;
    ``False``: never."""

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

    def code_json(self) -> dict[str, Any]:
        """:meth:`to_json` without the fields that never change compiled code
        (``NOT_IN_CODE``): what the compile cache's keys hash."""
        return {k: v for k, v in self.to_json().items() if k not in NOT_IN_CODE}


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
