"""Host cost of graphcomp's CUDA-graph runner per call, without a GPU.

W1 on one H100 is host-bound (host ms per step = step ms; the profiler puts ~9 ms of
a 25 ms profiled step in the runner's pool bookkeeping). This measures that
bookkeeping alone: a forward piece with W1's shape of outputs (``--saved`` released
activations the backward reads, plus the loss) and a backward piece returning
``--grads`` gradients, run through the real ``CudaGraphRunner`` on a stand-in device
whose replay does nothing. What is left is the runner's own Python per call:
signature, static-address checks, the ledger's liveness checks, handing released
outputs out, copying inputs.

    python -m benchmarks.runner_overhead [--steps 2000] [--saved 148] [--grads 110]

Prints microseconds per training step (one forward and one backward call) and
writes nothing. ``farm-bench``-style before/after comparisons: run it at two commits.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Any

import torch


class NullGraph:
    def replay(self) -> None:  # the GPU does the work; the host only launches
        pass

    def reset(self) -> None:
        pass


class NullDevice:
    """The runner's device with a replay that does nothing (host cost only)."""

    device_type = "cuda"

    def pool_handle(self) -> Any:
        return ("pool",)

    def new_stream(self) -> Any:
        return object()

    def current_stream(self) -> Any:
        return object()

    def wait(self, a: Any, b: Any) -> None:
        pass

    def stream(self, s: Any) -> Any:
        return contextlib.nullcontext()

    def new_graph(self) -> NullGraph:
        return NullGraph()

    def capture(self, g: Any, pool: Any, stream: Any, fn: Any, inputs: list[Any], replay_inputs: list[Any]) -> Any:
        return fn(inputs)

    def trial_capture(self, stream: Any, fn: Any, inputs: list[Any]) -> None:
        fn(list(inputs))

    def pin_pool(self, pool: Any) -> int:
        return 1

    def unpin_pool(self, pool: Any, token: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def available(self) -> bool:
        return True

    def supports_if_nodes(self) -> bool:
        return False


def build(saved: int, grads: int) -> tuple[Any, Any, list[torch.Tensor], torch.Tensor]:
    from graphcomp.runtime.runner import CudaGraphRunner

    params = [torch.randn(16) for _ in range(grads)]

    def fwd(args: list[Any]) -> tuple[Any, ...]:
        x = args[-1]
        acts = [x * (i + 1) for i in range(saved)]
        args.clear()
        return (acts[0].sum(), *acts)

    def bwd(args: list[Any]) -> tuple[Any, ...]:
        g = args[-1]
        args.clear()
        return tuple(g * (i + 1) for i in range(grads))

    f = CudaGraphRunner("fwd/piece_0", fwd, ["param"] * grads + ["copy"], clone_outputs={0}, copy_outputs="always")
    b = CudaGraphRunner("bwd/piece_0", bwd, ["piece_output"] * saved + ["copy"],
                        clone_outputs=set(range(grads)), copy_outputs="auto")
    return f, b, params, torch.randn(16)


def run(steps: int, saved: int, grads: int) -> float:
    from graphcomp import runtime

    runtime.reset()
    real = runtime.RUNTIME.device
    runtime.RUNTIME.device = NullDevice()  # type: ignore[assignment]
    try:
        f, b, params, x = build(saved, grads)
        t0 = 0.0
        warm = 10
        for s in range(steps + warm):
            if s == warm:
                t0 = time.perf_counter()
            out = f.call([*params, x])
            loss, acts = out[0], list(out[1:])
            del out
            g = b.call([*acts, loss])
            del acts, loss, g
        dt = time.perf_counter() - t0
    finally:
        runtime.reset()
        runtime.RUNTIME.device = real
    return dt / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--saved", type=int, default=148, help="released forward outputs (W1: ~148)")
    ap.add_argument("--grads", type=int, default=110, help="gradient outputs of the backward")
    a = ap.parse_args()
    us = run(a.steps, a.saved, a.grads)
    print(f"runner host cost: {us:.1f} us per step (forward + backward call; {a.saved} saved, {a.grads} grads)")


if __name__ == "__main__":
    main()
