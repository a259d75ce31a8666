"""torchrun worker for tests/gpu/test_divergence_gpu.py (issue 16): rank agreement on
NCCL with CUDA graphs on (Inductor codegen, default options).

Scenario ``diverge``: rank 1's forward reads one more weight than rank 0's (a
Python branch on rank-local state): each rank must raise ``RankDivergence`` naming
the first differing collective and the source line, well before NCCL's timeout.
Scenario ``agree``: the same model on both ranks trains 3 steps with CUDA graphs.

    torchrun --nproc-per-node 2 tests/gpu/divergence_worker.py OUTDIR {diverge,agree}

Each rank writes OUTDIR/divergence.rank<R>.json."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
from _agree_models import ThreePart  # noqa: E402  (the CPU rank-agreement tests' model)


def main() -> None:
    outdir, scenario = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    cuda = torch.cuda.is_available()  # (without a GPU: gloo on the CPU, a dry run of this script)
    dev = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # the group's own timeout far beyond the 60 s bar: an answer in time is the agreement check
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    import graphcomp
    from graphcomp.errors import RankDivergence

    torch.manual_seed(0)
    m = ThreePart(64).to(dev)
    graphcomp.shard(m)
    m.extra = scenario == "diverge" and rank == 1
    cm = torch.compile(m, backend="graphcomp")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    res: dict = {"rank": rank, "scenario": scenario}
    t0 = time.monotonic()
    try:
        losses = []
        for s in range(3):
            loss = cm(torch.randn(16, 64, device=dev, generator=torch.Generator(dev).manual_seed(s)))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
        res.update(losses=losses, counters=dict(graphcomp.counters))
    except Exception as e:  # noqa: BLE001 - Dynamo wraps backend errors: find ours
        inner = e
        while inner is not None and not isinstance(inner, RankDivergence):
            inner = getattr(inner, "inner_exception", None) or inner.__cause__
        res.update(error=str(inner if inner is not None else e), ours=inner is not None)
    res["seconds"] = time.monotonic() - t0
    with open(os.path.join(outdir, f"divergence.rank{rank}.json"), "w") as f:
        json.dump(res, f, indent=1)
    import graphcomp.runtime as gc_runtime

    gc_runtime.teardown()  # the captured graphs hold NCCL work: release them first
    if "error" in res:
        os._exit(0)  # the ranks disagreed: no collective may run again (the group is not torn down)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
