"""``graphcomp.tools.health``: what went well and what did not in a training run, with
one concrete thing to try per problem.

::

    from graphcomp.tools.health import format_health, health_report

    step = graphcomp.train_step(model, opt, ...)
    ...                                                   # train
    report = health_report(step, tokens_per_s=tps, mfu=0.41, world=8)
    logging.getLogger("train").info("%s", format_health(report))

:func:`health_report` reads what Dynamo and graphcomp recorded in this process
(call it before ``graphcomp.runtime.teardown()``; it changes nothing) and returns a
JSON-serializable dict:

* ``compile``: frames compiled, Dynamo graph breaks (reason -> count, from
  ``torch._dynamo.utils.counters["graph_break"]``: process-wide, not cleared by
  ``graphcomp.reset()``) and recompiles (``graphcomp.counters["recompiles"]``, the
  recompiled frames, and Dynamo's guard-failure reasons from
  ``torch._dynamo.utils.get_compilation_metrics()``, also process-wide);
* ``cudagraphs``: pieces captured and run eagerly (every eager piece with its frame,
  stage and reason, as ``graphcomp.frame_summaries()`` rows give them), captures,
  replays, re-captures, and calls that fell back to eager (with the pieces and why);
* ``step``: whether the whole training step is one CUDA graph and why not
  (``TrainStep.stats()["whole_step"]``), the optimizer step's mode and reason; without
  a ``step``, the optimizer and whole-step captures the runtime knows of;
* ``speed``: tokens/s in total and per GPU, MFU, peak memory (CUDA allocated and
  reserved, or the process's max RSS on CPU), exposed communication when the caller
  measured it (else ``"not measured"``);
* ``problems``: ``[{"kind", "what", "fix"}]``, where ``fix`` is ``FIXES[kind]``, one
  thing to try. Settings and the machine are not problems (``cudagraphs='off'``, no
  CUDA device: the summary says them); ``notes``: pieces run eagerly by design (too
  small to be worth a graph, a prefetch).

:func:`format_health` renders the report as text (one line per item).
"""

from __future__ import annotations

import logging
import resource
from typing import Any

import torch

log = logging.getLogger(__name__)

__all__ = ["FIXES", "format_health", "health_report"]

FIXES: dict[str, str] = {
    "graph_break": "run with TORCH_LOGS=graph_breaks to see the line; move that code (a print, .item(), a Python "
                   "branch on a tensor) out of the model's forward or the loss_fn",
    "recompile": "run with TORCH_LOGS=recompiles to see the failing guard; keep input shapes, dtypes and Python "
                 "values the same every step (pad or bucket sequence lengths)",
    "cpu": "create that tensor on the GPU (device=...) or compute it outside the compiled step",
    "device_copy": "move .cpu() / .to('cpu') / tensor printing out of the forward, or create the tensor on the GPU",
    "host_sync": "remove .item() / .tolist() / bool(tensor) from the forward; read values after the step",
    "data_dependent": "use fixed-shape ops (torch.where, masked_fill) instead of nonzero / boolean indexing, or pad "
                      "to a fixed size",
    "cudagraph_unsafe": "replace the op tagged cudagraph_unsafe, or run it outside the compiled step",
    "user_split_op": "drop the op from Config.split_ops if it can be captured",
    "rng": "use the default generator (torch.manual_seed) instead of an explicit torch.Generator in the model",
    "collective_pair": "keep each collective and its wait in one compiled region (no graph break between them)",
    "capture_failed": "move the op named in the reason out of the compiled region, or list it in Config.split_ops "
                      "(--option split_ops='[\"aten.<op>\"]')",
    "unsettled": "pad inputs whose shapes follow the data to a few sizes, and call each compiled region once per step",
    "cudagraph_fallback": "keep no reference to earlier steps' outputs (log loss.item() or a clone, not the "
                          "tensor) and run one forward per backward",
    "max_captures": "pad or bucket input shapes to a few sizes, or raise Config.max_captures "
                    "(--option max_captures=16)",
    "optimizer_unsupported": "use torch.optim.AdamW(fused=True)",
    "optimizer_eager": "build torch.optim.AdamW(fused=True) after graphcomp.shard(model), without step hooks",
    "whole_step_dynamic": "pad/bucket sequence lengths to a few sizes, or pass dynamic=False to graphcomp.train_step",
    "whole_step_failed": "run with TORCH_LOGS=+graphcomp to see the failing capture; whole_step=False keeps the pieces",
    "nonfinite_steps": "lower the learning rate or clip harder (max_norm); check the data for bad batches",
    "memory_budget_infeasible": "lower the batch size or sequence length, or raise Config.memory_budget",
}
"""Problem kind -> the one thing to try. Eager pieces use their split reason's kind
(``graphcomp.compiler.plan.REASON_KINDS``); ``unbacked_shape`` shares ``data_dependent``'s."""

