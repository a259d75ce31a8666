"""``graphcomp.tools.health``: the end-of-run report names each problem a run had,
with its reason and the one thing to try (``FIXES``): fallbacks forced on the CPU
stand-in CUDA device (a piece whose capture fails, a graph break in the loss, an
optimizer graphcomp does not capture), a recompile; a clean CPU run reports none.
(The example's command line prints it too: tests/cpu/test_examples.py.)"""

from __future__ import annotations

import pytest
import torch

import graphcomp
from graphcomp.runtime.manager import RUNTIME
from graphcomp.tools.health import FIXES, format_health, health_report


@torch.library.custom_op("graphcomp_health_test::fragile", mutates_args=())
def fragile(x: torch.Tensor) -> torch.Tensor:
    """Fails under (stand-in) CUDA-graph capture, as an op that syncs the host would."""
    if RUNTIME.device.capture_active():
        raise RuntimeError("operation not permitted when stream is capturing")
    return x * 2


@fragile.register_fake
def _(x):
    return torch.empty_like(x)


fragile.register_autograd(lambda ctx, grad: grad * 2)


class Net(torch.nn.Module):
    def __init__(self, fragile_op: bool):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(16, 16) for _ in range(3))
        self.fragile_op = fragile_op

    def forward(self, x, y):
        h = torch.relu(self.a(x))
        h = self.b(h)
        if self.fragile_op:
            h = torch.ops.graphcomp_health_test.fragile(h)
        return torch.nn.functional.mse_loss(self.c(torch.relu(h)), y)


@pytest.fixture(autouse=True)
def _fresh_dynamo_records():
    """Dynamo's graph-break counters and compilation metrics are process-wide."""
    torch._dynamo.utils.counters.clear()
    torch._dynamo.utils.clear_compilation_metrics()
    yield


def _batches(n: int, rows: int = 4):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(rows, 16, generator=g), torch.randn(rows, 16, generator=g)) for _ in range(n)]


def test_forced_fallbacks_are_reported_with_reason_and_fix(pg1):
    from _fakecuda import fake_cuda_runtime

    def loss_fn(model, x, y):
        loss = model(x, y)
        torch._dynamo.graph_break()  # (a print or .item() in a user's loss does the same)
        return loss * 1.0

    with fake_cuda_runtime():
        torch.manual_seed(0)
        m = Net(fragile_op=True)
        graphcomp.shard(m)
        opt = torch.optim.Adagrad(m.parameters(), lr=0.01)  # not captured by graphcomp.optim
        with pytest.warns(RuntimeWarning, match="optimizer Adagrad is not supported"):
            step = graphcomp.train_step(m, opt, loss_fn=loss_fn, options={"codegen": "eager"})
        with pytest.warns(RuntimeWarning, match="cannot be captured"):
            for x, y in _batches(4):
                step(x, y)
        report = health_report(step, tokens_per_s=1200.0, mfu=0.25, world=2)
        text = format_health(report)
        graphcomp.runtime.teardown()

    kinds = [p["kind"] for p in report["problems"]]
    assert sorted(kinds) == ["capture_failed", "graph_break", "optimizer_unsupported"], report["problems"]
    for p in report["problems"]:
        assert p["fix"] == FIXES[p["kind"]]
        assert f"[{p['kind']}]: {p['what']}\n    try: {p['fix']}" in text, text
    by_kind = {p["kind"]: p for p in report["problems"]}
    assert "operation not permitted when stream is capturing" in by_kind["capture_failed"]["what"]
    assert "Config.split_ops" in by_kind["capture_failed"]["fix"]
    assert "torch._dynamo.graph_break()" in by_kind["graph_break"]["what"]
    assert "TORCH_LOGS=graph_breaks" in by_kind["graph_break"]["fix"]
    assert "Adagrad is not supported" in by_kind["optimizer_unsupported"]["what"]
    assert by_kind["optimizer_unsupported"]["fix"] == "use torch.optim.AdamW(fused=True)"
    # the piece that failed to capture, with its frame, stage and reason; the others captured and replayed
    failed = [p for p in report["cudagraphs"]["eager_pieces"] if p["kinds"] == ["capture_failed"]]
    assert len(failed) == 1 and failed[0]["stage"] == "fwd", report["cudagraphs"]["eager_pieces"]
    assert report["cudagraphs"]["capture_failures"] == 1 and report["cudagraphs"]["replays"] > 0
    assert report["compile"]["frames"] == 2 and sum(report["compile"]["graph_breaks"].values()) >= 1
    # the whole step is not one graph because of the optimizer (listed once, as the optimizer's problem)
    assert "optimizer step is not captured" in report["step"]["whole_step"]
    assert not report["step"]["whole_step_one_graph"]
    assert report["step"]["optimizer"]["mode"] == "reference"
    assert report["speed"]["tokens_per_s_per_gpu"] == 600.0 and "MFU         : 25.0%" in text
    assert "exposed comm: not measured" in text


def test_clean_run_then_a_recompile(pg1):
    torch.manual_seed(0)
    m = Net(fragile_op=False)
    graphcomp.shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    step = graphcomp.train_step(m, opt, options={"codegen": "eager"}, dynamic=False)
    for x, y in _batches(3):
        step(x, y)
    report = health_report(step, exposed_comm=0.125)
    text = format_health(report)
    assert report["problems"] == [] and "problems    : none found" in text, text
    assert report["step"]["whole_step"] == "no CUDA device" and "whole step  : not one graph: no CUDA device" in text
    assert report["step"]["optimizer"] == {"mode": "reference", "reason": "no CUDA device"}
    assert report["speed"]["world"] == 1 and report["speed"]["peak_memory"]["max_rss_bytes"] > 0
    assert "throughput  : not measured" in text and "exposed comm: 12.5% of step time" in text

    x, y = _batches(1, rows=6)[0]  # a new batch size: dynamic=False recompiles
    step(x, y)
    report = health_report(step)
    assert [p["kind"] for p in report["problems"]] == ["recompile"], report["problems"]
    assert report["compile"]["recompiles"] == 1 and report["compile"]["recompiled_frames"] == [1]
    assert "size mismatch" in report["problems"][0]["what"], report["problems"]  # Dynamo's guard failure
    assert "TORCH_LOGS=recompiles" in format_health(report)
    bare = health_report()  # without a step: what the runtime knows (no captured step on the CPU)
    assert bare["step"]["source"] == "runtime" and bare["step"]["whole_step"] is None
    assert "whole step  : no whole-step capture" in format_health(bare)
