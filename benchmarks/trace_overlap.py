"""How much of each collective's kernel time overlaps compute, from a Chrome trace.

    python -m benchmarks.trace_overlap benchmarks/results/<run>-graphcomp.trace.json.gz [...]
    python -m benchmarks.trace_overlap --exposed [--min-us 100] TRACE.json.gz

Reads the GPU kernel events of a trace written by ``benchmarks.run --trace`` and
prints, per collective kind (AllGather, ReduceScatter, AllReduce), the number of
NCCL kernels, their total time and the share of that time during which a compute
(non-NCCL) kernel also runs. Issue 5 asks that a trace show gathers overlapping
compute: this is the number.

``--exposed`` lists, in time order, every NCCL kernel with at least ``--min-us``
microseconds during which no compute kernel runs (where a step waits for
communication), with its start (ms after the trace's first kernel), the exposed
and total time, and the last compute kernel that started before it: the
places a schedule leaves communication uncovered (W2 on 2 H200s, 873d921: the
forward's first gather, the LM-head gather, the head gradient's reduce-scatter
ahead of the backward's first gather, the last reduce-scatter).

``--kernels [--steps N] [--top K]`` sums the GPU time (kernels, copies, memsets)
per category (matmul, attention, Triton pointwise / reduction / template, ATen
elementwise and reductions, copies, optimizer, NCCL, other), divided by ``--steps``
(the trace's profiled steps: ``benchmarks.run`` profiles 3), with the GPU's busy
time (union of all its work) and the ``K`` kernels taking the most time: where a
GPU-bound step's time goes.
"""

from __future__ import annotations

import bisect
import gzip
import json
import sys

KINDS = ("AllGather", "ReduceScatter", "AllReduce")


def _merge(intervals: list[tuple[float, float]]) -> list[list[float]]:
    merged: list[list[float]] = []
    for s, t in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], t)
        else:
            merged.append([s, t])
    return merged


