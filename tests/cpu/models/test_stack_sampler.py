"""benchmarks/stack_sampler (gpu_session.sh's STACKS=<s>) and benchmarks.stack_summary."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks import stack_summary

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = "import time\ndef waiting_here():\n    time.sleep(1.6)\nwaiting_here()\n"


def _run(tmp_path: Path, **env: str) -> list[Path]:
    (tmp_path / "prog.py").write_text(SCRIPT)
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    e.update(PYTHONPATH=f"{ROOT / 'benchmarks' / 'stack_sampler'}:{ROOT}", STACKS_DIR=str(tmp_path / "st"), STACKS_S="0.3", **env)
    subprocess.run([sys.executable, str(tmp_path / "prog.py")], env=e, check=True, timeout=60)
    return sorted((tmp_path / "st").glob("stacks-*.txt")) if (tmp_path / "st").exists() else []


def test_rank0_is_sampled_and_summarized(tmp_path):
    files = _run(tmp_path, RANK="0", LOCAL_RANK="0")
    assert len(files) == 1
    samples = stack_summary.parse(files[0].read_text())
    assert len(samples) >= 3
    assert all(t > 0 for t, _ in samples) and [t for t, _ in samples] == sorted(t for t, _ in samples)
    assert any(f[2] == "waiting_here" for f in samples[0][1])
    text = stack_summary.summarize(samples)
    assert "waiting_here" in text and f"({len(samples)} samples)" in text


def test_other_ranks_and_unranked_processes_are_not_sampled(tmp_path):
    assert _run(tmp_path, RANK="1", LOCAL_RANK="1") == []
    assert _run(tmp_path) == []


def test_innermost_repository_frame():
    frames = [("/x/benchmarks/run.py", 10, "main"), ("/x/graphcomp/optim/captured_step.py", 335, "_clip_and_step"),
              ("/v/site-packages/torch/_ops.py", 865, "__call__")]
    assert stack_summary.innermost_ours(frames) == "graphcomp/optim/captured_step.py:335 _clip_and_step"
    assert stack_summary.innermost_ours(frames[2:]) == "-"


THREADED = """import threading, time
def compiling_in_a_thread():
    time.sleep(1.6)
def run_backward():  # the autograd engine: its C++ call blocks with no Python frame under it
    threading.Thread(target=compiling_in_a_thread, name="autograd-device").start()
    time.sleep(1.6)
run_backward()
"""


def test_working_thread_is_counted_when_the_main_thread_waits_in_the_engine(tmp_path):
    (tmp_path / "prog.py").write_text(THREADED)
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    e.update(PYTHONPATH=f"{ROOT / 'benchmarks' / 'stack_sampler'}:{ROOT}", STACKS_DIR=str(tmp_path / "st"),
             STACKS_S="0.3", RANK="0", LOCAL_RANK="0")
    subprocess.run([sys.executable, str(tmp_path / "prog.py")], env=e, check=True, timeout=60)
    text = next((tmp_path / "st").glob("stacks-*.txt")).read_text()
    assert "--- thread autograd-device" in text
    samples = stack_summary.parse(text)
    spliced = [[f[2] for f in fr] for _, fr in samples if any(f[2] == "compiling_in_a_thread" for f in fr)]
    assert spliced, samples
    assert all(names.index("run_backward") < names.index("compiling_in_a_thread") for names in spliced), spliced


def test_engine_wait_splices_the_working_threads_stack():
    text = ('=== t=1.0s\n  File "/v/site-packages/torch/autograd/graph.py", line 869, in _engine_run_backward\n'
            '--- thread Dummy-3\n  File "/v/site-packages/torch/_inductor/scheduler.py", line 10, in fuse_nodes\n'
            '  File "/v/site-packages/torch/_inductor/scheduler.py", line 20, in can_fuse\n'
            '=== t=3.0s\n  File "/v/site-packages/torch/_inductor/graph.py", line 5, in run\n')
    samples = stack_summary.parse(text)
    assert [f[2] for f in samples[0][1]] == ["_engine_run_backward", "fuse_nodes", "can_fuse"]
    out = stack_summary.inclusive(samples, "torch/_inductor/")
    assert "1.0s  torch/_inductor/scheduler.py fuse_nodes" in out and "2.0s  torch/_inductor/graph.py run" in out
