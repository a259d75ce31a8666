"""Memory model vs measured peak on one GPU (issue 5).

    python -m benchmarks.memcheck W2 off[,auto] [PASS[,PASS...]]

Trains the workload sharded with world size 1 (the graphs carry the collectives, so
the model sees what it sees on N GPUs, with N = 1) for 5 steps per CUDA-graph mode
and prints, per mode, the measured peak allocated memory, graphcomp's estimate
(``benchmarks.external.memory_estimate``: largest stage-graph peak + optimizer
state) and their ratio; ``$OUT/memcheck-<W>-1gpu.json`` gets everything. The
optional third argument names passes to switch off (e.g. ``chunk_lm_loss``, to
measure what that pass saves). On a CPU it is a dry run of the logic (zeros for
memory).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import graphcomp
import graphcomp

from . import workloads
from .external import memory_estimate
from .systems import make_optimizer, standard_step

_STAGE_KEYS = ("peak_bytes", "peak_bytes_allocated", "peak_node", "peak_bytes_inductor", "peak_node_inductor",
               "persistent_inputs")


def _no_cuda_memory_stats() -> None:
    """CPU dry run: the torch.cuda calls below become no-ops returning 0."""
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        setattr(torch.cuda, name, lambda *a, **k: None)
    torch.cuda.max_memory_allocated = torch.cuda.max_memory_reserved = lambda *a, **k: 0


def check(w: workloads.Workload, cudagraphs: str, dev: torch.device, disable: tuple[str, ...] = ()) -> dict:
    torch._dynamo.reset()
    graphcomp.reset()
    gc.collect()
    torch.cuda.empty_cache()
    t0 = time.time()
    model = workloads.build_model(w, dev, 0)
    graphcomp.shard(model, param_dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="graphcomp",
                             options={"cudagraphs": cudagraphs, "passes": {p: False for p in disable}})
    opt, _ = make_optimizer(model.parameters(), dev)
    step = standard_step(compiled, opt, dev, autocast=False)
    batches = workloads.make_batches(w, 5, 0, 1, 0, dev)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for b in batches:
        torch.cuda.synchronize()
        t = time.perf_counter()
        step(*b)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated()
    est = memory_estimate(opt)
    mems = {st: d.get("memory") for f in graphcomp.frame_summaries() for st, d in f["stages"].items()}
    r = {"cudagraphs": cudagraphs, "passes_off": list(disable), "sharded": True, "peak_alloc_gib": peak / 2**30,
         "peak_resv_gib": torch.cuda.max_memory_reserved() / 2**30,
         "est_gib": est.get("estimated_step_peak_bytes", 0) / 2**30, "estimate": est,
         "stage_mem": {k: {kk: v.get(kk) for kk in _STAGE_KEYS} for k, v in mems.items() if v},
         "step_ms": [round(x * 1e3, 1) for x in times], "wall_s": time.time() - t0,
         "counters": {k: v for k, v in graphcomp.counters.items()
                      if "captur" in k or "replay" in k or "fallback" in k or "copy_bytes" in k}}
    r["measured_over_est"] = r["peak_alloc_gib"] / r["est_gib"] if r["est_gib"] else None
    graphcomp.runtime.teardown()
    return r


def main(argv: list[str]) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    else:
        _no_cuda_memory_stats()
    w = workloads.get_workload(argv[0] if argv else "W2", warmup=2, steps=3)
    res = []
    disable = tuple(p for p in (argv[2] if len(argv) > 2 else "").split(",") if p)
    for mode in (argv[1] if len(argv) > 1 else "off").split(","):
        r = check(w, mode, dev, disable)
        print("MEMCHECK", json.dumps(r), flush=True)
        res.append(r)
    if os.environ.get("OUT"):
        tag = "".join(f"-no_{p}" for p in disable)
        with open(os.path.join(os.environ["OUT"], f"memcheck-{w.name}-1gpu{tag}.json"), "w") as f:
            json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