def _events(path: str, cats: tuple[str, ...]) -> list[dict]:
    """The trace's timed events of the categories ``cats``, by start."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return sorted((e for e in events if e.get("cat") in cats and "dur" in e), key=lambda e: e["ts"])


def _kernels(path: str) -> list[dict]:
    return _events(path, ("kernel",))


def _gpu_work(path: str) -> list[dict]:
    """Kernels, device copies and memsets, by start."""
    return _events(path, ("kernel", "gpu_memcpy", "gpu_memset"))


# (category, substrings of the lowercased name), first match wins
CATEGORIES = (
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_", "ampere_", "splitk")),
    ("copy", ("copyfunctor",)),  # a multi-tensor copy: graphcomp's bf16 pack of the shards (pack_cast)
    ("optimizer", ("multi_tensor_apply", "fused_adam", "adam")),
    ("triton pointwise", ("triton_poi",)),
    ("triton reduction", ("triton_red", "triton_per")),
    ("triton template", ("triton_tem",)),
    ("triton other", ("triton",)),
    ("copy", ("memcpy", "copy", "catarray", "cat_", "split_with_sizes", "chunk_cat")),
    ("memset", ("memset",)),
    ("aten reduction", ("reduce_kernel", "reduce")),
    ("aten elementwise", ("elementwise", "vectorized", "unrolled", "index", "scatter", "gather")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def kernel_breakdown(path: str, steps: int = 1) -> dict:
    """GPU time per category per step (ms), the busy time (union of all GPU work) and
    the per-name totals."""
    work = _gpu_work(path)
    by_cat: dict[str, list[float]] = {}
    by_name: dict[str, list[float]] = {}
    for e in work:
        c = by_cat.setdefault(category(e["name"]), [0, 0.0])
        c[0] += 1
        c[1] += e["dur"]
        n = by_name.setdefault(e["name"], [0, 0.0])
        n[0] += 1
        n[1] += e["dur"]
    busy = sum(t - s for s, t in _merge([(e["ts"], e["ts"] + e["dur"]) for e in work]))
    span = (max(e["ts"] + e["dur"] for e in work) - work[0]["ts"]) if work else 0.0
    per = 1e3 * steps
    return {"steps": steps, "busy_ms": busy / per, "span_ms": span / per,
            "categories": {k: {"count": v[0] / steps, "ms": v[1] / per}
                           for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1][1])},
            "names": {k: {"count": v[0] / steps, "ms": v[1] / per}
                      for k, v in sorted(by_name.items(), key=lambda kv: -kv[1][1])}}


def _is_nccl(e: dict) -> bool:
    return "nccl" in e["name"].lower()


def _coverage(kernels: list[dict]):
    """``covered(s, t)``: microseconds of [s, t) during which a compute kernel runs."""
    compute = _merge([(e["ts"], e["ts"] + e["dur"]) for e in kernels if not _is_nccl(e)])
    starts = [m[0] for m in compute]

    def covered(s: float, t: float) -> float:
        i, out = max(bisect.bisect_right(starts, s) - 1, 0), 0.0
        while i < len(compute) and compute[i][0] < t:
            out += max(0.0, min(t, compute[i][1]) - max(s, compute[i][0]))
            i += 1
        return out

    return covered


def exposed_kernels(path: str, min_us: float = 100.0) -> list[dict]:
    """NCCL kernels with at least ``min_us`` of their time under no compute kernel, in
    time order: start (ms after the first kernel), exposed and total ms, the stream,
    and the last compute kernel that started before it."""
    kernels = _kernels(path)
    if not kernels:
        return []
    covered = _coverage(kernels)
    t0 = kernels[0]["ts"]
    out, last_compute = [], None
    for e in kernels:  # (sorted by start)
        if not _is_nccl(e):
            last_compute = e
            continue
        exposed = e["dur"] - covered(e["ts"], e["ts"] + e["dur"])
        if exposed >= min_us:
            out.append({"start_ms": (e["ts"] - t0) / 1e3, "exposed_ms": exposed / 1e3, "dur_ms": e["dur"] / 1e3,
                        "name": e["name"], "stream": (e.get("args") or {}).get("stream"),
                        "after": None if last_compute is None else last_compute["name"]})
    return out


def overlap_report(path: str) -> dict[str, dict[str, float]]:
    kernels = _kernels(path)
    covered = _coverage(kernels)
    report = {}
    for kind in KINDS:
        ks = [e for e in kernels if _is_nccl(e) and kind.lower() in e["name"].lower()]
        if not ks:
            continue
        total = sum(e["dur"] for e in ks)
        over = sum(covered(e["ts"], e["ts"] + e["dur"]) for e in ks)
        report[kind] = {"kernels": len(ks), "total_ms": total / 1e3, "overlapped_share": over / total if total else 0.0}
    return report


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit(__doc__)
    if argv[0] == "--kernels":
        argv, steps, top = argv[1:], 1, 15
        while argv[:1] in (["--steps"], ["--top"]):
            if len(argv) < 2:
                raise SystemExit(f"{argv[0]} needs a number")
            steps, top = (int(argv[1]), top) if argv[0] == "--steps" else (steps, int(argv[1]))
            argv = argv[2:]
        if steps < 1:
            raise SystemExit(f"--steps {steps}: must be >= 1")
        for path in argv:
            r = kernel_breakdown(path, steps)
            total = sum(c["ms"] for c in r["categories"].values())
            print(f"{path}: per step (of {steps}): GPU busy {r['busy_ms']:.2f} ms of a {r['span_ms']:.2f} ms span; "
                  f"kernel time {total:.2f} ms (streams overlap)")
            for k, c in r["categories"].items():
                print(f"  {k:<18} {c['ms']:8.2f} ms  {100 * c['ms'] / total if total else 0:5.1f}%  {c['count']:7.1f} kernels")
            print(f"  top {top} kernels:")
            for k, c in list(r["names"].items())[:top]:
                print(f"  {c['ms']:8.3f} ms  x{c['count']:<6.1f} [{category(k)}] {k[:100]}")
        return
    if argv[0] == "--exposed":
        argv, min_us = argv[1:], 100.0
        if argv[:1] == ["--min-us"]:
            if len(argv) < 2:
                raise SystemExit("--min-us needs a number of microseconds")
            min_us, argv = float(argv[1]), argv[2:]
        for path in argv:
            rows = exposed_kernels(path, min_us)
            print(f"{path}: {len(rows)} NCCL kernels with >= {min_us:g} us exposed, "
                  f"{sum(r['exposed_ms'] for r in rows):.2f} ms in all")
            for r in rows:
                print(f"  {r['start_ms']:10.2f} ms  exposed {r['exposed_ms']:6.2f} of {r['dur_ms']:6.2f} ms  "
                      f"{r['name'][:48]}  (stream {r['stream']}; after {(r['after'] or '-')[:60]})")
        return
    for path in argv:
        for kind, r in overlap_report(path).items():
            print(f"{path}: {kind}: {r['kernels']} kernels, {r['total_ms']:.1f} ms, "
                  f"{100 * r['overlapped_share']:.1f}% overlapped with compute")


if __name__ == "__main__":
    main(sys.argv[1:])
