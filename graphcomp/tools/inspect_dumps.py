"""``graphcomp inspect DIR``: readable tables over a dump directory.

    graphcomp inspect DIR                       # frames, stages, passes, collectives
    graphcomp inspect DIR --rank 1              # another rank (default 0)
    graphcomp inspect DIR --frame 0 --stage joint --pass fuse_allgather_downcast --diff
"""

from __future__ import annotations

import difflib
from collections import defaultdict
from pathlib import Path
from typing import Any

from graphcomp.analysis import memory
from graphcomp.compiler.dump import load_runtime, load_summaries


def nodes_text(p: dict) -> str:
    """A piece row's node count, with its compile regions (``compile_regions``) when
    there are several: ``"4213 in 33 regions"``."""
    n = str(p.get("nodes", ""))
    return f"{n} in {p['regions']} regions" if p.get("regions", 1) > 1 else n


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(b) < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return f"{b:.1f} GiB"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _short(s: Any, n: int = 70) -> str:
    s = "" if s is None else str(s)
    return s if len(s) <= n else s[: n - 3] + "..."


REMAT_HEADER = ["stage", "budget", "est. peak as tagged", "est. peak planned", "recomputed", "kept",
                "user regions", "recompute (model)", "note"]


def remat_rows(frame: dict[str, Any]) -> list[list[str]]:
    """One row per stage where the ``remat`` pass planned under a budget: what it
    kept and recomputed (counts and bytes) and the estimated peak before/after."""
    rows = []
    for stage, st in frame.get("stages", {}).items():
        for p in st.get("passes", []):
            c = p.get("counts", {})
            if p.get("name") != "remat" or "budget_bytes" not in c:
                continue
            if "user_kept" in c:
                user = f"{c['user_kept']:g} saved ({_fmt_bytes(c.get('user_kept_bytes', 0))})"
            elif "user_recomputed" in c:
                user = f"{c['user_recomputed']:g} recomputed as written"
                if c.get("room_under_budget_bytes"):
                    user += (f" ({_fmt_bytes(c.get('user_recomputed_bytes', 0))}; "
                             f"{_fmt_bytes(c['room_under_budget_bytes'])} of the budget unused: remat='auto' saves what fits)")
            else:
                user = "-"
            note = "budget infeasible" if c.get("budget_infeasible") else ""
            rows.append([stage, _fmt_bytes(c["budget_bytes"]), _fmt_bytes(c.get("estimated_peak_before", 0)),
                         _fmt_bytes(c.get("estimated_peak_after", 0)),
                         f"{c.get('recomputed', 0):g} ({_fmt_bytes(c.get('recomputed_bytes', 0))})",
                         f"{c.get('kept', 0):g} ({_fmt_bytes(c.get('kept_bytes', 0))})", user,
                         f"{c.get('recompute_us', 0):g} us", note])
    return rows


def capture_seconds_text(piece: dict[str, Any]) -> str:
    """A piece row's capture calls in host seconds: "total (warm-up w)", or "-"."""
    cs = piece.get("capture_seconds")
    if not cs:
        return "-"
    return f"{sum(cs.values()):.3f} (warm-up {cs.get('warmup', 0.0):.3f})"


def inductor_order_text(frame: dict[str, Any]) -> str | None:
    """Per stage, whose node order Inductor compiled (``Config.inductor_memory_reorder``);
    None when no stage has a record (eager codegen, or no graphcomp collective)."""
    orders = []
    for stage, st in frame.get("stages", {}).items():
        r = st.get("inductor_memory_reorder")
        if r:
            orders.append(f"{stage}: " + ("graphcomp's order kept (Inductor's reorder_for_peak_memory off)"
                                          if not r["allowed"] else
                                          f"Inductor replaced the order of {r['replaced']} of {r['graphs']} graph(s)"))
    return "; ".join(orders) or None


def artifacts_text(frame: dict[str, Any]) -> str | None:
    """Per stage, where its compiled code came from (compiled here, ``cache_dir``, rank
    0) and Inductor's cache hits and misses; None when no stage has a record."""
    parts = []
    for stage, st in frame.get("stages", {}).items():
        r = st.get("artifacts")
        if r and "key" in r:
            parts.append(f"{stage}: {r['source']} (key {r['key']}, Inductor cache {r.get('fx_graph_cache_hits', 0)} "
                         f"hit(s), {r.get('fx_graph_cache_misses', 0)} miss(es))")
    return "; ".join(parts) or None


