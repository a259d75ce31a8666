"""Outputs of one run: JSON (everything), markdown table, PNG chart; loss parity; targets.

The JSON is rewritten after every system, so a run killed by a timeout still leaves
the systems it finished.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

from . import hf_models

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1

METRIC_KEYS = (
    "tokens_per_s_per_gpu",     # micro-batch * seq / median measured step time (per rank)
    "step_time_ms_median",      # median over the measured steps, max over ranks
    "step_times_ms",            # every measured step (rank 0)
    "host_ms_per_step_median",  # host wall time inside step() (no sync; blocks only on a full launch queue), max over ranks
    "mfu",                      # flops_per_token * tokens/s/GPU / 989e12
    "mfu_vs_measured_matmul",   # same numerator / bf16 matmul rate measured in this run (CUDA only)
    "peak_mem_allocated_gib",   # torch.cuda.max_memory_allocated, max over ranks (CUDA only)
    "peak_mem_reserved_gib",    # torch.cuda.max_memory_reserved, max over ranks (CUDA only)
    "compile_cold_s",           # wall time of the first step (compile + first run)
    "compile_warm_s",           # first step after dynamo reset + rebuild (--warm-compile)
    "loss_first",               # loss of the first measured step (mean over ranks)
    "loss_last",                # loss of the last measured step (mean over ranks)
    "losses",                   # loss of every step, warmup included (mean over ranks)
    "gpu_idle_share",           # profiler: share of time with no kernel on the GPU (--profile)
    "gpu_compute_idle_share",   # profiler: share of time with no non-NCCL kernel (--profile)
    "exposed_comm_share",       # profiler: share of time an NCCL kernel runs and no compute kernel (--profile)
    "dynamo_graphs",            # Dynamo graphs compiled for this system
    "dynamo_graph_breaks",      # Dynamo graph breaks for this system
    "wall_s",                   # wall time of the whole system (build, steps, profile, warm compile)
)

# the order of reference systems for loss parity and ratio columns
BASELINES = ("fsdp2", "fsdp2_compile", "ddp_compile", "ddp", "deepspeed_z3", "deepcompile", "inductor", "simplefsdp",
             "graph_trainer")

PEERS = ("simplefsdp", "graph_trainer", "deepcompile", "deepspeed_z3")
"""The other compiler-based / sharded-training frameworks ("peers", BENCHMARKS.md): a
``peer`` target compares graphcomp with the fastest of them that ran."""

PARITY_TOLERANCE = 2e-2
"""Relative loss difference accepted between systems (bf16 compute: see README)."""

# BENCHMARKS.md targets: (workload, world) -> checks
TARGETS: dict[tuple[str, int], list[dict]] = {
    ("W1", 2): [dict(kind="speed", system="graphcomp", baseline="fsdp2_compile", min=1.6),
                dict(kind="speed", system="graphcomp", baseline="fsdp2", min=2.0),
                dict(kind="speed", system="graphcomp", baseline="deepspeed_z3", min=2.0),
                dict(kind="peer", system="graphcomp", baseline=None, min=2.0)],
    ("W1", 1): [dict(kind="speed", system="graphcomp", baseline="inductor", min=1.3)],
    ("W2", 4): [dict(kind="speed", system="graphcomp", baseline="fsdp2_compile", min=1.15),
                dict(kind="speed", system="graphcomp", baseline="ddp_compile", min=0.97),
                dict(kind="memory", system="graphcomp", baseline="fsdp2", max=1.0)],
    ("W3", 4): [dict(kind="speed", system="graphcomp", baseline="fsdp2_compile", min=1.10),
                dict(kind="memory", system="graphcomp", baseline="fsdp2", max=0.90),
                dict(kind="compile", system="graphcomp", max_s=180.0)],
}

# BENCHMARKS.md / issue 12, every hf-* workload on 2 GPUs: CUDA graphs reach a steady
# state (nothing falls back or re-captures while the steps are timed), peak memory
# <= fsdp2_compile's, and on decoder (causal LM) families >= 2x fsdp2_compile.
HF_TARGETS: dict[int, list[dict]] = {
    2: [dict(kind="steady", system="graphcomp", max=0),
        dict(kind="speed", system="graphcomp", baseline="fsdp2_compile", min=2.0, families="causal"),
        dict(kind="memory", system="graphcomp", baseline="fsdp2_compile", max=1.0)],
}


def empty_metrics() -> dict[str, Any]:
    return {k: None for k in METRIC_KEYS}


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# --------------------------------------------------------------------------- loss parity
def loss_parity(systems: dict[str, dict], warmup: int) -> dict:
    """Max relative loss difference of each system against the reference system over
    the measured steps (and on the very first step, where all start from identical
    weights and data)."""
    ok = {n: r["metrics"]["losses"] for n, r in systems.items()
          if r["status"] == "ok" and r["metrics"].get("losses")}
    out: dict[str, Any] = {"reference": None, "tolerance": PARITY_TOLERANCE, "max_rel_diff": {},
                           "first_step_rel_diff": {}, "max_rel_diff_overall": None,
                           "first_step_max_rel_diff": None, "within_tolerance": None,
                           "note": "measured steps; relative to the reference system's loss"}
    if not ok:
        return out
    ref = next((b for b in BASELINES if b in ok), next(iter(ok)))
    out["reference"] = ref
    ref_l = ok[ref]
    n = min(len(v) for v in ok.values())
    lo = min(warmup, n - 1)
    for name, ls in ok.items():
        out["max_rel_diff"][name] = max(abs(a - b) / abs(b) for a, b in zip(ls[lo:n], ref_l[lo:n]))
        out["first_step_rel_diff"][name] = abs(ls[0] - ref_l[0]) / abs(ref_l[0])
    spread = [(max(v[i] for v in ok.values()) - min(v[i] for v in ok.values())) / abs(ref_l[i])
              for i in range(lo, n)]
    out["max_rel_diff_overall"] = max(spread)
    out["first_step_max_rel_diff"] = ((max(v[0] for v in ok.values()) - min(v[0] for v in ok.values()))
                                      / abs(ref_l[0]))
    out["within_tolerance"] = out["max_rel_diff_overall"] <= PARITY_TOLERANCE
    # the noise floor: how far the systems that are not graphcomp (the same model, data
    # and initial weights) drift apart over the same steps (bf16 training diverges)
    base = [v for name, v in ok.items() if not name.startswith("graphcomp")]
    out["baseline_spread"] = (max((max(v[i] for v in base) - min(v[i] for v in base)) / abs(ref_l[i])
                                  for i in range(lo, n)) if len(base) >= 2 else None)
    return out


# --------------------------------------------------------------------------- targets
def targets_for(workload: str, world: int, family: str | None = None) -> list[dict]:
    """The targets a run of ``workload`` on ``world`` ranks is judged by (``family``:
    the HF family of an hf-* workload)."""
    if family is None:
        return TARGETS.get((workload, world), [])
    kind = hf_models.FAMILIES[family].kind
    return [t for t in HF_TARGETS.get(world, []) if t.get("families", kind) == kind]


def evaluate_targets(workload: str, world: int, systems: dict[str, dict], family: str | None = None) -> list[dict]:
    def metric(name, key):
        r = systems.get(name)
        return r["metrics"][key] if r and r["status"] == "ok" else None

    out = []
    for t in targets_for(workload, world, family):
        row = dict(t, value=None, met=None)
        if t["kind"] == "speed":
            a, b = metric(t["system"], "tokens_per_s_per_gpu"), metric(t["baseline"], "tokens_per_s_per_gpu")
            if _num(a) and _num(b) and b > 0:
                row["value"] = a / b
                row["met"] = row["value"] >= t["min"]
        elif t["kind"] == "peer":
            row["peer"] = strongest_peer(systems)
            a = metric(t["system"], "tokens_per_s_per_gpu")
            b = metric(row["peer"], "tokens_per_s_per_gpu") if row["peer"] else None
            if _num(a) and _num(b) and b > 0:
                row["value"] = a / b
                row["met"] = row["value"] >= t["min"]
        elif t["kind"] == "memory":
            a, b = metric(t["system"], "peak_mem_allocated_gib"), metric(t["baseline"], "peak_mem_allocated_gib")
            if _num(a) and _num(b) and b > 0:
                row["value"] = a / b
                row["met"] = row["value"] <= t["max"]
        elif t["kind"] == "compile":
            a = metric(t["system"], "compile_cold_s")
            if _num(a):
                row["value"] = a
                row["met"] = a <= t["max_s"]
        elif t["kind"] == "steady":  # CUDA graphs only: on CPU nothing is captured, no verdict
            r = systems.get(t["system"])
            st = (r.get("stats") or {}) if r and r["status"] == "ok" else {}
            moved = st.get("counters_measured")
            if st.get("cuda_graphs_possible") and moved is not None:
                row["value"] = moved.get("cudagraph_fallbacks", 0) + moved.get("recaptures", 0)
                row["met"] = row["value"] <= t["max"]
        out.append(row)
    return out


def strongest_peer(systems: dict[str, dict]) -> str | None:
    """The :data:`PEERS` system with the most tokens/s/GPU in this run (None if none ran)."""
    ran = {n: systems[n]["metrics"]["tokens_per_s_per_gpu"] for n in PEERS
           if n in systems and systems[n]["status"] == "ok" and _num(systems[n]["metrics"]["tokens_per_s_per_gpu"])}
    return max(ran, key=ran.get) if ran else None


AC_SUFFIXES = {"-ac": True, "-noac": False}
"""``<system>-ac`` / ``<system>-noac``: the system with activation checkpointing per
block switched on / off whatever the workload's default (W3 checkpoints by default)."""


