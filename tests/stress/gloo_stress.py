"""Stress loop for multi-rank CPU (gloo) training with several collectives in flight.

Issue 16: 2- and 4-rank gloo training with ``schedule_prefetch`` reordering CPU
graphs crashed intermittently with heap corruption ("double free or corruption",
"malloc(): unaligned tcache chunk"). This loop trains a small sharded Llama
(``graphcomp.models``) with ``schedule_prefetch`` reordering CPU graphs
(``--prefetch-cpu on``; graphcomp's default leaves them alone), again and again,
each iteration under a timeout, with glibc's heap checks on, and counts what died::

    python tests/stress/gloo_stress.py --iters 50 --ranks 2 --prefetch-cpu on
    python tests/stress/gloo_stress.py --iters 50 --ranks 4 --prefetch-cpu on --contention 2

One iteration = on every rank: ``--steps`` training steps (forward, backward, SGD
step) of the sharded model; every ``--recompile-every`` iterations (default: each)
first a fresh compile (Dynamo and graphcomp reset) with the next configuration of
a fixed cycle (fuse / bucket / reshard_after_forward / prefetch cap / codegen).
The ranks are reused between iterations (starting processes that import torch
costs seconds); after a crash or a timeout they are killed and the next iteration
starts fresh ones.

Every rank's stderr (faulthandler stacks, glibc's abort messages) goes to
``<log-dir>/rank<r>-pid<p>.log``; a crash's message is classified from there.
Exit status: 0 when no iteration failed, 1 otherwise. The summary line is
machine-readable (``--json``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "cpu"))  # _dist.DistPool
sys.path.insert(0, str(HERE.parents[1]))  # graphcomp from this checkout

GLOBAL_BATCH, SEQ = 8, 32

# (fuse, bucket, reshard_after_forward, prefetch_bytes, codegen): every scheduling shape
# the passes produce on CPU graphs, cycled over iterations
CONFIGS = [
    dict(fuse=f, bucket=b, reshard=r, prefetch_bytes=p, codegen=c)
    for (f, b), r, p, c in itertools.product(
        [(True, True), (False, False), (True, False)], [True, False], [1 << 20, 8192], ["eager", "inductor"]
    )
]

MALLOC_ENV = {
    # glibc: abort on any detected heap inconsistency, and fill freed / fresh chunks
    # with a pattern so a use-after-free reads garbage instead of the old values
    "MALLOC_CHECK_": "3",
    "MALLOC_PERTURB_": "165",
    "LIBC_FATAL_STDERR_": "1",  # glibc's fatal messages to stderr, not /dev/tty
    "PYTHONFAULTHANDLER": "1",
}

SIGNALS = {6: "SIGABRT", 11: "SIGSEGV", 7: "SIGBUS", 4: "SIGILL", 8: "SIGFPE", 9: "SIGKILL"}
PATTERNS = [
    "double free or corruption",
    "malloc(): unaligned tcache chunk",
    "free(): invalid pointer",
    "corrupted size vs. prev_size",
    "malloc(): ",
    "free(): ",
    "Segmentation fault",
    "Fatal Python error",
]


def _redirect_stderr() -> None:
    """Rank setup (before every task): send this process's fd 2 to its own log file, once."""
    if os.environ.get("GRAPHCOMP_STRESS_REDIRECTED") == "1":
        return
    log_dir = os.environ["GRAPHCOMP_STRESS_LOG_DIR"]
    rank = os.environ.get("RANK", "x")
    path = os.path.join(log_dir, f"rank{rank}-pid{os.getpid()}.log")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    import faulthandler

    faulthandler.enable(file=sys.stderr, all_threads=True)
    os.environ["GRAPHCOMP_STRESS_REDIRECTED"] = "1"


_STATE: dict = {}  # per rank process: the compiled model of the current configuration


