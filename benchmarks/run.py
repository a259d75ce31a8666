"""The benchmark launcher (a CLI: progress goes to stdout, from rank 0 only).

    torchrun --nproc-per-node N -m benchmarks.run --workload W1 --systems graphcomp,fsdp2,...
    python -m benchmarks.run --nproc 2 --workload smoke        # re-launches itself under torchrun
    graphcomp bench ...                                          # calls main(argv)

Every system runs in this one process sequence, one after another, from identical
weights and data; the results go to <out-dir>/<date>-<workload>-<N>gpu.{json,md,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import logging
import os
import socket
import subprocess
import sys
import time
import traceback

# NVLink multicast off before anything can initialise NCCL (required on the GPU machines)
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import warnings  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from . import measure, report, workloads  # noqa: E402
from .external import (  # noqa: E402
    ABLATION_PREFIX, ENABLE_PREFIX, EXTERNAL_BUILDERS, ablation_systems, pass_variant, variant_builder,
)
from .systems import BUILDERS, Ctx, NotRun  # noqa: E402
from .torchtitan_systems import TORCHTITAN_BUILDERS  # noqa: E402

log = logging.getLogger("benchmarks")

ALL_BUILDERS = {**BUILDERS, **TORCHTITAN_BUILDERS, **EXTERNAL_BUILDERS}
DEFAULT_SYSTEMS = "graphcomp,fsdp2,fsdp2_compile,ddp_compile,simplefsdp,deepspeed_z3,deepcompile"
RUN_LAST = ("deepspeed_z3", "deepcompile")  # DeepSpeed patches torch internals: keep it after the others


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workload", default="smoke",
                   help=f"one of {sorted(workloads.WORKLOADS)}, a comma list of them (run one after another in "
                        f"this process, one result file each) or hf-all (every hf-* workload)")
    p.add_argument("--systems", default=DEFAULT_SYSTEMS,
                   help=f"comma list from {sorted(ALL_BUILDERS)}, '{ABLATION_PREFIX}<pass>', '{ENABLE_PREFIX}<pass>', "
                        "'graphcomp-ablation' (every default-on pass off in turn) or 'all'")
    p.add_argument("--ablation", action="store_true", help="append graphcomp-ablation to --systems")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                   help="define a graphcomp system NAME (use it in --systems) from a JSON variant, e.g. "
                        "'graphcomp-mine={\"options\": {\"remat\": \"auto\"}}' (keys: see GRAPHCOMP_VARIANTS "
                        "in benchmarks/external.py); repeatable")
    p.add_argument("--warmup", type=int, help="steps before the measured window (workload default)")
    p.add_argument("--steps", type=int, help="measured steps (workload default)")
    p.add_argument("--batch", type=int, help="micro-batch per rank (workload default)")
    p.add_argument("--seq", type=int, help="sequence length (workload default)")
    p.add_argument("--activation-checkpointing", choices=("on", "off"), help="override the workload's setting")
    p.add_argument("--hf-size", choices=sorted(workloads.HF_SIZE_SHAPES),
                   help="hf-* workloads: model size (benchmarks/hf_models.py SIZES; default small); batch, seq "
                        "and step counts follow the size unless given")
    p.add_argument("--hf-dropout", type=float,
                   help="hf-* workloads: set every dropout of the model (default: the family's own)")
    p.add_argument("--memory-cap", type=float, default=None, metavar="GiB",
                   help="CUDA: every system must fit under this many GiB per GPU (torch.cuda.set_per_process_memory_"
                        "fraction; a system that does not fit fails with the reason); graphcomp gets it as its "
                        "memory_budget. Pair with <system>-ac / <system>-noac to find the fastest configuration that fits")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: ranks form a (world/N, N) mesh ('dp', 'tp'); graphcomp (TP plan + "
                        "shard over dp) vs fsdp2/fsdp2_compile + TP (torchtitan's recipe); Llama workloads only")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--tag", default="", help="suffix of the output file names")
    p.add_argument("--warm-compile", action="store_true",
                   help="after the run, reset Dynamo, rebuild and time the first step again (costs a compile)")
    p.add_argument("--fresh-cache", action="store_true",
                   help="each system compiles with a fresh, empty Inductor cache (truly cold compile times)")
    p.add_argument("--profile", action="store_true", help="profile a few extra steps for the GPU idle share")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--trace", default="", help="comma-separated systems whose profiled steps are also written as a "
                                               "Chrome trace of rank 0 (<out-dir>/<date>-<W>-<N>gpu[-tag]-<system>"
                                               ".trace.json.gz); needs --profile")
    p.add_argument("--trace-ranks", default="0", help="comma-separated ranks whose traces --trace writes (default 0; "
                                                      "rank R > 0 adds -rankR to the file name): a step waiting in "
                                                      "collectives on rank 0 shows where the slower rank spends it")
    p.add_argument("--log-every", type=int, default=10, help="progress line every N steps")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--cpu", action="store_true", help="force CPU + gloo even if CUDA is there")
    p.add_argument("--pg-timeout", type=float, default=900.0, help="process-group timeout, seconds")
    p.add_argument("--nproc", type=int, default=None,
                   help="when not already under torchrun: re-launch under torch.distributed.run with N ranks")
    args = p.parse_args(argv)
    try:
        _trace_ranks(args.trace_ranks)
    except ValueError as e:  # refused at start, not after a system's compile
        p.error(str(e))
    return args


# --------------------------------------------------------------------------- setup
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_distributed(args) -> tuple[torch.device, int, int]:
    if "RANK" not in os.environ:  # plain `python -m benchmarks.run`: one rank
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    timeout = _dt.timedelta(seconds=args.pg_timeout)
    if torch.cuda.is_available() and not args.cpu:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device, rank, world


def _with_checkpointing(builder, on: bool):
    """``builder`` run on the workload with ``activation_checkpointing=on``."""
    def build(ctx: Ctx):
        w = ctx.workload
        if w.family is not None and on:
            raise NotRun(f"activation checkpointing is not supported for the HF workload {w.name!r}")
        return builder(dataclasses.replace(ctx, workload=dataclasses.replace(w, activation_checkpointing=on)))

    return build


def add_variant(spec: str) -> str:
    """``NAME=JSON`` from ``--variant``: a graphcomp system named NAME; returns NAME."""
    import json

    from .external import check_variant

    name, sep, text = spec.partition("=")
    name = name.strip()
    if not sep or not name:
        raise SystemExit(f"--variant {spec!r}: expected NAME=JSON, e.g. 'graphcomp-mine={{\"options\": {{}}}}'")
    if name in ALL_BUILDERS:
        raise SystemExit(f"--variant {name!r}: a system of that name exists already; pick another name")
    try:
        variant = check_variant(name, json.loads(text))
    except (json.JSONDecodeError, ValueError) as e:
        raise SystemExit(f"--variant {spec!r}: {e}") from None
    ALL_BUILDERS[name] = variant_builder(name, variant)
    return name


def expand_systems(spec: str, ablation: bool) -> list[tuple[str, object]]:
    """[(name, builder | NotRun)] in run order (DeepSpeed systems last)."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    ac_names: dict[str, tuple[str, bool]] = {}  # fsdp2_compile-noac: fsdp2_compile, checkpointing off
    for n in names:
        base, on = report.split_ac_suffix(n)
        if on is not None:
            if base not in ALL_BUILDERS:
                raise SystemExit(f"unknown system {base!r} in {n!r}; '{n[len(base):]}' follows one of "
                                 f"{sorted(ALL_BUILDERS)}")
            ac_names[n] = (base, on)
    names = [n for n in names if n not in ac_names]
    if "all" in names:
        i = names.index("all")
        names[i:i + 1] = ["graphcomp", "fsdp2", "fsdp2_compile", "ddp", "ddp_compile", "inductor",
                          "simplefsdp", "graph_trainer", "deepspeed_z3", "deepcompile", "graphcomp-ablation"]
    if ablation and "graphcomp-ablation" not in names:
        names.append("graphcomp-ablation")
    out: list[tuple[str, object]] = []
    for n in names:
        if n == "graphcomp-ablation":
            abl, reason = ablation_systems()
            if reason:
                out.append((n, NotRun(f"ablation needs the pass list: {reason}")))
            elif not abl:
                out.append((n, NotRun("graphcomp registers no pass that is on by default: nothing to ablate")))
            out += [(a, variant_builder(a, pass_variant(a))) for a in abl]
        elif pass_variant(n) is not None:
            out.append((n, variant_builder(n, pass_variant(n))))
        elif n in ALL_BUILDERS:
            out.append((n, ALL_BUILDERS[n]))
        else:
            raise SystemExit(f"unknown system {n!r}; valid: {sorted(ALL_BUILDERS)}, {ABLATION_PREFIX}<pass>, "
                             f"graphcomp-ablation, all")
    for n, (base, on) in ac_names.items():
        out.append((n, _with_checkpointing(ALL_BUILDERS[base], on)))
    seen, uniq = set(), []
    for n, b in out:
        if n not in seen:
            seen.add(n)
            uniq.append((n, b))
    last = sorted((x for x in uniq if x[0] in RUN_LAST), key=lambda x: RUN_LAST.index(x[0]))
    return [x for x in uniq if x[0] not in RUN_LAST] + last


