"""GraphcompTrainer (Hugging Face Trainer on graphcomp) on 1 and 2 GPUs via torchrun
(worker: tests/gpu/hf_trainer_worker.py): NCCL, Inductor, CUDA graphs at their
defaults. With 1 GPU the worker shards the model itself (over the one-rank group), so
both cases train DTensor shards through the captured optimizer step.

* fp32: 6 steps of Trainer's fused AdamW with gradient accumulation 2, active
  clipping and a linear schedule match the unsharded eager reference (losses and norms
  within 1e-4, parameters within 1e-3 of each tensor's norm: Inductor's kernels round
  differently from eager ones); pieces captured and replayed with no fallback; the
  optimizer step (clip + AdamW) captured and replayed.
* bf16: 8 steps with a checkpoint at step 4, then a new Trainer resumed from it: the
  master weights stay fp32, the resumed steps' losses within 1e-3 of
  the uninterrupted run's (Inductor's scatter-adds are atomic on GPUs, so not bitwise);
  both runs captured with no fallback.
"""

from pathlib import Path

import pytest
import torch

from _launch import torchrun_results

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

WORKER = Path(__file__).resolve().parent / "hf_trainer_worker.py"


def _captured_without_fallback(c: dict) -> None:
    assert c.get("pieces_captured", 0) >= 1 and c.get("replays", 0) >= 1, c
    assert c.get("cudagraph_fallbacks", 0) == 0 and c.get("capture_failures", 0) == 0, c
    assert c.get("optimizer_steps_captured", 0) >= 1 and c.get("optimizer_fallbacks", 0) == 0, c


@pytest.mark.parametrize("nproc", [1, 2])
def test_trainer_parity_capture_and_resume(tmp_path, nproc):
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    res = torchrun_results(WORKER, [str(tmp_path)], nproc, tmp_path, stem="hf_trainer", keep=f"hf_trainer_{nproc}gpu",
                           what="GraphcompTrainer", timeout=540, compile_threads=4)
    for r in res:
        f = r["fp32"]
        assert f["sharded"] and f["device"].startswith("cuda"), f
        torch.testing.assert_close(torch.tensor([e["loss"] for e in f["log"]]), torch.tensor(f["ref_losses"]),
                                   rtol=1e-4, atol=0)
        torch.testing.assert_close(torch.tensor([e["grad_norm"] for e in f["log"]]), torch.tensor(f["ref_norms"]),
                                   rtol=1e-4, atol=0)
        assert min(f["ref_norms"]) > 0.5  # clipping active at every step
        assert f["param_rel_err"] < 1e-3, f["param_rel_err"]
        assert f["optimizer"]["mode"] == "captured", f["optimizer"]
        _captured_without_fallback(f["counters"])

        b, rs = r["bf16"], r["resumed"]
        assert b["master_dtype"] == "torch.float32", b
        assert all(abs(e["loss"]) < 100 for e in b["log"]), b["log"]  # (finite: random tokens, no trend to expect)
        _captured_without_fallback(b["counters"])
        _captured_without_fallback(rs["counters"])
        full = {e["step"]: e["loss"] for e in b["log"]}
        resumed = {e["step"]: e["loss"] for e in rs["log"]}
        assert sorted(resumed) == list(range(1, 9)), resumed
        for s in range(5, 9):
            assert resumed[s] == pytest.approx(full[s], rel=1e-3), (s, resumed[s], full[s])
