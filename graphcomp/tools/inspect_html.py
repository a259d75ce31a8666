"""``graphcomp inspect DIR --html OUT.html``: one self-contained page per rank.

The page reads only ``DIR/rank<R>/summary.json`` and has, per frame: what the frame
is (compile id, codegen, world size, compile time, config), a table of every pass
per stage (enabled, changed, nodes before/after, time, counts, reason, op-count
diff), the pieces of split graphs (mode, nodes, captures, pool, split reason), the
collectives (aggregated, and every one), and per stage the estimated memory over
the graph as an inline SVG chart: the conservative model (``peak_bytes``) and the
Inductor model (``peak_bytes_inductor``) per node position, with the collectives
marked under the axis (``graphcomp/analysis/memory.py``). No scripts, fonts, stylesheets or
images are loaded from anywhere: the file can be mailed or attached to an issue.
"""

from __future__ import annotations

import html
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from graphcomp.compiler.dump import load_runtime, load_summaries
from graphcomp.tools.inspect_dumps import REMAT_HEADER, RUNTIME_HEADER, _fmt_bytes, capture_seconds_text, inductor_order_text, memory_lines, nodes_text, remat_rows, runtime_rows

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#1b1b1b;max-width:1200px}
h1{font-size:22px} h2{font-size:18px;border-bottom:2px solid #ccc;padding-bottom:4px;margin-top:36px}
h3{font-size:15px;margin:20px 0 6px}
table{border-collapse:collapse;margin:4px 0 12px} th,td{border:1px solid #ccc;padding:3px 7px;text-align:left;vertical-align:top;max-width:380px;overflow-wrap:anywhere}
th{background:#f0f0f0} td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.changed td{background:#eef8ee} tr.off td{color:#888} .muted{color:#777}
code,pre{font:12px ui-monospace,monospace} pre{background:#f7f7f7;padding:8px;overflow:auto}
dl{display:grid;grid-template-columns:max-content auto;gap:2px 14px} dt{font-weight:600}
svg{background:#fff;border:1px solid #ddd}
"""

_COLL_COLORS = {"all_gather": "#1f77b4", "reduce_scatter": "#ff7f0e", "all_reduce": "#2ca02c"}


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def _table(header: list[str], rows: list[list[Any]], cls: str = "", row_classes: list[str] | None = None,
           num_cols: set[int] = frozenset()) -> str:
    if not rows:
        return '<p class="muted">(none)</p>'
    out = [f'<table class="{cls}"><thead><tr>' + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr></thead><tbody>"]
    for i, r in enumerate(rows):
        rc = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
        cells = "".join(f'<td class="num">{_e(v)}</td>' if j in num_cols else f"<td>{_e(v)}</td>"
                        for j, v in enumerate(r))
        out.append(f"<tr{rc}>{cells}</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def memory_svg(stage: str, mem: dict[str, Any], width: int = 760, height: int = 230) -> str:
    """An inline SVG line chart of ``mem['timeline']`` (see ``memory.timeline_summary``)."""
    tl = mem.get("timeline")
    if not tl or not tl.get("bytes"):
        return '<p class="muted">(no memory timeline in this summary)</p>'
    left, right, top, bottom = 78, 12, 26, 44
    pw, ph = width - left - right, height - top - bottom
    n, step = max(1, int(tl["num_nodes"])), int(tl["step"])
    top_bytes = max(max(tl["bytes"]), max(tl.get("bytes_inductor") or [0]), 1)

    def x(i: float) -> float:
        return left + pw * min(i, n) / n

    def y(b: float) -> float:
        return top + ph * (1 - b / top_bytes)

    def line(vals: list[int]) -> str:
        pts = []
        for j, v in enumerate(vals):  # bucket j covers nodes [j*step, (j+1)*step): a flat segment
            pts.append(f"{x(j * step):.1f},{y(v):.1f}")
            pts.append(f"{x(min(n, (j + 1) * step)):.1f},{y(v):.1f}")
        return " ".join(pts)

    title = (f"{stage}: estimated memory over {n} graph nodes; peak {_fmt_bytes(mem.get('peak_bytes', 0))} "
             f"(conservative), {_fmt_bytes(mem.get('peak_bytes_inductor') or 0)} (Inductor model)")
    parts = [f'<svg role="img" class="memory-chart" data-stage="{_e(stage)}" '
             f'width="{width}" height="{height}" viewBox="0 0 {width} {height}"><title>{_e(title)}</title>']
    for frac in (0, 0.25, 0.5, 0.75, 1):
        yy = y(top_bytes * frac)
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#eee"/>'
                     f'<text x="{left - 6}" y="{yy + 4:.1f}" font-size="11" text-anchor="end">'
                     f"{_e(_fmt_bytes(top_bytes * frac))}</text>")
    parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{top + ph}" y2="{top + ph}" stroke="#333"/>'
                 f'<line x1="{left}" x2="{left}" y1="{top}" y2="{top + ph}" stroke="#333"/>')
    for i in (0, n // 2, n):
        parts.append(f'<text x="{x(i):.1f}" y="{top + ph + 30}" font-size="11" text-anchor="middle">{i}</text>')
    parts.append(f'<text x="{left + pw / 2:.1f}" y="{height - 2}" font-size="11" text-anchor="middle">'
                 "node (graph order)</text>")
    parts.append(f'<polyline class="mem-conservative" fill="none" stroke="#999" stroke-dasharray="4 3" '
                 f'stroke-width="1.5" points="{line(tl["bytes"])}"/>')
    if tl.get("bytes_inductor"):
        parts.append(f'<polyline class="mem-inductor" fill="none" stroke="#d62728" stroke-width="1.5" '
                     f'points="{line(tl["bytes_inductor"])}"/>')
    for i, kind in tl.get("collectives", []):
        color = _COLL_COLORS.get(kind, "#555")
        parts.append(f'<line class="coll" x1="{x(i):.1f}" x2="{x(i):.1f}" y1="{top + ph + 3}" y2="{top + ph + 14}" '
                     f'stroke="{color}"><title>{_e(kind)} at node {i}</title></line>')
    legend = [("#999", "conservative (peak_bytes)", "4 3"), ("#d62728", "Inductor model", "")]
    legend += [(c, k, "") for k, c in _COLL_COLORS.items() if any(kk == k for _, kk in tl.get("collectives", []))]
    lx = left
    for color, label, dash in legend:
        parts.append(f'<line x1="{lx}" x2="{lx + 18}" y1="12" y2="12" stroke="{color}" stroke-width="2" '
                     f'stroke-dasharray="{dash}"/><text x="{lx + 22}" y="16" font-size="11">{_e(label)}</text>')
        lx += 30 + 7 * len(label)
    parts.append("</svg>")
    return "".join(parts)


def _passes_table(frame: dict[str, Any]) -> str:
    rows, classes = [], []
    for stage, st in frame.get("stages", {}).items():
        for p in st.get("passes", []):
            counts = ", ".join(f"{k}={v:g}" for k, v in sorted(p.get("counts", {}).items()))
            diff = ", ".join(f"{k} {v:+d}" for k, v in sorted(p.get("op_diff", {}).items()))
            rows.append([stage, p["name"], "on" if p["enabled"] else "off", "yes" if p["changed"] else "no",
                         f"{p['nodes_before']} → {p['nodes_after']}" if p["enabled"] else "",
                         f"{p['seconds'] * 1e3:.1f}" if p["enabled"] else "", counts, p.get("reason") or "", diff])
            classes.append("changed" if p["changed"] else ("" if p["enabled"] else "off"))
    return _table(["stage", "pass", "enabled", "changed", "nodes", "ms", "counts", "reason", "op-count diff"],
                  rows, "passes", classes, {5})


def _pieces_table(frame: dict[str, Any]) -> str:
    rows = []
    for stage, st in frame.get("stages", {}).items():
        for p in st.get("partitions", []):
            rows.append([stage, p.get("piece"), p.get("mode", ""), nodes_text(p), p.get("captures", "-"),
                         _fmt_bytes(p["pool_bytes"]) if "pool_bytes" in p else "-",
                         p.get("static_inputs", "-"), p.get("copy_inputs", "-"), capture_seconds_text(p),
                         p.get("reason") or ""])
    if not rows:
        return '<p class="muted">(no split graphs: CUDA graphs off, or no CUDA tensors)</p>'
    return _table(["stage", "piece", "mode", "nodes", "captures", "pool", "static inputs", "copied inputs",
                   "capture s", "reason"], rows, "pieces", None, {3, 4})


def _collectives(frame: dict[str, Any]) -> str:
    agg: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    buckets: dict[tuple[str, str, str], set] = defaultdict(set)
    every = []
    for stage, st in frame.get("stages", {}).items():
        for c in st.get("collectives", []):
            k = (stage, c["kind"], c["dtype"])
            agg[k][0] += 1
            agg[k][1] += max(c["bytes"], 0)
            if c.get("bucket") is not None:
                buckets[k].add(c["bucket"])
            every.append([stage, c["node"], c["kind"], c["dtype"], _fmt_bytes(max(c["bytes"], 0)),
                          "" if c.get("bucket") is None else c["bucket"], ", ".join(c.get("params") or [])])
    rows = [[s, k, d, n, _fmt_bytes(b), len(buckets[(s, k, d)]) or "-"] for (s, k, d), (n, b) in sorted(agg.items())]
    if not rows:
        return '<p class="muted">(no collectives)</p>'
    return (_table(["stage", "collective", "dtype", "count", "bytes", "buckets"], rows, "collectives", None, {3})
            + f"<details><summary>every collective ({len(every)})</summary>"
            + _table(["stage", "node", "kind", "dtype", "bytes", "bucket", "parameters"], every, "collectives-all")
            + "</details>")


def _memory(frame: dict[str, Any]) -> str:
    out = []
    for stage, st in frame.get("stages", {}).items():
        m = st.get("memory")
        if not m:
            continue
        out.append(f'<h4>{_e(stage)}</h4>')
        if "error" in m:
            out.append(f'<p class="muted">memory model failed: {_e(m["error"])}</p>')
            continue
        big = ", ".join(f"{x['node']} = {_fmt_bytes(x['bytes'])}" for x in m.get("largest_live", []))
        out.append(
            f"<p>peak {_e(_fmt_bytes(m['peak_bytes']))} at <code>{_e(m.get('peak_node'))}</code> "
            f"({_e(m.get('peak_op', ''))}, node {_e(m.get('peak_index'))} of {_e(m.get('num_nodes'))}); "
            f"allocated-only {_e(_fmt_bytes(m.get('peak_bytes_allocated') or 0))}; Inductor model "
            f"{_e(_fmt_bytes(m.get('peak_bytes_inductor') or 0))}. Largest live there: {_e(big) or '-'}</p>")
        out.append(memory_svg(stage, m))
    rows = remat_rows(frame)
    if rows:
        out.append("<h4>remat: saved activations kept / recomputed under memory_budget</h4>")
        out.append(_table(REMAT_HEADER, rows, "remat"))
    return "".join(out) or '<p class="muted">(no memory estimates)</p>'


def _frame(frame: dict[str, Any]) -> str:
    fid = frame["frame"]
    cs = frame.get("compile_seconds")
    meta = [("compile id", frame.get("compile_id")), ("codegen", frame.get("codegen")),
            ("world size", frame.get("world_size")), ("recompile", frame.get("recompile")),
            ("compile time", f"{cs:.2f} s" if isinstance(cs, (int, float)) else "?"),
            ("inputs", frame.get("num_inputs")), ("stages", ", ".join(frame.get("stages", {})))]
    order = inductor_order_text(frame)
    if order:
        meta.append(("Inductor node order", order))
    dl = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in meta)
    cfg = json.dumps(frame.get("config", {}), indent=1, sort_keys=True, default=str)
    return (f'<section class="frame" id="frame-{fid}"><h2>Frame {fid}</h2><dl>{dl}</dl>'
            f"<details><summary>config</summary><pre>{_e(cfg)}</pre></details>"
            f'<h3 id="frame-{fid}-passes">Passes</h3>{_passes_table(frame)}'
            f'<h3 id="frame-{fid}-pieces">Pieces</h3>{_pieces_table(frame)}'
            f'<h3 id="frame-{fid}-collectives">Collectives</h3>{_collectives(frame)}'
            f'<h3 id="frame-{fid}-memory">Memory over the graph (static estimate)</h3>{_memory(frame)}'
            "</section>")


def _runtime(root: str | Path, rank: int, summary: dict[str, Any] | None = None) -> str:
    """The teardown's record (``runtime.json``): what ran captured, the counters, and
    on CUDA the measured peak against the largest estimated graph peak."""
    rec = load_runtime(root, rank)
    if rec is None:
        return ""
    rows, counters = runtime_rows(rec)
    mem = "".join(f"<p>{_e(line)}</p>" for line in memory_lines(rec, summary))
    return ('<section class="runtime" id="runtime"><h2>What ran captured (at teardown)</h2>'
            + _table(RUNTIME_HEADER, rows, num_cols={3, 4, 5}) + _table(["counter", "value"], counters, num_cols={1})
            + mem + "</section>")


def render_html(root: str | Path, *, rank: int = 0, frame: int | None = None) -> str:
    """The page for ``rank``'s summary under ``root`` (every frame, or ``frame``)."""
    summaries = load_summaries(root)
    if rank not in summaries:
        raise ValueError(f"no summary for rank {rank} under {str(root)!r}; ranks: {sorted(summaries)}")
    s = summaries[rank]
    frames = [f for f in s["frames"] if frame is None or f["frame"] == frame]
    if frame is not None and not frames:
        raise ValueError(f"no frame {frame} in rank {rank}'s summary; valid frames: {[f['frame'] for f in s['frames']]}")
    toc = "".join(f'<li><a href="#frame-{f["frame"]}">frame {f["frame"]}</a> ({_e(", ".join(f.get("stages", {})))})</li>'
                  for f in frames)
    title = f"graphcomp inspect: {Path(root).name}, rank {rank}"
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
            f"<h1>{_e(title)}</h1><p>{len(s['frames'])} frame(s) on rank {rank} of ranks {sorted(summaries)}; "
            f"dump directory <code>{_e(Path(root).resolve())}</code>.</p><ul>{toc}</ul>"
            + "".join(_frame(f) for f in frames) + (_runtime(root, rank, s) if frame is None else "")
            + "</body></html>\n")


def write_html(root: str | Path, out: str | Path, *, rank: int = 0, frame: int | None = None) -> Path:
    page = render_html(root, rank=rank, frame=frame)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
