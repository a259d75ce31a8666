"""graphcomp's import graph has no cycle: every ``from . import x`` /
``from .x import y`` in ``graphcomp/``, at module level or inside a
function, is an edge; a cycle (even through a lazy import) fails with its path. And
the installed CLI does not import the (unshipped) benchmarks package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _modules() -> dict[str, Path]:
    mods = {}
    for p in (REPO / "graphcomp").rglob("*.py"):
        rel = p.relative_to(REPO).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    root = ".".join(base + ([node.module] if node.module else []))
                else:
                    root = node.module or ""
                targets = [root] + [f"{root}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                # a module's own ancestor packages have run their __init__ before it (their
                # re-exports of it are not a cycle of its making): no edge to them
                if t in mods and t != mod and not mod.startswith(t + "."):
                    edges[mod].add(t)
    return edges


def test_no_import_cycle():
    edges = _edges(_modules())
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                cyc = stack[stack.index(n):] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cyc))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_cli_does_not_import_benchmarks():
    code = "import sys, graphcomp, graphcomp.tools.cli; print(any(m.split('.')[0] == 'benchmarks' for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


# Passes are functions of (graph, context): what they know beyond the graph and the
# config comes through PassContext.env (graphcomp.compiler.compile_env), never from
# process-global state.
_GLOBAL_STATE = {
    "graphcomp.session": "the session (counters, plans, groups)",
    "graphcomp.runtime": "the CUDA-graph runtime",
    "graphcomp.runtime.manager": "the CUDA-graph runtime",
    "graphcomp.compiler.agreement": "the agreement store (use ctx.env.agree_kept / ctx.env.prior_plan / keep_plan)",
    "graphcomp.sharding.prefetch": "the cross-step prefetch registry (use ctx.env.cross_step_prefetch)",
    "graphcomp.sharding.gloo_groups": "the gloo group registry (use ctx.env.is_serial_group)",
}
_GLOBAL_NAMES = {"SESSION", "RUNTIME", "PREFETCH"}


def global_state_reads(source: str) -> list[str]:
    """What a module's source imports or names of graphcomp's process-global state."""
    out = []
    for node in ast.walk(ast.parse(source)):
        mods = []
        if isinstance(node, ast.ImportFrom) and node.module:
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        out += [f"line {node.lineno}: imports {m} ({_GLOBAL_STATE[m]})" for m in mods if m in _GLOBAL_STATE]
        if isinstance(node, ast.Name) and node.id in _GLOBAL_NAMES:
            out.append(f"line {node.lineno}: reads {node.id}")
    return out


def test_no_pass_reads_process_global_state():
    bad = {p.name: r for p in sorted((REPO / "graphcomp" / "passes").glob("*.py"))
           if (r := global_state_reads(p.read_text()))}
    assert not bad, f"passes reading process-global state (carry it in PassContext.env instead): {bad}"


def test_the_global_state_check_finds_a_planted_read():
    planted = "from graphcomp.session import SESSION\nfrom graphcomp.compiler import agreement\n" \
              "def f(ctx):\n    return SESSION.plans\n"
    found = global_state_reads(planted)
    assert any("graphcomp.session" in f for f in found) and any("agreement" in f for f in found)
    assert any("reads SESSION" in f for f in found)
    assert global_state_reads("from graphcomp.compiler.pipeline import PassContext\n") == []


# One capture primitive: graphcomp.runtime.capture creates, captures and frees every
# CUDA graph; the owners (runner, optimizer step, whole step) decide when, not how.
_CAPTURE_CALLS = {"capture", "trial_capture", "new_graph", "reset_graph", "capture_begin", "capture_end", "CUDAGraph"}
_CAPTURE_HOME = {"graphcomp/runtime/capture.py", "graphcomp/runtime/device.py"}


def capture_calls(source: str) -> list[str]:
    """Device-level capture calls in a module's source (``dev.capture(...)``,
    ``RUNTIME.device.reset_graph(...)``, ``torch.cuda.CUDAGraph()``)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _CAPTURE_CALLS:
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name in ("dev", "device", "cuda") or node.func.attr in ("CUDAGraph", "capture_begin", "capture_end"):
                out.append(f"line {node.lineno}: {ast.unparse(node.func)}")
    return out


def test_graphs_are_captured_only_through_the_capture_primitive():
    bad = {str(p.relative_to(REPO)): r for p in sorted((REPO / "graphcomp").rglob("*.py"))
           if str(p.relative_to(REPO)) not in _CAPTURE_HOME and (r := capture_calls(p.read_text()))}
    assert not bad, f"CUDA graphs captured or freed outside graphcomp.runtime.capture: {bad}"


def test_the_capture_check_finds_a_planted_capture():
    planted = "def f(dev, g):\n    dev.capture(g, None, None, f, [], [])\n    RUNTIME.device.reset_graph(g)\n" \
              "    torch.cuda.CUDAGraph()\n"
    assert len(capture_calls(planted)) == 3
    assert capture_calls("from graphcomp.runtime import capture\ncapture.capture('piece', f)\n") == []