_NOT_PROBLEMS = {"too_small", "prefetched"}  # eager by design: not worth a graph, or a prefetch on purpose
_CHOICES = ("no CUDA device", "cudagraphs='off'", "whole_step=False")  # reasons that are settings, not problems
_COUNTERS = ("frames_compiled", "recompiles", "pieces_captured", "pieces_eager", "captures", "replays", "recaptures",
             "hazard_recaptures", "cudagraph_fallbacks", "capture_failures", "pieces_turned_eager",
             "pieces_eager_calls", "optimizer_steps_captured", "optimizer_steps_eager",
             "optimizer_steps_skipped_nonfinite", "step_captures", "step_replays", "step_capture_fallbacks",
             "memory_budget_infeasible")


def _first_line(text: str, n: int = 160) -> str:
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    return line if len(line) <= n else line[: n - 3] + "..."


def _graph_breaks() -> dict[str, int]:
    from torch._dynamo.utils import counters

    out: dict[str, int] = {}
    for reason, n in counters.get("graph_break", {}).items():
        key = _first_line(reason)
        out[key] = out.get(key, 0) + int(n)
    return out


def _recompile_reasons() -> list[str]:
    try:
        from torch._dynamo.utils import get_compilation_metrics

        return [_first_line(m.recompile_reason) for m in get_compilation_metrics()
                if getattr(m, "recompile_reason", None)]
    except Exception:  # noqa: BLE001 - a private torch API; the count stays without reasons
        return []


def _pieces(frames: list[dict]) -> tuple[list[dict], int]:
    """(eager pieces with frame, stage, reason, kinds; number of capturable pieces).
    Compile regions of graphs that nothing captures (CPU graphs, ``cudagraphs='off'``)
    are neither."""
    eager, captured = [], 0
    for fr in frames:
        for stage, st in fr.get("stages", {}).items():
            for row in st.get("partitions", []):
                if row.get("mode") != "eager":
                    captured += 1
                    continue
                reason = str(row.get("reason", ""))
                if reason.startswith("not captured"):  # a compile region of a graph nothing captures (CPU, off)
                    continue
                head = reason.split(":", 1)[0] if ":" in reason else ""
                kinds = [k.strip() for k in head.split(",") if k.strip()] if " " not in head.strip() else []
                eager.append({"frame": fr.get("frame"), "stage": stage, "piece": row.get("piece"),
                              "nodes": row.get("nodes"), "reason": reason, "kinds": kinds})
    return eager, captured


def _fallback_runners() -> list[dict]:
    """Captured pieces some of whose calls ran eagerly because of a run-time hazard."""
    from graphcomp.runtime.manager import RUNTIME

    out = []
    for r in list(RUNTIME.runners):
        misses, warned = getattr(r, "misses", 0), sorted(getattr(r, "_warned", ()))
        if misses or warned:
            out.append({"piece": r.name, "eager_calls": misses, "why": warned})
    return sorted(out, key=lambda d: d["piece"])