def _train(rank: int, world: int, cfg: dict, steps: int, seed: int, prefetch_cpu: bool | None,
           recompile: bool = True) -> dict:
    """One iteration on one rank: ``steps`` SGD steps of the sharded tiny Llama; a fresh
    compile first when ``recompile`` (or when this rank has no model yet)."""
    import torch
    import torch.distributed as dist

    import importlib

    import graphcomp

    gc_backend = importlib.import_module("graphcomp.compiler.backend")
    from graphcomp.models import Llama, synthetic_batch
    from graphcomp.compiler.plan import FramePlan

    # the knob (graphcomp.compiler.plan.FramePlan.prefetch_cpu_graphs) for every frame compiled here;
    # None: graphcomp's default
    gc_backend.FramePlan = FramePlan if prefetch_cpu is None else (lambda: FramePlan(prefetch_cpu_graphs=prefetch_cpu))
    if recompile or not _STATE:
        _STATE.clear()
        torch._dynamo.reset()
        graphcomp.reset()
        torch.manual_seed(seed)
        m = Llama("tiny")
        graphcomp.shard(m)
        options = {
            "codegen": cfg["codegen"],
            "bucket_bytes": 4096,
            "prefetch_bytes": cfg["prefetch_bytes"],
            "reshard_after_forward": cfg["reshard"],
            "passes": {"fuse_allgather_downcast": cfg["fuse"], "bucket_collectives": cfg["bucket"]},
        }
        # the backend function itself: works without `pip install` (no entry point needed)
        _STATE.update(m=m, opt=torch.optim.SGD(m.parameters(), lr=0.1),
                      cm=torch.compile(m, backend=gc_backend.graphcomp_backend, options=options))
    m, opt, cm = _STATE["m"], _STATE["opt"], _STATE["cm"]
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        tok, tgt = synthetic_batch(m.cfg, GLOBAL_BATCH, SEQ, seed=seed * 1000 + step)
        loss = cm(tok[rank::world], tgt[rank::world])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / world)
    c = graphcomp.counters
    return {
        "losses": losses,
        "seconds": time.perf_counter() - t0,
        # frames schedule_prefetch reordered in this iteration's compile (0 without one)
        "prefetch_changed": int(dict(c).get("pass:schedule_prefetch:changed", 0)) if recompile else 0,
    }


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += 1


def _start_contention(n: int) -> list[subprocess.Popen]:
    """``n`` busy-looping processes (CPU contention: ranks get descheduled mid-collective)."""
    code = "import time\nwhile True:\n    sum(range(10000))\n"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def _classify(text: str) -> str:
    for p in PATTERNS:
        if p in text:
            line = next(line for line in text.splitlines() if p in line)
            return line.strip()[:160]
    return ""


