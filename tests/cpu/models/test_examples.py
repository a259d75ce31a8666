"""examples/train_llm.py: unit tests of its data, schedule and checkpoint helpers, and
end-to-end runs on 2 gloo CPU ranks under torchrun (a checkpoint and a resume; the
token-file data path with local weights).

The end-to-end runs use ``--codegen eager`` (graphcomp's passes, FX graphs run as they
are): one launch of the tiny preset takes about 17 s on 2 CPU cores that way, and
about 57 s with Inductor (35 s of it compiling), too slow for CI. They train the tiny
preset with one decoder layer instead of two (a ``--config`` file; the token-file
test's saved model): what they check (checkpoints, resume, data, loading weights) is
the same for one layer, and each launch compiles about a third faster. The resume check is
bitwise: the resumed run restores parameters and AdamW moments exactly (DCP stores
the tensors), the lr is a function of the step, each data row a function of (seed,
micro-batch, row), and the same graphs run on the same 2 single-threaded ranks with
the same gloo all-reduces, so every floating-point operation repeats exactly.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from _dist import free_port

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "examples" / "train_llm.py"
LAUNCH_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def tl():
    spec = importlib.util.spec_from_file_location("train_llm", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _args(tl, *extra):
    return tl.parse_args(["--seq-len", "8", "--batch-size", "2", *extra])


def _launch(cwd: Path, *args: str) -> str:
    """torchrun 2 ranks of the example; its stdout (rank 0's progress lines)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(SCRIPT), "--codegen", "eager", *args]
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)  # its own process group: a hang kills the ranks too
    try:
        out, err = p.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"train_llm.py hung for {LAUNCH_TIMEOUT_S} s: {' '.join(cmd)}\n{out[-3000:]}\n{err[-5000:]}")
    assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{out[-3000:]}\n{err[-6000:]}"
    return out


