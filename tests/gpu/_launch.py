"""Run a worker script under ``torchrun`` from a GPU test and read what its ranks wrote.

    results = torchrun_results(script, [args...], nproc, tmp_path, stem="soak", keep="soak_1gpu",
                               what="soak", timeout=540, compile_threads=4)

Multicast stays off (``NCCL_NVLS_ENABLE=0`` and friends); a run past ``timeout``
fails the test naming what hung; a non-zero exit fails it with the stderr tail. The
ranks write ``OUTDIR/<stem>.rank<R>.json``; with ``GRAPHCOMP_GPU_RESULTS`` set, the
list of them is also kept there as ``<keep>.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def torchrun_results(script: Path, args: list[str], nproc: int, outdir: Path, *, stem: str, keep: str,
                     what: str, timeout: float, compile_threads: int = 1) -> list[Any]:
    env = {**os.environ, **MULTICAST_OFF, "TORCHINDUCTOR_COMPILE_THREADS": str(compile_threads)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(script), *args]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"{what} on {nproc} GPU(s) did not finish in {timeout}s (hang?)\n{err[-6000:]}")
    assert out.returncode == 0, out.stderr[-4000:]
    results = [json.loads((Path(outdir) / f"{stem}.rank{r}.json").read_text()) for r in range(nproc)]
    kept = os.environ.get("GRAPHCOMP_GPU_RESULTS")
    if kept:
        os.makedirs(kept, exist_ok=True)
        Path(kept, f"{keep}.json").write_text(json.dumps(results, indent=1))
    return results