def _new_log_text(log_dir: Path, seen: dict[str, int]) -> str:
    out = []
    for f in sorted(log_dir.glob("rank*.log")):
        data = f.read_text(errors="replace")
        start = seen.get(f.name, 0)
        if len(data) > start:
            out.append(f"--- {f.name}\n{data[start:]}")
        seen[f.name] = len(data)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20, help="iterations (fresh compile + --steps steps each)")
    ap.add_argument("--ranks", type=int, default=2, choices=[2, 4], help="gloo ranks")
    ap.add_argument("--steps", type=int, default=4, help="training steps per iteration")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds one iteration may take")
    ap.add_argument("--recompile-every", type=int, default=1,
                    help="compile afresh (next configuration) every K iterations; the others train the same model")
    ap.add_argument("--contention", type=int, default=0, help="busy-looping processes beside the ranks")
    ap.add_argument("--prefetch-cpu", choices=["default", "on", "off"], default="default",
                    help="schedule_prefetch on CPU graphs (FramePlan.prefetch_cpu_graphs); "
                         "default: graphcomp's default (off)")
    ap.add_argument("--codegen", choices=["eager", "inductor", "cycle"], default="cycle",
                    help="restrict the config cycle to one codegen")
    ap.add_argument("--no-malloc-checks", action="store_true", help="run without MALLOC_CHECK_/MALLOC_PERTURB_")
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="extra environment for the ranks")
    ap.add_argument("--log-dir", default=None, help="where rank stderr logs go (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the summary to this JSON file")
    args = ap.parse_args(argv)
    if args.iters < 1:
        ap.error(f"--iters must be >= 1, got {args.iters}")
    if args.recompile_every < 1:
        ap.error(f"--recompile-every must be >= 1, got {args.recompile_every}")

    from _dist import DistPool, RankError

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="gloo_stress_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {"GRAPHCOMP_STRESS_LOG_DIR": str(log_dir)}
    if not args.no_malloc_checks:
        env.update(MALLOC_ENV)
    for kv in args.env:
        k, _, v = kv.partition("=")
        env[k] = v
    configs = [c for c in CONFIGS if args.codegen in ("cycle", c["codegen"])]
    contention = _start_contention(args.contention)
    summary = {"iterations": 0, "ok": 0, "crashes": 0, "timeouts": 0, "errors": 0, "signals": {},
               "messages": {}, "ranks": args.ranks, "steps_per_iteration": args.steps,
               "recompile_every": args.recompile_every, "compiles": 0,
               "prefetch_cpu": args.prefetch_cpu, "contention": args.contention,
               "malloc_checks": not args.no_malloc_checks, "prefetch_changed_frames": 0, "failures": []}
    seen: dict[str, int] = {}
    t_start = time.monotonic()
    pool = DistPool(args.ranks, timeout=args.timeout, env=env, setup=_redirect_stderr)
    try:
        for it in range(args.iters):
            cfg = configs[(it // args.recompile_every) % len(configs)]
            recompile = it % args.recompile_every == 0 or not pool.alive  # fresh ranks have no model
            t0 = time.monotonic()
            status, detail = "ok", ""
            try:
                knob = None if args.prefetch_cpu == "default" else args.prefetch_cpu == "on"
                res = pool.run(_train, cfg, args.steps, it, knob, recompile, timeout=args.timeout)
                summary["prefetch_changed_frames"] += res[0]["prefetch_changed"]
                summary["compiles"] += int(recompile)
                if not all(r["losses"] == res[0]["losses"] for r in res):
                    status, detail = "error", "ranks disagree on the loss"
            except TimeoutError as e:
                status, detail = "timeout", str(e)
            except RankError as e:
                detail = str(e)
                codes = re.search(r"exit codes (\{[^}]*\})", detail)
                if codes:
                    status = "crash"
                    for code in re.findall(r"-?\d+:\s*(-?\d+)", codes.group(1)):
                        sig = SIGNALS.get(-int(code), f"exit {code}") if int(code) < 0 else f"exit {code}"
                        summary["signals"][sig] = summary["signals"].get(sig, 0) + 1
                else:
                    status = "error"
            summary["iterations"] += 1
            text = _new_log_text(log_dir, seen)
            if status == "ok":
                summary["ok"] += 1
            else:
                summary["crashes" if status == "crash" else status + "s"] += 1
                msg = _classify(text + "\n" + detail) or (detail.splitlines()[0][:160] if detail else status)
                summary["messages"][msg] = summary["messages"].get(msg, 0) + 1
                summary["failures"].append({"iter": it, "status": status, "config": cfg, "message": msg})
                (log_dir / f"failure-{it}.txt").write_text(detail + "\n" + text)
            print(f"[stress] iter {it + 1}/{args.iters} {status:7s} {time.monotonic() - t0:6.1f}s cfg={cfg}"
                  + (f"  {detail.splitlines()[0][:200] if detail else ''}" if status != "ok" else ""), flush=True)
    finally:
        pool.close()
        for p in contention:
            p.kill()
            p.wait()
    summary["seconds"] = round(time.monotonic() - t_start, 1)
    summary["log_dir"] = str(log_dir)
    print("[stress] SUMMARY " + json.dumps({k: v for k, v in summary.items() if k != "failures"}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0 if summary["ok"] == summary["iterations"] else 1


if __name__ == "__main__":
    sys.exit(main())
