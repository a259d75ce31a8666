"""Run the HF model zoo worker for many (family, mode) jobs, several at a time.

    python tests/gpu/hf_zoo_driver.py OUTDIR [--nproc 1] [--jobs 4] [--families a,b] [--modes parity,bf16]

Every job is ``torchrun --nproc-per-node NPROC tests/gpu/hf_zoo_worker.py FAMILY MODE
OUTDIR`` under a timeout, with its own rendezvous port and log
(``OUTDIR/<family>.<mode>.log``); compiles are CPU-bound, so jobs sharing one GPU
overlap well. Prints one line per job and writes ``OUTDIR/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)

ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(family: str, mode: str, outdir: str, nproc: int, timeout: float, extra_env: dict | None = None) -> dict:
    log = os.path.join(outdir, f"{family}.{mode}.log")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(_free_port()), os.path.join(HERE, "hf_zoo_worker.py"), family, mode, outdir]
    env = {**os.environ, **ENV, "TORCHINDUCTOR_COMPILE_THREADS": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "4"),
           **(extra_env or {})}
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=REPO).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    res = {"family": family, "mode": mode, "rc": rc, "seconds": round(time.time() - t0, 1), "log": log}
    path = os.path.join(outdir, f"{family}.{mode}.rank0.json")
    if os.path.exists(path):
        with open(path) as f:
            res["result"] = json.load(f)
    return res


def summarize(r: dict) -> str:
    d = r.get("result", {})
    head = f"{r['family']:<20} {r['mode']:<7} rc={r['rc']!s:<8} {r['seconds']:>6.1f}s"
    if not d.get("ok"):
        return f"{head} ERROR {d.get('error', '(no result)')[:300]}"
    if r["mode"] == "parity":
        return (f"{head} loss {d['loss_max_rel']:.1e} grad {d['grad_max_rel']:.1e} param {d['param_max_rel']:.1e} "
                f"fallbacks {d['counters'].get('cudagraph_fallbacks', 0)} captures {d['counters'].get('captures', 0)}")
    a = d["after_warmup"]
    return (f"{head} after warm-up: fallbacks {a['cudagraph_fallbacks']} recaptures {a['recaptures']} "
            f"hazard {a['hazard_recaptures']} | captured pieces {d['counters_end'].get('pieces_captured', 0)} "
            f"eager {d['counters_end'].get('pieces_eager', 0)} step {1e3 * sorted(d['step_seconds'])[len(d['step_seconds']) // 2]:.1f} ms")


def main() -> None:
    from benchmarks.hf_models import FAMILIES

    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--modes", default="parity,bf16")
    ap.add_argument("--timeout", type=float, default=420)
    a = ap.parse_args()
    os.makedirs(a.outdir, exist_ok=True)
    jobs = [(f, m) for f in a.families.split(",") for m in a.modes.split(",")]
    with ThreadPoolExecutor(a.jobs) as ex:
        results = list(ex.map(lambda j: run_job(j[0], j[1], a.outdir, a.nproc, a.timeout), jobs))
    for r in results:
        print(summarize(r), flush=True)
    with open(os.path.join(a.outdir, "summary.json"), "w") as f:
        json.dump([{k: v for k, v in r.items() if k != "result"} | {"ok": r.get("result", {}).get("ok", False)}
                   for r in results], f, indent=1)


if __name__ == "__main__":
    main()
