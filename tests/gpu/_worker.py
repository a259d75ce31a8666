"""GPU worker for tests/gpu: ``torchrun --nproc-per-node N tests/gpu/_worker.py SCENARIO OUTDIR``.

Each rank writes ``OUTDIR/<scenario>.rank<R>.json``. Scenarios:

* ``train``   : sharded Llama, 20 steps CUDA graphs off vs on (eager codegen: bitwise;
                Inductor codegen: within float tolerance), peak memory
                off vs on, loss of step N read after step N+1, 2 micro-batches
                (two forwards, one backward) and gradient accumulation
                (forward/backward twice) vs the same with graphs off;
                graphcomp.runtime.teardown() then destroy_process_group.
* ``memory``  : peak memory (allocated and reserved) CUDA graphs off vs on
                (copy_outputs auto / always; and with a fused AdamW, whose step
                allocates no temporaries), W1 model, Inductor; the CUDA-graph
                pool's own segments; the capture stream's cuBLAS workspace.
* ``regions`` : ``compile_regions`` (Inductor, CUDA graphs): the ``tiny-deep`` Llama
                with a prefetch cap of about one weight (points with nothing in
                flight between blocks), 10 steps with and without regions; counters
                and the largest relative loss / parameter difference.
* ``exit``    : captures graphs with collectives and calls destroy_process_group
                WITHOUT teardown (the wrapped destroy / atexit must release them);
                the parent checks the process exits in time.
"""

from __future__ import annotations

import json
import os
import sys
import time

for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(k, v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.utils.checkpoint  # noqa: E402

import graphcomp  # noqa: E402
from graphcomp.models import Llama, synthetic_batch  # noqa: E402

STEPS = 20


class _Checkpointed(torch.nn.Module):
    """A block under ``torch.utils.checkpoint`` (non-reentrant), as W3's blocks."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False)


def _model(preset: str, seed: int = 0, checkpoint: bool = False, param_dtype=None,
           embedding: str | None = None) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = Llama(preset).cuda()
    m.reset_parameters(seed=seed)
    if checkpoint:
        for i, blk in enumerate(list(m.layers)):
            m.layers[i] = _Checkpointed(blk)
    kw = {} if param_dtype is None else {"param_dtype": param_dtype}
    graphcomp.shard(m, **kw, **({} if embedding is None else {"embedding": embedding}))
    return m


def _pool_reserved() -> int:
    """Bytes of device memory in graphcomp's CUDA-graph pool (its segments)."""
    pool = graphcomp.runtime.RUNTIME.pool
    if pool is None:
        return 0
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == tuple(pool))


def _train(preset, options, steps, batch, seq, micro=1, interleaved=False, set_to_none=None, fused_adam=False,
           checkpoint=False, param_dtype=None, captured_opt=None, embedding=None):
    """``set_to_none``: zero_grad's argument every step (None: alternate True/False);
    ``checkpoint``: every block under ``torch.utils.checkpoint``; ``embedding``:
    ``graphcomp.shard``'s (None: its default, which exchanges the tiny Llama's
    lookups on NCCL)."""
    torch._dynamo.reset()
    m = _model(preset, checkpoint=checkpoint, param_dtype=param_dtype, embedding=embedding)
    cm = torch.compile(m, backend="graphcomp", options=options)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, **({"fused": True} if fused_adam else {}))
    # captured_opt: graphcomp.optim.capture's options; its step replaces opt.step()
    opt_step = opt.step if captured_opt is None else graphcomp.optim.capture(opt, **captured_opt)
    rank = dist.get_rank()
    losses = []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    step_peaks, step_reserved = [], []
    peak = 0
    for step in range(steps):
        torch.cuda.reset_peak_memory_stats()
        if micro == 1:
            tok, tgt = synthetic_batch(m.cfg, batch, seq, seed=1000 * rank + step, device="cuda")
            loss = cm(tok, tgt)
            loss.backward()
        elif interleaved:  # gradient accumulation: forward, backward, forward, backward
            for k in range(micro):
                tok, tgt = synthetic_batch(m.cfg, batch, seq, seed=1000 * rank + 10 * step + k, device="cuda")
                loss = cm(tok, tgt)
                loss.backward()
        else:  # two forwards, then one backward of the summed losses
            ls = []
            for k in range(micro):
                tok, tgt = synthetic_batch(m.cfg, batch, seq, seed=1000 * rank + 10 * step + k, device="cuda")
                ls.append(cm(tok, tgt))
            loss = sum(ls)
            loss.backward()
        if step == 0:
            first_grads = [None if p.grad is None else p.grad.detach().clone() for p in m.parameters()]
        opt_step()
        opt.zero_grad(set_to_none=(step % 2 == 0) if set_to_none is None else set_to_none)
        losses.append(loss.detach())  # read only at the end: step N after step N+1
        torch.cuda.synchronize()
        step_peaks.append(torch.cuda.max_memory_allocated() - base)
        step_reserved.append(torch.cuda.max_memory_reserved())
        peak = max(peak, step_peaks[-1])
    torch.cuda.synchronize()
    params = [p.detach().clone() for p in m.parameters()]
    return {
        "losses": [float(x) for x in losses],
        "loss_bits": [int(x.view(torch.int32).item()) for x in torch.stack(losses).float()],
        "peak": peak,
        "step_peaks": step_peaks,
        "step_reserved": step_reserved,
        "pool_bytes": sum(r.get("pool_bytes", 0) for f in graphcomp.frame_summaries()
                          for d in f["stages"].values() for r in d.get("partitions", [])),
        "seconds": time.perf_counter() - t0,
        "pool_reserved": _pool_reserved(),
        "params": params,
        "first_grads": first_grads,  # after the first backward, before the optimizer step
        "counters": {k: v for k, v in graphcomp.counters.items() if not k.startswith("bytes")},
    }


