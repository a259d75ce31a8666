"""Dumps are written per rank/frame/stage/pass and read back by `graphcomp inspect`."""

import json
import subprocess
import sys

import pytest
import torch

from graphcomp import cli
from graphcomp.config import Config
from graphcomp.models import TinyMLP
from graphcomp.pipeline import PassSpec, registered_passes, temporary_registry


def _gelu_to_relu(gm, ctx):
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.gelu.default:
            n.target = torch.ops.aten.relu.default
            n.args = n.args[:1]
            n.kwargs = {}
            ctx.count("gelu_replaced")
    if not ctx.record.counts:
        ctx.nothing("no gelu in this graph")
    return gm


def _compile_with_test_pass(tmp_path):
    spec = PassSpec("gelu_to_relu", _gelu_to_relu, frozenset({"joint", "fwd", "bwd"}))
    with temporary_registry(spec, replace=False):
        m = TinyMLP()
        cm = torch.compile(m, backend="graphcomp", options={"codegen": "eager", "dump_dir": str(tmp_path)})
        x = torch.randn(4, 16)
        out = cm(x)
        out.sum().backward()
        fc = m.fc2(torch.relu(m.fc1(x)))
        torch.testing.assert_close(out, fc)  # the pass really changed what runs
    return tmp_path


def test_dump_layout_and_summary(tmp_path):
    root = _compile_with_test_pass(tmp_path)
    summary = json.loads((root / "rank0" / "summary.json").read_text())
    (frame,) = summary["frames"]
    assert set(frame["stages"]) == {"dynamo", "joint", "fwd", "bwd"}
    joint = frame["stages"]["joint"]
    rec = next(p for p in joint["passes"] if p["name"] == "gelu_to_relu")
    assert rec["changed"] and rec["counts"] == {"gelu_replaced": 1}
    assert rec["op_diff"]["aten.relu.default"] == 1
    fwd_rec = next(p for p in frame["stages"]["fwd"]["passes"] if p["name"] == "gelu_to_relu")
    assert not fwd_rec["changed"] and fwd_rec["reason"] == "no gelu in this graph"
    d = root / "rank0" / "frame000" / "joint"
    idx = [p["name"] for p in joint["passes"]].index("gelu_to_relu")
    before = (d / f"{idx:02d}-gelu_to_relu.before.txt").read_text()
    after = (d / f"{idx:02d}-gelu_to_relu.after.txt").read_text()
    assert "torch.ops.aten.gelu.default" in before and "torch.ops.aten.gelu.default" not in after
    assert "torch.ops.aten.relu.default" in after
    assert "f32[4, 37][37, 1]cpu" in before  # print_readable with strides and devices
    assert frame["config"]["codegen"] == "eager"


def test_inspect_table_and_diff(tmp_path, capsys):
    root = _compile_with_test_pass(tmp_path)
    assert cli.main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert "frame 0" in out and "gelu_to_relu" in out and "gelu_replaced=1" in out
    for stage in ("joint", "fwd", "bwd"):
        assert f"\n{stage}" in out
    assert cli.main(["inspect", str(root), "--frame", "0", "--stage", "joint", "--pass", "gelu_to_relu", "--diff"]) == 0
    diff = capsys.readouterr().out
    assert diff.startswith("---") and "-" in diff and "+" in diff and "relu" in diff


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--frame", "7"], "no frame 7"),
        (["--rank", "3"], "no summary for rank 3"),
        (["--diff", "--frame", "0"], "--diff needs --stage, --pass"),
        (["--diff", "--frame", "0", "--stage", "joint", "--pass", "nope"], "pass 'nope' did not run"),
    ],
)
def test_inspect_errors(tmp_path, capsys, args, msg):
    root = _compile_with_test_pass(tmp_path)
    assert cli.main(["inspect", str(root), *args]) == 2
    assert msg in capsys.readouterr().err


def test_inspect_missing_dir(tmp_path, capsys):
    assert cli.main(["inspect", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_console_script_installed(tmp_path):
    root = _compile_with_test_pass(tmp_path)
    out = subprocess.run([sys.executable, "-m", "graphcomp.cli", "inspect", str(root)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "gelu_to_relu" in out.stdout


def test_structured_trace_gets_our_graphs(tmp_path):
    code = (
        "import torch\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())\n"
        "torch.compile(m, backend='graphcomp', options={'codegen': 'eager'})(torch.randn(2, 4)).sum().backward()\n"
    )
    env = {**__import__("os").environ, "TORCH_TRACE": str(tmp_path / "trace")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    text = "".join(p.read_text() for p in (tmp_path / "trace").glob("*"))
    for stage in ("joint", "fwd", "bwd"):
        assert f"graphcomp_frame0_{stage}_input" in text
