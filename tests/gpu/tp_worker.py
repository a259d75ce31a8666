"""Tensor parallel (launched by test_tp_gpu.py under torchrun): tp = $GC_TP (default:
the world size) on a (world / tp, tp) mesh ("dp", "tp"): tp=2, dp=1 on 2 GPUs, the
2x2 mesh on 4.

Every rank applies ``graphcomp.models.tp_plan`` (sequence parallel; loss parallel in
the ``lp`` runs) to the ``tiny-tp`` Llama on ``mesh["tp"]``, shards it with
``graphcomp.shard(mesh=mesh, dp_dim="dp")`` and trains STEPS SGD steps, for each run
of RUNS; each dp rank trains on its share of the batch (``[dp_rank::dp]``), and the
recorded loss is the mean over the dp ranks. Rank 0 also trains the unsharded eager
reference on the whole batch. A run records its losses,
parameters, graphcomp's counters and, from the frame summaries, every tensor-parallel
collective of the compiled graphs with the piece that holds it and that piece's mode,
and graphcomp's own (dp) collectives that sit outside a captured piece.
Rank 0 writes the verdict JSON to argv[1].

On the CPU (gloo) the same script is a dry run of its logic: CUDA graphs are off
there and nothing is captured.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

import graphcomp
from graphcomp.models import Llama, get_config, synthetic_batch, tp_plan
from graphcomp.sharding.shard import full_state_dict


STEPS, BATCH, SEQ = 10, 4, 32
# (name, codegen, cudagraphs, loss_parallel, param_dtype)
RUNS = [
    ("eager-off", "eager", "off", False, None),
    ("eager-on", "eager", "auto", False, None),
    ("eager-lp-off", "eager", "off", True, None),
    ("eager-lp-on", "eager", "auto", True, None),
    ("eager-bf16-off", "eager", "off", False, torch.bfloat16),
    ("eager-bf16-on", "eager", "auto", False, torch.bfloat16),
    ("inductor-off", "inductor", "off", False, None),
    ("inductor-on", "inductor", "auto", False, None),
]
CONFIG = get_config("tiny-tp")


def reference(device):
    torch.manual_seed(0)
    m = Llama(CONFIG).to(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    losses = []
    for step in range(STEPS):
        tok, tgt = synthetic_batch(m.cfg, BATCH, SEQ, seed=step, device=device)
        loss = m(tok, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().float().cpu() for k, v in m.state_dict().items()}


def graph_collectives(foreign: bool) -> list[dict]:
    """Every TP collective (``foreign=True``) or every graphcomp collective
    (``foreign=False``) of the compiled fwd/bwd graphs with its piece's mode."""
    out = []
    for f in graphcomp.frame_summaries():
        for stage in ("fwd", "bwd"):
            st = f["stages"].get(stage)
            if not st:
                continue
            modes = {f"piece_{r['piece']}": r["mode"] for r in st.get("partitions", [])}
            for c in st["collectives"]:
                if bool(c["foreign"]) == foreign:
                    piece = c.get("piece")
                    out.append({"stage": stage, "kind": c["kind"], "piece": piece,
                                "mode": modes.get(piece) if piece else None})
    return out


def train(device, mesh, codegen, cudagraphs, lp, param_dtype):
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    torch._dynamo.reset()
    graphcomp.reset()
    torch.manual_seed(0)
    m = Llama(CONFIG).to(device)
    dp, dpr = mesh["dp"].size(), mesh["dp"].get_local_rank()
    parallelize_module(m, mesh["tp"], tp_plan(m, sequence_parallel=True, loss_parallel=lp))
    graphcomp.shard(m, mesh=mesh, dp_dim="dp", param_dtype=param_dtype)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    opts = {"codegen": codegen, "cudagraphs": cudagraphs if device.type == "cuda" else "off"}
    cm = torch.compile(m, backend="graphcomp", options=opts)
    losses = []
    for step in range(STEPS):
        tok, tgt = synthetic_batch(m.cfg, BATCH, SEQ, seed=step, device=device)
        tok, tgt = tok[dpr::dp], tgt[dpr::dp]  # this dp rank's sequences (dp=1: the whole batch)
        with loss_parallel() if lp else contextlib.nullcontext():
            loss = cm(tok, tgt)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        loss = (loss.to_local() if hasattr(loss, "to_local") else loss).clone()
        if dp > 1:
            dist.all_reduce(loss, group=mesh["dp"].get_group())
        losses.append(loss.item() / dp)
    params = {k: v.float().cpu() for k, v in full_state_dict(m).items()}
    dp_colls = [c for c in graph_collectives(foreign=False) if c["mode"] != "cudagraph"]
    return losses, params, dict(graphcomp.counters), graph_collectives(foreign=True), dp_colls


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main():
    out_path = sys.argv[1]
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from torch.distributed.device_mesh import init_device_mesh

    tp = int(os.environ.get("GC_TP", world))
    if world % tp:
        raise SystemExit(f"tp_worker: GC_TP={tp} does not divide the world size {world}")
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    report = {"world": world, "tp": tp, "dp": world // tp, "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None, "runs": {}}
    ref_losses, ref_params = reference(device) if rank == 0 else (None, None)
    results = {}
    for name, codegen, cg, lp, pdt in RUNS:
        losses, params, counters, colls, dp_not_captured = train(device, mesh, codegen, cg, lp, pdt)
        results[name] = (losses, params)
        if rank != 0:
            continue
        entry = {"codegen": codegen, "cudagraphs": cg, "loss_parallel": lp, "param_dtype": str(pdt),
                 "losses": losses, **{k: counters.get(k, 0) for k in (
                     "captures", "replays", "pieces_captured", "pieces_eager", "cudagraph_fallbacks", "recaptures",
                     "capture_failures")},
                 "tp_collectives": len(colls),
                 "tp_collectives_by_stage": {s: sum(c["stage"] == s for c in colls) for s in ("fwd", "bwd")},
                 "tp_collectives_not_captured": [c for c in colls if c["mode"] != "cudagraph"],
                 "graphcomp_collectives_not_captured": dp_not_captured,
                 "eager_pieces": [f"{f['frame']}/{s}/{pt.get('piece')}: {pt.get('reason')}"
                                  for f in graphcomp.frame_summaries() for s, st in f["stages"].items()
                                  for pt in st.get("partitions", []) if pt.get("mode") != "cudagraph"],
                 "graphcomp_collectives": sum(1 for f in graphcomp.frame_summaries() for s in ("fwd", "bwd")
                                              for c in f["stages"].get(s, {}).get("collectives", []) if not c["foreign"])}
        if pdt is None:
            entry["loss_max_rel"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            entry["param_max_rel"] = max(rel(params[k], ref_params[k]) for k in ref_params)
        base = name.replace("-on", "-off")
        if name.endswith("-on") and base in results:  # CUDA graphs on vs off
            bl, bp = results[base]
            entry["bitwise_equal_to_" + base] = losses == bl and all(torch.equal(params[k], bp[k]) for k in params)
            entry["loss_max_rel_vs_" + base] = max(abs(a - b) / abs(b) for a, b in zip(losses, bl))
        report["runs"][name] = entry
        long = ("losses", "tp_collectives_not_captured", "graphcomp_collectives_not_captured")
        short = {k: v for k, v in entry.items() if k not in long}
        short.update({k: len(entry[k]) for k in long[1:]})
        print(json.dumps({"run": name, **short}), flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    import graphcomp.runtime as gc_runtime

    gc_runtime.teardown()  # the captured graphs hold NCCL work: release them first
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