def split_ac_suffix(name: str) -> tuple[str, bool | None]:
    """(base system, checkpointing on/off) of ``<system>-ac`` / ``<system>-noac``;
    (name, None) for a name without such a suffix."""
    for suffix, on in AC_SUFFIXES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], on
    return name, None


def fastest_variants(systems: dict[str, dict]) -> dict[str, str]:
    """For each system run in several checkpointing configurations (``X``, ``X-ac``,
    ``X-noac``): the name of its fastest configuration that ran (under ``--memory-cap``,
    the fastest that fits)."""
    groups: dict[str, list[str]] = {}
    for n in systems:
        groups.setdefault(split_ac_suffix(n)[0], []).append(n)
    out = {}
    for base, names in groups.items():
        ok = [n for n in names if systems[n]["status"] == "ok" and _num(systems[n]["metrics"]["tokens_per_s_per_gpu"])]
        if len(names) > 1 and ok:
            out[base] = max(ok, key=lambda n: systems[n]["metrics"]["tokens_per_s_per_gpu"])
    return out


def _target_text(t: dict) -> str:
    if t["kind"] == "speed":
        want = f"{t['system']} tokens/s ≥ {t['min']}× {t['baseline']}"
    elif t["kind"] == "peer":
        want = (f"{t['system']} tokens/s ≥ {t['min']}× the strongest peer "
                f"({t.get('peer') or 'none of ' + ', '.join(PEERS) + ' ran'})")
    elif t["kind"] == "memory":
        want = f"{t['system']} peak mem ≤ {t['max']}× {t['baseline']}"
    elif t["kind"] == "steady":
        want = f"{t['system']} CUDA-graph fallbacks + recaptures during the measured steps ≤ {t['max']}"
    else:
        want = f"{t['system']} cold compile ≤ {t['max_s']:.0f} s"
    got = "not measured" if t["value"] is None else f"{t['value']:.3g}"
    mark = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
    return f"- {want}: {got} ({mark})"


