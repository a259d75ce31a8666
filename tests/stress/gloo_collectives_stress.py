"""Collective-level stress: raw ``_c10d_functional`` collectives on gloo, many in flight.

No Dynamo, no compiled graph, no graphcomp pass: every iteration issues 1..``--max-inflight``
all-gathers and reduce-scatters (inputs built by graphcomp's ``pack_cast`` /
``pack_for_reduce_scatter`` ops, or plain tensors with ``--plain``), drops every
input right after its collective is issued (what a graph's last-use free does),
allocates and frees scratch tensors, then waits the collectives in a shuffled
order (the same on every rank) and checks each result exactly. glibc's heap
checks are on in the ranks (``MALLOC_CHECK_=3``, ``MALLOC_PERTURB_``)::

    python tests/stress/gloo_collectives_stress.py --iters 1500 --ranks 2
    python tests/stress/gloo_collectives_stress.py --iters 1500 --max-inflight 1   # control

This isolates what a prefetching schedule changes on gloo (several collectives in
flight at once) from graphcomp's graphs; see docs/heap-corruption.md. Exit status
0 when every rank finished with exact results.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "cpu"))  # _dist
sys.path.insert(0, str(HERE.parents[1]))  # graphcomp from this checkout

SIZES = [1, 7, 33, 64, 257, 1000, 4099, 20000]
MALLOC_ENV = {"MALLOC_CHECK_": "3", "MALLOC_PERTURB_": "165", "LIBC_FATAL_STDERR_": "1"}


def _gloo_group(threads: int):
    """A new gloo process group whose backend runs collectives on ``threads`` worker
    threads (``ProcessGroupGloo``'s default is 2): ``graphcomp._compat.new_gloo_group``."""
    from graphcomp import _compat

    return _compat.new_gloo_group(None, threads)


def _body(rank: int, world: int, iters: int, max_inflight: int, plain: bool, seed: int, threads: int = 0) -> dict:
    import torch
    import torch.distributed as dist

    import graphcomp.ops.collectives  # noqa: F401  (registers graphcomp::)

    c10d, gc = torch.ops._c10d_functional, torch.ops.graphcomp
    group = (_gloo_group(threads) if threads else dist.group.WORLD).group_name
    rng = random.Random(seed)  # same draws on every rank: same collectives, same order
    n_coll = bad = 0
    t0 = time.perf_counter()
    for _ in range(iters):
        pending = []
        for j in range(rng.randint(1, max_inflight)):
            n = rng.choice(SIZES)
            if rng.random() < 0.5:
                x = torch.full((n,), float(rank * 1000 + j))
                if not plain:
                    x = gc.pack_cast([x, torch.full((3,), float(rank))], torch.float32)
                h = c10d.all_gather_into_tensor(x, world, group)
                del x  # last use: only the in-flight collective holds the input now
                pending.append(("ag", j, n, h))
            else:
                p = torch.full((world * n,), float(rank + 1))
                if not plain:
                    p = gc.pack_for_reduce_scatter([p], world, torch.float32)
                h = c10d.reduce_scatter_tensor(p, "sum", world, group)
                del p
                pending.append(("rs", j, n, h))
            scratch = [torch.empty(rng.choice([8, 100, 5000])).fill_(-1.0) for _ in range(3)]
            del scratch
        order = list(range(len(pending)))
        rng.shuffle(order)
        for i in order:
            kind, j, n, h = pending[i]
            r = c10d.wait_tensor(h)
            if kind == "ag":
                if not plain:
                    r = gc.unpack_gathered(r, world, [n, 3])[0]
                expected = torch.cat([torch.full((n,), float(q * 1000 + j)) for q in range(world)])
            else:
                expected = torch.full((n,), float(sum(range(1, world + 1))))
            bad += int(not torch.equal(r, expected))
            n_coll += 1
        pending.clear()
    import os

    return {"collectives": n_coll, "wrong_results": bad, "seconds": round(time.perf_counter() - t0, 1),
            "process_threads": len(os.listdir("/proc/self/task"))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=1500)
    ap.add_argument("--ranks", type=int, default=2, choices=[2, 4])
    ap.add_argument("--max-inflight", type=int, default=24, help="most collectives issued before the first wait")
    ap.add_argument("--plain", action="store_true", help="plain tensors instead of graphcomp's pack/unpack ops")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gloo-threads", type=int, default=0,
                    help="run the collectives on a new gloo group with this many worker threads (0: the default group, 2 threads)")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None, help="also write the result to this JSON file")
    args = ap.parse_args(argv)
    if args.iters < 1 or args.max_inflight < 1:
        ap.error(f"--iters and --max-inflight must be >= 1, got {args.iters} and {args.max_inflight}")

    from _dist import run_distributed

    t0 = time.monotonic()
    out = {"iters": args.iters, "ranks": args.ranks, "max_inflight": args.max_inflight, "plain": args.plain,
           "gloo_threads": args.gloo_threads or 2, "seed": args.seed}
    try:
        res = run_distributed(_body, args.ranks, args.iters, args.max_inflight, args.plain, args.seed,
                              args.gloo_threads, timeout=args.timeout, env=MALLOC_ENV)
        out.update(status="ok", collectives=res[0]["collectives"], process_threads=res[0]["process_threads"],
                   wrong_results=sum(r["wrong_results"] for r in res))
    except Exception as e:  # a crashed rank (RankError) or a hang (TimeoutError)
        out.update(status="failed", error=f"{type(e).__name__}: " + " | ".join(str(e).splitlines()[-2:])[:400])
    out["seconds"] = round(time.monotonic() - t0, 1)
    print("[collectives-stress] " + json.dumps(out), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if out["status"] == "ok" and out["wrong_results"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