def _stream_workspace_bytes() -> int:
    """Bytes the caching allocator hands cuBLAS / cuBLASLt the first time a matmul
    runs on a new stream (a per-stream workspace; the capture stream has one)."""
    a = torch.randn(256, 256, device="cuda")
    b = torch.randn(256, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y1 = a @ a
        y2 = torch.nn.functional.linear(a, a, b)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated() - before - y1.nbytes - y2.nbytes
    del y1, y2
    return max(used, 0)


def scenario_train(out):
    preset = os.environ.get("GC_PRESET", "tiny")
    res = {}
    graphcomp.reset()
    off = _train(preset, {"codegen": "eager", "cudagraphs": "off"}, STEPS, 4, 64)
    graphcomp.reset()
    on = _train(preset, {"codegen": "eager", "cudagraphs": "auto"}, STEPS, 4, 64)
    res["bitwise_losses"] = off["loss_bits"] == on["loss_bits"]
    res["bitwise_params"] = all(torch.equal(a, b) for a, b in zip(off["params"], on["params"]))
    res["losses_off"], res["losses_on"] = off["losses"], on["losses"]
    res["distinct_losses"] = len(set(on["losses"])) == len(on["losses"])
    res["counters_on"] = on["counters"]
    res["peak_off"], res["peak_on"] = off["peak"], on["peak"]
    res["seconds_off"], res["seconds_on"] = off["seconds"], on["seconds"]
    # Inductor-compiled pieces: graphs on vs off within float tolerance (Inductor's
    # embedding backward accumulates with atomics, so bitwise equality is not expected)
    graphcomp.reset()
    ioff = _train(preset, {"codegen": "inductor", "cudagraphs": "off"}, STEPS, 4, 64)
    graphcomp.reset()
    ion = _train(preset, {"codegen": "inductor", "cudagraphs": "auto"}, STEPS, 4, 64)
    res["inductor_loss_max_rel"] = max(abs(a - b) / abs(b) for a, b in zip(ioff["losses"], ion["losses"]))
    res["inductor_param_max_rel"] = max(float((a - b).norm() / b.norm().clamp_min(1e-30))
                                        for a, b in zip(ion["params"], ioff["params"]))
    res["inductor_counters_on"] = ion["counters"]
    res["inductor_seconds_off"], res["inductor_seconds_on"] = ioff["seconds"], ion["seconds"]
    # gradient accumulation: two forwards before one backward
    graphcomp.reset()
    acc_off = _train(preset, {"codegen": "eager", "cudagraphs": "off"}, 4, 2, 32, micro=2)
    graphcomp.reset()
    acc_on = _train(preset, {"codegen": "eager", "cudagraphs": "auto"}, 4, 2, 32, micro=2)
    res["accum_losses_equal"] = acc_off["loss_bits"] == acc_on["loss_bits"]
    res["accum_params_equal"] = all(torch.equal(a, b) for a, b in zip(acc_off["params"], acc_on["params"]))
    res["accum_counters"] = acc_on["counters"]
    # gradient accumulation, forward/backward twice per step: the first micro-batch's
    # gradients (param.grad) are alive while the second forward replays
    graphcomp.reset()
    ga_off = _train(preset, {"codegen": "eager", "cudagraphs": "off"}, 4, 2, 32, micro=2, interleaved=True)
    graphcomp.reset()
    ga_on = _train(preset, {"codegen": "eager", "cudagraphs": "auto"}, 4, 2, 32, micro=2, interleaved=True)
    res["gradacc_losses_equal"] = ga_off["loss_bits"] == ga_on["loss_bits"]
    res["gradacc_params_equal"] = all(torch.equal(a, b) for a, b in zip(ga_off["params"], ga_on["params"]))
    res["gradacc_counters"] = ga_on["counters"]
    released = graphcomp.runtime.teardown()
    res["released"] = released
    return res


def scenario_memory(out):
    """Peak memory with CUDA graphs off vs on (copy_outputs "auto", the default, and
    "always"), on the W1 model (Inductor, as users run it) so fixed overheads do not
    dominate; zero_grad(set_to_none=True) as in most training loops, losses kept
    (detached) across steps. Peaks are the steady state (steps 2..), both what the caching
    allocator counts as allocated and what it reserved from the device: a replay
    allocates nothing, so only "reserved" sees the pool's scratch memory. The one
    fixed cost CUDA graphs add, cuBLAS's workspace for the capture stream, is
    measured on a fresh stream."""
    res = {"capture_stream_workspace": _stream_workspace_bytes(), "preset": "W1", "batch": 8, "seq": 512}
    runs = {"off": ({"cudagraphs": "off"}, False), "auto": ({"cudagraphs": "auto"}, False),
            "always": ({"cudagraphs": "auto", "copy_outputs": "always"}, False),
            # the fused AdamW step allocates no temporaries: without them, what the graphs cost
            "off_fused": ({"cudagraphs": "off"}, True), "auto_fused": ({"cudagraphs": "auto"}, True)}
    for name, (opts, fused) in runs.items():
        graphcomp.reset()
        torch.cuda.empty_cache()
        r = _train("W1", {"codegen": "inductor", **opts}, 5, 8, 512, set_to_none=True, fused_adam=fused)
        res[f"pool_reserved_{name}"] = r["pool_reserved"]
        res[f"alloc_{name}"] = max(r["step_peaks"][2:])
        res[f"reserved_{name}"] = max(r["step_reserved"][2:])
        res[f"step_peaks_{name}"], res[f"step_reserved_{name}"] = r["step_peaks"], r["step_reserved"]
        res[f"pool_bytes_{name}"] = r["pool_bytes"]
        res[f"counters_{name}"] = r["counters"]
        graphcomp.runtime.teardown()
        del r
    res["mem_peak_off"], res["mem_peak_on"] = res["reserved_off"], res["reserved_auto"]
    res["mem_ratio"] = res["reserved_auto"] / max(res["reserved_off"], 1)
    res["alloc_ratio"] = res["alloc_auto"] / max(res["alloc_off"], 1)
    return res


def _loss_max_rel(losses, ref):
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref))