def _peak_memory() -> dict[str, Any]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"device": "cuda", "max_allocated_bytes": torch.cuda.max_memory_allocated(),
                "max_reserved_bytes": torch.cuda.max_memory_reserved()}
    return {"device": "cpu", "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _step_part(step: Any, problems: list[dict]) -> dict[str, Any]:
    """The whole step and the optimizer step: what they are, and their problems."""
    from graphcomp.runtime.manager import RUNTIME

    def problem(kind: str, what: str) -> None:
        problems.append({"kind": kind, "what": what, "fix": FIXES[kind]})

    if step is not None:
        st = step.stats()
        opt, whole, whole_cap = st.get("optimizer", {}), st.get("whole_step"), st.get("whole_step_capture")
    else:  # the captured optimizer steps and whole steps the runtime knows of
        owners = RUNTIME.owner_stats()
        opt = next((o for o in owners if str(o.get("name", "")).startswith("optim/")), {})
        whole_cap = next((o for o in owners if str(o.get("name", "")).startswith("step/")), None)
        wmode = (whole_cap or {}).get("mode")
        whole = ("captured as one CUDA graph" if wmode == "captured" else
                 str(whole_cap.get("reason")) if wmode in ("off", "uncaptured") else None)
    mode, reason = opt.get("mode"), opt.get("reason")
    if mode in ("reference", "eager") and reason and reason not in _CHOICES:  # (a choice: the summary says it)
        kind = "optimizer_unsupported" if "is not supported" in reason else "optimizer_eager"
        problem(kind, f"the optimizer step is not captured: {reason}")
    if whole is not None and not whole.startswith("captured") and whole not in _CHOICES:
        if "dynamic shapes" in whole:
            problem("whole_step_dynamic", f"the whole step is not one graph: {whole}")
        elif "optimizer step is not captured" not in whole:  # (that problem is listed once, above)
            problem("whole_step_failed", f"the whole step is not one graph: {whole}")
    if whole_cap and whole_cap.get("mode") == "uncaptured" and whole_cap.get("reason") != "released by teardown":
        problem("whole_step_failed", f"the whole-step graph was given up: {whole_cap.get('reason')}")
    return {"source": "train_step" if step is not None else "runtime", "whole_step": whole,
            "whole_step_one_graph": bool(whole and whole.startswith("captured")),
            "whole_step_capture": whole_cap and {k: whole_cap.get(k) for k in ("mode", "reason", "replays")},
            "optimizer": {"mode": mode, "reason": reason}}


def health_report(step: Any = None, *, tokens_per_s: float | None = None, mfu: float | None = None,
                  world: int | None = None, exposed_comm: float | None = None) -> dict[str, Any]:
    """The report of this process's run so far (see the module docstring). ``step``: the
    :class:`graphcomp.TrainStep` trained with (None: what the runtime knows).
    ``tokens_per_s``: measured over all ranks; ``world``: ranks (default: the process
    group's size, else 1); ``mfu`` and ``exposed_comm``: fractions in [0, 1] (exposed
    communication: the share of step time in which only communication runs)."""
    from graphcomp.session import SESSION

    if world is None:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    counters = {k: SESSION.counters[k] for k in _COUNTERS if SESSION.counters[k]}
    frames = SESSION.frames.to_json()  # (graphcomp.frame_summaries())
    problems: list[dict] = []
    notes: list[str] = []

    def problem(kind: str, what: str) -> None:
        problems.append({"kind": kind, "what": what, "fix": FIXES[kind]})

    breaks = _graph_breaks()
    for reason, n in sorted(breaks.items(), key=lambda kv: -kv[1]):
        problem("graph_break", f"Dynamo graph break (counted {n}x while compiling): {reason}")
    recompiled = [fr.get("frame") for fr in frames if fr.get("recompile")]
    reasons = _recompile_reasons()
    n_re = max(counters.get("recompiles", 0), len(recompiled))
    if n_re:
        problem("recompile", f"{n_re} recompile(s)" + (f"; first reason: {reasons[0]}" if reasons else ""))

    eager, captured = _pieces(frames)
    seen: dict[str, list[dict]] = {}
    by_design = 0
    for p in eager:
        kinds = ["data_dependent" if k == "unbacked_shape" else k for k in p["kinds"] if k not in _NOT_PROBLEMS]
        kind = next((k for k in kinds if k in FIXES), None)
        if kind is not None:
            seen.setdefault(kind, []).append(p)
        by_design += bool(p["kinds"]) and not kinds
    if by_design:
        notes.append(f"{by_design} piece(s) run eagerly by design (too small to be worth a graph, or a prefetch)")
    for kind, ps in seen.items():
        p = ps[0]
        problem(kind, f"{len(ps)} piece(s) run eagerly; first: frame {p['frame']} {p['stage']} piece_{p['piece']} "
                      f"({p['nodes']} nodes): {p['reason']}")
    fallbacks = _fallback_runners()
    if counters.get("cudagraph_fallbacks"):
        names = ", ".join(f"{f['piece']} ({'/'.join(f['why'])})" for f in fallbacks if set(f["why"]) - {"max"})
        problem("cudagraph_fallback", f"{counters['cudagraph_fallbacks']} call(s) of captured pieces ran eagerly"
                + (f": {names}" if names else ""))
    if counters.get("pieces_eager_calls"):
        problem("max_captures", f"{counters['pieces_eager_calls']} call(s) ran eagerly beyond Config.max_captures")
    if counters.get("optimizer_steps_skipped_nonfinite"):
        problem("nonfinite_steps", f"{counters['optimizer_steps_skipped_nonfinite']} optimizer step(s) skipped: "
                                   "the gradient norm was not finite")
    if counters.get("memory_budget_infeasible"):
        problem("memory_budget_infeasible", f"{counters['memory_budget_infeasible']} graph(s) do not fit "
                                            "Config.memory_budget")

    step_part = _step_part(step, problems)
    log.debug("graphcomp health report: %d problem(s)", len(problems))
    speed = {"tokens_per_s": tokens_per_s, "world": world,
             "tokens_per_s_per_gpu": None if tokens_per_s is None else tokens_per_s / world,
             "mfu": mfu, "peak_memory": _peak_memory(),
             "exposed_comm": "not measured" if exposed_comm is None else exposed_comm}
    return {
        "compile": {"frames": counters.get("frames_compiled", len(frames)), "graph_breaks": breaks,
                    "recompiles": n_re, "recompiled_frames": recompiled, "recompile_reasons": reasons,
                    "seconds": sum(fr.get("compile_seconds") or 0.0 for fr in frames),
                    "phase_seconds": _phase_seconds(frames), "graphs_from": _graphs_from(frames)},
        "cudagraphs": {"pieces_captured": counters.get("pieces_captured", 0), "capturable_pieces": captured,
                       "eager_pieces": eager, "fallback_pieces": fallbacks,
                       **{k: counters.get(k, 0) for k in ("captures", "replays", "recaptures", "hazard_recaptures",
                                                          "cudagraph_fallbacks", "capture_failures",
                                                          "pieces_turned_eager")}},
        "step": step_part, "speed": speed, "counters": counters, "problems": problems, "notes": notes,
    }


def _phase_seconds(frames: list[dict[str, Any]]) -> dict[str, float]:
    """Compile seconds per phase (the passes of each stage, Inductor per stage), summed
    over the frames, longest first."""
    out: dict[str, float] = {}
    for fr in frames:
        for name, s in (fr.get("phase_seconds") or {}).items():
            out[name] = out.get(name, 0.0) + s
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _graphs_from(frames: list[dict[str, Any]]) -> dict[str, int]:
    """How many stage graphs were compiled here, loaded from ``Config.cache_dir`` or
    from rank 0 (``Config.compile_once``): the ``artifacts`` record of each stage."""
    out: dict[str, int] = {}
    for fr in frames:
        for st in (fr.get("stages") or {}).values():
            src = (st.get("artifacts") or {}).get("source")
            if src is not None:
                out[src] = out.get(src, 0) + 1
    return out


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def format_health(report: dict[str, Any]) -> str:
    """The report as text: a summary block, then each problem with its fix."""
    c, g, s, sp = report["compile"], report["cudagraphs"], report["step"], report["speed"]
    breaks = sum(c["graph_breaks"].values())
    lines = ["graphcomp health report",
             f"  compile     : {c['frames']} frame(s), {breaks} graph break(s), {c['recompiles']} recompile(s)"
             + (f"; {c['seconds']:.1f} s: " + ", ".join(f"{k} {v:.1f} s" for k, v in list(c["phase_seconds"].items())[:4])
                if c.get("phase_seconds") else "")
             + ("; graphs " + ", ".join(f"{n} {'compiled here' if k == 'compiled' else 'from ' + k}"
                                         for k, n in c["graphs_from"].items()) if c.get("graphs_from") else ""),
             f"  cuda graphs : {g['pieces_captured']} piece(s) captured, {len(g['eager_pieces'])} eager; "
             f"{g['captures']} capture(s), {g['replays']} replay(s), {g['recaptures'] + g['hazard_recaptures']} "
             f"re-capture(s), {g['cudagraph_fallbacks']} eager fallback call(s)"]
    whole = s["whole_step"]
    undecided = ("not decided yet (train_step decides after two steps)" if s["source"] == "train_step"
                 else "no whole-step capture")
    lines.append("  whole step  : " + (undecided if whole is None else
                                      "one CUDA graph" if s["whole_step_one_graph"] else f"not one graph: {whole}"))
    opt = s["optimizer"]
    lines.append(f"  optimizer   : {opt['mode'] or 'n/a'}" + (f" ({opt['reason']})" if opt.get("reason") else ""))
    tps, per, mem = sp["tokens_per_s"], sp["tokens_per_s_per_gpu"], sp["peak_memory"]
    unit = "GPU" if mem["device"] == "cuda" else "rank"
    lines.append("  throughput  : " + ("not measured" if tps is None else
                                      f"{tps:,.0f} tokens/s, {per:,.0f} tokens/s/{unit} ({sp['world']} rank(s))"))
    lines.append("  MFU         : " + ("n/a" if sp["mfu"] is None else f"{100 * sp['mfu']:.1f}%"))
    lines.append("  peak memory : " + (f"{_gib(mem['max_allocated_bytes'])} allocated, "
                                      f"{_gib(mem['max_reserved_bytes'])} reserved (CUDA)" if mem["device"] == "cuda"
                                      else f"{_gib(mem['max_rss_bytes'])} max RSS (CPU)"))
    ec = sp["exposed_comm"]
    lines.append("  exposed comm: " + (ec if isinstance(ec, str) else f"{100 * ec:.1f}% of step time"))
    for n in report["notes"]:
        lines.append(f"  note: {n}")
    if not report["problems"]:
        lines.append("  problems    : none found")
    for i, p in enumerate(report["problems"], 1):
        lines.append(f"  problem {i} [{p['kind']}]: {p['what']}")
        lines.append(f"    try: {p['fix']}")
    return "\n".join(lines)
