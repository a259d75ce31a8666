"""Every private torch API graphcomp touches, in one place, with version checks.

graphcomp runs on torch 2.11 and 2.13. When a private API moves, this package is
the only place to change. Everything else imports from here.

This module is a flat list of small adapters, each with its version notes; it
imports nothing of graphcomp but its own topic modules, re-exported here:
``remat`` (checkpoint tags, flops), ``collectives`` (collectives recorded, not run,
during a CUDA-graph warm-up), ``gloo`` (gloo process groups) and ``fp8`` (the scaled
matmul, FX node annotations).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- FX
def print_readable(gm: fx.GraphModule) -> str:
    try:
        return gm.print_readable(print_output=False, include_stride=True, include_device=True)
    except TypeError:  # older signature
        return gm.print_readable(print_output=False)


# ---------------------------------------------------------------- structured trace
def trace_artifact(name: str, text: str | Callable[[], str]) -> None:
    """Emit a string artifact to torch's structured trace (``TORCH_TRACE``)."""
    try:
        from torch._logging import trace_structured
    except ImportError:  # pragma: no cover
        return
    payload = text if callable(text) else (lambda: text)
    trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": "string"}, payload_fn=payload)


GRAPH_ARTIFACT = "graphcomp_graphs"
"""torch.compile logging artifact carrying graphcomp's graphs (see :func:`graph_logger`)."""


@functools.lru_cache(None)
def graph_logger() -> logging.Logger:
    """The logger graphcomp's stage and pass-output graphs go to, at DEBUG.

    It is torch's artifact logger ``graphcomp_graphs`` (registered here, at import
    of graphcomp), a child of the ``graphcomp`` logger. ``TORCH_LOGS="+graphcomp"``
    (the module-name form of ``TORCH_LOGS``) shows graphcomp's DEBUG logs and the
    graphs with torch's formatting; ``TORCH_LOGS="graphcomp"`` only its INFO logs.
    In a program: ``torch._logging.set_logs(modules={"graphcomp": logging.INFO,
    "graphcomp_graphs": True})`` (the ``graphcomp`` entry gives the logger torch's
    handler). ``TORCH_LOGS="graphcomp_graphs"`` cannot work: torch parses
    ``TORCH_LOGS`` while it is imported, before graphcomp can register the name,
    and rejects unknown names. Where the registration API is missing, a plain
    ``graphcomp.graphs`` logger is used."""
    try:
        from torch._logging import getArtifactLogger
        from torch._logging._internal import log_registry, register_artifact

        if not log_registry.is_artifact(GRAPH_ARTIFACT):
            register_artifact(GRAPH_ARTIFACT, "graphcomp's stage graphs and the output of every graphcomp pass")
        return getArtifactLogger("graphcomp", GRAPH_ARTIFACT)
    except Exception as e:  # pragma: no cover - a torch without the artifact registry
        log.debug("torch artifact logging unavailable (%s); graphs go to the 'graphcomp.graphs' logger", e)
        return logging.getLogger("graphcomp.graphs")


def log_graph(name: str, gm: fx.GraphModule) -> None:
    """Hand one graphcomp graph to the tools that collect torch.compile's graphs.

    ``torch._dynamo.utils.lazy_format_graph_code`` is what torch calls for each of
    its own graphs (Dynamo's, AOTAutograd's forward/backward); ``depyf.prepare_debug``
    replaces that function's code to write every graph it is given into its dump
    directory as ``__compiled_fn_<N>.<name>.<k>.py``. The formatted text then goes to
    :func:`graph_logger` (TORCH_LOGS). Formatting is lazy: without depyf and with the
    logger off this costs one object. A failure here never fails the compile."""
    try:
        from torch._dynamo.utils import lazy_format_graph_code

        text = lazy_format_graph_code(name, gm, include_stride=True, include_device=True)
    except Exception as e:
        log.warning("graphcomp could not hand graph %r to torch's graph logging (depyf, TORCH_LOGS): %s: %s",
                    name, type(e).__name__, e)
        return
    graph_logger().debug("%s", text)


def current_compile_id() -> str | None:
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
    except Exception:
        return None
    return None if cid is None else str(cid)


def dynamo_compile_id() -> tuple[int, int] | None:
    """Dynamo's (frame id, compile of that frame) for the frame being compiled: one
    frame id per code object in the order first compiled (``torch._dynamo.reset()``
    restarts them at 0), the second number counts its recompiles; None outside a
    Dynamo compile."""
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
    except Exception:
        return None
    if cid is None or getattr(cid, "frame_id", None) is None:
        return None
    return int(cid.frame_id), int(getattr(cid, "frame_compile_id", 0) or 0)


def dynamo_compile_context() -> Any:
    """The object standing for the Dynamo compile in progress (one per compile of a
    frame: the graphs of one frame split at graph breaks share it), or None."""
    try:
        from torch._guards import CompileContext

        return CompileContext.try_get()
    except Exception:
        return None


def is_recompile() -> bool:
    """True when Dynamo is compiling a frame it has compiled before (a guard failed)."""
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
        return cid is not None and getattr(cid, "frame_compile_id", 0) not in (0, None)
    except Exception:
        return False