# --------------------------------------------------------------------------- writers
def write_json(path: str, result: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)


def _fmt(x, spec: str = ".3g", none: str = "–") -> str:
    return format(x, spec) if _num(x) else none


def _pct(x) -> str:
    return (f"{x * 100:.1f}%" if x >= 1e-3 else f"{x * 100:.2g}%") if _num(x) else "–"


def markdown(result: dict) -> str:
    w, env, systems = result["workload"], result["env"], result["systems"]
    world = env["world_size"]
    tp = int((result.get("args") or {}).get("tp") or 1)
    lines = [f"# {_title(w)}{f' (tensor parallel {tp})' if tp > 1 else ''} on {world} × {env['device_name']} ({env['device_type']})", "",
             f"{env['date']} · torch {env['torch']} · CUDA {env['cuda']} · NCCL {env['nccl']} · "
             f"commit {(env['git_commit'] or 'unknown')[:12]}"
             f"{' (dirty)' if env.get('git_dirty') else ''} · DeepSpeed {env['deepspeed']}", "",
             f"{_model_text(w, result['model'])} ({result['model']['params'] / 1e6:.4g}M params), micro-batch "
             f"{w['batch']} × seq {w['seq']} per {'rank' if tp == 1 else f'dp group of {tp} tensor-parallel ranks'}, "
             f"{w['warmup']} warmup + {w['steps']} measured steps"
             f"{', activation checkpointing' if w['activation_checkpointing'] else ''}; "
             f"matmul bf16 measured: {_fmt(env['matmul_bf16_tflops_measured'], '.0f')} TFLOP/s", ""]
    base = [b for b in BASELINES if _num(systems.get(b, {}).get("metrics", {}).get("tokens_per_s_per_gpu"))]
    head = (["system", "tokens/s/GPU"] + [f"× {b}" for b in base] +
            ["MFU", "MFU/matmul", "step ms", "host ms", "peak alloc GiB", "peak resv GiB", "compile s (cold/warm)",
             "loss first → last", "GPU idle", "exposed comm"])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in systems.items():
        m = r["metrics"]
        if r["status"] != "ok":
            lines.append(f"| {name} | **{r['status']}** |" + " |" * (len(head) - 2))
            continue
        tps = m["tokens_per_s_per_gpu"]
        ratios = [_fmt(tps / systems[b]["metrics"]["tokens_per_s_per_gpu"], ".2f") + "×" for b in base]
        row = ([name, _fmt(tps, ",.0f")] + ratios +
               [_pct(m["mfu"]), _pct(m["mfu_vs_measured_matmul"]),
                _fmt(m["step_time_ms_median"], ".1f"), _fmt(m.get("host_ms_per_step_median"), ".2f"),
                _fmt(m["peak_mem_allocated_gib"], ".2f"),
                _fmt(m["peak_mem_reserved_gib"], ".2f"),
                f"{_fmt(m['compile_cold_s'], '.1f')} / {_fmt(m['compile_warm_s'], '.1f')}",
                f"{_fmt(m['loss_first'], '.4f')} → {_fmt(m['loss_last'], '.4f')}",
                _pct(m["gpu_idle_share"]), _pct(m.get("exposed_comm_share"))])
        lines.append("| " + " | ".join(row) + " |")
    bad = {n: r for n, r in systems.items() if r["status"] != "ok"}
    if bad:
        lines += ["", "Not run / failed:", ""]
        lines += [f"- `{n}`: {r['status']}: {(r['reason'] or '').splitlines()[0][:300]}" for n, r in bad.items()]
    peer = strongest_peer(systems)
    if peer is not None:
        g = systems.get("graphcomp", {})
        gt = g.get("metrics", {}).get("tokens_per_s_per_gpu") if g.get("status") == "ok" else None
        pt = systems[peer]["metrics"]["tokens_per_s_per_gpu"]
        lines += ["", f"Strongest peer ({', '.join(PEERS)}) in this run: `{peer}`, {_fmt(pt, ',.0f')} tokens/s/GPU"
                      + (f"; graphcomp / {peer} = {gt / pt:.2f}×" if _num(gt) else "")]
    best = fastest_variants(systems)
    if best:
        cap = result["env"].get("memory_cap_gib")
        lines += ["", "Fastest configuration of each system run with and without activation checkpointing"
                  + (f" that fits under --memory-cap {cap:g} GiB" if cap else "") + ": "
                  + "; ".join(f"`{b}`: `{n}`" for b, n in best.items())]
    est_lines = []
    for name, r in systems.items():
        est = (r.get("stats") or {}).get("memory_estimate") or {}
        meas = r["metrics"].get("peak_mem_allocated_gib")
        if est.get("estimated_step_peak_bytes") and _num(meas):
            e = est["estimated_step_peak_bytes"] / 2**30
            est_lines.append(f"- {name}: estimated {e:.2f} GiB (largest graph peak + optimizer state), measured "
                             f"{meas:.2f} GiB: measured/estimated {meas / e:.2f}")
    if est_lines:
        lines += ["", "graphcomp memory model vs measured peak (rank max):", ""] + est_lines
    cg_lines = [f"- {name}: {_cudagraph_text(r['stats'])}" for name, r in systems.items()
                if r["status"] == "ok" and "counters" in (r.get("stats") or {})]
    if cg_lines:
        lines += ["", "graphcomp CUDA graphs (rank 0; whole run, and during the measured steps after the arrow):",
                  ""] + cg_lines
    p = result.get("loss_parity") or {}
    if p.get("reference"):
        lines += ["", f"Loss parity vs `{p['reference']}` (max relative difference over measured steps; "
                      f"tolerance {p['tolerance']:g}): overall {_fmt(p['max_rel_diff_overall'], '.2e')} "
                      f"({'within' if p['within_tolerance'] else 'OUTSIDE'} tolerance); first step "
                      f"{_fmt(p['first_step_max_rel_diff'], '.2e')}"
                      + (f"; the systems other than graphcomp differ from each other by up to "
                         f"{_fmt(p['baseline_spread'], '.2e')} over the same steps"
                         if p.get("baseline_spread") is not None else ""), ""]
        lines += [f"- {n}: {_fmt(v, '.2e')}" for n, v in p["max_rel_diff"].items()]
    if result.get("targets"):
        lines += ["", "Targets (BENCHMARKS.md):", ""] + [_target_text(t) for t in result["targets"]]
    lines += ["", f"Columns: tokens/s/GPU = micro-batch × seq{f' / {tp} (tp)' if tp > 1 else ''} / median step "
                  "time; × X = tokens/s ratio to "
                  "system X in this run; MFU = model FLOPs / 989 TFLOP/s; MFU/matmul = same over the bf16 matmul "
                  "rate measured in this run; compile = wall time of the first step (cold) and of the first "
                  "step after a Dynamo reset (warm, --warm-compile). See benchmarks/README.md."]
    return "\n".join(lines) + "\n"