def _param_max_rel(params, ref):
    """Largest difference of any parameter, relative to that parameter's largest element."""
    return max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))
               for a, b in zip(params, ref))


def _compare(res, codegen, on, off):
    """Into ``res``, under ``<codegen>_``: whether the pass-on run equals the pass-off run
    bitwise (losses, parameters, first-step gradients), their largest relative
    differences, and both runs' counters."""
    grads = [(a, b) for a, b in zip(on["first_grads"], off["first_grads"]) if a is not None and b is not None]
    res[f"{codegen}_bitwise_losses"] = on["loss_bits"] == off["loss_bits"]
    res[f"{codegen}_bitwise_params"] = all(torch.equal(a, b) for a, b in zip(on["params"], off["params"]))
    res[f"{codegen}_bitwise_grads"] = all(torch.equal(a, b) for a, b in grads)
    res[f"{codegen}_loss_max_rel"] = _loss_max_rel(on["losses"], off["losses"])
    res[f"{codegen}_param_max_rel"] = _param_max_rel(on["params"], off["params"])
    res[f"{codegen}_grad_max_rel"] = _param_max_rel([a for a, _ in grads], [b for _, b in grads])
    res[f"{codegen}_counters_on"], res[f"{codegen}_counters_off"] = on["counters"], off["counters"]


def scenario_regions(out):
    base = {"codegen": "inductor", "region_min_nodes": 8, "prefetch_bytes": 2048, "bucket_bytes": 12288}
    graphcomp.reset()
    # checkpointed blocks, as W3's: on CUDA each block's attention takes its RNG state as a
    # torch.Generator input, which made every W3 region "not reusable" before 76f554b
    whole = _train("tiny-deep", {**base, "compile_regions": False}, 10, 2, 32, set_to_none=True, checkpoint=True)
    graphcomp.reset()
    reg = _train("tiny-deep", {**base, "compile_regions": True}, 10, 2, 32, set_to_none=True, checkpoint=True)
    return {
        "counters": reg["counters"],
        "counters_whole": whole["counters"],
        "losses": reg["losses"],
        "losses_whole": whole["losses"],
        "loss_max_rel": _loss_max_rel(reg["losses"], whole["losses"]),
        "param_max_rel": _param_max_rel(reg["params"], whole["params"]),
    }


