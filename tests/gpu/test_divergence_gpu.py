"""Rank agreement on 2 GPUs (issue 16): a rank whose forward reads an extra weight
makes both ranks raise RankDivergence, naming the collective and the source line,
within 60 s (NCCL's timeout is 300 s); matching ranks train with CUDA graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _launch import torchrun_results

pytestmark = pytest.mark.gpu
SCRIPT = Path(__file__).with_name("divergence_worker.py")
WAIT_S = 60.0


def _need2() -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


def test_divergent_ranks_both_raise_naming_the_read(tmp_path):
    _need2()
    res = torchrun_results(SCRIPT, [str(tmp_path), "diverge"], 2, tmp_path, stem="divergence",
                           keep="divergence_2gpu", what="rank divergence", timeout=240)
    for r in res:
        assert r.get("ours"), r
        assert r["seconds"] < WAIT_S, r
        msg = r["error"]
        assert "ranks disagree on the collectives of the fwd graph" in msg, msg
        # (bucketing on by default: the three gathers are one bucket, issued at its first member's line)
        assert "collective #0 differs" in msg and "bucket=joint:ag0" in msg, msg
        assert "_agree_models.py" in msg and "x = x @ self.p.w1" in msg, msg


def test_matching_ranks_train_with_cuda_graphs(tmp_path):
    _need2()
    res = torchrun_results(SCRIPT, [str(tmp_path), "agree"], 2, tmp_path, stem="divergence",
                           keep="agreement_2gpu", what="rank agreement", timeout=240)
    for r in res:
        assert "error" not in r, r
        c = r["counters"]
        assert c["rank_agreement_checks"] >= 2 and "rank_divergences" not in c, c
        assert c.get("replays", 0) > 0 and c.get("cudagraph_fallbacks", 0) == 0, c
    assert res[0]["losses"] == res[1]["losses"]  # the same batch on both ranks: the same loss
