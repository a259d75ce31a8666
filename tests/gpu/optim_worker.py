"""GPU worker for graphcomp.optim.capture: ``torchrun --nproc-per-node N tests/gpu/optim_worker.py SCENARIO OUTDIR``
(also imported by tests/gpu/test_optim_gpu.py for the in-process 1-GPU run).

Each rank writes ``OUTDIR/optim_<scenario>.rank<R>.json``. Scenarios:

* ``numerics``: a sharded Llama("tiny") compiled with graphcomp (CUDA graphs on,
  eager codegen), 20 AdamW steps (fused, and foreach) with the captured step: clip
  at 1.0, a LambdaLR warm-up + decay, a NaN gradient injected at step 7 on the last
  rank. A twin of the model gets a clone of the same gradients every step and runs
  torch's eager ``clip_grad_norm_`` + ``opt.step()`` (lr as a float32 device tensor,
  ``capturable=True`` for foreach, the step skipped on the host when the norm is not
  finite). Parameters, optimizer state and norms must be bitwise equal after every
  step; counters show what ran captured. A second pass uses
  ``zero_grad(set_to_none=False)`` and gradient accumulation (two backwards a step).
* ``perf``: W1 (1 GPU: unsharded-size shards of world 1), eager codegen, fused and
  foreach AdamW: host time per step of eager clip + step vs the captured step
  (perf_counter around the call, no sync: what the host spends), ``ready()`` alone,
  device time per step (CUDA events around the step), and the private pool's
  reserved bytes (memory_snapshot segments of the step's pool).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time

for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(k, v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import graphcomp  # noqa: E402
import graphcomp.runtime  # noqa: E402
from graphcomp.models import Llama, synthetic_batch  # noqa: E402

STEPS = 20
NAN_STEP = 7


def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def _optimizer(params, kind, reference):
    kw = dict(lr=1e-3, weight_decay=0.1)
    if kind == "fused":
        kw["fused"] = True
    else:
        kw["foreach"] = True
        if reference:
            kw["capturable"] = True  # the captured step switches the optimizer to this (torch's graph-safe path)
    return torch.optim.AdamW(params, **kw)


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * 0.95 ** s)


def _reference_step(opt, lr_tensors, max_norm=1.0):
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    total = total.full_tensor() if isinstance(total, DTensor) else total
    if not bool(torch.isfinite(total)):
        return total
    saved = [g["lr"] for g in opt.param_groups]
    for g, t in zip(opt.param_groups, lr_tensors or ()):  # (None: the optimizer as the user built it)
        t.fill_(g["lr"])
        g["lr"] = t
    try:
        opt.step()
    finally:
        for g, v in zip(opt.param_groups, saved):
            g["lr"] = v
    return total


def _same(m, o, rm, ro):
    """(params equal, state equal) bitwise."""
    pe = all(torch.equal(_local(a), _local(b)) for a, b in zip(m.parameters(), rm.parameters()))
    se = True
    for a, b in zip(m.parameters(), rm.parameters()):
        sa, sb = o.state[a], ro.state[b]
        # (a fallback keeps the user's optimizer as built: its step counts may live on the host)
        se &= sa.keys() == sb.keys() and all(torch.equal(_local(sa[k]).to(_local(sb[k]).device), _local(sb[k]))
                                             for k in sa)
    return pe, se


def numerics(rank: int, world: int, kind: str, set_to_none: bool = True, micro: int = 1, device: str = "cuda") -> dict:
    """(``device="cpu"`` with a stand-in CUDA-graph device: a smoke run of this code on the CPU.)"""
    torch._dynamo.reset()
    graphcomp.reset()
    torch.manual_seed(0)
    m = Llama("tiny").to(device)
    m.reset_parameters(seed=0)
    graphcomp.shard(m)
    rm = copy.deepcopy(m)  # the twin: gets the same gradients, steps eagerly
    cm = torch.compile(m, backend="graphcomp", options={"codegen": "eager"})
    o = _optimizer(m.parameters(), kind, False)
    sched = _schedule(o)
    step = graphcomp.optim.capture(o, max_norm=1.0)
    # the twin: the graph-safe form the captured step runs (capturable, a device-tensor lr),
    # or, where graphcomp falls back to torch's own step, the optimizer as the user built it
    fallback = step.stats()["mode"] == "reference"
    ro = _optimizer(rm.parameters(), kind, not fallback)
    rsched = _schedule(ro)
    lr_tensors = None if fallback else [torch.zeros((), dtype=torch.float32, device=device) for _ in ro.param_groups]
    first_bad = None
    norms_equal = True
    for s in range(STEPS):
        for k in range(micro):
            tok, tgt = synthetic_batch(m.cfg, 4, 64, seed=1000 * rank + 10 * s + k, device=device)
            cm(tok, tgt).backward()
        if s == NAN_STEP and rank == world - 1:
            _local(next(iter(m.parameters())).grad).view(-1)[0] = float("nan")
        for a, b in zip(m.parameters(), rm.parameters()):
            b.grad = None if a.grad is None else a.grad.detach().clone()
        norm = step()
        rnorm = _reference_step(ro, lr_tensors)
        ok_norm = torch.equal(norm, rnorm) or bool(norm.isnan() & rnorm.isnan())
        norms_equal &= ok_norm
        pe, se = _same(m, o, rm, ro)
        if first_bad is None and not (pe and se and ok_norm):
            first_bad = {"step": s, "params": pe, "state": se, "norm": [float(norm), float(rnorm)]}
        o.zero_grad(set_to_none=set_to_none)
        ro.zero_grad()
        sched.step()
        rsched.step()
    step.sync_counters()
    pe, se = _same(m, o, rm, ro)
    c = {k: v for k, v in graphcomp.counters.items() if k.startswith(("optimizer_", "cudagraph_", "captures", "replays"))}
    return {"kind": kind, "set_to_none": set_to_none, "micro": micro, "params_equal": pe, "state_equal": se,
            "norms_equal": norms_equal, "first_bad": first_bad, "counters": c, "stats": step.stats(),
            "lr_is_float": all(isinstance(g["lr"], float) for g in o.param_groups),
            "if_nodes": graphcomp.runtime.RUNTIME.device.supports_if_nodes(), "if_node_probe": _if_probe()}


def _if_probe() -> dict:
    """What decides conditional-node support on this build (for the record)."""
    cls = getattr(torch.cuda, "CUDAGraph", None)
    return {"torch_cuda": torch.version.cuda,
            "python_api": bool(cls is not None and hasattr(cls, "begin_capture_to_if_node")),
            "c_api": bool(hasattr(torch._C, "_CUDAGraph") and hasattr(torch._C._CUDAGraph, "begin_capture_to_if_node"))}


def scenario_numerics(rank, world):
    out = {}
    for kind in ("fused", "foreach"):
        out[kind] = numerics(rank, world, kind)
    out["fused_accum_keep"] = numerics(rank, world, "fused", set_to_none=False, micro=2)
    out["released"] = graphcomp.runtime.teardown()
    return out


def _pool_reserved(pool) -> int:
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == tuple(pool))


def scenario_perf(rank, world):
    torch._dynamo.reset()
    graphcomp.reset()
    torch.manual_seed(0)
    m = Llama("W1").cuda()
    m.reset_parameters(seed=0)
    graphcomp.shard(m)
    cm = torch.compile(m, backend="graphcomp", options={"codegen": "eager"})
    local_bytes = sum(_local(p).numel() * _local(p).element_size() for p in m.parameters())
    out = {}
    for kind in ("fused", "foreach"):
        res = {"kind": kind, "params": sum(1 for _ in m.parameters()), "local_param_bytes": local_bytes}
        for mode in ("eager", "captured"):
            before = dict(graphcomp.counters)
            o = _optimizer(m.parameters(), kind, reference=False)  # as users build it
            step = graphcomp.optim.capture(o, max_norm=1.0) if mode == "captured" else None
            host, dev, ready = [], [], []
            for s in range(12):
                tok, tgt = synthetic_batch(m.cfg, 2, 256, seed=1000 * rank + s, device="cuda")
                cm(tok, tgt).backward()
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                t0 = time.perf_counter()
                if step is None:
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                    o.step()
                else:
                    step()
                host.append(time.perf_counter() - t0)
                e1.record()
                torch.cuda.synchronize()
                dev.append(e0.elapsed_time(e1) / 1e3)
                if step is not None and s >= 4:
                    t0 = time.perf_counter()
                    step.ready()
                    ready.append(time.perf_counter() - t0)
                o.zero_grad()
            tail = sorted(host[4:]), sorted(dev[4:])  # steps 4..: after warm-up and capture
            res[f"{mode}_host_us"] = tail[0][len(tail[0]) // 2] * 1e6
            res[f"{mode}_device_us"] = tail[1][len(tail[1]) // 2] * 1e6
            if step is not None:
                res["ready_us"] = sorted(ready)[len(ready) // 2] * 1e6
                res["pool_reserved"] = _pool_reserved(step._pool) if step._pool is not None else 0
                res["counters"] = {k: v - before.get(k, 0) for k, v in graphcomp.counters.items()
                                   if k.startswith("optimizer_")}
                res["stats"] = step.stats()
                step.release()
            del o, step
        out[kind] = res
    return out


def main():
    scenario, outdir = sys.argv[1], sys.argv[2]
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    res = {"numerics": scenario_numerics, "perf": scenario_perf}[scenario](rank, world)
    res["world"] = world
    with open(os.path.join(outdir, f"optim_{scenario}.rank{rank}.json"), "w") as f:
        json.dump(res, f, default=str)
    graphcomp.runtime.teardown()  # always before destroy_process_group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
