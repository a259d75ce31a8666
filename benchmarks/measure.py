"""Measurements: step timing, memory, bf16 matmul rate, profiler idle share, environment.

Step times on CUDA come from CUDA events recorded between steps (no host sync per
step, so a system's host overhead shows exactly as much as it stalls the GPU); on
CPU from ``time.perf_counter`` (CPU work is synchronous anyway).
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import logging
import os
import platform
import socket
import statistics
import subprocess
import time
from typing import Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

PEAK_BF16_FLOPS = 989e12
"""H100/H200 SXM dense bf16 peak (BENCHMARKS.md): the MFU denominator."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """``mark()`` before the first measured step and after every step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def times_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


# --------------------------------------------------------------------------- memory
def reset_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> tuple[float | None, float | None]:
    if device.type != "cuda":
        return None, None
    g = 1024**3
    return torch.cuda.max_memory_allocated(device) / g, torch.cuda.max_memory_reserved(device) / g


def free_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- collectives
def allreduce_floats(vals: list[float | None], op: str, device: torch.device) -> list[float | None]:
    """Element-wise max/min/mean across ranks; ``None`` stays ``None`` (every rank
    must pass ``None`` at the same positions, which holds for device-type facts)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return vals
    t = torch.tensor([0.0 if v is None else float(v) for v in vals], dtype=torch.float64, device=device)
    rop = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "mean": dist.ReduceOp.SUM}[op]
    dist.all_reduce(t, op=rop)
    if op == "mean":
        t /= dist.get_world_size()
    return [None if v is None else float(x) for v, x in zip(vals, t.tolist())]


# --------------------------------------------------------------------------- matmul rate
def bf16_matmul_tflops(device: torch.device, n: int = 8192, iters: int = 10) -> float | None:
    """Measured dense bf16 matmul rate (TFLOP/s) of this GPU: the MFU reference
    that the same run actually achieves. ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b, out=c)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        torch.mm(a, b, out=c)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end)
    del a, b, c
    torch.cuda.empty_cache()
    return 2 * n**3 * iters / (ms / 1e3) / 1e12


# --------------------------------------------------------------------------- profiler
def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


ANNOTATIONS = ("gpu_user_annotation", "user_annotation")
"""Kineto activity types that are not work on the GPU: ``gpu_user_annotation`` is a
``record_function`` range (FSDP2's, DeepSpeed's, torch.compile's) projected onto the
GPU timeline, which spans whole regions, gaps included. Counted as compute, those
ranges made eager systems look busy: graphcomp with CUDA graphs off showed 0.02%
exposed communication where its trace has 11 ms per W2 step (2 H200s, 6d7974a)."""


def _device_intervals(prof, device_type) -> list[tuple[float, float, str]]:
    """(start_us, end_us, name) of every kernel, copy and memset on ``device_type``
    (annotations left out: :data:`ANNOTATIONS`). Reads the raw Kineto events (cheap) rather than
    ``prof.events()``, which builds a full event tree."""
    try:
        out = []
        for e in prof.profiler.kineto_results.events():
            if e.device_type() == device_type and _is_gpu_work(e):
                s = e.start_ns() / 1e3
                out.append((s, s + e.duration_ns() / 1e3, e.name()))
        return out
    except AttributeError:  # older/newer private API: fall back to the public one
        return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type == device_type and not getattr(e, "is_user_annotation", False)]


def device_shares(ev: list[tuple[float, float, str]]) -> dict | None:
    """Shares of the span from the first to the last event (see :func:`gpu_idle_share`)
    from (start_us, end_us, name) work intervals; ``None`` for an empty span."""
    span = max(e for _, e, _ in ev) - min(s for s, _, _ in ev)
    if span <= 0:
        return None
    busy = _union_length([(s, e) for s, e, _ in ev])
    compute = _union_length([(s, e) for s, e, n in ev if "nccl" not in n.lower()])
    comm = _union_length([(s, e) for s, e, n in ev if "nccl" in n.lower()])
    return {"idle": 1.0 - busy / span, "compute_idle": 1.0 - compute / span, "comm": comm / span,
            "exposed_comm": (busy - compute) / span,  # time only NCCL kernels run
            "comm_overlapped": (1.0 - (busy - compute) / comm) if comm > 0 else None,
            "span_ms": span / 1e3}