def _title(w: dict) -> str:
    return f"{w['name']} ({w['preset']})" if w.get("family") else w["name"]


def _model_text(w: dict, model: dict) -> str:
    if w.get("family"):
        return f"model `{model.get('hf_class', w['family'])}` (transformers, size `{w['preset']}`)"
    return f"model preset `{w['preset']}`"


def _cudagraph_text(stats: dict) -> str:
    c, m = stats["counters"], stats.get("counters_measured") or {}

    def both(k):
        return f"{c.get(k, 0)}" + (f" → {m[k]}" if k in m else "")

    txt = (f"captures {both('captures')}, pieces captured {both('pieces_captured')}, pieces eager "
           f"{both('pieces_eager')}, capture failures {both('capture_failures')}, fallbacks "
           f"{both('cudagraph_fallbacks')}, recaptures {both('recaptures')} (hazard {both('hazard_recaptures')})")
    return txt if stats.get("cuda_graphs_possible", True) else txt + "; no CUDA here: nothing is captured"


def write_png(path: str, result: dict) -> str | None:
    """Bar charts of tokens/s/GPU and peak memory. Returns a note when skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"PNG skipped: matplotlib not installed ({e}); pip install matplotlib (the [bench] extra)"
    systems = result["systems"]
    names = list(systems)
    tps = [systems[n]["metrics"]["tokens_per_s_per_gpu"] if systems[n]["status"] == "ok" else None for n in names]
    mem = [systems[n]["metrics"]["peak_mem_allocated_gib"] if systems[n]["status"] == "ok" else None for n in names]
    resv = [systems[n]["metrics"]["peak_mem_reserved_gib"] if systems[n]["status"] == "ok" else None for n in names]
    env, w = result["env"], result["workload"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.55 * len(names) + 2.2))
    colors = ["#d62728" if n.startswith("graphcomp") else "#1f77b4" for n in names]
    na = "n/a (no CUDA)" if env["device_type"] != "cuda" else "n/a"
    y = list(range(len(names)))
    axes[1].barh(y, [v if _num(v) else 0 for v in resv], color="#cccccc", label="max_memory_reserved")
    for ax, vals, title, fmt in ((axes[0], tps, "tokens/s per GPU (higher is better)", "{:,.0f}"),
                                 (axes[1], mem, "peak memory per GPU, GiB (lower is better)", "{:.2f}")):
        ax.barh(y, [v if _num(v) else 0 for v in vals], color=colors,
                label="max_memory_allocated" if ax is axes[1] else None)
        ax.set_yticks(y, names)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        top = max([v for v in vals + (resv if ax is axes[1] else []) if _num(v)], default=1.0) or 1.0
        ax.set_xlim(0, top * 1.25)
        for i, (n, v) in enumerate(zip(names, vals)):
            label = fmt.format(v) if _num(v) else (systems[n]["status"] if systems[n]["status"] != "ok" else na)
            if ax is axes[1] and _num(resv[i]):
                label += f" (resv {resv[i]:.2f})"
            x = max(v if _num(v) else 0, resv[i] if ax is axes[1] and _num(resv[i]) else 0)
            ax.text(x + top * 0.01, i, label, va="center", fontsize=8)
    if any(_num(v) for v in mem):
        axes[1].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{_title(w)} · {env['world_size']} × {env['device_name']} · micro-batch {w['batch']} × seq "
                 f"{w['seq']} · torch {env['torch']} · {env['date'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_all(stem: str, result: dict, png: bool = True) -> list[str]:
    """Write ``stem``.json/.md (and .png); returns notes (e.g. PNG skipped)."""
    notes = []
    write_json(stem + ".json", result)
    with open(stem + ".md", "w") as f:
        f.write(markdown(result))
    if png:
        try:
            note = write_png(stem + ".png", result)
        except Exception as e:  # noqa: BLE001 - a chart must never lose the numbers
            note = f"PNG failed: {type(e).__name__}: {e}"
        if note:
            notes.append(note)
    return notes