def _one_layer_config(tl):
    """The tiny preset with one decoder layer (a LlamaConfig; the launches compile it faster)."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**tl.PRESETS["tiny-llama"], "num_hidden_layers": 1})


def _metrics(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


# ------------------------------------------------------------------ unit tests
def test_rows_are_a_function_of_position_not_of_the_world_size(tl):
    one = tl.Batches(_args(tl, "--batch-size", "4"), 256, rank=0, world=1)
    halves = [tl.Batches(_args(tl), 256, rank=r, world=2) for r in range(2)]
    for g in (0, 7):
        full, _ = one.get(g, torch.device("cpu"))
        assert torch.equal(full, torch.cat([h.get(g, torch.device("cpu"))[0] for h in halves]))
        assert torch.equal(full, one.get(g, torch.device("cpu"))[0])  # deterministic
    assert not torch.equal(one.get(0, torch.device("cpu"))[0], one.get(1, torch.device("cpu"))[0])
    x, y = one.get(3, torch.device("cpu"))
    assert x.shape == (4, 8) and x.dtype == torch.int64 and torch.equal(x, y) and int(x.max()) < 256
    step = (x[:, 1:] - x[:, :-1]) % 256  # synthetic rows are arithmetic progressions (learnable)
    assert torch.equal(step, step[:, :1].expand_as(step))


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_rows_are_windows_of_the_file(tl, tmp_path, dtype):
    path = tmp_path / "tokens.bin"
    np.arange(5000, dtype=dtype).tofile(path)
    b = tl.Batches(_args(tl, "--data", str(path), "--data-dtype", dtype, "--batch-size", "3"), 10_000, 0, 1)
    x, _ = b.get(2, torch.device("cpu"))
    assert x.shape == (3, 8)
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(3, 7, dtype=torch.int64))  # contiguous windows
    assert int(x.min()) >= 0 and int(x.max()) < 5000


def test_token_file_errors_name_the_problem(tl, tmp_path):
    odd = tmp_path / "odd.bin"
    np.arange(5, dtype=np.uint16).tofile(odd)  # 10 bytes: not a whole number of uint32
    with pytest.raises(ValueError, match="not a whole number of uint32 tokens.*--data-dtype"):
        tl.Batches(_args(tl, "--data", str(odd), "--data-dtype", "uint32"), 256, 0, 1)
    with pytest.raises(ValueError, match="fewer than --seq-len 8"):
        tl.Batches(_args(tl, "--data", str(odd), "--data-dtype", "uint16"), 256, 0, 1)
    big = tmp_path / "big.bin"
    np.full(100, 300, dtype=np.uint16).tofile(big)
    with pytest.raises(ValueError, match="token id 300 .* >= the model's vocab_size 256"):
        tl.Batches(_args(tl, "--data", str(big)), 256, 0, 1).get(0, torch.device("cpu"))
    with pytest.raises(ValueError, match="is not a file"):
        tl.Batches(_args(tl, "--data", str(tmp_path / "missing.bin")), 256, 0, 1)


def test_cosine_schedule_with_linear_warmup(tl):
    f = tl.lr_lambda(_args(tl, "--steps", "12", "--warmup-steps", "2", "--min-lr-ratio", "0.1"))
    assert [f(0), f(1), f(2)] == [0.5, 1.0, 1.0]
    assert f(7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(12) == pytest.approx(0.1) and f(50) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(1, 12))


def test_only_complete_checkpoints_count(tl, tmp_path):
    for name, files in [("step_00000002", [".metadata", "trainer.json"]), ("step_00000010", [".metadata", "trainer.json"]),
                        ("step_00000012.tmp", [".metadata", "trainer.json"]),  # crashed before the rename
                        ("step_00000011", ["trainer.json"]), ("other", [".metadata", "trainer.json"])]:
        (tmp_path / name).mkdir()
        for f in files:
            (tmp_path / name / f).write_text("{}")
    assert [p.name for p in tl.complete_checkpoints(str(tmp_path))] == ["step_00000002", "step_00000010"]
    assert tl.complete_checkpoints(str(tmp_path / "none")) == []


def test_bad_arguments_are_refused(tl, capsys):
    with pytest.raises(SystemExit):
        tl.parse_args(["--grad-accum", "0"])
    assert "--grad-accum must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tl.parse_args(["--resume"])
    assert "--resume without a path needs --ckpt-dir" in capsys.readouterr().err
    with pytest.raises(ValueError, match="neither a preset .*tiny-llama.* nor a local directory"):
        tl.load_config(tl.parse_args(["--model", "no-such-model"]))


# ------------------------------------------------------- 2 ranks under torchrun
def test_resume_gives_the_uninterrupted_runs_next_losses(tmp_path, tl):
    _one_layer_config(tl).save_pretrained(tmp_path / "one_layer")  # (config.json)
    common = ["--config", "one_layer/config.json", "--steps", "6", "--grad-accum", "2", "--seq-len", "32",
              "--ckpt-interval", "3", "--log-interval", "2"]
    out = _launch(tmp_path, *common, "--ckpt-dir", "a", "--metrics-file", "a.jsonl")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["step_00000003", "step_00000006"]
    lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert [ln.split(" |")[0] for ln in lines] == ["step 2/6", "step 4/6", "step 6/6"], out
    for field in ("loss ", "lr ", "grad-norm ", "tok/s", "MFU n/a", "max RSS", "s/step"):
        assert all(field in ln for ln in lines), (field, lines)
    counters = json.loads(out.split("[train] graphcomp counters: ")[1].splitlines()[0])
    assert counters["frames_compiled"] == 1 and "recompiles" not in counters, counters  # no graph break
    assert counters["bytes_gathered:float32"] > 0 and counters["collective_buckets"] >= 1, counters
    full = _metrics(tmp_path / "a.jsonl")
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    assert full[6]["loss"] < full[1]["loss"]  # it learns

    # a fresh directory with the middle checkpoint, plus two that resume must skip:
    # a save that crashed before its rename, and a directory without DCP's metadata
    b = tmp_path / "b"
    b.mkdir()
    shutil.copytree(tmp_path / "a" / "step_00000003", b / "step_00000003")
    shutil.copytree(tmp_path / "a" / "step_00000006", b / "step_00000005.tmp")
    shutil.copytree(tmp_path / "a" / "step_00000006", b / "step_00000004")
    (b / "step_00000004" / ".metadata").unlink()
    out = _launch(tmp_path, *common, "--ckpt-dir", "b", "--resume", "--metrics-file", "b.jsonl")
    assert "resumed from b/step_00000003 at step 3" in out, out
    resumed = _metrics(tmp_path / "b.jsonl")
    assert sorted(resumed) == [4, 5, 6]
    for s in (4, 5, 6):  # bitwise: see the module docstring
        assert resumed[s] == full[s], (s, resumed[s], full[s])
    assert (b / "step_00000006" / ".metadata").is_file()


def test_token_file_with_local_weights(tmp_path, tl):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_one_layer_config(tl), attn_implementation="sdpa")
    with torch.no_grad():
        model.lm_head.weight.zero_()  # uniform next-token distribution: the first loss is exactly ln(vocab)
    model.save_pretrained(tmp_path / "init")
    vocab = model.config.vocab_size
    np.random.default_rng(0).integers(0, vocab, 20_000, dtype=np.uint32).tofile(tmp_path / "tokens.bin")
    out = _launch(tmp_path, "--init-from", "init", "--data", "tokens.bin", "--data-dtype", "uint32", "--steps", "2",
                  "--seq-len", "32", "--metrics-file", "m.jsonl", "--ckpt-dir", "ck")
    assert "data file" in out, out
    m = _metrics(tmp_path / "m.jsonl")
    assert m[1]["loss"] == pytest.approx(math.log(vocab), abs=1e-5)  # loaded, not randomly initialized
    assert m[2]["loss"] != m[1]["loss"]
    trainer = json.loads((tmp_path / "ck" / "step_00000002" / "trainer.json").read_text())
    assert trainer["data"] == {"kind": "file", "seed": 0, "tokens": 20_000}
    assert trainer["next_micro_batch"] == 2 and trainer["world_size"] == 2
