"""``graphcomp demo`` / ``make demo``: the main job, end to end.

Trains the ``demo`` Llama (graphcomp/models.py) for a few steps with
``graphcomp.shard`` + ``graphcomp.train_step`` (the README's loop) on 2 ranks: NCCL
on GPUs when there are enough, else gloo on the CPU. Rank 0 prints the loss of every
step, what each pass did (the ``graphcomp inspect`` table) and where the dumps are.

    python -m graphcomp.tools.cli demo                 # launches 2 ranks with torchrun
    python -m graphcomp.tools.cli demo -- --steps 10 --codegen eager --nproc 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="graphcomp demo")
    p.add_argument("--nproc", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--preset", default="demo", help="model preset from graphcomp.models.PRESETS")
    p.add_argument("--batch", type=int, default=4, help="global batch size (split over ranks)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--codegen", choices=["inductor", "eager"], default="inductor")
    p.add_argument("--dump-dir", default=os.path.abspath("graphcomp_dumps"), help="graph dumps ('': none)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="any graphcomp.Config field (repeatable; VALUE is JSON, else a string)")
    p.add_argument("--health-file", help="write the health report as JSON here; '{rank}' in the name gives every "
                                         "rank its own file (else rank 0 writes it)")
    return p


def launch(argv: list[str]) -> int:
    """Start ``--nproc`` ranks of :func:`main` with torch.distributed.run."""
    argv = [a for a in argv if a != "--"]
    args = _parser().parse_args(argv)
    env = dict(os.environ)
    for k, v in MULTICAST_OFF.items():
        env.setdefault(k, v)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           "--master-port", str(_free_port()), "-m", "graphcomp.tools.demo", *_without_nproc(argv)]
    print(f"[demo] launching: {' '.join(cmd)}", flush=True)
    return subprocess.call(cmd, env=env)


def _without_nproc(argv: list[str]) -> list[str]:
    """The ranks' arguments: ``argv`` without ``--nproc N`` / ``--nproc=N`` (the ranks
    read their number from torchrun; torchrun's own parser takes ``--nproc`` anywhere
    on its command line for an abbreviation of its ``--nproc-per-node`` and stops)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    from graphcomp.tools.options_arg import parse_options

    try:
        options = parse_options(args.option, {"codegen": args.codegen, "dump_dir": args.dump_dir or None})
    except ValueError as e:
        p.error(str(e))
    import torch
    import torch.distributed as dist

    import graphcomp
    from graphcomp.tools.inspect_dumps import format_summary
    from graphcomp.models import Llama, get_config, synthetic_batch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available() and torch.cuda.device_count() >= world)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)  # noqa: E731
    cfg = get_config(args.preset)
    if args.batch % world:
        raise ValueError(f"--batch {args.batch} must be divisible by the number of ranks {world}")
    say(f"[demo] {world} rank(s) on {'cuda/nccl' if use_cuda else 'cpu/gloo'}, preset {args.preset}, codegen {args.codegen}")

    torch.manual_seed(0)
    model = Llama(cfg).to(device)
    param_dtype = torch.bfloat16 if use_cuda else None
    graphcomp.shard(model, param_dtype=param_dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=use_cuda or None)
    step_fn = graphcomp.train_step(model, opt, max_norm=1.0, options=options)
    per_rank = args.batch // world
    try:
        for step in range(args.steps):
            tokens, targets = synthetic_batch(cfg, args.batch, args.seq, seed=step, device=device)
            tokens, targets = tokens[rank * per_rank:(rank + 1) * per_rank], targets[rank * per_rank:(rank + 1) * per_rank]
            t0 = time.perf_counter()
            lval = step_fn(tokens, targets)
            dist.all_reduce(lval)
            norm = step_fn.last_norm
            say(f"[demo] step {step}: loss {lval.item() / world:.4f}  grad-norm {float(norm):.3f}"
                f"  {time.perf_counter() - t0:.2f}s{'  (includes compile)' if step == 0 else ''}")
        say(f"[demo] whole step as one CUDA graph: {step_fn.whole_step_reason}")
        say("\n[demo] what each pass did (rank 0; `graphcomp inspect " + args.dump_dir + "` shows the same):\n")
        say(format_summary({"rank": rank, "frames": graphcomp.frame_summaries()}))
        say(f"\n[demo] dumps: {args.dump_dir}/rank*/ (summary.json, frameNNN/<stage>/NN-<pass>.before/after.txt)")
        say(f"[demo] counters: {dict(sorted(graphcomp.counters.items()))}")
        if args.health_file and (rank == 0 or "{rank}" in args.health_file):
            from graphcomp.tools.health import health_report

            with open(args.health_file.replace("{rank}", str(rank)), "w") as f:
                json.dump(health_report(step_fn, world=world), f, indent=1, default=str)
    finally:
        teardown = getattr(getattr(graphcomp, "runtime", None), "teardown", None)
        if teardown is not None:
            teardown()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
