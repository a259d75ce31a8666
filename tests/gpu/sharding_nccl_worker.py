"""2-GPU NCCL check of issue 4 (launched by test_sharding_nccl.py under torchrun).

Every rank trains the sharded, compiled tiny Llama for STEPS SGD steps on its slice
of the global batch, for each (fuse, bucket) combination; rank 0 also trains the
unsharded eager reference on the whole batch. Writes a JSON verdict to argv[1].
"""

import itertools
import json
import os
import sys

import torch
import torch.distributed as dist

import graphcomp
from graphcomp.models import Llama, synthetic_batch
from graphcomp.sharding.shard import full_state_dict

STEPS, BATCH, SEQ = 10, 4, 32


def reference(device, steps):
    torch.manual_seed(0)
    m = Llama("tiny").to(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        tok, tgt = synthetic_batch(m.cfg, BATCH, SEQ, seed=step, device=device)
        loss = m(tok, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().float().cpu() for k, v in m.state_dict().items()}


def sharded(device, rank, world, fuse, bucket, codegen, param_dtype, steps, cudagraphs="auto"):
    torch._dynamo.reset()
    graphcomp.reset()
    torch.manual_seed(0)
    m = Llama("tiny").to(device)
    graphcomp.shard(m, param_dtype=param_dtype)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    opts = {"codegen": codegen, "bucket_bytes": 12288, "cudagraphs": cudagraphs if cuda_ok() else "off",
            "passes": {"fuse_allgather_downcast": fuse, "bucket_collectives": bucket}}
    cm = torch.compile(m, backend="graphcomp", options=opts)
    losses = []
    for step in range(steps):
        tok, tgt = synthetic_batch(m.cfg, BATCH, SEQ, seed=step, device=device)
        loss = cm(tok[rank::world], tgt[rank::world])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        l = loss.detach().clone()
        dist.all_reduce(l)
        losses.append(l.item() / world)
    return losses, {k: v.float().cpu() for k, v in full_state_dict(m).items()}, dict(graphcomp.counters)


def cuda_ok():
    return torch.cuda.is_available()


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main():
    out_path = sys.argv[1]
    cuda = torch.cuda.is_available()  # gloo on the CPU: a dry run of this script's logic
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    report = {"world": world, "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None, "runs": []}
    ok = True
    ref_losses, ref_params = reference(device, STEPS) if rank == 0 else (None, None)
    runs = [(f, b, "eager", None, "auto") for f, b in itertools.product([True, False], [True, False])]
    runs += [(True, True, "inductor", None, "off"), (True, True, "inductor", None, "auto"),
             (False, False, "inductor", None, "auto")]
    runs += [(f, b, "eager", torch.bfloat16, "auto") for f, b in itertools.product([True, False], [True, False])]
    bf16_base = None
    for fuse, bucket, codegen, pdt, cg in runs:
        losses, params, counters = sharded(device, rank, world, fuse, bucket, codegen, pdt, STEPS, cg)
        if rank != 0:
            continue
        entry = {"fuse": fuse, "bucket": bucket, "codegen": codegen, "param_dtype": str(pdt), "cudagraphs": cg,
                 "captures": counters.get("captures", 0), "replays": counters.get("replays", 0),
                 "bytes_gathered": {k: v for k, v in counters.items() if k.startswith("bytes_gathered")},
                 "buckets": counters.get("collective_buckets", 0), "gathers_fused": counters.get("gathers_fused", 0)}
        if pdt is None:
            entry["loss_max_rel"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            entry["param_max_rel"] = max(rel(params[k], ref_params[k]) for k in ref_params)
            tol = 1e-5 if codegen == "eager" else 1e-4
            entry["ok"] = entry["loss_max_rel"] <= tol and entry["param_max_rel"] <= tol
        else:
            # bf16: casting before or after a gather is the same rounding: bitwise equal across combos
            if bf16_base is None:
                bf16_base = (losses, params)
            entry["bitwise_equal_to_first_bf16_run"] = losses == bf16_base[0] and all(
                torch.equal(params[k], bf16_base[1][k]) for k in params)
            entry["loss_rel_vs_fp32_ref"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            entry["ok"] = entry["bitwise_equal_to_first_bf16_run"] and entry["loss_rel_vs_fp32_ref"] < 2e-2
        ok &= entry["ok"]
        report["runs"].append(entry)
        print(json.dumps(entry), flush=True)
    if rank == 0:
        report["ok"] = ok
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
