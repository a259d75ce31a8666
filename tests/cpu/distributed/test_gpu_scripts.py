"""The GPU session scripts select what they mean to run: device time is short (30
minutes a session), so a step whose pytest selection is empty, or a script with a
syntax error, must fail here, on the CPU, not on the device machine."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SESSION = ROOT / "tests" / "gpu" / "session.sh"


def _steps() -> list[tuple[str, list[str]]]:
    out = []
    for line in SESSION.read_text().splitlines():
        m = re.search(r"\brun (\w+) \S+ python -m pytest (.*)$", line)
        if m:
            args = [a for a in shlex.split(m.group(2)) if a not in ("-q", "-s", "-p", "no:cacheprovider")]
            out.append((m.group(1), args))
    return out


def test_scripts_parse():
    for script in (SESSION, ROOT / "benchmarks" / "gpu_session.sh"):
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, (script, r.stderr)


_SELECT_PLUGIN = """
import json, os
from _pytest.mark import KeywordMatcher
from _pytest.mark.expression import Expression

def pytest_collection_finish(session):
    steps = json.loads(os.environ["GC_SESSION_STEPS"])
    counts = {}
    for name, specs, kexpr in steps:
        expr = Expression.compile(kexpr) if kexpr else None
        n = 0
        for item in session.items:
            nodeid = item.nodeid
            if not any(nodeid == s or nodeid.startswith(s + "::") or nodeid.startswith(s + "[") for s in specs):
                continue
            if expr is not None and not expr.evaluate(KeywordMatcher.from_item(item)):
                continue
            n += 1
        counts[name] = n
    with open(os.environ["GC_SESSION_COUNTS"], "w") as f:
        json.dump(counts, f)
"""


def test_every_session_step_selects_tests(tmp_path):
    """One collection of tests/gpu, then each step's paths and ``-k`` expression applied
    with pytest's own keyword matching (one subprocess instead of one per step: 94 s of
    CI on 2 cores before)."""
    import json
    import os

    steps = _steps()
    assert {"zoo2", "cg2", "optim2", "diverge", "tp", "soak2"} <= {s for s, _ in steps}, steps
    pytest.importorskip("transformers")  # (the HF zoo's GPU test imports the model families)
    parsed = []
    for name, args in steps:
        specs, kexpr, i = [], None, 0
        while i < len(args):
            if args[i] == "-k":
                kexpr, i = args[i + 1], i + 2
                continue
            assert not args[i].startswith("-"), (name, args)  # an option this test does not model
            specs.append(args[i])
            i += 1
        assert specs, (name, args)
        parsed.append((name, specs, kexpr))
    (tmp_path / "gc_select_plugin.py").write_text(_SELECT_PLUGIN)
    counts_file = tmp_path / "counts.json"
    env = dict(os.environ, GC_SESSION_STEPS=json.dumps(parsed), GC_SESSION_COUNTS=str(counts_file),
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-p", "gc_select_plugin", "tests/gpu"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert r.returncode == 0 and counts_file.exists(), (r.stdout[-1500:], r.stderr[-1500:])
    counts = json.loads(counts_file.read_text())
    empty = {name: specs_k for name, *specs_k in parsed if counts.get(name, 0) == 0}
    assert not empty, f"session steps that select no test: {empty}"


def test_smoke_check_gates_the_session(tmp_path):
    """``tests/gpu/smoke.py`` is the session's first step: it imports and reports
    (here: no CUDA device, exit 1), and session.sh stops when it fails."""
    import json

    out = tmp_path / "smoke.json"
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "smoke.py"), str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 1, (r.stdout, r.stderr)
    rep = json.loads(out.read_text())
    assert rep["ok"] is False and "no CUDA device" in rep["error"], rep
    text = SESSION.read_text()
    assert "tests/gpu/smoke.py" in text and "exit 1" in text
