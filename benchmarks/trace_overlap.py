"""How much of each collective's kernel time overlaps compute, from a Chrome trace.

    python -m benchmarks.trace_overlap benchmarks/results/<run>-graphcomp.trace.json.gz [...]

Reads the GPU kernel events of a trace written by ``benchmarks.run --trace`` and
prints, per collective kind (AllGather, ReduceScatter, AllReduce), the number of
NCCL kernels, their total time and the share of that time during which a compute
(non-NCCL) kernel also runs. Issue 5 asks that a trace show gathers overlapping
compute: this is the number.
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


def overlap_report(path: str) -> dict[str, dict[str, float]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    compute = _merge([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()])
    starts = [m[0] for m in compute]

    def covered(s: float, t: float) -> float:
        i, out = max(bisect.bisect_right(starts, s) - 1, 0), 0.0
        while i < len(compute) and compute[i][0] < t:
            out += max(0.0, min(t, compute[i][1]) - max(s, compute[i][0]))
            i += 1
        return out

    report = {}
    for kind in KINDS:
        ks = [e for e in kernels if "nccl" in e["name"].lower() and kind.lower() in e["name"].lower()]
        if not ks:
            continue
        total = sum(e["dur"] for e in ks)
        over = sum(covered(e["ts"], e["ts"] + e["dur"]) for e in ks)
        report[kind] = {"kernels": len(ks), "total_ms": total / 1e3, "overlapped_share": over / total if total else 0.0}
    return report


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    for path in argv:
        for kind, r in overlap_report(path).items():
            print(f"{path}: {kind}: {r['kernels']} kernels, {r['total_ms']:.1f} ms, "
                  f"{100 * r['overlapped_share']:.1f}% overlapped with compute")


if __name__ == "__main__":
    main(sys.argv[1:])
