"""What the distributed-safety checks cost at compile time, on the demo model.

Compiles the ``demo`` Llama (graphcomp/models.py) on 2 gloo ranks (CPU), one
training step, and reads from every frame summary: the passes' own time, the
collective verifier's time (``verify_seconds`` of each pass record) and the rank
agreement exchange (``rank_agreement_seconds`` of each fwd/bwd stage), against the
whole compile (``compile_seconds``). Run::

    python -m benchmarks.safety_cost [--preset demo] [--codegen inductor] [--bucket-bytes 0] [--out FILE.json]

The README's "Distributed safety" section quotes its output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _rank_body(rank: int, world: int, preset: str, codegen: str, bucket_bytes: int) -> dict:
    import torch

    import graphcomp
    from graphcomp.models import Llama, get_config, synthetic_batch

    torch._dynamo.reset()
    graphcomp.reset()
    torch.manual_seed(0)
    cfg = get_config(preset)
    model = Llama(cfg)
    graphcomp.shard(model)
    cm = torch.compile(model, backend="graphcomp", options={"codegen": codegen, "bucket_bytes": bucket_bytes})
    tok, tgt = synthetic_batch(cfg, 2 * world, 64, seed=0)
    cm(tok[rank::world], tgt[rank::world]).backward()
    out = {"compile": 0.0, "passes": 0.0, "verify": 0.0, "agree": 0.0, "frames": 0, "collectives": 0}
    for f in graphcomp.frame_summaries():
        out["frames"] += 1
        out["compile"] += f["compile_seconds"] or 0.0
        for st in f["stages"].values():
            out["agree"] += st.get("rank_agreement_seconds", 0.0)
            out["collectives"] += len(st.get("collectives") or [])
            for p in st["passes"]:
                out["passes"] += p["seconds"]
                out["verify"] += p.get("verify_seconds", 0.0)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.safety_cost")
    p.add_argument("--preset", default="demo")
    p.add_argument("--codegen", choices=["inductor", "eager"], default="inductor")
    p.add_argument("--bucket-bytes", type=int, default=64 * 2**20, help="0: no buckets (one collective per parameter)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "cpu"))
    from _dist import run_distributed

    res = run_distributed(_rank_body, 2, args.preset, args.codegen, args.bucket_bytes, timeout=900)
    for r, row in enumerate(res):
        print(f"rank {r}: {row['frames']} frame(s), {row['collectives']} collectives; compile {row['compile']:.2f} s, "
              f"passes {row['passes'] * 1e3:.1f} ms, verifier {row['verify'] * 1e3:.1f} ms "
              f"({100 * row['verify'] / max(row['compile'], 1e-9):.2f}% of compile), rank agreement "
              f"{row['agree'] * 1e3:.1f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"preset": args.preset, "codegen": args.codegen, "bucket_bytes": args.bucket_bytes, "ranks": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