def _is_gpu_work(event) -> bool:
    """Not an annotation range (an unknown activity type counts as work)."""
    ann = getattr(event, "is_user_annotation", None)
    if ann is not None and ann():
        return False
    kind = getattr(event, "activity_type", None)
    return kind is None or str(kind()) not in ANNOTATIONS


def gpu_idle_share(run_steps: Callable[[int], None], n_steps: int, device: torch.device,
                   trace_path: str | None = None) -> dict:
    """Profile ``n_steps`` extra steps (outside the timed window) and return, as shares
    of the span from the first to the last GPU event:

    * ``idle``: no GPU activity at all;
    * ``compute_idle``: no non-NCCL kernel running;
    * ``comm``: some NCCL kernel running;
    * ``exposed_comm``: an NCCL kernel running and no compute kernel (communication
      that nothing hides); ``comm_overlapped`` = 1 - exposed_comm / comm.

    ``trace_path``: also write the Chrome trace there (gzip when it ends in .gz).
    ``None`` values off CUDA."""
    out = {"idle": None, "compute_idle": None, "profiled_steps": n_steps, "gpu_events": 0, "error": None}
    if device.type != "cuda":
        out["error"] = "no CUDA device"
        return out
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    # CPU ops with shapes too: the collective calls give the bytes each dtype moved
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        run_steps(n_steps)
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out["collective_bytes_per_step"] = collective_bytes(prof, n_steps, world_size())
    ev = _device_intervals(prof, DeviceType.CUDA)
    out["gpu_events"] = len(ev)
    if not ev:
        out["error"] = "profiler saw no GPU events"
        return out
    shares = device_shares(ev)
    if shares is None:
        out["error"] = "empty GPU span"
        return out
    out.update(shares)
    if trace_path:
        try:
            _export_trace(prof, trace_path)
            out["trace"] = os.path.basename(trace_path)
        except Exception as e:  # noqa: BLE001 - a trace is extra; never lose the numbers
            out["trace_error"] = f"{type(e).__name__}: {e}"
    out["analysis_s"] = time.perf_counter() - t0
    return out


def _export_trace(prof, path: str) -> None:
    if not path.endswith(".gz"):
        prof.export_chrome_trace(path)
        return
    import gzip
    import shutil
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        raw = tmp.name
    try:
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    finally:
        os.unlink(raw)


_DTYPE_NAMES = {"c10::BFloat16": "bfloat16", "c10::Half": "float16", "float": "float32", "double": "float64"}
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
# op name -> (kind, index of the input tensor, multiply input bytes by world size?)
_COLLECTIVE_EVENTS = {
    "_c10d_functional::all_gather_into_tensor": ("all_gather", 0, True),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", 0, False),
    "c10d::_allgather_base_": ("all_gather", 1, True),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1, False),
}
# Not counted: the grouped collectives of zero_copy_buckets (``*_coalesced``). The
# profiler records no shapes for a tensor-list argument (torch 2.13: ``[]`` with
# dtype "TensorList"), so their bytes come from graphcomp's graph count only.


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def collective_bytes(prof, n_steps: int, world: int) -> dict[str, float]:
    """Bytes per step moved by all-gathers (gathered output bytes) and reduce-scatters
    (input bytes), by dtype, read from the profiled collective calls' recorded input
    shapes and dtypes, e.g. ``{"all_gather:bfloat16": 1.2e8}``. This confirms, from a
    trace, the bytes graphcomp counts from its graphs."""
    acc: dict[str, float] = {}
    try:
        events = [(e.name(), e.shapes(), e.dtypes()) for e in prof.profiler.kineto_results.events()]
    except AttributeError:
        events = [(e.name, e.input_shapes, getattr(e, "input_types", [])) for e in prof.events()]
    for name, shapes, dtypes in events:
        spec = _COLLECTIVE_EVENTS.get(name)
        if spec is None or len(shapes) <= spec[1] or len(dtypes) <= spec[1]:
            continue
        kind, i, times_world = spec
        dt = _DTYPE_NAMES.get(dtypes[i], dtypes[i])
        numel = 1
        for d in shapes[i]:
            numel *= d
        b = numel * _ITEMSIZE.get(dt, 0) * (world if times_world else 1)
        acc[f"{kind}:{dt}"] = acc.get(f"{kind}:{dt}", 0.0) + b / max(n_steps, 1)
    return acc