# --------------------------------------------------------------------------- one system
class Printer:
    def __init__(self, rank: int):
        self.rank = rank

    def __call__(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)


def _cleanup(built, device) -> None:
    if built is not None and built.teardown is not None:
        try:
            built.teardown()
        except Exception as e:  # noqa: BLE001
            log.warning("teardown failed: %s", e)


def _reset(device) -> None:
    measure.free_memory(device)
    torch._dynamo.reset()
    measure.free_memory(device)


def _fresh_inductor_cache():
    """A temporary Inductor cache dir with in-memory caches cleared: truly cold compiles."""
    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache
    return fresh()


def _timed_first_step(built, batch, device) -> tuple[torch.Tensor, float]:
    measure.sync(device)
    t0 = time.perf_counter()
    loss = built.step(*batch)
    measure.sync(device)
    return loss, time.perf_counter() - t0


def _phase_diff(after: dict[str, float], before: dict[str, float], top: int = 30) -> dict[str, float]:
    """The ``top`` largest per-phase second counts of ``after - before`` (phases nest:
    their sum is not the first step's time)."""
    d = {k: round(v - before.get(k, 0.0), 3) for k, v in after.items() if v - before.get(k, 0.0) > 1e-3}
    return dict(sorted(d.items(), key=lambda kv: -kv[1])[:top])


