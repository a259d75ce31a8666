"""GPU worker for FP8 training: ``torchrun --nproc-per-node N tests/gpu/fp8_worker.py OUTDIR``.

Each rank trains a Llama wide enough for the default FP8 filter (d 2048: every block
linear converts, the head does not) with ``graphcomp.train_step`` at its defaults
(Inductor, CUDA graphs, the whole step captured where safe), fused AdamW, clip 1.0,
from the same seed and data, four times:

* ``bf16``: ``shard(param_dtype=bf16)``, no FP8;
* ``tensorwise`` / ``rowwise``: ``shard(param_dtype=bf16, fp8=recipe)``;
* ``tensorwise_nopass``: tensorwise with ``fp8_allgather`` off (the weights gathered in
  bf16, cast after the gather: the same values, other bytes on the wire).

The data cycles through two batches per rank, so the loss falls fast (memorization) and
the FP8 curves can be compared with bf16's in a few steps. It writes
``OUTDIR/fp8.rank<R>.json``: per run the losses, the counters, ``graphcomp.fp8.stats``
summed up, the gathered bytes per dtype of the compiled graphs, the peak memory and the
median step time of the last steps.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(k, v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import graphcomp  # noqa: E402
import graphcomp.runtime  # noqa: E402
from graphcomp.models import Llama, LlamaConfig, synthetic_batch  # noqa: E402

STEPS = int(os.environ.get("GC_FP8_STEPS", "30"))
TIMED = 10
CFG = LlamaConfig(vocab_size=8192, dim=2048, n_layers=2, n_heads=16, n_kv_heads=16, ffn_dim=5632, max_seq_len=1024)
RUNS = {"bf16": (None, True), "tensorwise": ("tensorwise", True), "rowwise": ("rowwise", True),
        "tensorwise_nopass": ("tensorwise", False)}


def train(fp8: str | None, fused: bool, rank: int, device: torch.device) -> dict:
    torch._dynamo.reset()
    graphcomp.reset()
    torch.manual_seed(0)
    m = Llama(CFG).to(device)
    m.reset_parameters(seed=0)
    graphcomp.shard(m, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, fp8=fp8)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    step = graphcomp.train_step(m, opt, max_norm=1.0, options={"passes": {"fp8_allgather": fused}})
    batches = [synthetic_batch(CFG, 4, 512, seed=100 * rank + i, device=device) for i in range(2)]
    torch.cuda.reset_peak_memory_stats(device)
    losses, ms = [], []
    for i in range(STEPS):
        tok, tgt = batches[i % 2]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(tok, tgt)
        torch.cuda.synchronize()
        if i >= STEPS - TIMED:
            ms.append((time.perf_counter() - t0) * 1e3)
        losses.append(float(loss))
    gathered: dict[str, int] = {}
    for f in graphcomp.frame_summaries():
        for st in ("fwd", "bwd"):
            for c in f["stages"].get(st, {}).get("collectives", []):
                if c["kind"] == "all_gather":
                    gathered[c["dtype"]] = gathered.get(c["dtype"], 0) + c["bytes"]
    st = graphcomp.fp8.stats(m)
    out = {"losses": losses, "counters": dict(graphcomp.counters), "gathered_bytes": gathered,
           "fp8_layers": len(st), "input_saturated_total": sum(s["input_saturated_total"] for s in st.values()),
           "scales_finite": all(torch.isfinite(torch.tensor([s["input_scale"], s["weight_scale"]])).all().item()
                                for s in st.values()),
           "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
           "step_ms_median": statistics.median(ms), "whole_step": step.whole_step_reason}
    graphcomp.runtime.teardown()
    return out


def main() -> None:
    outdir = sys.argv[1]
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    res = {"world": dist.get_world_size(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(device)}
    for name, (fp8, fused) in RUNS.items():
        res[name] = train(fp8, fused, rank, device)
    with open(os.path.join(outdir, f"fp8.rank{rank}.json"), "w") as f:
        json.dump(res, f, indent=1)
    graphcomp.runtime.teardown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
