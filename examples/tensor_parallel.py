"""Tensor parallel + sharding (2-D) with graphcomp: a runnable example.

    torchrun --nproc-per-node 4 examples/tensor_parallel.py              # 4 CPU ranks (gloo): dp=2 x tp=2
    torchrun --nproc-per-node 8 examples/tensor_parallel.py --tp 4 --preset W1 --seq-len 1024   # 8 GPUs

Ranks form a ``(dp, tp)`` mesh. Tensor parallelism (``parallelize_module`` with the
Llama's plan: column-/row-wise attention and MLP, sequence parallel, loss parallel)
places the weights on ``mesh["tp"]``; ``graphcomp.shard`` then shards them over
``mesh["dp"]``; the whole model is compiled with ``backend="graphcomp"``. The ranks
of one tp group read the same batch; each dp group its own.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

import graphcomp
from graphcomp.models import Llama, synthetic_batch, tp_plan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (divides the world size)")
    p.add_argument("--preset", default="tiny-tp", help="graphcomp.models preset (vocabulary divisible by --tp)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=2, help="sequences per dp rank")
    p.add_argument("--seq-len", type=int, default=32, help="divisible by --tp (sequence parallel)")
    p.add_argument("--codegen", default="inductor", choices=("inductor", "eager"))
    p.add_argument("--ckpt-dir", default=None, help="save a torch.distributed.checkpoint here at the end")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))

    torch.manual_seed(0)  # the same initial weights on every rank
    model = Llama(args.preset).to(device)
    parallelize_module(model, mesh["tp"], tp_plan(model, sequence_parallel=True, loss_parallel=True))
    graphcomp.shard(model, mesh=mesh, dp_dim="dp",  # params: 2-D DTensors (dp shard of the tp shard)
                    param_dtype=torch.bfloat16 if cuda else None, reduce_dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after shard(): on the shards
    cmodel = torch.compile(model, backend="graphcomp", options={"codegen": args.codegen})

    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    for step in range(args.steps):
        tokens, targets = synthetic_batch(model.cfg, args.batch_size * dp_size, args.seq_len, seed=step, device=device)
        rows = slice(dp_rank * args.batch_size, (dp_rank + 1) * args.batch_size)  # this dp group's sequences
        with loss_parallel():  # the logits stay vocabulary-sharded over tp
            loss = cmodel(tokens[rows], targets[rows])
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # global over dp and tp
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach().to_local()  # a replicated DTensor under loss_parallel
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        if dist.get_rank() == 0:
            print(f"step {step + 1}/{args.steps} | loss {loss.item() / dp_size:.4f} | "
                  f"grad-norm {norm.full_tensor().item():.3f}", flush=True)
    if args.ckpt_dir:
        dcp.save(model.state_dict(), checkpoint_id=args.ckpt_dir)  # DTensors of the full shapes, on the 2-D mesh
        if dist.get_rank() == 0:
            print(f"saved {args.ckpt_dir}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