def _trace_ranks(text: str) -> set[int]:
    try:
        return {int(x) for x in text.split(",") if x.strip()}
    except ValueError:
        raise ValueError(f"--trace-ranks: {text!r} is not a comma-separated list of ranks (e.g. 0,1)") from None


def _failure_text(e: BaseException) -> str:
    """Exception text plus the innermost frames (and those of a backend's own error,
    which Dynamo wraps in BackendCompilerFailed)."""
    msg = " ".join(str(e).replace("Set TORCHDYNAMO_VERBOSE=1", "\n").split("\n")[0:3]).split()
    text = f"{type(e).__name__}: {' '.join(msg)[:400]}\n" + "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-6))
    inner = getattr(e, "inner_exception", None)
    if isinstance(inner, BaseException):
        text += "\ninner exception:\n" + "".join(
            traceback.format_exception(type(inner), inner, inner.__traceback__, limit=-10))
    return text


def run_system(name: str, builder, ctx: Ctx, args, batches, matmul_tflops, P: Printer) -> dict:
    w, device = ctx.workload, ctx.device
    res = {"status": "ok", "reason": None, "config": None, "metrics": report.empty_metrics(), "stats": {}}
    t_sys = time.perf_counter()
    built = None
    total = w.warmup + w.steps
    stack = contextlib.ExitStack()
    try:
        if isinstance(builder, NotRun):
            raise builder
        measure.reset_memory(device)
        dyn0 = measure.dynamo_stats()
        if args.fresh_cache:
            stack.enter_context(_fresh_inductor_cache())
        built = builder(ctx)
        res["config"] = built.config
        measure.free_memory(device)  # peak memory = the training steps, not the full-model build
        measure.reset_memory(device)
        P(f"[bench] system={name} {'compiling' if built.compiles else 'first step'}...")
        ph0, gp0 = measure.compile_phase_seconds(), measure.graphcomp_pass_seconds()
        loss0, cold = _timed_first_step(built, batches[0], device)
        res["stats"]["first_step_phases_s"] = _phase_diff(measure.compile_phase_seconds(), ph0)
        if name.startswith("graphcomp"):
            res["stats"]["first_step_graphcomp_s"] = _phase_diff(measure.graphcomp_pass_seconds(), gp0)
        losses = [loss0]
        P(f"[bench] system={name} first step {cold:.1f} s{' (compile)' if built.compiles else ''} "
          f"loss={loss0.item():.4f}")
        if built.compiles:
            top = list(res["stats"]["first_step_phases_s"].items())[:10]
            gc_s = res["stats"].get("first_step_graphcomp_s", {})
            P(f"[bench] system={name} first-step phases (s, nested): {top}"
              + (f"; graphcomp: {list(gc_s.items())[:8]}" if gc_s else ""))
        timer = measure.StepTimer(device)
        host: list[float] = []  # wall time of each measured step() call on the host (no synchronization)
        t_log, last = time.perf_counter(), 0
        for s in range(1, total):
            if s == w.warmup:
                if built.on_window is not None:
                    built.on_window("start")
                timer.mark()
            h0 = time.perf_counter()
            losses.append(built.step(*batches[s]))
            if s >= w.warmup:
                host.append((time.perf_counter() - h0) * 1e3)
                timer.mark()
            if (s + 1) % args.log_every == 0 or s == total - 1:
                lv = losses[-1].item()
                dt = (time.perf_counter() - t_log) / (s - last) * 1e3
                t_log, last = time.perf_counter(), s
                phase = "measure" if s >= w.warmup else "warmup"
                P(f"[bench] system={name} step {s + 1}/{total} ({phase}) loss={lv:.4f} {dt:.1f} ms")
        times = timer.times_ms()
        if built.on_window is not None:
            built.on_window("end")
        alloc, resv = measure.peak_memory_gib(device)
        dyn1 = measure.dynamo_stats()
        loss_t = torch.stack([x.float() for x in losses]).double()
        if ctx.world > 1:
            dist.all_reduce(loss_t)
            loss_t /= ctx.world
        med, alloc, resv, host_med = measure.allreduce_floats(
            [measure.median(times), alloc, resv, measure.median(host)], "max", device)
        m = res["metrics"]
        tps = w.batch * w.seq / ctx.tp / (med / 1e3)  # a dp group's tp GPUs share its micro-batch
        fpt = ctx.flops_per_token if ctx.flops_per_token is not None else workloads.model_info(w)["flops_per_token"]
        m.update(tokens_per_s_per_gpu=tps, step_time_ms_median=med, host_ms_per_step_median=host_med,
                 step_times_ms=[round(t, 3) for t in times],
                 mfu=fpt * tps / measure.PEAK_BF16_FLOPS,
                 mfu_vs_measured_matmul=(fpt * tps / (matmul_tflops * 1e12)) if matmul_tflops else None,
                 peak_mem_allocated_gib=alloc, peak_mem_reserved_gib=resv, compile_cold_s=cold,
                 losses=loss_t.tolist(), loss_first=loss_t[w.warmup].item(), loss_last=loss_t[-1].item(),
                 dynamo_graphs=dyn1.get("graphs", 0) - dyn0.get("graphs", 0),
                 dynamo_graph_breaks=dyn1.get("graph_breaks", 0) - dyn0.get("graph_breaks", 0))
        P(f"[bench] system={name} median {med:.1f} ms/step, {tps:,.0f} tokens/s/GPU"
          + (f", peak {alloc:.2f} GiB" if alloc is not None else ""))
        # extras: a failure here keeps the numbers above and is recorded in stats
        if args.profile:
            def more(n):
                for i in range(n):
                    built.step(*batches[i % total])
            try:
                tpath = None
                if ctx.rank in _trace_ranks(args.trace_ranks) and name in {x.strip() for x in args.trace.split(",") if x.strip()}:
                    tpath = f"{args.trace_base}-{name}{f'-rank{ctx.rank}' if ctx.rank else ''}.trace.json.gz"
                prof = measure.gpu_idle_share(more, args.profile_steps, device, trace_path=tpath)
            except Exception as e:  # noqa: BLE001
                prof = {"error": _failure_text(e)}
            m["gpu_idle_share"], m["gpu_compute_idle_share"] = prof.get("idle"), prof.get("compute_idle")
            m["exposed_comm_share"] = prof.get("exposed_comm")
            res["stats"]["profile"] = prof
        if built.stats is not None:
            try:
                res["stats"].update(built.stats())
            except Exception as e:  # noqa: BLE001
                res["stats"]["stats_error"] = _failure_text(e)
        if args.warm_compile and built.compiles:
            _cleanup(built, device)
            built = None
            _reset(device)
            P(f"[bench] system={name} warm compile (fresh build after dynamo reset)...")
            try:
                built = builder(ctx)
                _, warm = _timed_first_step(built, batches[0], device)
                m["compile_warm_s"] = warm
                P(f"[bench] system={name} warm first step {warm:.1f} s")
            except Exception as e:  # noqa: BLE001
                res["stats"]["warm_compile_error"] = _failure_text(e)
                P(f"[bench] system={name} warm compile failed: {type(e).__name__}: {e}"[:300])
    except NotRun as e:
        res.update(status="not run", reason=str(e), metrics=report.empty_metrics())
    except Exception as e:  # noqa: BLE001 - record, never a number
        why = _failure_text(e)
        if ctx.memory_cap_bytes is not None and isinstance(e, torch.OutOfMemoryError):
            why = f"does not fit under --memory-cap {ctx.memory_cap_bytes / 2**30:g} GiB: {why}"
        res.update(status="failed", reason=why, metrics=report.empty_metrics())
    finally:
        _cleanup(built, device)
        built = None
        _reset(device)
        stack.close()
    # agree across ranks: a system counts only if it ran on every rank
    failed = measure.allreduce_floats([0.0 if res["status"] == "ok" else 1.0], "max", device)[0]
    if failed and res["status"] == "ok":
        res.update(status="failed", reason="failed on another rank", metrics=report.empty_metrics())
    res["metrics"]["wall_s"] = time.perf_counter() - t_sys
    if res["status"] != "ok":
        P(f"[bench] system={name} {res['status'].upper()}: {(res['reason'] or '').splitlines()[0][:400]}")
    P(f"[bench] system={name} done in {res['metrics']['wall_s']:.1f} s")
    return res