def format_frame(frame: dict[str, Any]) -> str:
    """One frame: a pass table per stage, then a collective table."""
    cs = frame.get("compile_seconds")
    head = (
        f"frame {frame['frame']}  compile_id={frame.get('compile_id')}  codegen={frame.get('codegen')}"
        f"  world={frame.get('world_size')}  recompile={frame.get('recompile')}"
        + (f"  compile={cs:.1f}s" if isinstance(cs, (int, float)) else "")
    )
    out = [head]
    rows = []
    for stage, st in frame.get("stages", {}).items():
        passes = st.get("passes", [])
        rows.append([stage, "(input)", "", "", f"{st['nodes_in']}", "", ""])
        for p in passes:
            what = ", ".join(f"{k}={v:g}" for k, v in sorted(p.get("counts", {}).items()))
            if p.get("reason"):
                what = (what + "; " if what else "") + p["reason"]
            rows.append(
                [
                    "",
                    p["name"],
                    "on" if p["enabled"] else "off",
                    "yes" if p["changed"] else "no",
                    f"{p['nodes_before']}->{p['nodes_after']}" if p["enabled"] else "",
                    f"{p['seconds'] * 1e3:.1f}" if p["enabled"] else "",
                    _short(what),
                ]
            )
        rows.append(["", "(output)", "", "", f"{st['nodes_out']}", "", ""])
    out.append(_table(rows, ["stage", "pass", "enabled", "changed", "nodes", "ms", "what / why"]))
    crow = []
    for stage, st in frame.get("stages", {}).items():
        agg: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0])
        buckets: dict[tuple[str, str], set] = defaultdict(set)
        for c in st.get("collectives", []):
            k = (c["kind"], c["dtype"])
            agg[k][0] += 1
            agg[k][1] += max(c["bytes"], 0)
            if c.get("bucket") is not None:
                buckets[k].add(c["bucket"])
        for (kind, dtype), (n, b, _) in sorted(agg.items()):
            crow.append([stage, kind, dtype, str(n), _fmt_bytes(b), str(len(buckets[(kind, dtype)]) or "-")])
    if crow:
        out.append("")
        out.append(_table(crow, ["stage", "collective", "dtype", "count", "bytes", "buckets"]))
    else:
        out.append("(no collectives)")
    orders = inductor_order_text(frame)
    if orders:
        out.append("Inductor node order (inductor_memory_reorder): " + orders)
    sources = artifacts_text(frame)
    if sources:
        out.append("compiled code from (compile_once, cache_dir): " + sources)
    mrow = []
    for stage, st in frame.get("stages", {}).items():
        m = st.get("memory")
        if not m:
            continue
        if "error" in m:
            mrow.append([stage, "?", "", "", _short(m["error"], 60)])
            continue
        where = f"{m.get('peak_node')} ({m.get('peak_op', '')}, node {m.get('peak_index')}/{m.get('num_nodes')})"
        big = ", ".join(f"{x['node']}={_fmt_bytes(x['bytes'])}" for x in m.get("largest_live", [])[:3])
        ind = m.get("peak_bytes_inductor")
        mrow.append([stage, _fmt_bytes(m["peak_bytes"]), "?" if ind is None else _fmt_bytes(ind),
                     _short(where, 60), _short(big, 60)])
    if mrow:
        out.append("")
        out.append(_table(mrow, ["stage", "est. peak", "est. peak (Inductor)", "where", "largest live there"]))
    rrows = remat_rows(frame)
    if rrows:
        out.append("")
        out.append(_table(rrows, REMAT_HEADER))
    parts = [(stage, p) for stage, st in frame.get("stages", {}).items() for p in st.get("partitions", [])]
    if parts:
        out.append("")
        prow = [
            [s, str(p.get("piece")), p.get("mode", ""), nodes_text(p),
             str(p.get("captures", "-")), _fmt_bytes(p["pool_bytes"]) if "pool_bytes" in p else "-",
             capture_seconds_text(p), _short(p.get("reason"), 60)]
            for s, p in parts
        ]
        out.append(_table(prow, ["stage", "piece", "mode", "nodes", "captures", "pool", "capture s", "reason"]))
    return "\n".join(out)


def format_summary(summary: dict[str, Any], frame: int | None = None) -> str:
    frames = [f for f in summary["frames"] if frame is None or f["frame"] == frame]
    if frame is not None and not frames:
        valid = [f["frame"] for f in summary["frames"]]
        raise ValueError(f"no frame {frame} in rank {summary['rank']}'s summary; valid frames: {valid}")
    return f"rank {summary['rank']}: {len(summary['frames'])} frame(s)\n\n" + "\n\n".join(format_frame(f) for f in frames)


_RUNTIME_COUNTERS = ("captures", "replays", "cudagraph_fallbacks", "recaptures", "step_captures", "step_replays",
                     "step_calls_uncaptured", "step_recaptures", "step_capture_failures", "step_capture_fallbacks",
                     "optimizer_captures", "optimizer_steps_captured", "optimizer_steps_eager",
                     "optimizer_steps_in_step_graph", "optimizer_recaptures", "optimizer_fallbacks",
                     "optimizer_steps_skipped_nonfinite")


RUNTIME_HEADER = ["capture", "mode", "graph held", "calls", "replays", "recaptures", "reason / last decision"]


