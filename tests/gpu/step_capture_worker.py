"""GPU worker for graphcomp.capture_step: ``torchrun --nproc-per-node N tests/gpu/step_capture_worker.py PRESET OUTDIR``.

Each rank trains ``Llama(PRESET)`` (sharded over the ranks, compiled with graphcomp's
defaults: Inductor codegen, CUDA graphs auto) with fused AdamW through
``graphcomp.optim.capture(max_norm=1.0)``, STEPS steps, twice from the same seed:

* ``plain``: the step function called as it is (pieces and the optimizer replay
  their own graphs);
* ``whole``: the same function through ``graphcomp.capture_step`` (2 warm-up calls,
  then one CUDA graph per step).

It writes ``OUTDIR/step_capture.rank<R>.json``: losses and norms of both runs, the
largest relative difference of the final parameters and optimizer state, whether
they are bitwise equal, the counters of the whole run, the pieces' replay counter
per step (it must stop moving once the whole step is captured), and host time per
step (perf_counter around the call, no sync: what the host spends) and step time
(synchronized) of each run's last steps.

``GC_STEP_CAPTURE_MODE=train_step`` replaces ``whole`` by ``graphcomp.train_step(m, opt,
max_norm=1.0)`` at its defaults (the one entry point, which decides the whole-step
capture itself after two steps); its ``stats()`` go to the JSON.

``GC_DETERMINISTIC=1`` (the test's default) runs with
``torch.use_deterministic_algorithms(True)``: Inductor then lowers the embedding's
backward (an accumulating ``index_put``) to ATen's sorted kernel instead of atomic
adds, whose order can change from one run to the next. Without it, on 2 H100s at
9d25f96, the two runs were bitwise equal for 10 steps and then drifted (the losses in
the 6th digit, parameters 2e-4 relative after Adam). ``GC_STEP_CAPTURE_PLAIN_TWICE=1``
adds a second ``plain`` run (``plain2``) and its difference from the first: the
spread of the kernels themselves.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(k, v)

DETERMINISTIC = os.environ.get("GC_DETERMINISTIC", "0") == "1"
if DETERMINISTIC:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (before CUDA starts)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import graphcomp  # noqa: E402
import graphcomp.runtime  # noqa: E402
from graphcomp import optim as gopt  # noqa: E402
from graphcomp.models import Llama, synthetic_batch  # noqa: E402

STEPS = int(os.environ.get("GC_STEP_CAPTURE_STEPS", "14"))
TIMED = 6  # last steps timed


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def train(preset: str, whole: bool | str, rank: int, world: int, device: torch.device) -> dict:
    torch._dynamo.reset()  # (else the second run reuses the first run's frame, whose runners teardown released)
    graphcomp.reset()
    torch.manual_seed(0)
    m = Llama(preset).to(device)
    m.reset_parameters(seed=0)
    if world > 1:
        graphcomp.shard(m, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    if whole == "train_step":
        ts = graphcomp.train_step(m, opt, max_norm=1.0)
        cstep = ts.update

        def run(tok, tgt):
            return ts(tok, tgt), ts.last_norm
    else:
        cstep = gopt.capture(opt, max_norm=1.0)
        cm = torch.compile(m, backend="graphcomp")

        def train_step(tok, tgt):
            loss = cm(tok, tgt)
            loss.backward()
            norm = cstep()
            opt.zero_grad(set_to_none=True)
            return loss.detach(), norm

        run = graphcomp.capture_step(train_step, params=m.parameters(), optimizers=[cstep]) if whole else train_step
    seq = min(256, m.cfg.max_seq_len)
    batches = [synthetic_batch(m.cfg, 4, seq, seed=1000 * rank + i, device=device) for i in range(STEPS)]
    losses, norms, piece_replays, host_ms, step_ms = [], [], [], [], []
    for i, (tok, tgt) in enumerate(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss, norm = run(tok, tgt)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= STEPS - TIMED:
            host_ms.append((t1 - t0) * 1e3)
            step_ms.append((t2 - t0) * 1e3)
        losses.append(float(loss))
        norms.append(float(_local(norm)))
        piece_replays.append(graphcomp.counters.get("replays", 0))
    params = [_local(p).detach().clone() for p in m.parameters()]
    state = [_local(v).detach().clone() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    out = {"losses": losses, "norms": norms, "piece_replays": piece_replays, "counters": dict(graphcomp.counters),
           "host_ms_median": statistics.median(host_ms), "step_ms_median": statistics.median(step_ms),
           "stats": (ts.stats() if whole == "train_step" else run.stats()) if whole else None,
           "optimizer": cstep.stats()["mode"], "clip_folded": cstep.stats()["clip_folded"]}
    graphcomp.runtime.teardown()
    return out, params, state


def _max_rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        d = (x.float() - y.float()).abs().max().item()
        s = y.float().abs().max().item()
        worst = max(worst, d / s if s else d)
    return worst


def main() -> None:
    preset, outdir = sys.argv[1], sys.argv[2]
    hang = float(os.environ.get("GC_STEP_CAPTURE_HANG_DUMP", "0"))
    if hang > 0:  # every thread's stack on stderr if the run is still going then (the test prints stderr)
        import faulthandler

        faulthandler.dump_traceback_later(hang, exit=False)
    if DETERMINISTIC:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # (no NaN fill kernels)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    plain, p_params, p_state = train(preset, False, rank, world, device)
    mode = os.environ.get("GC_STEP_CAPTURE_MODE", "whole")
    whole, w_params, w_state = train(preset, "train_step" if mode == "train_step" else True, rank, world, device)
    res = {
        "rank": rank, "world": world, "preset": preset, "steps": STEPS, "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "mode": mode, "plain": plain, "whole": whole,
        "params_bitwise": all(torch.equal(a, b) for a, b in zip(w_params, p_params)),
        "state_bitwise": all(torch.equal(a, b) for a, b in zip(w_state, p_state)),
        "params_max_rel": _max_rel(w_params, p_params), "state_max_rel": _max_rel(w_state, p_state),
        "losses_bitwise": whole["losses"] == plain["losses"], "deterministic": DETERMINISTIC,
    }
    if os.environ.get("GC_STEP_CAPTURE_PLAIN_TWICE", "0") == "1":
        plain2, q_params, q_state = train(preset, False, rank, world, device)
        res.update(plain2=plain2, plain2_params_max_rel=_max_rel(q_params, p_params),
                   plain2_state_max_rel=_max_rel(q_state, p_state), plain2_losses_bitwise=plain2["losses"] == plain["losses"])
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, f"step_capture.rank{rank}.json"), "w") as f:
        json.dump(res, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