# ------------------------------------------------------------------ FX
@contextlib.contextmanager
def lazy_graph_modules() -> Iterator[None]:
    """GraphModules built inside (``split_module``'s glue and pieces) generate their
    Python code only when first called or read (``torch.fx._lazy_graph_module``), and a
    later ``recompile()`` of them only marks the code stale. An eager recompile would
    regenerate a piece's code every time a pass rewrites it, several times per stage
    before the code first runs: slow for the backward of a deep model (thousands of
    nodes)."""
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:  # pragma: no cover (every supported torch has it)
        yield
        return
    with _use_lazy_graph_module(True):
        yield


def lazy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` as a lazy GraphModule over the same graph (its ``recompile()`` only marks
    the code stale; the code is generated when first called or read), or ``gm`` when it
    is one already. The partitioner's backward is a plain GraphModule, which
    regenerates its code after each pass that rewrites it (slow for a deep model's
    backward of thousands of nodes). Attributes the
    constructor does not carry (``meta``, ``shape_env``) are carried here."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # pragma: no cover
        return gm
    if isinstance(gm, _LazyGraphModule):
        return gm
    new = _LazyGraphModule(gm, gm.graph)
    new.meta = gm.meta
    new.shape_env = getattr(gm, "shape_env", None)
    return new


# ------------------------------------------------------------------ AOTAutograd
def aot_autograd(**kwargs: Any) -> Callable[..., Any]:
    from torch._dynamo.backends.common import aot_autograd as _aot

    return _aot(**kwargs)


def min_cut_partition(joint: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    kwargs.setdefault("compiler", "inductor")
    fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    _saved_tensors_before_opaque(fw, bw)
    return fw, bw


def _is_opaque_val(v: Any) -> bool:
    """A saved value AOTAutograd counts as an opaque object (not a tensor, not a symint)."""
    from torch._library.fake_class_registry import FakeScriptObject

    kinds: tuple[type, ...] = (torch.ScriptObject, FakeScriptObject)
    try:
        from torch._opaque_base import OpaqueBase  # torch 2.13
        kinds += (OpaqueBase,)
    except ImportError:  # torch 2.11: no opaque objects in graphs
        pass
    return isinstance(v, kinds)


def _saved_tensors_before_opaque(fw: fx.GraphModule, bw: fx.GraphModule) -> bool:
    """Work around torch 2.13's partitioner: with a recomputed random op (the
    attention of a ``torch.utils.checkpoint`` region) it appends the saved RNG
    states to the forward's outputs before the saved symints but after the saved
    opaque objects (a DTensor's ``DeviceMesh``, saved because the backward returns
    it with the gradients), while AOTAutograd slices the saved values as [tensors,
    opaque objects, symints]: the mesh lands among the tensors and the first forward
    fails in ``save_from_forward`` ("expected all tensors_saved_with_vc_check to be
    Tensors"). Moves such tensors before the first opaque object, in the forward's
    outputs and the backward's inputs alike, only when the backward's saved inputs
    mirror the forward's saved outputs position by position (type, and name apart
    from the RNG states); otherwise leaves both as they are. True when it moved any."""
    out_node = next(iter(fw.graph.find_nodes(op="output")))
    outs = list(out_node.args[0])
    phs = [n for n in bw.graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")]
    n = len(phs)
    if n == 0 or n > len(outs):
        return False
    saved = outs[len(outs) - n:]

    def kind(x: Any) -> str:
        v = x.meta.get("val") if isinstance(x, fx.Node) else None
        return "opaque" if _is_opaque_val(v) else "tensor" if isinstance(v, torch.Tensor) else "other"

    kinds = [kind(x) for x in saved]
    if "opaque" not in kinds:
        return False
    first = kinds.index("opaque")
    late = [i for i in range(first, n) if kinds[i] == "tensor"]
    if not late:
        return False
    for i, (x, ph) in enumerate(zip(saved, phs)):  # the backward mirrors the forward's saved values
        if kind(ph) != kinds[i] or (i not in late and isinstance(x, fx.Node) and x.name != ph.name):
            return False
    order = list(range(first)) + late + [i for i in range(first, n) if i not in late]
    fw.graph.output(tuple(outs[: len(outs) - n]) + tuple(saved[i] for i in order))
    fw.graph.erase_node(out_node)
    # the backward's inputs are its placeholders in graph order: put the saved ones first, reordered
    new_phs = [phs[i] for i in order]
    head = next(iter(bw.graph.nodes))
    if new_phs[0] is not head:
        head.prepend(new_phs[0])
    for prev, ph in zip(new_phs, new_phs[1:]):
        prev.append(ph)
    fw.recompile()
    bw.recompile()
    return True


def make_boxed_func(fn: Callable[..., Any]) -> Callable[..., Any]:
    from torch._functorch.aot_autograd import make_boxed_func as _mb

    return _mb(fn)


def is_joint_graph(gm: fx.GraphModule) -> bool:
    """AOTAutograd names the joint graph's cotangent inputs ``tangents_*``."""
    return any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes)


# -------------------------------------------------------------------- Inductor
def inductor_compile_fx(gm: fx.GraphModule, example_inputs: Sequence[Any], *, inner_compile: Callable[..., Any]) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, inner_compile=inner_compile)


def register_inductor_decompositions(table: dict[Any, Any]) -> None:
    """Add ``table`` to Inductor's own decomposition table (idempotent; ops already there
    are left alone). Passing ``decompositions=`` to ``compile_fx`` instead would make
    every compile bypass Inductor's FX-graph cache."""
    from torch._inductor import decomposition

    # select_decomp_table() returns a cached copy of the table (fast_random_decomps)
    # unless a fallback config is set: both get the entries
    for target in (decomposition.decompositions, decomposition.fast_random_decomps()):
        for op, fn in table.items():
            target.setdefault(op, fn)


def inductor_decompositions() -> dict[Any, Any]:
    """The decomposition table AOTAutograd traces Inductor's joint graphs with
    (``torch._inductor.decomposition.select_decomp_table()``, same in 2.11 and 2.13): a
    pass that traces new nodes into such a graph uses it too, or Inductor meets ops it
    only knows decomposed (``aten._to_copy``: "both a fallback and a decomp")."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def compile_fx_inner(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    from torch._inductor.compile_fx import compile_fx_inner as _inner

    return _inner(gm, example_inputs, **kwargs)


@contextlib.contextmanager
def inductor_memory_reorder(allow: bool, replaced: list[bool]) -> Iterator[None]:
    """Graphs Inductor compiles inside: its ``reorder_for_peak_memory`` scheduler pass
    off when not ``allow``; when allowed, ``replaced`` gets one bool per graph, True
    when the pass replaced the node order (it returns the scheduler's node list in a
    new order, or in the same one). The pass is looked up on ``torch._inductor.memory``
    when the scheduler runs, so wrapping the module attribute sees every call; a
    torch without it (or without the config key) leaves everything as it is."""
    import torch._inductor.config as iconfig

    if not allow:
        if hasattr(iconfig, "reorder_for_peak_memory"):
            with iconfig.patch({"reorder_for_peak_memory": False}):
                yield
        else:  # pragma: no cover - a torch without the pass
            yield
        return
    try:
        from torch._inductor import memory as imem

        orig = imem.reorder_for_peak_memory
    except (ImportError, AttributeError):  # pragma: no cover
        yield
        return

    def watched(nodes: Any, *args: Any, **kwargs: Any) -> Any:
        before = [id(n) for n in nodes]
        out = orig(nodes, *args, **kwargs)
        replaced.append([id(n) for n in out] != before)
        return out

    imem.reorder_for_peak_memory = watched
    try:
        yield
    finally:
        imem.reorder_for_peak_memory = orig


class _JointHook:
    """Adapter: Inductor calls ``joint_custom_pre_pass(graph)`` on the joint graph
    (training) or the forward graph (inference) before partitioning."""

    def __init__(self, fn: Callable[[fx.GraphModule], fx.GraphModule], uuid: str):
        self.fn = fn
        self._uuid = uuid

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        assert isinstance(gm, fx.GraphModule), "joint graph without an owning GraphModule"
        out = self.fn(gm)
        if out is not gm:  # a pass built a new module: move its graph and children over
            for name, child in out.named_children():
                setattr(gm, name, child)
            gm.graph = out.graph
            gm.recompile()

    def uuid(self) -> Any:
        return self._uuid


def make_joint_hook(fn: Callable[[fx.GraphModule], fx.GraphModule], uuid: str) -> Any:
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:  # pragma: no cover
        return _JointHook(fn, uuid)

    class JointHook(_JointHook, CustomGraphPass):  # type: ignore[misc]
        pass

    return JointHook(fn, uuid)


# Config.inductor_fusion_search="fast": Inductor settings for the graphs graphcomp compiles
FAST_FUSION_SEARCH = {"max_fusion_buffer_group_pairwise_attempts": 16, "loop_ordering_after_fusion": False}


@contextlib.contextmanager
def inductor_fusion_search(mode: str) -> Iterator[None]:
    """``"fast"``: :data:`FAST_FUSION_SEARCH` for the compiles inside (the settings this
    torch has); ``"inductor"``: nothing changed."""
    import torch._inductor.config as iconfig

    patch = {k: v for k, v in FAST_FUSION_SEARCH.items() if hasattr(iconfig, k)} if mode == "fast" else {}
    with iconfig.patch(patch):
        yield


@contextlib.contextmanager
def inductor_patches(joint_hook: Any, *, no_donated_buffers: bool = False) -> Iterator[None]:
    """Install our joint hook and switch off the AOTAutograd cache (a cache hit
    would skip our partition-time passes and our per-stage compile hook).

    ``no_donated_buffers``: AOTAutograd "donates" saved activations to the
    backward, and Inductor may then write into those input buffers. A CUDA-graph
    runner executes a piece several times on the same inputs (warm-up, capture,
    replay), so every run after the first would read clobbered inputs (wrong
    gradients from the first step on). Off when graphcomp captures.

    Inductor's partitioner is ``min_cut_rematerialization_partition`` followed by
    :func:`_saved_tensors_before_opaque` (``config.custom_partitioner_fn``, where
    this torch has it and the user set none), as the eager codegen's
    :func:`min_cut_partition`."""
    import torch._functorch.config as fconfig
    import torch._inductor.config as iconfig

    fpatches: dict[str, Any] = {}
    if hasattr(fconfig, "enable_autograd_cache"):
        fpatches["enable_autograd_cache"] = False
    if no_donated_buffers and hasattr(fconfig, "donated_buffer"):
        fpatches["donated_buffer"] = False
    ipatches: dict[str, Any] = {}
    if getattr(iconfig, "custom_partitioner_fn", "absent") is None:
        part = _ordered_partitioner()
        if part is not None:
            ipatches["custom_partitioner_fn"] = part
    with inductor_cache_key(joint_hook), fconfig.patch(fpatches), iconfig.patch(ipatches):
        yield


@functools.cache
def _ordered_partitioner() -> Any:
    """:func:`min_cut_partition` as Inductor's ``CustomPartitionerFn`` (one instance
    per process), or None where this torch has no such class."""
    try:
        from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files
    except ImportError:
        return None

    class OrderedPartitioner(CustomPartitionerFn):  # type: ignore[misc,valid-type]
        def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any
                     ) -> tuple[fx.GraphModule, fx.GraphModule]:
            return min_cut_partition(gm, joint_inputs, **kwargs)

        def uuid(self) -> Any:
            return get_hash_for_files((__file__,))

        def __reduce__(self) -> Any:
            # Inductor pickles its config (this object included) into the FX-graph
            # cache key: a local class cannot be pickled, which would bypass the cache
            # for every compile ("Failed to pickle cache key"). By reference instead.
            return (_ordered_partitioner, ())

    return OrderedPartitioner()


@contextlib.contextmanager
def inductor_cache_key(joint_hook: Any) -> Iterator[None]:
    """Keep our joint hook installed while a stage graph is compiled.

    Inductor's FX-graph cache hashes the installed custom passes' uuids into its
    key, but AOTAutograd compiles the backward lazily, at the first backward, long
    after ``inductor_patches`` has exited: without this the backward's key would
    carry no graphcomp id at all. That key also omits AOTAutograd's donated-buffer
    indices, so an identical backward once compiled with donation (by
    ``backend="inductor"``, or by graphcomp without CUDA graphs) would be served to
    a CUDA-graph piece, which runs several times on the same saved activations
    (wrong gradients, parameters drifting from the reference within a few steps).
    The hook never runs here: the joint passes ran before partitioning."""
    import torch._inductor.config as iconfig

    with iconfig.patch({"joint_custom_pre_pass": joint_hook}):
        yield


def inductor_decompositions() -> dict[Any, Any]:
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


# ------------------------------------------------------------ fake tensors / misc
def real_tensors() -> Any:
    """A context in which ops on real tensors run for real even while a compile's
    fake mode is active (``unset_fake_temporarily``, the same in 2.11 and 2.13)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def detect_fake_mode(inputs: Sequence[Any]) -> Any:
    from torch._guards import detect_fake_mode as _d

    return _d(inputs)


def skip_top_level_frames(*fns: Callable[..., Any]) -> None:
    """Dynamo never compiles these functions' frames, nor the frames they call,
    when they are called from eager code (they run as plain Python), but still
    inlines them while tracing a caller: a per-code-object frame strategy
    (``FrameExecStrategy(SKIP, SKIP)``; where that is not available, ``skip_code``:
    the frames they call are then compiled as usual), not a graph break."""
    codes = [getattr(fn, "__code__", fn) for fn in fns]
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        for code in codes:
            set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
        return
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - older/newer layouts
        pass
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:  # pragma: no cover
        return
    for code in codes:
        skip_code(code)


def has_mm_out_dtype() -> bool:
    """Whether this torch has ``aten::mm.dtype`` (bf16/fp16 x same -> fp32 product on
    CUDA; the ``fuse_grad_upcast`` pass)."""
    return "dtype" in torch.ops.aten.mm.overloads()


# ------------------------------------------------------ functional collectives
# graphcomp.sharding.shard traces parameter gathers and gradient reduce-scatters into the
# graph through the ``_c10d_functional`` ops (what Dynamo/AOTAutograd emit for
# torch.distributed._functional_collectives and what the graph passes match). The
# ops take the process-group *name* (a str), which Dynamo treats as a constant.
def funcol_all_gather(t: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    """All-gather ``t`` along dim 0 over the group: [c, *rest] -> [group_size*c, *rest]
    (``_c10d_functional.all_gather_into_tensor`` + ``wait_tensor``)."""
    out = torch.ops._c10d_functional.all_gather_into_tensor(t, group_size, group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def funcol_reduce_scatter_sum(t: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    """Sum-reduce-scatter ``t`` along dim 0: [group_size*c, *rest] -> [c, *rest]
    (``_c10d_functional.reduce_scatter_tensor`` + ``wait_tensor``)."""
    out = torch.ops._c10d_functional.reduce_scatter_tensor(t, "sum", group_size, group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def funcol_broadcast(t: torch.Tensor, src: int, group_name: str) -> torch.Tensor:
    """Broadcast ``t`` from group rank ``src`` (``_c10d_functional.broadcast``)."""
    out = torch.ops._c10d_functional.broadcast(t, src, group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def process_group_name(group: Any) -> str:
    """The registered name of a ProcessGroup (what the functional ops take)."""
    name = getattr(group, "group_name", None)
    if isinstance(name, str) and name:
        return name
    from torch.distributed.distributed_c10d import _get_process_group_name

    return _get_process_group_name(group)


# ------------------------------------------------------ gloo worker threads
# (one worker thread per gloo group: see the module's docstring) in graphcomp/_compat/gloo.py
from graphcomp._compat.gloo import gloo_timeout, gloo_worker_threads, group_by_name, group_is_live, new_gloo_group


# ------------------------------------------- CUDA-graph warm-up: collectives
# (a warm-up records collectives without running them): in graphcomp/_compat/collectives.py
from graphcomp._compat.collectives import collectives_not_run  # noqa: E402,F401

# --------------------------------------------------- activation-checkpoint tags
# (and flop formulas): in graphcomp/_compat/remat.py, re-exported here
from graphcomp._compat.remat import allow_side_effects_under_checkpoint, checkpoint_policy, clear_recompute, is_mutating, is_user_checkpoint, must_recompute, node_flops, recompute_is_deterministic

# ------------------------------------------------- FP8: scaled matmul, node annotations
# in graphcomp/_compat/fp8.py, re-exported here
from graphcomp._compat.fp8 import annotate as fx_annotate, annotations as fx_annotations  # noqa: E402,F401
from graphcomp._compat.fp8 import preserve_node_meta, scaled_mm  # noqa: E402,F401


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of a CUDA device (identical on every rank of one machine
    type), or None for other devices."""
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(device).total_memory)
    return None


# ------------------------------------------------------------------ CUDA graphs
def storage_handle(t: torch.Tensor) -> int:
    """An integer naming ``t``'s StorageImpl, valid while a tensor on it is held
    (for :func:`storage_refs`, which the runner calls before every replay)."""
    return int(t.untyped_storage()._cdata)


def storage_refs(handle: int) -> int:
    """How many TensorImpls share the storage ``handle`` (from :func:`storage_handle`)
    names (cudagraph trees use the same private call to detect live outputs)."""
    return int(torch._C._storage_Use_Count(handle))


def storage_weakref(t: torch.Tensor) -> Any:
    """A weak reference to ``t``'s StorageImpl (``.expired()`` once no tensor or
    storage object holds it); does not keep the memory alive."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def pool_storage(ptr: int, nbytes: int, device: torch.device) -> Any:
    """A storage over ``nbytes`` of graphcomp's CUDA-graph pool at ``ptr`` that
    frees nothing when it dies (the same private constructor cudagraph trees use for
    replayed outputs). Its ``_cdata`` is a handle for :func:`storage_refs`: 1 while
    only this object holds it, one more per tensor built on it."""
    return torch._C._construct_storage_from_data_pointer(ptr, device, nbytes)


def pool_views(st: Any, device: torch.device, views: Sequence[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """One tensor on storage ``st`` (from :func:`pool_storage`) per
    ``(storage_offset, size, stride, dtype)`` in ``views`` (offsets in elements of
    that dtype)."""
    return [torch.empty((0,), dtype=dt, device=device).set_(st, off, size, stride) for off, size, stride, dt in views]


def pin_pool(device_index: int, pool: Any) -> None:
    """Keep a CUDA-graph memory pool from being freed after its graphs are reset
    (its free blocks would go back to the device on ``empty_cache``) while tensors
    built by :func:`pool_views` still point into it: one more use of the pool
    that routes no allocation to it.

    torch 2.13's ``_cuda_beginAllocateToPool`` takes a stream filter (ours accepts
    no stream); torch 2.11's takes none (it routes the allocations of the current
    thread or stream), and there the thread-routing binding, with no allocation
    between begin and end, does the same. The first form that this torch accepts
    is remembered."""
    global _PIN_FORM
    C = torch._C
    if _PIN_FORM in (None, "filter"):
        try:
            C._cuda_beginAllocateToPool(device_index, pool, lambda _stream: False)
            _PIN_FORM = "filter"
        except TypeError:  # pybind rejects the arguments before any side effect
            if _PIN_FORM == "filter":
                raise
            _PIN_FORM = "thread" if hasattr(C, "_cuda_beginAllocateCurrentThreadToPool") else "plain"
    if _PIN_FORM == "thread":
        C._cuda_beginAllocateCurrentThreadToPool(device_index, pool)
    elif _PIN_FORM == "plain":
        C._cuda_beginAllocateToPool(device_index, pool)
    C._cuda_endAllocateToPool(device_index, pool)


_PIN_FORM: str | None = None


def unpin_pool(device_index: int, pool: Any) -> None:
    """Undo :func:`pin_pool`."""
    torch._C._cuda_releasePool(device_index, pool)


def boxed_false() -> Any:
    """``BoxedBool(False)``: the ``cudagraphs`` kwarg that keeps Inductor from
    capturing CUDA graphs itself (graphcomp's runners own capture)."""
    from torch._inductor.utils import BoxedBool

    return BoxedBool(False)


def compile_fx_inner_filtered(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """``compile_fx_inner`` with only the kwargs this torch version knows."""
    from torch._inductor import compile_fx as _cfx

    known = set(getattr(_cfx, "_CompileFxKwargs", type("K", (), {"__annotations__": {}})).__annotations__)
    known |= set(inspect.signature(_cfx.compile_fx_inner).parameters)
    kwargs = {k: v for k, v in kwargs.items() if k in known or not known}
    return _cfx.compile_fx_inner(gm, example_inputs, **kwargs)


def _fw_metadata_attr(name: str) -> Any:
    """An attribute of AOTAutograd's ``fw_metadata`` in the current TracingContext,
    or None outside one."""
    try:
        from torch._guards import TracingContext

        tc = TracingContext.try_get()
        md = getattr(tc, "fw_metadata", None) if tc is not None else None
        return getattr(md, name, None)
    except Exception:
        return None


def fw_static_input_indices() -> list[int] | None:
    """AOT's ``fw_metadata.static_input_indices`` (parameters, buffers), or None."""
    idx = _fw_metadata_attr("static_input_indices")
    return list(idx) if idx is not None else None


def fw_num_user_outputs() -> int | None:
    """Number of forward outputs handed back to user code (mutated inputs + user
    outputs: ``fw_metadata.num_forward_returns``), or None outside AOTAutograd."""
    n = _fw_metadata_attr("num_forward_returns")
    return int(n) if n is not None else None


def count_tangents(gm: fx.GraphModule) -> int:
    """Leading backward-graph inputs that are not tangents (saved tensors)."""
    from torch._inductor.utils import count_tangents as _ct

    return _ct(gm)


@contextlib.contextmanager
def nested_tracing_context(fake_mode: Any) -> Iterator[Any]:
    """A fresh TracingContext (so compiling a piece does not append to the outer
    graph's output-stride report); yields it."""
    from torch._guards import TracingContext, tracing

    outer = TracingContext.try_get()
    tc = TracingContext(fake_mode)
    if outer is not None and getattr(outer, "fw_metadata", None) is not None:
        tc.fw_metadata = outer.fw_metadata
    with tracing(tc):
        yield tc


_DESTROY_WRAPPED = False
_BEFORE_DESTROY: list[Callable[[str | None], Any]] = []  # set by graphcomp.runtime (this module imports nothing of graphcomp)


def before_destroy_process_group(fn: Callable[[str | None], Any]) -> None:
    """Register ``fn`` to run before ``torch.distributed.destroy_process_group``
    once it is wrapped (:func:`wrap_destroy_process_group`): the runtime's teardown,
    and forgetting ``graphcomp.shard``'s group names. ``fn`` gets the name of the
    group being destroyed, or None when every group goes (the default group, or a
    group whose name could not be read)."""
    if fn not in _BEFORE_DESTROY:
        _BEFORE_DESTROY.append(fn)


def _destroyed_group_name(group: Any) -> str | None:
    """The name of the subgroup ``destroy_process_group(group)`` destroys; None for
    every group (``group`` None or the default group, or a name that cannot be read:
    the callbacks then forget everything, which is always safe)."""
    if group is None:
        return None
    try:
        import torch.distributed as dist

        if group is dist.GroupMember.WORLD:  # (what dist.group.WORLD returns)
            return None
        return process_group_name(group)
    except Exception:  # noqa: BLE001 (a group torch no longer knows: forget everything)
        return None


def wrap_destroy_process_group() -> bool:
    """Patch ``torch.distributed.destroy_process_group`` once so it runs the
    registered callbacks first (the runtime releases graphcomp's CUDA graphs: graphs
    holding NCCL work hang the destroy). Idempotent; returns True when the patch is
    (now) in place."""
    global _DESTROY_WRAPPED
    if _DESTROY_WRAPPED:
        return True
    try:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d_mod
    except ImportError:  # pragma: no cover
        return False
    orig = dist.destroy_process_group
    if getattr(orig, "_graphcomp_wrapped", False):
        _DESTROY_WRAPPED = True
        return True

    @functools.wraps(orig)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        name = _destroyed_group_name(args[0] if args else kwargs.get("group"))
        for fn in list(_BEFORE_DESTROY):
            fn(name)
        return orig(*args, **kwargs)

    destroy_process_group._graphcomp_wrapped = True  # type: ignore[attr-defined]
    dist.destroy_process_group = destroy_process_group
    if getattr(c10d_mod, "destroy_process_group", None) is orig:
        c10d_mod.destroy_process_group = destroy_process_group
    _DESTROY_WRAPPED = True
    return True


def mark_outputs_user_visible(gm: fx.GraphModule) -> None:
    """Make Inductor keep the traced strides of every output of ``gm``.

    Inductor keeps an output's strides only when its index is in the output node's
    ``user_visible_output_idxs`` (``_inductor/graph.py`` get_user_visible_output_strides,
    same in 2.11 and 2.13); other outputs may come back in any layout. A whole
    stage graph is safe without it (AOTAutograd re-strides the backward's inputs
    from the forward's reported strides), but a piece of a split graph feeds
    another piece compiled against the traced strides: a different layout there
    would be read wrongly."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    rets = out.args[0] if isinstance(out.args[0], (list, tuple)) else (out.args[0],)
    out.meta["user_visible_output_idxs"] = [i for i, r in enumerate(rets) if isinstance(r, fx.Node)]


# ------------------------------------------------------------- chunked LM loss
def has_fp32_out_addmm(t: torch.Tensor) -> bool:
    """True where ``aten::addmm.dtype_out`` (bf16/fp16 matrices, fp32 accumulator;
    torch >= 2.8, CUDA kernels only) can add a product into an fp32 tensor in place."""
    return t.device.type == "cuda" and hasattr(torch.ops.aten.addmm, "dtype_out")


def addmm_accumulate_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` in place, ``acc`` at least as wide as ``a`` and ``b``, the
    products summed in ``acc``'s dtype: one matmul with ``acc`` as its accumulator
    (same dtype; or bf16/fp16 into fp32 on CUDA), else (CPU) on copies of ``a`` and
    ``b`` in ``acc``'s dtype (exact: the upcast loses nothing)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16) and has_fp32_out_addmm(a):
        torch.ops.aten.addmm.dtype_out(acc, a, b, torch.float32, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def is_autocast_marker(node: fx.Node) -> str | None:
    """``"enter"`` / ``"exit"`` for the nodes Dynamo emits around a traced
    ``torch.autocast`` region (``torch.amp.autocast_mode._enter_autocast`` /
    ``_exit_autocast``, the same in 2.11 and 2.13), else None."""
    if node.op != "call_function":
        return None
    name = getattr(node.target, "__name__", "")
    mod = getattr(node.target, "__module__", "") or ""
    if "autocast" not in mod:
        return None
    return {"_enter_autocast": "enter", "_exit_autocast": "exit"}.get(name)


def autocast_enabled() -> list[str]:
    """Device types with autocast enabled in the calling thread (Dynamo traces the
    frame under this state, so its graph computes in the autocast dtypes)."""
    out = []
    for dev in ("cuda", "cpu"):
        try:
            if torch.is_autocast_enabled(dev):
                out.append(dev)
        except (TypeError, RuntimeError):  # pragma: no cover - device type unknown to this build
            pass
    return out

# -------------------------------------------------------------- optimizer capture
def cuda_graph_if_supported() -> bool:
    """Whether CUDA graphs can hold conditional (IF) nodes here: a CUDA >= 12.4
    build (not ROCm) whose ``torch.cuda.CUDAGraph`` has
    ``begin_capture_to_if_node`` (torch >= 2.7; used by ``torch.cond`` under capture)."""
    if getattr(torch.version, "hip", None) or not torch.version.cuda:
        return False
    try:
        major, minor = (int(x) for x in torch.version.cuda.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (12, 4) and hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")


@contextlib.contextmanager
def cuda_graph_if(graph: Any, pred: torch.Tensor) -> Iterator[None]:
    """While ``graph`` is being captured: the kernels issued in the block go into
    an IF node that runs at replay only while ``pred`` (a 0-dim bool CUDA tensor,
    read on the device at replay) is true."""
    graph.begin_capture_to_if_node(pred)
    try:
        yield
    finally:
        graph.end_capture_to_conditional_node()


def dtensor_local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (the same object every call, no autograd
    node: ``to_local()`` costs an autograd Function per call), or ``t`` itself."""
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


def optimizer_step_hooks(opt: Any) -> int:
    """How many step pre/post hooks would run in ``opt.step()`` (its own and the
    global ones registered with ``torch.optim.optimizer.register_optimizer_step_*_hook``),
    graphcomp's own (marked ``_graphcomp_own``: cheap checks, not part of the update) not counted."""
    from torch.optim import optimizer as _opt

    hooks = [*(getattr(opt, "_optimizer_step_pre_hooks", {}) or {}).values(),
             *(getattr(opt, "_optimizer_step_post_hooks", {}) or {}).values(),
             *(getattr(_opt, "_global_optimizer_pre_hooks", {}) or {}).values(),
             *(getattr(_opt, "_global_optimizer_post_hooks", {}) or {}).values()]
    return sum(not getattr(h, "_graphcomp_own", False) for h in hooks)  # (graphcomp's own checks run anyway)


def grads_of(params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """``[p.grad for p in params]`` without the ``__torch_function__`` dispatch a
    tensor subclass (DTensor) makes on each ``.grad`` read."""
    with torch._C.DisableTorchFunctionSubclass():
        return [p.grad for p in params]


def local_data_ptrs(tensors: Sequence[torch.Tensor | None]) -> tuple[int | None, ...]:
    """The data pointer of each tensor's local shard (a DTensor's ``_local_tensor``,
    else the tensor itself); None for None. One pass, for per-step address checks."""
    return tuple(None if t is None else getattr(t, "_local_tensor", t).data_ptr() for t in tensors)


# ------------------------------------------------------------ device meshes (2-D)
def root_mesh(mesh: Any) -> Any:
    """The mesh ``mesh`` was sliced from (``mesh2d["tp"]`` -> ``mesh2d``), or
    ``mesh`` itself. 2.13: ``DeviceMesh._get_root_mesh()``; older layouts kept the
    parent in ``_mesh_resources``."""
    get = getattr(mesh, "_get_root_mesh", None)
    if get is not None:
        return get()
    from torch.distributed.device_mesh import _mesh_resources  # pragma: no cover - older layouts

    return _mesh_resources.get_root_mesh(mesh)


def strided_shard(dim: int, split_factor: int) -> Any:
    """``_StridedShard(dim, split_factor=...)``: the placement of a dimension sharded
    *inside* the shards of a mesh dimension that comes after it (FSDP2 + TP's layout;
    ``torch.distributed.tensor.placement_types``, private in 2.11 and 2.13)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def is_strided_shard(p: Any) -> bool:
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover
        return False
    return isinstance(p, _StridedShard)


def default_store() -> Any:
    """The key-value store of the default process group (the rendezvous store), or
    None when there is none (no process group, or a backend without one)."""
    import torch.distributed.distributed_c10d as c10d

    try:
        return c10d._get_default_store()
    except Exception:  # noqa: BLE001 - not initialized, or no store
        return None


def group_ranks(group_name: str) -> list[int] | None:
    """The global ranks of the process group registered as ``group_name`` (what
    functional collectives name), or None when this process cannot resolve it."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    try:
        pg = c10d._resolve_process_group(group_name)
        return list(dist.get_process_group_ranks(pg))
    except Exception:  # noqa: BLE001 - a group of another process, or destroyed
        return None


def cuda_event(external: bool = False) -> Any:
    """``torch.cuda.Event(external=...)``; where this torch has no ``external`` flag, a
    plain event (inside a capture it then orders the graph's own streams only, and a
    wait outside the graph does not see it: callers record a plain event after the
    replay instead, see ``supports_external_events``)."""
    if external and supports_external_events():
        return torch.cuda.Event(external=True)
    return torch.cuda.Event()


def supports_external_events() -> bool:
    """Whether ``torch.cuda.Event`` takes ``external=True`` (event record nodes in graphs)."""
    import inspect

    try:
        return "external" in inspect.signature(torch.cuda.Event.__new__).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


def custom_op_tags(*tags: Any) -> dict[str, Any]:
    """``tags=`` for ``torch.library.custom_op`` where this torch takes it (and has
    every tag), else nothing."""
    import inspect

    if not all(t is not None for t in tags) or "tags" not in inspect.signature(torch.library.custom_op).parameters:
        return {}
    return {"tags": tags}


def group_backend(group_name: str) -> str | None:
    """The backend name (``"nccl"``, ``"gloo"``, ...) of the process group registered
    as ``group_name``, or None when this process cannot resolve it."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    try:
        return str(dist.get_backend(c10d._resolve_process_group(group_name))).lower()
    except Exception:  # noqa: BLE001 - a group of another process, destroyed, or a fake name
        return None


# ------------------------------------------------ fused optimizers' Meta kernels
# torch (2.11, 2.13) has Meta kernels for `_fused_adam_` / `_fused_adamw_` with a float
# lr only. A fused Adam/AdamW whose lr is a tensor (graphcomp's captured step makes it
# one) on DTensor parameters goes through DTensor's sharding propagation, which runs the
# op on fake tensors; without a Meta kernel FakeTensor's fallback materializes a real
# zero tensor for every parameter, gradient and state and runs the real kernel on them:
# a full extra copy of the optimizer's memory and a much slower first step, growing
# with the model. These ops are in place and return nothing, so their Meta kernel only
# checks that the arguments are lists; each is registered only where torch has none.
# (Fused SGD / Adagrad have no DTensor sharding rule at all in these versions: not here.)
_FUSED_INPLACE_OPS = ("_fused_adam_.tensor_lr", "_fused_adamw_.tensor_lr")
_FUSED_META_LIB: Any = None


def _fused_inplace_meta(*lists: Any, **_: Any) -> None:
    for t in lists:
        torch._check(isinstance(t, (list, tuple)), lambda: f"expected a tensor list, got {type(t).__name__}")


def register_fused_optimizer_meta() -> list[str]:
    """Register the Meta kernels above where torch lacks them (idempotent); returns the
    op names registered by this call."""
    global _FUSED_META_LIB
    added = []
    for name in _FUSED_INPLACE_OPS:
        base, _, overload = name.partition(".")
        if getattr(getattr(torch.ops.aten, base, None), overload or "default", None) is None:
            continue  # not in this torch
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Meta"):
            continue
        if _FUSED_META_LIB is None:
            _FUSED_META_LIB = torch.library.Library("aten", "IMPL", "Meta")  # kept alive: it owns the kernels
        _FUSED_META_LIB.impl(name, _fused_inplace_meta)
        added.append(name)
    if added:
        logging.getLogger("graphcomp").debug("registered Meta kernels for aten::%s", ", aten::".join(added))
    return added
