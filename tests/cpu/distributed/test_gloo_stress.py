"""A shortened run of tests/stress/gloo_stress.py in `make test`.

4 iterations on 2 gloo ranks, each a fresh compile of the sharded tiny Llama with
graphcomp's defaults and 3 training steps, with glibc's heap checks on; every
iteration under a timeout. graphcomp.shard puts the CPU parameters on a gloo group
with one worker thread (graphcomp.sharding.gloo_groups), so ``schedule_prefetch`` reorders
the CPU graphs by default. The full loop (hundreds of iterations, 2 and 4 ranks) and
its numbers: docs/heap-corruption.md. (10 iterations until 2026-11-26: 56 s of CI; a
smoke at either count, the failure it guards against was once in 150 iterations.)
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

STRESS = Path(__file__).resolve().parents[2] / "stress" / "gloo_stress.py"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_gloo_stress_short(tmp_path):
    out = tmp_path / "summary.json"
    # a smoke of the stress script (2 iterations; the failure it hunts showed once in 150)
    cmd = [sys.executable, str(STRESS), "--iters", "2", "--ranks", "2", "--steps", "3", "--codegen", "eager",
           "--timeout", "120", "--log-dir", str(tmp_path / "logs"), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["iterations"] == 2
    assert (s["crashes"], s["timeouts"], s["errors"]) == (0, 0, 0), s["failures"]
    assert s["ok"] == 2 and proc.returncode == 0
    assert s["malloc_checks"] and s["prefetch_cpu"] == "default"
    assert s["compiles"] == 2
    # one worker thread per gloo group: the default prefetches on CPU graphs too (each
    # compile reorders its forward and its backward; docs/heap-corruption.md)
    assert s["prefetch_changed_frames"] == 2 * s["compiles"]


def test_gloo_stress_rejects_bad_arguments(tmp_path):
    for bad in (["--iters", "0"], ["--ranks", "3"], ["--prefetch-cpu", "maybe"]):
        proc = subprocess.run([sys.executable, str(STRESS), *bad], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and bad[0] in proc.stderr, (bad, proc.stderr)
