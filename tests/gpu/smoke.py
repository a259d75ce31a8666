"""GPU smoke check (one GPU, about 15 s): the first step of every device session.

The CPU suite runs the CUDA-graph runtime on a stand-in device, so a private torch
binding that 2.11 spells differently from 2.13 passes CI and fails every capture on
the GPU machines (2026-11-25: ``_cuda_beginAllocateToPool``'s arity cost a whole
5-minute device call). This script calls each CUDA-only ``graphcomp._compat``
helper the runtime uses, then trains a tiny model 4 SGD steps with
``cudagraphs="require"`` against eager PyTorch, and exits non-zero on the first
failure, so ``tests/gpu/session.sh`` stops before spending the call.

    python tests/gpu/smoke.py [OUT.json]
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def _compat_bindings(report: dict) -> None:
    import torch

    from graphcomp import _compat

    dev = torch.device("cuda", torch.cuda.current_device())
    report["device_memory_bytes"] = _compat.device_memory_bytes(dev)
    report["cuda_graph_if_supported"] = _compat.cuda_graph_if_supported()
    # a real graph pool: capture one allocation, view it through pool_storage/pool_views
    pool = torch.cuda.graph_pool_handle()
    g = torch.cuda.CUDAGraph()
    x = torch.ones(256, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x * 2  # warm-up outside the capture
        with torch.cuda.graph(g, pool=pool, stream=s):
            y = x * 2
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    st = _compat.pool_storage(y.data_ptr(), y.numel() * y.element_size(), dev)
    (v,) = _compat.pool_views(st, dev, [(0, (256,), (1,), torch.float32)])
    assert torch.equal(v, torch.full_like(v, 2.0)), "pool_views does not read the pool tensor"
    refs = _compat.storage_refs(_compat.storage_handle(v))
    assert refs >= 1, refs
    report["storage_refs_ok"] = True
    _compat.pin_pool(dev.index, pool)
    report["pin_form"] = _compat._PIN_FORM
    del v, st, y
    g.reset()
    _compat.unpin_pool(dev.index, pool)
    torch.cuda.synchronize()
    report["pin_pool_ok"] = True


def _tiny_training(report: dict) -> None:
    import torch

    import graphcomp
    import graphcomp.runtime
    from graphcomp.models import TinyMLP

    def run(compiled: bool):
        torch.manual_seed(0)
        m = TinyMLP(64, 96, 8).cuda()
        f = torch.compile(m, backend="graphcomp", options={"cudagraphs": "require", "codegen": "eager"}) if compiled else m
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        losses = []
        for step in range(4):
            gen = torch.Generator("cuda").manual_seed(step)
            x = torch.randn(32, 64, device="cuda", generator=gen)
            t = torch.randn(32, 8, device="cuda", generator=gen)
            loss = f(x, t)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
        return losses, [p.detach().clone() for p in m.parameters()]

    ref_l, ref_p = run(False)
    graphcomp.counters.reset()
    got_l, got_p = run(True)
    c = dict(graphcomp.counters)
    report["counters"] = {k: c.get(k, 0) for k in ("captures", "replays", "cudagraph_fallbacks", "capture_failures")}
    assert c.get("captures", 0) > 0 and c.get("replays", 0) > 0, c
    assert c.get("cudagraph_fallbacks", 0) == 0 and c.get("capture_failures", 0) == 0, c
    assert got_l == ref_l, (got_l, ref_l)  # eager codegen replays the same kernels: bitwise
    assert all(torch.equal(a, b) for a, b in zip(got_p, ref_p)), "parameters differ from eager"
    graphcomp.runtime.teardown()


def main() -> int:
    import torch

    report: dict = {"torch": torch.__version__, "ok": False}
    t0 = time.monotonic()
    try:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
        report["device"] = torch.cuda.get_device_name()
        _compat_bindings(report)
        _tiny_training(report)
        report["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported, exit code 1
        report["error"] = f"{type(e).__name__}: {e}"
        report["traceback"] = traceback.format_exc()[-4000:]
    report["seconds"] = round(time.monotonic() - t0, 1)
    text = json.dumps(report, indent=1)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
