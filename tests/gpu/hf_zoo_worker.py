"""GPU worker for the HF model zoo: ``torchrun --nproc-per-node N tests/gpu/hf_zoo_worker.py FAMILY MODE OUTDIR``.

Each rank writes ``OUTDIR/<family>.<mode>.rank<R>.json`` (also on failure, with the
traceback). Modes:

* ``parity``: fp32, dropout 0, default graphcomp options (Inductor, CUDA graphs
  ``auto``): ``STEPS`` SGD steps with clipping vs an unsharded eager reference on the
  global batch: losses, step-1 gradients (before clipping) and final parameters. (SGD:
  an update linear in the gradient; AdamW's sign-like first steps would hide a
  scaled gradient.) A tensor's error is relative to its reference norm, floored at
  1e-3 of the largest tensor's (the gradient of a bias before a softmax is rounding
  noise).
* ``bf16``: ``graphcomp.shard(param_dtype=bf16)``, the family's default dropout,
  default options, ``BF16_STEPS`` steps of ``loss.backward(); clip; opt.step();
  opt.zero_grad()``; the CUDA-graph counters after warm-up (step ``WARM``) and at the
  end, the pieces and their reasons, every warning.

``GC_ZOO_SIZE`` picks the size (``benchmarks.hf_models.SIZES``; default ``gpu-tiny``);
``GC_ZOO_LAYERS`` overrides its layer count (deep models: ``compile_regions="auto"``).
``GC_ZOO_EMBEDDING`` is ``graphcomp.shard``'s ``embedding`` (default ``gather``); the
result's ``exchanged`` lists the embeddings that exchange tokens.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings

for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(k, v)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import graphcomp  # noqa: E402
import graphcomp.runtime  # noqa: E402
from benchmarks import hf_models as zoo  # noqa: E402

STEPS = 8
LR = 0.1
BF16_STEPS = 20
WARM = 4  # counters must not move after this many bf16 steps
BATCH, SEQ = 2, 64  # per rank
DEV = os.environ.get("GC_ZOO_DEVICE", "cuda")  # "cpu" (gloo) to check the worker itself
EMBEDDING = os.environ.get("GC_ZOO_EMBEDDING", "gather")  # shard(embedding=...)
LAYERS = int(os.environ["GC_ZOO_LAYERS"]) if os.environ.get("GC_ZOO_LAYERS") else None  # the size's when unset
CG_COUNTERS = ("cudagraph_fallbacks", "recaptures", "hazard_recaptures", "captures", "replays",
               "pieces_captured", "pieces_eager", "capture_failures", "pieces_turned_eager")


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _counters() -> dict[str, int]:
    return {k: int(v) for k, v in graphcomp.counters.items() if not k.startswith("bytes")}


def _pieces() -> list[dict]:
    rows = []
    for f in graphcomp.frame_summaries():
        for stage, d in f["stages"].items():
            for r in d.get("partitions", []):
                rows.append({"frame": f["frame"], "stage": stage, **{k: v for k, v in r.items() if k != "runner"}})
    return rows


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Logical-shape full gradients of a sharded model, by parameter name."""
    from graphcomp.sharding.shard import shard_info

    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        mod_name, _, attr = name.rpartition(".")
        info = shard_info(model.get_submodule(mod_name), attr)
        out[name] = p.grad.full_tensor().narrow(0, 0, info.rows).reshape(info.shape).float().clone()  # (world 1: a view of p.grad, which clipping scales)
    return out


def _exchanged(model: torch.nn.Module) -> list[str]:
    """The embeddings that exchange tokens (``shard(embedding="exchange")``), by module name."""
    return [n for n, mod in model.named_modules() if "_graphcomp_exchange" in mod.__dict__]


def _global_batches(model, steps, world, seed0=0):
    return [zoo.make_batch(model, BATCH * world, SEQ, seed=seed0 + s, device=DEV) for s in range(steps)]


