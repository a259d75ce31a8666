"""graphcomp's graphs in the debugging tools users already have: depyf's dump
directory (``depyf.prepare_debug``) and ``TORCH_LOGS`` / ``torch._logging.set_logs``.
(``TORCH_TRACE`` + tlparse: tests/cpu/distributed/test_inspect.py.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphcomp.compiler.pipeline import PassSpec, temporary_registry

ROOT = Path(__file__).resolve().parents[3]


def _relu_to_sigmoid(gm, ctx):
    """A test pass whose output differs visibly from its input (relu is not decomposed
    by Inductor's table, so the joint graph has it with either codegen)."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.relu.default:
            n.target = torch.ops.aten.sigmoid.default
            ctx.count("relu_replaced")
    if not ctx.record.counts:
        return ctx.unchanged(gm, "no relu in this graph")
    return ctx.changed(gm)


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_depyf_dump_dir_holds_graphcomps_transformed_graphs(tmp_path, codegen):
    depyf = pytest.importorskip("depyf")
    spec = PassSpec("relu_to_sigmoid", _relu_to_sigmoid, frozenset({"joint"}))
    m = torch.nn.Sequential(torch.nn.Linear(16, 37), torch.nn.ReLU(), torch.nn.Linear(37, 5))
    x = torch.randn(4, 16)
    with temporary_registry(spec, replace=False):
        cm = torch.compile(m, backend="graphcomp", options={"codegen": codegen})
        with depyf.prepare_debug(str(tmp_path)):
            out = cm(x)
            out.sum().backward()
    torch.testing.assert_close(out, m[2](torch.sigmoid(m[0](x))))  # the transformed graph is what ran
    files = {p.name: p for p in tmp_path.iterdir()}
    ours = sorted(n for n in files if ".graphcomp_frame0_" in n)
    # depyf names graphs <compiled fn>.<name>.<k>.py: the stage inputs and every pass output
    for name in ("dynamo_input", "joint_input", "fwd_input", "bwd_input", "fwd_00_schedule_prefetch",
                 "bwd_00_defer_weight_grads", "bwd_04_cudagraphs"):
        assert any(f".graphcomp_frame0_{name}." in n for n in ours), (name, ours)
    (after,) = [files[n] for n in ours if "_joint_" in n and n.split(".")[1].endswith("_relu_to_sigmoid")]
    (before,) = [files[n] for n in ours if ".graphcomp_frame0_joint_input." in n]
    assert "torch.ops.aten.relu.default" in before.read_text()
    text = after.read_text()
    assert "torch.ops.aten.sigmoid.default" in text and "torch.ops.aten.relu.default" not in text
    assert any(n.startswith("full_code_for_") for n in files)  # depyf's own dump is intact


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env}
    if "TORCH_LOGS" not in env:
        full_env.pop("TORCH_LOGS", None)  # the caller's own setting would change what is printed
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=full_env)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


_COMPILE = (
    "import torch, graphcomp\n"
    "from graphcomp.models import TinyMLP\n"
    "{pre}"
    "torch.compile(TinyMLP(), backend='graphcomp', options={{'codegen': 'eager'}})(torch.randn(4, 16)).sum().backward()\n"
)


def _graph_headers(stderr: str) -> list[str]:
    return [ln.split("===== ")[1].split(" =====")[0] for ln in stderr.splitlines() if "[__graphcomp_graphs]" in ln
            and "===== " in ln]


def test_torch_logs_module_name_shows_graphcomps_graphs():
    p = _run(_COMPILE.format(pre=""), TORCH_LOGS="+graphcomp")
    heads = _graph_headers(p.stderr)
    for name in ("graphcomp_frame0_joint_input", "graphcomp_frame0_fwd_input"):
        assert name in heads, (name, heads)
    # a pass's graph: graphcomp_frame<F>_<stage>_<NN>_<pass> (NN: its place among the stage's passes)
    for stage, name in (("joint", "bucket_collectives"), ("bwd", "cudagraphs")):
        assert any(h.startswith(f"graphcomp_frame0_{stage}_") and h.endswith(f"_{name}") for h in heads), (name, heads)
    assert "torch.ops.aten.addmm.default" in p.stderr and '"f32[4, 37][37, 1]cpu"' in p.stderr  # strides, device
    assert "graphcomp frame 0 bwd:" in p.stderr  # graphcomp's own logs come along


def test_set_logs_artifact_shows_only_the_graphs():
    pre = "import logging\ntorch._logging.set_logs(modules={'graphcomp': logging.WARNING, 'graphcomp_graphs': True})\n"
    p = _run(_COMPILE.format(pre=pre))
    assert "graphcomp_frame0_joint_input" in _graph_headers(p.stderr)
    assert "graphcomp frame 0 bwd:" not in p.stderr  # the INFO logs stay off
    quiet = _run(_COMPILE.format(pre=""))
    assert "[__graphcomp_graphs]" not in quiet.stderr and "=====" not in quiet.stderr  # off by default