# --------------------------------------------------------------------------- main
def _output_stem(args, w, world) -> str:
    os.makedirs(args.out_dir, exist_ok=True)
    date = _dt.date.today().isoformat()
    tp = f"-tp{args.tp}" if getattr(args, "tp", 1) > 1 else ""
    stem = os.path.join(args.out_dir, f"{date}-{w.label}-{world}gpu{tp}{('-' + args.tag) if args.tag else ''}")
    if os.path.exists(stem + ".json"):
        stem += _dt.datetime.now().strftime("-%H%M%S")
    return stem


def _relaunch(args, argv: list[str]) -> int:
    """Re-run this module under torch.distributed.run with --nproc ranks."""
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        rest.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "benchmarks.run", *rest]
    print("[bench] launching: " + " ".join(cmd), flush=True)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    return subprocess.call(cmd, env=env)


def expand_workloads(spec: str) -> list[str]:
    """Workload names of ``--workload``: a comma list; ``hf-all`` = every hf-* workload."""
    names: list[str] = []
    for n in (x.strip() for x in spec.split(",")):
        if not n:
            continue
        add = [k for k in workloads.WORKLOADS if k.startswith("hf-")] if n == "hf-all" else [n]
        names += [a for a in add if a not in names]
    if not names:
        raise SystemExit("benchmarks.run: --workload is empty")
    return names