def run_parity(family: str, rank: int, world: int) -> dict:
    size = os.environ.get("GC_ZOO_SIZE", "gpu-tiny")
    ref = zoo.build_model(family, size, seed=0, device=DEV, dropout=0.0, layers=LAYERS)
    batches = _global_batches(ref, STEPS, world)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    ref_losses, ref_g1 = [], {}
    for s, b in enumerate(batches):
        loss = ref(**b).loss
        loss.backward()
        if s == 0:
            ref_g1 = {n: p.grad.detach().float().clone() for n, p in ref.named_parameters() if p.grad is not None}
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        ref_losses.append(float(loss))
    ref_params = {n: p.detach().float().clone() for n, p in ref.named_parameters()}
    del ref, opt

    m = zoo.build_model(family, size, seed=0, device=DEV, dropout=0.0, layers=LAYERS)
    graphcomp.shard(m, embedding=EMBEDDING)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    cm = torch.compile(m, backend="graphcomp")
    losses, g1 = [], {}
    for s, b in enumerate(batches):
        loss = cm(**zoo.split_batch(b, rank, world)).loss
        loss.backward()
        if s == 0:
            g1 = _full_grads(m)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        losses.append(float(lt) / world)
    from graphcomp.sharding.shard import full_state_dict

    params = {k: v.float() for k, v in full_state_dict(m, cpu=False).items()}

    gfloor = 1e-3 * max(float(g.norm()) for g in ref_g1.values())
    pfloor = 1e-3 * max(float(p.norm()) for p in ref_params.values())

    def rel(a, b, floor):
        return float((a - b).norm()) / max(float(b.norm()), floor)

    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    grad_rel = {n: rel(g1[n], ref_g1[n], gfloor) for n in ref_g1 if n in g1}
    names = {n for n, _ in m.named_parameters()}
    param_rel = {n: rel(params[n], ref_params[n], pfloor) for n in ref_params if n in names and n in params}
    return {
        "losses": losses, "ref_losses": ref_losses, "loss_max_rel": loss_rel,
        "grad_max_rel": max(grad_rel.values()) if grad_rel else None,
        "grad_missing": sorted(set(ref_g1) - set(g1)),
        "param_max_rel": max(param_rel.values()) if param_rel else None,
        "worst_grad": max(grad_rel, key=grad_rel.get) if grad_rel else None,
        "worst_param": max(param_rel, key=param_rel.get) if param_rel else None,
        "counters": _counters(), "exchanged": _exchanged(m),
    }


def run_bf16(family: str, rank: int, world: int) -> dict:
    size = os.environ.get("GC_ZOO_SIZE", "gpu-tiny")
    m = zoo.build_model(family, size, seed=0, device=DEV, layers=LAYERS)  # the family's default dropout
    graphcomp.shard(m, param_dtype=torch.bfloat16, embedding=EMBEDDING)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    cm = torch.compile(m, backend="graphcomp")
    losses, warm, times = [], None, []
    for s in range(BF16_STEPS):
        b = zoo.make_batch(m, BATCH, SEQ, seed=1000 * rank + s, device=DEV)
        _sync()
        t0 = time.perf_counter()
        loss = cm(**b).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        _sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        if s + 1 == WARM:
            warm = _counters()
    end = _counters()
    return {
        "losses": losses, "step_seconds": times, "counters_warm": warm, "counters_end": end,
        "after_warmup": {k: end.get(k, 0) - (warm or {}).get(k, 0) for k in CG_COUNTERS},
        "finite": all(x == x and abs(x) < 1e4 for x in losses), "exchanged": _exchanged(m),
    }


def main() -> None:
    family, mode, outdir = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(outdir, exist_ok=True)
    if DEV == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if DEV == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    res: dict = {"family": family, "mode": mode, "world": world, "ok": False}
    rec: list = []
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            res.update({"parity": run_parity, "bf16": run_bf16}[mode](family, rank, world))
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001 - recorded, then re-raised
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        res["counters"] = _counters()
        raise
    finally:
        res["warnings"] = sorted({f"{x.category.__name__}: {x.message}" for x in rec or () if "graphcomp" in str(x.message)})
        res["pieces"] = _pieces()
        with open(os.path.join(outdir, f"{family}.{mode}.rank{rank}.json"), "w") as f:
            json.dump(res, f, default=str, indent=1)
        try:
            graphcomp.runtime.teardown()  # always before destroy_process_group
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
