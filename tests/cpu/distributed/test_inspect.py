"""Dumps are written per rank/frame/stage/pass and read back by `graphcomp inspect`."""

import json
import subprocess
import sys

import pytest
import torch

from graphcomp.tools import cli
from graphcomp.config import Config
from graphcomp.models import TinyMLP
from graphcomp.compiler.pipeline import PassSpec, registered_passes, temporary_registry


def _gelu_to_relu(gm, ctx):
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.gelu.default:
            n.target = torch.ops.aten.relu.default
            n.args = n.args[:1]
            n.kwargs = {}
            ctx.count("gelu_replaced")
    if not ctx.record.counts:
        return ctx.unchanged(gm, "no gelu in this graph")
    return ctx.changed(gm)


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
    out = subprocess.run([sys.executable, "-m", "graphcomp.tools.cli", "inspect", str(root)], capture_output=True, text=True, timeout=120)
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


# ------------------------------------------------------------------ --html
class _Page(__import__("html.parser").parser.HTMLParser):
    """Collects ids, tags, external references, table rows (as cell texts) and SVG charts."""

    def __init__(self):
        super().__init__()
        self.ids, self.tags, self.refs, self.rows, self.charts = set(), [], [], [], []
        self._row, self._cell, self._table = None, None, []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        if "id" in a:
            self.ids.add(a["id"])
        for k in ("src", "href", "data", "action", "srcset"):
            if k in a and not a[k].startswith("#"):
                self.refs.append((tag, k, a[k]))
        if tag == "table":
            self._table.append(a.get("class", ""))
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._cell = ""
        elif tag == "svg":
            self.charts.append({"attrs": a, "polylines": {}, "ticks": 0})
        elif tag == "polyline" and self.charts:
            self.charts[-1]["polylines"][a["class"]] = [tuple(map(float, p.split(","))) for p in a["points"].split()]
        elif tag == "line" and self.charts and a.get("class") == "coll":
            self.charts[-1]["ticks"] += 1

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._row is not None:
            self._row.append(self._cell.strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.rows.append((self._table[-1] if self._table else "", self._row))
            self._row = None
        elif tag == "table" and self._table:
            self._table.pop()

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def _parse(text):
    p = _Page()
    p.feed(text)
    p.close()
    return p


def _self_contained(page, text):
    assert text.startswith("<!DOCTYPE html>")
    assert page.refs == [], page.refs  # no external resource of any kind
    assert not {"script", "link", "img", "iframe", "object", "embed"} & set(page.tags)
    assert "http://" not in text and "https://" not in text and "url(" not in text


def test_html_page_from_a_real_dump(tmp_path, capsys):
    root = _compile_with_test_pass(tmp_path / "dumps")
    out = tmp_path / "report" / "page.html"
    assert cli.main(["inspect", str(root), "--html", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    text = out.read_text()
    page = _parse(text)
    _self_contained(page, text)
    assert {"frame-0", "frame-0-passes", "frame-0-pieces", "frame-0-collectives", "frame-0-memory"} <= page.ids
    passes = [r for t, r in page.rows if t == "passes"]
    assert passes[0] == ["stage", "pass", "enabled", "changed", "nodes", "ms", "counts", "reason", "op-count diff"]
    row = next(r for r in passes if r[:2] == ["joint", "gelu_to_relu"])
    assert row[2:4] == ["on", "yes"] and row[6] == "gelu_replaced=1"
    assert "aten.gelu.default -1" in row[8] and "aten.relu.default +1" in row[8]
    fwd = next(r for r in passes if r[:2] == ["fwd", "gelu_to_relu"])
    assert fwd[3] == "no" and fwd[7] == "no gelu in this graph"
    summary = json.loads((root / "rank0" / "summary.json").read_text())
    stages = summary["frames"][0]["stages"]
    # one chart per stage with a memory model (the pre-AOTAutograd "dynamo" stage has none)
    assert [c["attrs"]["data-stage"] for c in page.charts] == [s for s in stages if s != "dynamo"]
    for chart in page.charts:
        tl = stages[chart["attrs"]["data-stage"]]["memory"]["timeline"]
        cons, ind = chart["polylines"]["mem-conservative"], chart["polylines"]["mem-inductor"]
        assert len(cons) == 2 * len(tl["bytes"]) and len(ind) == 2 * len(tl["bytes_inductor"])
        top = min(y for _, y in cons + ind)  # SVG y grows downwards: the peak is the smallest y
        assert top == pytest.approx(26.0)  # the plot's top edge: the chart is scaled to the peak
    assert "(no split graphs" in text  # CPU graphs are never split


def _synthetic_summary(root):
    """A summary.json as a 2-rank CUDA run writes it: split pieces, bucketed collectives."""
    tl = {"num_nodes": 10, "step": 2, "bytes": [100, 400, 300, 200, 50], "bytes_inductor": [80, 300, 250, 150, 40],
          "collectives": [[1, "all_gather"], [7, "reduce_scatter"]]}
    mem = {"peak_bytes": 400, "peak_node": "mm_3", "peak_index": 3, "num_nodes": 10, "inputs_bytes": 10,
           "peak_bytes_allocated": 350, "peak_bytes_inductor": 300, "peak_op": "aten.mm.default",
           "largest_live": [{"node": "mm_3", "bytes": 256}], "timeline": tl}
    passes = [{"name": "partition_graph", "stage": "fwd", "enabled": True, "changed": True, "seconds": 0.0123,
               "nodes_before": 10, "nodes_after": 13, "reason": None, "counts": {"pieces": 3, "cut:host_sync": 1},
               "notes": [], "op_diff": {}},
              {"name": "schedule_prefetch", "stage": "fwd", "enabled": False, "changed": False, "seconds": 0,
               "nodes_before": 0, "nodes_after": 0, "reason": "disabled in Config.passes", "counts": {},
               "notes": [], "op_diff": {}}]
    parts = [{"piece": 0, "mode": "cudagraph", "nodes": 6, "captures": 1, "pool_bytes": 3 * 2**20, "reason": None,
              "static_inputs": 4, "copy_inputs": 1,
              "capture_seconds": {"warmup": 1.25, "trial_capture": 0.125, "capture": 0.125}},
             {"piece": 1, "mode": "eager", "nodes": 1, "reason": "host_sync: aten._local_scalar_dense (.item())"}]
    colls = [{"node": "ag", "op": "x", "kind": "all_gather", "dtype": "bfloat16", "bytes": 2048, "bucket": 0,
              "params": ["w1", "w2"]},
             {"node": "rs", "op": "y", "kind": "reduce_scatter", "dtype": "float32", "bytes": 4096, "bucket": None}]
    frame = {"frame": 0, "compile_id": "0/0", "recompile": False, "codegen": "inductor", "world_size": 2,
             "config": {"cudagraphs": "auto"}, "num_inputs": 3, "compile_seconds": 1.5,
             "stages": {"fwd": {"nodes_in": 10, "nodes_out": 13, "passes": passes, "collectives": colls,
                                "partitions": parts, "memory": mem}}}
    (root / "rank0").mkdir(parents=True)
    (root / "rank0" / "summary.json").write_text(json.dumps({"version": 1, "rank": 0, "frames": [frame]}))
    return root


def test_html_pieces_collectives_and_chart_geometry(tmp_path):
    from graphcomp.tools.inspect_html import render_html

    text = render_html(_synthetic_summary(tmp_path / "d"))
    page = _parse(text)
    _self_contained(page, text)
    pieces = [r for t, r in page.rows if t == "pieces"]
    assert pieces[1] == ["fwd", "0", "cudagraph", "6", "1", "3.0 MiB", "4", "1", "1.500 (warm-up 1.250)", ""]
    assert pieces[2] == ["fwd", "1", "eager", "1", "-", "-", "-", "-", "-",
                         "host_sync: aten._local_scalar_dense (.item())"]
    colls = [r for t, r in page.rows if t == "collectives"]
    assert colls[1:] == [["fwd", "all_gather", "bfloat16", "1", "2.0 KiB", "1"],
                         ["fwd", "reduce_scatter", "float32", "1", "4.0 KiB", "-"]]
    every = [r for t, r in page.rows if t == "collectives-all"]
    assert every[1][-1] == "w1, w2"
    off = next(r for t, r in page.rows if t == "passes" and r[1] == "schedule_prefetch")
    assert off[2:4] == ["off", "no"] and off[7] == "disabled in Config.passes"
    (chart,) = page.charts
    cons = chart["polylines"]["mem-conservative"]
    # 760x230 chart, plot area x 78..748, y 26..186; bucket j spans nodes [2j, 2j+2) of 10
    assert cons[:4] == [(78.0, pytest.approx(146.0)), (212.0, pytest.approx(146.0)), (212.0, 26.0), (346.0, 26.0)]
    assert chart["ticks"] == 2
    assert ("<title>fwd: estimated memory over 10 graph nodes; peak 400 B (conservative), 300 B (Inductor model)"
            "</title>") in text


def test_html_errors(tmp_path, capsys):
    root = _synthetic_summary(tmp_path / "d")
    assert cli.main(["inspect", str(root), "--html", str(tmp_path / "x.html"), "--stage", "fwd"]) == 2
    assert "--html writes whole frames" in capsys.readouterr().err
    assert cli.main(["inspect", str(root), "--html", str(tmp_path / "x.html"), "--frame", "4"]) == 2
    assert "no frame 4" in capsys.readouterr().err
    assert not (tmp_path / "x.html").exists()


def test_html_renders_in_a_headless_browser(tmp_path):
    import shutil

    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    from graphcomp.tools.inspect_html import write_html

    page = write_html(_synthetic_summary(tmp_path / "d"), tmp_path / "page.html")
    png = tmp_path / "page.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1200,1400",
                    f"--screenshot={png}", page.as_uri()], capture_output=True, timeout=120)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a rendered page, not an empty canvas


def test_measured_peak_against_the_largest_estimate(tmp_path, monkeypatch):
    """runtime.json's ``memory`` (teardown, CUDA only) and ``graphcomp inspect``'s
    measured-vs-estimated lines (the estimated vs measured peak)."""
    from graphcomp.tools.inspect_dumps import inspect_dir, largest_estimate
    from graphcomp.tools.inspect_html import render_html
    from graphcomp.runtime import manager

    # CPU process: nothing measured
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert manager.measured_memory() is None
    # a CUDA process (the allocator's peaks stood in)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 270 if d == 1 else -1)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 512 if d == 1 else -1)
    mem = manager.measured_memory()
    assert mem == {"device": "cuda:1", "max_allocated_bytes": 270, "max_reserved_bytes": 512}

    root = _synthetic_summary(tmp_path / "d")  # its fwd stage: est. 400 B, Inductor 300 B, codegen inductor
    summary = json.loads((root / "rank0" / "summary.json").read_text())
    assert largest_estimate(summary) == (300, 0, "fwd")
    (root / "rank0" / "runtime.json").write_text(json.dumps({"owners": [], "counters": {}, "memory": mem}))
    text = inspect_dir(root)
    assert "measured peak on cuda:1: 270 B allocated, 512 B reserved" in text, text
    assert "largest estimated graph peak: 300 B (frame 0, fwd;" in text and "measured / estimated 0.90" in text, text
    assert "measured / estimated 0.90" in render_html(root)
    # a runtime record without memory (CPU): no such lines
    (root / "rank0" / "runtime.json").write_text(json.dumps({"owners": [], "counters": {}}))
    assert "measured peak" not in inspect_dir(root)


def test_piece_rows_name_their_compile_regions():
    """A captured piece divided into compile regions (``compile_regions``) says how
    many in the inspect tables; other pieces show their node count alone."""
    from graphcomp.tools.inspect_dumps import nodes_text
    from graphcomp.compiler.plan import Piece

    row = Piece(index=0, mode="cudagraph", nodes=4213, regions=33).row()
    assert row["regions"] == 33 and nodes_text(row) == "4213 in 33 regions"
    plain = Piece(index=1, mode="eager", nodes=12).row()
    assert "regions" not in plain and nodes_text(plain) == "12"


def test_cli_demo_hands_its_options_to_the_demo(monkeypatch):
    """`graphcomp demo --steps 2 ...` reaches graphcomp.tools.demo with every option (argparse's
    REMAINDER used to reject a first option as the outer parser's)."""
    import graphcomp.tools.demo

    seen = []
    monkeypatch.setattr(graphcomp.tools.demo, "launch", lambda argv: seen.append(argv) or 0)
    assert cli.main(["demo", "--steps", "2", "--codegen", "eager"]) == 0
    assert cli.main(["demo"]) == 0
    assert seen == [["--steps", "2", "--codegen", "eager"], []]


def test_demo_launch_keeps_nproc_for_torchrun_only(monkeypatch):
    """`graphcomp demo --nproc 1 ...`: torchrun gets --nproc-per-node 1, the ranks get the
    rest (torchrun's parser stops at a `--nproc` after the module it runs)."""
    import subprocess

    import graphcomp.tools.demo as demo

    cmds = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, env=None: cmds.append(cmd) or 0)
    assert demo.launch(["--steps", "2", "--nproc", "1", "--codegen", "eager"]) == 0
    assert demo.launch(["--nproc=3"]) == 0
    (a, b) = cmds
    assert a[a.index("--nproc-per-node") + 1] == "1" and a[a.index("graphcomp.tools.demo") + 1:] == [
        "--steps", "2", "--codegen", "eager"], a
    assert b[b.index("--nproc-per-node") + 1] == "3" and b[-1] == "graphcomp.tools.demo", b


def test_demo_refuses_a_bad_option_naming_the_valid_ones(capsys):
    """`graphcomp demo --option KEY=VALUE` takes any Config field; a bad one is an error
    before any rank starts."""
    import graphcomp.tools.demo as demo

    with pytest.raises(SystemExit):
        demo.main(["--option", "compile_onc=false"])
    err = capsys.readouterr().err
    assert "compile_onc" in err and "compile_once" in err, err
    with pytest.raises(SystemExit):
        demo.main(["--option", "cudagraphs=sometimes"])
    assert "'off', 'auto', 'require'" in capsys.readouterr().err