def run_workload(w: workloads.Workload, systems, args, env: dict, device, rank: int, world: int, P: Printer) -> dict:
    """Every system on workload ``w``; writes <stem>.json/.md/.png (rank 0) after each."""
    model_info = workloads.model_info(w)
    stem = _output_stem(args, w, world) if rank == 0 else None
    n_params = model_info["params"]
    result = {
        "schema": report.SCHEMA_VERSION, "workload": w.to_json(), "model": model_info,
        "env": env, "args": vars(args), "systems": {}, "loss_parity": None, "targets": [], "notes": [],
    }
    model_desc = f"preset={w.preset}" if w.family is None else f"model={model_info['hf_class']} size={w.preset}"
    P(f"[bench] workload={w.name} {model_desc} params={n_params / 1e6:.4g}M batch={w.batch} seq={w.seq} "
      f"world={world} device={env['device_name']} systems={','.join(n for n, _ in systems)}")
    args.trace_base = os.path.join(args.out_dir, f"{_dt.date.today().isoformat()}-{w.label}-{world}gpu"
                                                 f"{('-' + args.tag) if args.tag else ''}")
    # with --tp, the tp ranks of one dp group train on the same micro-batch
    batches = workloads.make_batches(w, w.warmup + w.steps, rank // args.tp, world // args.tp, args.seed, device)
    for name, builder in systems:
        ctx = Ctx(workload=w, device=device, rank=rank, world=world, seed=args.seed,
                  flops_per_token=model_info["flops_per_token"], tp=args.tp,
                  memory_cap_bytes=None if args.memory_cap is None else int(args.memory_cap * 2**30))
        result["systems"][name] = run_system(name, builder, ctx, args, batches,
                                             env["matmul_bf16_tflops_measured"], P)
        result["loss_parity"] = report.loss_parity(result["systems"], w.warmup)
        # BENCHMARKS.md's targets are for sharding alone: a --tp run has none
        result["targets"] = ([] if args.tp > 1 else
                             report.evaluate_targets(w.name, world, result["systems"], family=w.family))
        if rank == 0:  # after every system, so a timeout keeps what finished
            result["notes"] = report.write_all(stem, result, png=not args.no_png)
    if rank == 0:
        for note in result["notes"]:
            P(f"[bench] note: {note}")
        P(report.markdown(result))
        P(f"[bench] wrote {stem}.json, {stem}.md" + ("" if args.no_png or result["notes"] else f", {stem}.png"))
    del batches
    measure.free_memory(device)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.nproc and "LOCAL_RANK" not in os.environ:
        return _relaunch(args, argv)
    # DeepSpeed calls collectives that torch >= 2.13 deprecates: one line per call otherwise
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    logging.basicConfig(level=os.environ.get("BENCH_LOG", "WARNING"),
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    ac = None if args.activation_checkpointing is None else args.activation_checkpointing == "on"
    try:  # every workload is checked before any process group starts
        ws = [workloads.get_workload(n, batch=args.batch, seq=args.seq, warmup=args.warmup, steps=args.steps,
                                     activation_checkpointing=ac, hf_size=args.hf_size, hf_dropout=args.hf_dropout)
              for n in expand_workloads(args.workload)]
    except ValueError as e:
        raise SystemExit(f"benchmarks.run: {e}") from None
    if args.tp < 1:
        raise SystemExit(f"benchmarks.run: --tp must be >= 1, got {args.tp}")
    if args.tp > 1 and any(w.family is not None for w in ws):
        raise SystemExit("benchmarks.run: --tp runs graphcomp's Llama workloads (W1, W2, W3, smoke-tp); the hf-* "
                         "workloads have no tensor-parallel plan in the harness")
    for spec in args.variant:
        add_variant(spec)
    systems = expand_systems(args.systems, args.ablation)
    if args.memory_cap is not None and (args.memory_cap <= 0 or args.cpu or not torch.cuda.is_available()):
        raise SystemExit(f"benchmarks.run: --memory-cap {args.memory_cap}: needs a CUDA device and a positive "
                         f"number of GiB (it caps torch.cuda's allocator per GPU)")
    device, rank, world = setup_distributed(args)
    P = Printer(rank)
    try:
        if world % args.tp:
            raise SystemExit(f"benchmarks.run: --tp {args.tp} does not divide the world size {world}")
        if args.memory_cap is not None:
            total = torch.cuda.get_device_properties(device).total_memory
            if args.memory_cap * 2**30 > total:
                raise SystemExit(f"benchmarks.run: --memory-cap {args.memory_cap} GiB exceeds this GPU's "
                                 f"{total / 2**30:.1f} GiB")
            torch.cuda.set_per_process_memory_fraction(args.memory_cap * 2**30 / total, device)
        env = measure.environment(device, world)
        env["memory_cap_gib"] = args.memory_cap
        mm = measure.bf16_matmul_tflops(device)
        env["matmul_bf16_tflops_measured"] = measure.allreduce_floats([mm], "min", device)[0]
        os.makedirs(args.out_dir, exist_ok=True)
        for w in ws:
            run_workload(w, systems, args, env, device, rank, world, P)
    finally:
        torch._dynamo.reset()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
