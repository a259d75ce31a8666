"""Time to the first step: compile-once across ranks and the compile cache across runs.

Runs ``graphcomp demo`` (``graphcomp.shard`` + ``graphcomp.train_step`` on a
``graphcomp.models`` preset) for one optimizer step, ``--nproc`` ranks under
``torchrun``, once per scenario, and records each run's wall time (process start to
exit: imports, model, compile, the step), the CPU seconds of the whole process tree
(every rank and Inductor's compile workers) and, from every rank's health report,
the compile time per phase and where each stage graph came from.

Scenarios (every run starts with an empty Inductor cache of its own, as on a fresh
machine: a ``TMPDIR`` of its own, where Inductor's default cache lives):

* ``cold-every-rank``: ``compile_once=False``, every rank compiles (the baseline);
* ``cold-once``: ``compile_once=True``, rank 0 compiles, the others load its
  artifacts; it also writes the compile cache (``cache_dir``);
* ``warm``: a new job with ``cache_dir`` pointing at the cache ``cold-once`` wrote.

    python -m benchmarks.compile_start --nproc 4 --model demo --out benchmarks/results/compile_start_cpu
    python -m benchmarks.compile_start --nproc 1 --model W3-narrow --seq-len 8192 --batch-size 1 --out $OUT/start

Writes ``compile_start.json`` and ``compile_start.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCENARIOS = ("cold-every-rank", "cold-once", "warm")


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_job(args: argparse.Namespace, scenario: str, work: pathlib.Path, cache: pathlib.Path) -> dict:
    tmpdir = work / f"tmp-{scenario}"  # a TMPDIR of its own: Inductor's default cache starts empty
    shutil.rmtree(tmpdir, ignore_errors=True)
    tmpdir.mkdir(parents=True)
    health = work / f"health-{scenario}-{{rank}}.json"
    env = dict(os.environ, TMPDIR=str(tmpdir), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env.pop(var, None)
    env.pop("GRAPHCOMP_CACHE_DIR", None)
    options = ["--option", f"compile_once={'false' if scenario == 'cold-every-rank' else 'true'}"]
    if scenario != "cold-every-rank":
        options += ["--option", f"cache_dir={cache}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc), "--master-port",
           str(args.port), "-m", "graphcomp.tools.demo", "--preset", args.model, "--steps", "1",
           "--batch", str(args.batch_size * args.nproc), "--seq", str(args.seq_len), "--dump-dir", "",
           "--health-file", str(health), *options, *args.extra]
    cpu0, t0 = _cpu_children(), time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    wall, cpu = time.perf_counter() - t0, _cpu_children() - cpu0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"{scenario}: the job failed (exit {proc.returncode})")
    ranks = []
    for r in range(args.nproc):
        rep = json.loads(pathlib.Path(str(health).replace("{rank}", str(r))).read_text())
        ranks.append({"rank": r, "compile_seconds": rep["compile"]["seconds"],
                      "phase_seconds": rep["compile"]["phase_seconds"], "graphs_from": rep["compile"]["graphs_from"]})
    return {"scenario": scenario, "wall_seconds": round(wall, 2), "cpu_seconds": round(cpu, 2), "ranks": ranks}


def markdown(res: dict) -> str:
    base = res["runs"][0]  # (cold-every-rank when it ran)
    lines = [f"# Time to the first step: {res['model']}, {res['nproc']} rank(s), {res['device']}", "",
             f"torch {res['torch']}, commit {res['commit']}, {res['date']}. One optimizer step of "
             "`graphcomp demo` per run, each with an empty Inductor cache; wall time from process start "
             "to exit, CPU seconds of every rank and compile worker.", "",
             f"| scenario | wall s | vs {base['scenario']} | CPU s (all ranks) | vs {base['scenario']} | rank 0 compile s | graphs (rank 0 / others) |",
             "|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        r0 = r["ranks"][0]
        others = {}
        for rk in r["ranks"][1:]:
            for k, n in rk["graphs_from"].items():
                others[k] = others.get(k, 0) + n
        fmt = lambda d: ", ".join(f"{n} {k}" for k, n in d.items()) or "-"  # noqa: E731
        lines.append(f"| {r['scenario']} | {r['wall_seconds']:.1f} | {r['wall_seconds'] / base['wall_seconds']:.2f}x | "
                     f"{r['cpu_seconds']:.1f} | {r['cpu_seconds'] / base['cpu_seconds']:.2f}x | "
                     f"{r0['compile_seconds']:.1f} | {fmt(r0['graphs_from'])} / {fmt(others)} |")
    lines += ["", "Compile seconds per phase, rank 0:", ""]
    for r in res["runs"]:
        top = ", ".join(f"{k} {v:.1f}" for k, v in list(r["ranks"][0]["phase_seconds"].items())[:6])
        lines.append(f"- {r['scenario']}: {top}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--model", default="demo")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma list of {SCENARIOS}")
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    p.add_argument("--out", required=True)
    p.add_argument("extra", nargs="*", help="more arguments for graphcomp demo (after --)")
    args = p.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    bad = sorted(set(scenarios) - set(SCENARIOS))
    if bad:
        p.error(f"unknown scenario(s) {bad}; valid: {list(SCENARIOS)}")
    import torch

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="compile_start-"))
    cache = work / "graphcomp-cache"
    runs = []
    for sc in scenarios:
        runs.append(run_job(args, sc, work, cache))
        print(json.dumps(runs[-1]), flush=True)
    res = {"model": args.model, "nproc": args.nproc, "seq_len": args.seq_len, "batch_size": args.batch_size,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)",
           "torch": torch.__version__, "commit": os.environ.get("BENCH_GIT_COMMIT") or _commit(),
           "date": time.strftime("%Y-%m-%d"), "runs": runs}
    (out / "compile_start.json").write_text(json.dumps(res, indent=1))
    (out / "compile_start.md").write_text(markdown(res))
    print(markdown(res))
    shutil.rmtree(work, ignore_errors=True)
    return 0


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