def runtime_rows(rec: dict[str, Any]) -> tuple[list[list[str]], list[list[str]]]:
    """``runtime.json`` as rows: one per whole-step or optimizer-step capture
    (:data:`RUNTIME_HEADER`), and (counter, value) for the run-time counters that are set."""
    rows = []
    for st in rec.get("owners", []):
        if "error" in st:
            rows.append([str(st.get("name")), "?", "", "", "", "", _short(st["error"])])
            continue
        rows.append([str(st.get("name")), str(st.get("mode")), "yes" if st.get("captured") else "no",
                     str(st.get("calls", "")), str(st.get("replays", "")), str(st.get("recaptures", "")),
                     _short(st.get("reason") or (st.get("decisions") or [""])[-1])])
    c = rec.get("counters", {})
    return rows, [[k, str(c[k])] for k in _RUNTIME_COUNTERS if c.get(k)]


def largest_estimate(summary: dict[str, Any]) -> tuple[int, int, str] | None:
    """(bytes, frame, stage) of the largest forward/backward peak graphcomp's memory
    model estimated (Inductor's fusion modelled where the frame compiled with Inductor,
    as ``max_memory_allocated`` counts), or None."""
    best = None
    for f in summary.get("frames", []):
        for stage, st in f.get("stages", {}).items():
            pk = memory.allocated_peak(st.get("memory") or {}, f.get("codegen"))
            if stage in ("fwd", "bwd") and isinstance(pk, int) and (best is None or pk > best[0]):
                best = (pk, f.get("frame"), stage)
    return best


def memory_lines(rec: dict[str, Any], summary: dict[str, Any] | None) -> list[str]:
    """The measured peak (``runtime.json``'s ``memory``, CUDA only) against the largest
    estimated graph peak of ``summary``; [] when nothing was measured."""
    mem = rec.get("memory")
    if not mem:
        return []
    alloc = mem["max_allocated_bytes"]
    out = [f"measured peak on {mem.get('device', '?')}: {_fmt_bytes(alloc)} allocated, "
           f"{_fmt_bytes(mem.get('max_reserved_bytes', 0))} reserved (torch.cuda.max_memory_allocated / "
           f"_reserved at teardown: since the process started or the last reset_peak_memory_stats)"]
    est = largest_estimate(summary) if summary else None
    if est:
        out.append(f"largest estimated graph peak: {_fmt_bytes(est[0])} (frame {est[1]}, {est[2]}; the graph's "
                   f"inputs and saved activations, not memory held outside the graphs such as optimizer state): "
                   f"measured / estimated {alloc / max(est[0], 1):.2f}")
    return out


def format_runtime(rec: dict[str, Any], summary: dict[str, Any] | None = None) -> str:
    """What ran captured (``runtime.json``, written by ``graphcomp.runtime.teardown()``):
    whole-step and optimizer-step captures, the run-time counters, and on CUDA the
    measured peak against ``summary``'s largest estimated graph peak."""
    rows, counters = runtime_rows(rec)
    out = ["what ran captured (written at teardown)",
           _table(rows, RUNTIME_HEADER) if rows else "(no whole-step or optimizer-step capture)"]
    if counters:
        out.append(_table(counters, ["counter", "value"]))
    out += memory_lines(rec, summary)
    return "\n".join(out)


def pass_diff(root: str | Path, rank: int, frame: int, stage: str, pass_name: str) -> str:
    """Unified diff of one pass's before/after graph text."""
    d = Path(root) / f"rank{rank}" / f"frame{frame:03d}" / stage
    if not d.is_dir():
        stages = sorted(p.name for p in d.parent.glob("*") if p.is_dir()) if d.parent.is_dir() else []
        raise ValueError(f"no dumps for rank {rank} frame {frame} stage {stage!r} under {str(root)!r}; stages there: {stages}")
    befores = sorted(d.glob(f"*-{pass_name}.before.txt"))
    if not befores:
        have = sorted({p.name.split("-", 1)[1].rsplit(".", 2)[0] for p in d.glob("*-*.before.txt")})
        raise ValueError(f"pass {pass_name!r} did not run in frame {frame} stage {stage!r}; passes that ran: {have}")
    before = befores[0]
    after = before.with_name(before.name.replace(".before.txt", ".after.txt"))
    a, b = before.read_text().splitlines(keepends=True), after.read_text().splitlines(keepends=True)
    diff = "".join(difflib.unified_diff(a, b, fromfile=str(before), tofile=str(after)))
    return diff or f"(pass {pass_name!r} left the {stage} graph of frame {frame} unchanged)\n"


def inspect_dir(root: str | Path, *, rank: int = 0, frame: int | None = None, stage: str | None = None,
                pass_name: str | None = None, diff: bool = False) -> str:
    summaries = load_summaries(root)
    if rank not in summaries:
        raise ValueError(f"no summary for rank {rank} under {str(root)!r}; ranks: {sorted(summaries)}")
    if diff:
        missing = [n for n, v in (("--frame", frame), ("--stage", stage), ("--pass", pass_name)) if v is None]
        if missing:
            raise ValueError(f"--diff needs {', '.join(missing)}")
        return pass_diff(root, rank, frame, stage, pass_name)  # type: ignore[arg-type]
    text = format_summary(summaries[rank], frame)
    rec = load_runtime(root, rank)
    if rec is not None and frame is None:
        text += "\n\n" + format_runtime(rec, summaries[rank])
    return text
