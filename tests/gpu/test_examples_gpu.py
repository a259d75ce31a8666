"""examples/train_llm.py on 2 GPUs (NCCL, bf16 compute, Inductor, CUDA graphs): it
trains, CUDA graphs capture without falling back, and a resume from the middle
checkpoint continues with the uninterrupted run's losses.

Not bitwise, unlike the CPU test (tests/cpu/models/test_examples.py): Inductor's backward of
the embedding (and other scatter-adds) uses atomic adds on GPUs, so gradients may
differ in their last bits between two runs; the losses of the steps after the resume
are compared to 1e-3 relative."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_llm.py"


def _launch(cwd: Path, *args: str) -> str:
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0,1"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT), *args]
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"hung: {' '.join(cmd)}\n{out[-3000:]}\n{err[-5000:]}")
    assert p.returncode == 0, f"{' '.join(cmd)}\n{out[-3000:]}\n{err[-6000:]}"
    return out


def _counters(out: str) -> dict:
    line = next(ln for ln in out.splitlines() if ln.startswith("[train] graphcomp counters: "))
    return json.loads(line.split(": ", 1)[1])


def _metrics(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_train_llm_on_2_gpus_captures_and_resumes(tmp_path):
    common = ["--model", "tiny-llama", "--steps", "8", "--grad-accum", "2", "--batch-size", "4", "--seq-len", "128",
              "--ckpt-interval", "4", "--log-interval", "2"]
    out = _launch(tmp_path, *common, "--ckpt-dir", "a", "--metrics-file", "a.jsonl")
    keep = os.environ.get("GRAPHCOMP_GPU_RESULTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / "train_llm_2gpu.txt").write_text(out)
    assert "2 rank(s) on cuda/nccl" in out and "compute dtype torch.bfloat16" in out, out
    lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert len(lines) == 4 and all("GiB peak alloc" in ln for ln in lines), out
    if any(k in torch.cuda.get_device_name(0) for k in ("H100", "H200")):
        assert all("MFU n/a" not in ln for ln in lines), out
    c = _counters(out)
    assert c.get("pieces_captured", 0) >= 1 and c.get("replays", 0) >= 1, c
    assert c.get("cudagraph_fallbacks", 0) == 0, c
    full = _metrics(tmp_path / "a.jsonl")
    assert full[8]["loss"] < full[1]["loss"], full

    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "step_00000004", tmp_path / "b" / "step_00000004")
    out = _launch(tmp_path, *common, "--ckpt-dir", "b", "--resume", "--metrics-file", "b.jsonl")
    assert "resumed from b/step_00000004 at step 4" in out, out
    resumed = _metrics(tmp_path / "b.jsonl")
    assert sorted(resumed) == [5, 6, 7, 8]
    for s in resumed:
        assert resumed[s]["lr"] == full[s]["lr"]
        assert resumed[s]["loss"] == pytest.approx(full[s]["loss"], rel=1e-3), (s, resumed[s], full[s])
