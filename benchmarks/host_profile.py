"""Where the host time of one training step goes: cProfile over the measured steps of
one benchmark system (one rank), printed by own time and by cumulative time.

    python -m benchmarks.host_profile --workload W1 --system graphcomp [--steps 20] [--out FILE]

The GPU work is not synchronized per step (as in ``benchmarks.run``), so the profile is
the host's own work: Python, dispatch, launches, and any host sync the step makes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch
import torch.distributed as dist

from . import workloads
from .run import ALL_BUILDERS, _free_port
from .systems import Ctx


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="W1")
    p.add_argument("--system", default="graphcomp", choices=sorted(ALL_BUILDERS))
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=45)
    p.add_argument("--out", help="also write the report here")
    a = p.parse_args(argv)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    w = workloads.get_workload(a.workload, warmup=a.warmup, steps=a.steps)
    ctx = Ctx(workload=w, device=device, rank=0, world=1, seed=0,
              flops_per_token=workloads.model_info(w)["flops_per_token"])
    built = ALL_BUILDERS[a.system](ctx)
    batches = workloads.make_batches(w, 4, 0, 1, 0, device)
    for i in range(a.warmup):
        built.step(*batches[i % 4])
    if cuda:
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for i in range(a.steps):
        built.step(*batches[i % 4])
    prof.disable()
    host = (time.perf_counter() - t0) / a.steps * 1e3
    if cuda:
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / a.steps * 1e3
    buf = io.StringIO()
    buf.write(f"{a.system} on {a.workload}, {a.steps} steps: host {host:.2f} ms/step under cProfile "
              f"(wall incl. final sync {wall:.2f} ms/step)\n")
    for key in ("tottime", "cumulative"):
        buf.write(f"\n==== by {key}\n")
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(a.top)
    text = buf.getvalue()
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    if built.teardown is not None:
        built.teardown()
    try:
        import graphcomp.runtime

        graphcomp.runtime.teardown()
    except ImportError:
        pass
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
