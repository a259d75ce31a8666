"""Host cost of one training step through graphcomp, without a GPU: W1's structure
(12 layers, so W1's ~110 sharded parameters) at tiny sizes, on one gloo rank, its
graphs split and every piece run through the real CUDA-graph runtime on a stand-in
device whose replay does nothing. What is left is the host work of a step: Dynamo's
guards, AOTAutograd's runtime wrappers (DTensor parameters unwrapped each call),
graphcomp's glue and runners, the autograd engine.

    python -m benchmarks.call_overhead [--steps 300] [--layers 12] [--profile] [--guard-filter]

Prints microseconds per step (forward + backward, no optimizer) and, with
``--profile``, the top of a cProfile by cumulative time. ``--guard-filter`` compiles
with ``guard_filter_fn=graphcomp.guard_filter`` (A/B it against a run without).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import socket
import time
import warnings


def _init_world1() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=0, world_size=1)


def run(steps: int, layers: int, profile: bool = False, guard_filter: bool = False) -> float:
    import sys
    from pathlib import Path

    import torch
    from _pytest.monkeypatch import MonkeyPatch

    import graphcomp
    from graphcomp import runtime
    from graphcomp.models import Llama, get_config

    from .runner_overhead import NullDevice

    # the CPU tests' switch that splits CPU graphs and captures them as CUDA ones
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "cpu"))
    from _fakecuda import install_pretend_cuda

    _init_world1()
    torch._dynamo.reset()
    graphcomp.reset()
    real_dev = runtime.RUNTIME.device
    runtime.RUNTIME.device = NullDevice()  # type: ignore[assignment]
    mp = MonkeyPatch()
    install_pretend_cuda(mp)
    try:
        torch.manual_seed(0)
        m = Llama(get_config("tiny").with_(n_layers=layers))
        graphcomp.shard(m)
        opts = {"codegen": "eager", **({"guard_filter_fn": graphcomp.guard_filter} if guard_filter else {})}
        cm = torch.compile(m, backend="graphcomp", options=opts)
        tok = torch.randint(0, 131, (1, 16))
        params = list(m.parameters())
        warm = 5
        t0 = 0.0
        prof = cProfile.Profile() if profile else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for s in range(steps + warm):
                if s == warm:
                    t0 = time.perf_counter()
                    if prof is not None:
                        prof.enable()
                loss = cm(tok, tok)
                loss.backward()
                del loss
                for p in params:
                    p.grad = None
        dt = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
        c = graphcomp.counters
        if c.get("replays", 0) < 2 * steps or c.get("cudagraph_fallbacks", 0):
            raise RuntimeError(f"benchmark did not time the replay path: {dict(c)}")
    finally:
        runtime.reset()
        runtime.RUNTIME.device = real_dev
        mp.undo()
    return dt / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--guard-filter", action="store_true", help="compile with guard_filter_fn=graphcomp.guard_filter")
    a = ap.parse_args()
    us = run(a.steps, a.layers, a.profile, a.guard_filter)
    print(f"host cost: {us:.1f} us per step (forward + backward, {a.layers} layers, replays do nothing"
          f"{', graphcomp.guard_filter' if a.guard_filter else ''})")


if __name__ == "__main__":
    main()