def scenario_defer(out):
    """defer_weight_grads on NCCL with CUDA graphs: the checkpointed tiny-deep Llama (W3's
    shape in miniature, remat="auto") with the pass moving everything it may (the wire
    modelled slow) against the pass off, 10 AdamW steps each: eager codegen bitwise
    equal (the pass only moves nodes; here the moved weight gradients run while the
    reduce-scatters before them are in flight), Inductor within rounding."""
    base = {"remat": "auto", "prefetch_bytes": 2048, "bucket_bytes": 12288}
    res = {}
    for codegen in ("eager", "inductor"):
        runs = {}
        for name, rate in (("off", None), ("on", 1.0)):
            graphcomp.reset()
            opts = {**base, "codegen": codegen}
            if rate is None:
                opts["passes"] = {"defer_weight_grads": False}
            else:  # the wire modelled slow: the pass moves everything it may
                opts["collective_bytes_per_s"] = rate
            runs[name] = _train("tiny-deep", opts, 10, 2, 32, set_to_none=True, checkpoint=True)
            graphcomp.runtime.teardown()
        _compare(res, codegen, runs["on"], runs["off"])
    return res


def scenario_avg(out):
    """avg_reduce_scatter on NCCL with CUDA graphs (world 2): the sharded tiny Llama, bf16
    gathers and fp32 gradients as W2, 10 AdamW steps with the pass on and off, eager
    codegen and Inductor: the averaging reduce-scatter is bitwise the sum divided by 2
    (eager codegen: bitwise runs; Inductor's atomic table gradient differs run to run)."""
    base = {"prefetch_bytes": 2048, "bucket_bytes": 12288}
    res = {}
    for codegen in ("eager", "inductor"):
        runs = {}
        for name in ("off", "on"):
            graphcomp.reset()
            opts = {**base, "codegen": codegen}
            if name == "off":
                opts["passes"] = {"avg_reduce_scatter": False}
            runs[name] = _train("tiny", opts, 10, 2, 32, set_to_none=True, param_dtype=torch.bfloat16)
            graphcomp.runtime.teardown()
        _compare(res, codegen, runs["on"], runs["off"])
    return res


def scenario_exchange(out):
    """``embedding="auto"`` (the default) on NCCL with CUDA graphs: the sharded tiny Llama
    (fp32, every rank the same token count, so its lookups exchange) against
    ``embedding="gather"``, 10 AdamW steps, eager codegen and Inductor."""
    base = {"prefetch_bytes": 2048, "bucket_bytes": 12288}
    res = {}
    for codegen in ("eager", "inductor"):
        runs = {}
        for name, emb in (("off", "gather"), ("on", None)):
            graphcomp.reset()
            runs[name] = _train("tiny", {**base, "codegen": codegen}, 10, 2, 32, set_to_none=True, embedding=emb)
            graphcomp.runtime.teardown()
        _compare(res, codegen, runs["on"], runs["off"])
        res[f"{codegen}_first_loss_equal"] = runs["on"]["losses"][0] == runs["off"]["losses"][0]
    return res


def scenario_prefetch(out):
    """Cross-step prefetch on NCCL with CUDA graphs: the sharded tiny Llama (bf16 gathers,
    the table gathered alone), fused AdamW through graphcomp.optim.capture (clip 1.0,
    captured) with prefetch on and off, 10 steps, eager codegen and Inductor."""
    base = {"bucket_bytes": 8192}
    res = {}
    for codegen in ("eager", "inductor"):
        runs = {}
        for name in ("off", "on"):
            graphcomp.reset()
            runs[name] = _train("tiny", {**base, "codegen": codegen}, 10, 2, 32, set_to_none=True,
                                param_dtype=torch.bfloat16, fused_adam=True, embedding="gather",
                                captured_opt={"max_norm": 1.0, "prefetch": name == "on"})
            graphcomp.runtime.teardown()
        _compare(res, codegen, runs["on"], runs["off"])
    return res


def scenario_exit(out):
    graphcomp.reset()
    r = _train("tiny", {"codegen": "eager", "cudagraphs": "auto"}, 3, 2, 32)
    return {"captures": r["counters"].get("captures", 0)}


def main():
    scenario, outdir = sys.argv[1], sys.argv[2]
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    res = {"train": scenario_train, "memory": scenario_memory, "regions": scenario_regions,
           "defer": scenario_defer, "avg": scenario_avg, "prefetch": scenario_prefetch,
           "exchange": scenario_exchange,
           "exit": scenario_exit}[scenario](outdir)
    res["world"] = dist.get_world_size()
    with open(os.path.join(outdir, f"{scenario}.rank{rank}.json"), "w") as f:
        json.dump(res, f, default=str)
    if scenario in ("train", "memory", "regions", "defer", "avg", "prefetch", "exchange"):
        graphcomp.runtime.teardown()  # always before destroy_process_group
    dist.destroy_process_group()  # "exit": graphs still alive here; the wrapped destroy releases them


if __name__ == "__main__":
    main()
