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

ROOT = Path(__file__).resolve().parents[2]
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


def test_every_session_step_selects_tests():
    steps = _steps()
    assert {"zoo2", "cg2", "optim2", "diverge", "tp", "soak2"} <= {s for s, _ in steps}, steps
    pytest.importorskip("transformers")  # (the HF zoo's GPU test imports the model families)
    for name, args in steps:
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
        m = re.search(r"(\d+)(?:/\d+)? tests? (?:collected|selected)", r.stdout)
        assert r.returncode == 0 and m and int(m.group(1)) > 0, (name, args, r.stdout[-1500:], r.stderr[-1500:])


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