# --------------------------------------------------------------------------- dynamo stats
def dynamo_stats() -> dict[str, int]:
    """Cumulative Dynamo counters (diff two snapshots for one system)."""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001
        return {}
    return {
        "graphs": int(counters["stats"].get("unique_graphs", 0)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


def compile_phase_seconds() -> dict[str, float]:
    """Cumulative seconds per timed compile phase of this process (Dynamo's
    ``dynamo_timed`` regions: tracing, AOTAutograd, Inductor lowering, codegen,
    waiting for Triton's compile workers, ...), by phase name; diff two snapshots
    for one system's first step. Nested phases overlap (a sum is not a total)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except Exception:  # noqa: BLE001
        return {}
    return {k: float(sum(v)) for k, v in dict(compilation_time_metrics).items()}


def graphcomp_pass_seconds() -> dict[str, float]:
    """Seconds graphcomp's passes took so far in this process, per pass (all frames and
    stages), plus the collective verifier's (``verify``), the compile-time rank
    agreement's (``rank_agreement``), the frames' recorded compile seconds
    (``frame_compile``) and the CUDA-graph pieces' capture calls (host seconds:
    ``cudagraph_warmup``, ``cudagraph_trial_capture``, ``cudagraph_capture``, outside
    Dynamo's timers); {} without graphcomp."""
    try:
        from graphcomp.session import SESSION
    except Exception:  # noqa: BLE001
        return {}
    out: dict[str, float] = {}
    for f in SESSION.frames.to_json():
        out["frame_compile"] = out.get("frame_compile", 0.0) + float(f.get("compile_seconds") or 0.0)
        for st in f.get("stages", {}).values():
            out["rank_agreement"] = out.get("rank_agreement", 0.0) + float(st.get("rank_agreement_seconds") or 0.0)
            for part in st.get("partitions", []):  # the CUDA-graph runners' capture calls (host seconds)
                for phase, sec in (part.get("capture_seconds") or {}).items():
                    out[f"cudagraph_{phase}"] = out.get(f"cudagraph_{phase}", 0.0) + float(sec)
            for r in st.get("passes", []):
                out[r["name"]] = out.get(r["name"], 0.0) + float(r.get("seconds", 0.0))
                out["verify"] = out.get("verify", 0.0) + float(r.get("verify_seconds", 0.0))
    return out


# --------------------------------------------------------------------------- environment
def _pkg_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(args: list[str], cwd: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.machine()} CPU ({os.cpu_count()} cores)"


def environment(device: torch.device, world: int) -> dict:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = os.environ.get("BENCH_GIT_COMMIT") or _git(["rev-parse", "HEAD"], repo)
    dirty = _git(["status", "--porcelain", "--untracked-files=no"], repo)
    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit,
        "git_dirty": None if dirty is None else bool(dirty),
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": None,
        "device_type": device.type,
        "device_name": _cpu_name(),
        "device_count": 0,
        "world_size": world,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "deepspeed": _pkg_version("deepspeed"),
        "graphcomp": _pkg_version("graphcomp"),
        "peak_bf16_tflops_assumed": PEAK_BF16_FLOPS / 1e12,
        "matmul_bf16_tflops_measured": None,
        "env_vars": {k: os.environ.get(k) for k in (
            "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
            "NCCL_GRAPH_REGISTER", "PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS")},
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["device_count"] = torch.cuda.device_count()
        try:
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # noqa: BLE001
            log.warning("NCCL version unavailable: %s", e)
    return env
