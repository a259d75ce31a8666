"""Soak: many training steps with the sequence length varying per step (and per rank).

    torchrun --standalone --nproc-per-node N tests/gpu/soak.py OUTDIR [--steps 1000] [--preset demo]

A sharded Llama compiled with ``backend="graphcomp"`` (CUDA graphs on, Inductor),
fused AdamW through ``graphcomp.optim.capture``; every step draws its sequence length
from 4 buckets (a seeded stream per rank, so ranks train on different lengths at the
same step). Writes ``OUTDIR/soak.rank<R>.json``: Dynamo frames compiled and
recompiles, CUDA-graph counters, allocated / reserved memory every step after step
50 (the check: no growth), step times, and the time to tear down and exit.
``dynamic=False``: one Dynamo frame per bucket (4 frames, 3 recompiles), each
captured; with dynamic shapes the pieces would run eagerly (shapes follow the data).
(``--cpu``: a dry run of this script on gloo ranks, without CUDA graphs.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(k, v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import graphcomp  # noqa: E402
import graphcomp.runtime  # noqa: E402
from graphcomp.models import Llama, synthetic_batch  # noqa: E402

BUCKETS = (64, 96, 112, 128)
SETTLE = 50  # steps after which memory must not grow


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--preset", default="demo")
    p.add_argument("--codegen", default="inductor", choices=("inductor", "eager"),
                   help="eager: the pieces' FX code (fast compiles; the short rank-local capture check)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--hang-dump", type=float, default=0.0,
                   help="seconds after which every thread's stack is printed (0: never): a hang shows where it waits")
    a = p.parse_args()
    if a.hang_dump > 0:
        import faulthandler
        faulthandler.dump_traceback_later(a.hang_dump, exit=False)
    cuda = torch.cuda.is_available() and not a.cpu
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    m = Llama(a.preset).to(device)
    m.reset_parameters(seed=0)
    graphcomp.shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=cuda)
    step_fn = graphcomp.optim.capture(opt, max_norm=1.0)
    # one graph per bucket, each captured
    cm = torch.compile(m, backend="graphcomp", dynamic=False, options={"codegen": a.codegen})
    lengths = random.Random(1234 + rank)
    alloc, resv, times, seqs, losses = [], [], [], [], []
    t_start = time.perf_counter()
    for s in range(a.steps):
        seq = lengths.choice(BUCKETS)
        tok, tgt = synthetic_batch(m.cfg, a.batch, seq, seed=1000 * rank + s, device=device)
        t0 = time.perf_counter()
        loss = cm(tok, tgt)
        loss.backward()
        step_fn()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        seqs.append(seq)
        if s % 50 == 0 or s == a.steps - 1:
            losses.append(loss.detach().item())
            print(f"[soak] rank {rank}: step {s} seq {seq} loss {losses[-1]:.4f} at {time.perf_counter() - t_start:.1f} s, "
                  f"frames {graphcomp.counters.get('frames_compiled', 0)}", flush=True)
        if cuda:
            alloc.append(torch.cuda.memory_allocated())
            resv.append(torch.cuda.memory_reserved())
    wall = time.perf_counter() - t_start
    step_fn.sync_counters()
    counters = {k: v for k, v in graphcomp.counters.items() if not k.startswith("bytes")}
    after = slice(SETTLE, None)
    res = {
        "rank": rank, "world": world, "steps": a.steps, "preset": a.preset, "codegen": a.codegen, "buckets": BUCKETS,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
        "wall_s": wall, "losses_every_50": losses,
        "bucket_counts": {b: seqs.count(b) for b in BUCKETS},
        "first_step_of_bucket": {b: seqs.index(b) for b in BUCKETS if b in seqs},
        "step_ms_median_after_settle": 1e3 * sorted(times[after])[len(times[after]) // 2] if times[after] else None,
        "frames_compiled": counters.get("frames_compiled", 0), "recompiles": counters.get("recompiles", 0),
        "counters": counters, "optimizer": {k: v for k, v in step_fn.stats().items() if k != "decisions"},
        "allocated_at_settle": alloc[SETTLE - 1] if len(alloc) >= SETTLE else None,
        "allocated_max_after_settle": max(alloc[after]) if alloc[after] else None,
        "allocated_min_after_settle": min(alloc[after]) if alloc[after] else None,
        "reserved_at_settle": resv[SETTLE - 1] if len(resv) >= SETTLE else None,
        "reserved_max_after_settle": max(resv[after]) if resv[after] else None,
        "allocated_max_50_100": max(alloc[SETTLE:SETTLE + 50]) if len(alloc) > SETTLE else None,
        "allocated_max_last_100": max(alloc[-100:]) if alloc else None,
        "allocated_last": alloc[-1] if alloc else None, "reserved_last": resv[-1] if resv else None,
    }
    t0 = time.perf_counter()
    res["released_graphs"] = graphcomp.runtime.teardown()  # always before destroy_process_group
    dist.barrier()
    dist.destroy_process_group()
    res["teardown_s"] = time.perf_counter() - t0
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"soak.rank{rank}.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"[soak] rank {rank}: {a.steps} steps in {wall:.1f} s, frames {res['frames_compiled']}, "
          f"recompiles {res['recompiles']}, reserved at {SETTLE} {res['reserved_at_settle']} max after "
          f"{res['reserved_max_after_settle']}", flush=True)


if __name__ == "__main__":
    main()
