"""examples/train_llm.py: unit tests of its arguments (``--option``, ``--model``),
weight loading, data, schedule and checkpoint helpers, and end-to-end runs on 2 gloo
CPU ranks under torchrun: a checkpoint and a resume of a config-only directory with
``--random-init``; a saved model's weights loaded from its directory, whose first
loss is the unsharded eager model's loss on the same global batch, with
``--option``s that reach graphcomp.Config; the health report at the end of each run.

The end-to-end runs use ``--option codegen=eager`` (graphcomp's passes, FX graphs run
as they are): one launch of the tiny preset takes about 17 s on 2 CPU cores that way,
and about 57 s with Inductor (35 s of it compiling), too slow for CI. The resume runs
train the tiny preset with one decoder layer instead of two (a config-only
directory): what they check (checkpoints, resume, data) is the same for one layer,
and each launch compiles about a third faster. The resume check is bitwise: the
resumed run restores parameters and AdamW moments exactly (DCP stores the tensors),
the lr is a function of the step, each data row a function of (seed, micro-batch,
row), and the same graphs run on the same 2 single-threaded ranks with the same gloo
all-reduces, so every floating-point operation repeats exactly. Forced fallbacks in
the health report (a failed capture, a graph break, an unsupported optimizer) are
tests/cpu/test_health.py's: a CPU run has no CUDA graphs to fall back from.
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


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _launch(cwd: Path, *args: str) -> str:
    """torchrun 2 ranks of the example; its stdout (rank 0's progress lines)."""
    env = _env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(SCRIPT), "--option", "codegen=eager", *args]
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


def _error_of(tl, capsys, *argv) -> str:
    """parse_args refuses ``argv``: its message (argparse's, on stderr)."""
    with pytest.raises(SystemExit) as e:
        tl.parse_args(list(argv))
    assert e.value.code == 2
    return capsys.readouterr().err


def test_bad_arguments_are_refused(tl, capsys):
    assert "--grad-accum must be >= 1, got 0" in _error_of(tl, capsys, "--grad-accum", "0")
    assert "--resume without a path needs --ckpt-dir" in _error_of(tl, capsys, "--resume")
    err = _error_of(tl, capsys, "--model", "no-such-model")
    assert "--model 'no-such-model' is neither a preset (tiny-llama, " in err and "nor a local directory" in err


def test_options_reach_every_config_field(tl, capsys):
    import dataclasses

    import graphcomp

    args = tl.parse_args(["--option", "codegen=eager", "--option", "memory_budget=0.5", "--option", "max_captures=16",
                          "--option", 'split_ops=["aten.nonzero"]', "--option", 'passes={"remat": false}',
                          "--option", 'passes={"bucket_collectives": false}', "--option", "dump_dir=null"])
    assert args.options == {"codegen": "eager", "memory_budget": 0.5, "max_captures": 16,
                            "split_ops": ["aten.nonzero"], "passes": {"remat": False, "bucket_collectives": False},
                            "dump_dir": None}  # (JSON values; mappings given twice merge)
    cfg = graphcomp.Config.from_options(args.options)
    assert cfg.codegen == "eager" and cfg.max_captures == 16 and cfg.passes["remat"] is False
    assert tl.parse_args([]).options == {}
    # an unknown key names every valid one
    err = _error_of(tl, capsys, "--option", "codegenn=eager")
    assert "--option codegenn: not a graphcomp.Config field; valid keys: " in err
    for f in dataclasses.fields(graphcomp.Config):
        assert f.name in err
    # a bad value: Config's own error, naming the field and its valid values
    err = _error_of(tl, capsys, "--option", "cudagraphs=sometimes")
    assert "error: --option: Config.cudagraphs: invalid value 'sometimes'; valid values: [" in err, err
    assert "'auto'" in err and "'require'" in err
    assert "Config.max_captures: must be >= 1, got 0" in _error_of(tl, capsys, "--option", "max_captures=0")
    assert "expected KEY=VALUE" in _error_of(tl, capsys, "--option", "codegen")
    # --codegen, --cudagraphs, --dump-dir: shorthands of their --option
    assert tl.parse_args(["--codegen", "eager", "--cudagraphs", "off", "--dump-dir", "d"]).options == {
        "codegen": "eager", "cudagraphs": "off", "dump_dir": "d"}
    assert tl.parse_args(["--codegen", "eager", "--option", "codegen=eager"]).options == {"codegen": "eager"}
    err = _error_of(tl, capsys, "--codegen", "eager", "--option", "codegen=inductor")
    assert '--codegen eager and --option codegen="inductor" disagree' in err, err


def _llama_config(tl, layers: int):
    """The tiny preset with ``layers`` decoder layers (a LlamaConfig)."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**tl.PRESETS["tiny-llama"], "num_hidden_layers": layers})


def test_model_directory_needs_weights_or_random_init(tl, tmp_path, capsys):
    _llama_config(tl, 1).save_pretrained(tmp_path / "cfg_only")  # config.json, no weights
    err = _error_of(tl, capsys, "--model", str(tmp_path / "cfg_only"))
    assert "has a config.json but no weights (model.safetensors, " in err and "pass --random-init" in err, err
    args = tl.parse_args(["--model", str(tmp_path / "cfg_only"), "--random-init"])
    assert args.weights is None
    model, how = tl.build_model(tl.load_config(args), args, torch.device("cpu"))
    assert how == "random (seed 0)" and model.config.num_hidden_layers == 1
    (tmp_path / "empty").mkdir()
    assert "no config.json in that directory" in _error_of(tl, capsys, "--model", str(tmp_path / "empty"))


@pytest.mark.parametrize("fmt", ["sharded_safetensors", "pytorch_bin"])
def test_weights_load_from_a_model_directory(tl, tmp_path, fmt):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    saved = AutoModelForCausalLM.from_config(_llama_config(tl, 1))
    d = tmp_path / "m"
    if fmt == "sharded_safetensors":
        saved.save_pretrained(d, max_shard_size="100KB")  # model.safetensors.index.json + shards
        assert (d / "model.safetensors.index.json").is_file()
    else:
        saved.config.save_pretrained(d)
        torch.save(saved.state_dict(), d / "pytorch_model.bin")
    args = tl.parse_args(["--model", str(d), "--seed", "5"])
    assert args.weights and args.weights[0].name in tl.WEIGHT_FILES
    model, how = tl.build_model(tl.load_config(args), args, torch.device("cpu"))
    n = len(saved.state_dict())
    assert how == f"loaded from {d} ({n} tensors)"
    for k, v in saved.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    # --random-init ignores them
    args = tl.parse_args(["--model", str(d), "--random-init"])
    model, how = tl.build_model(tl.load_config(args), args, torch.device("cpu"))
    assert how == "random (seed 0)"
    assert not torch.equal(model.state_dict()["model.norm.weight"] + model.lm_head.weight.sum(),
                           saved.state_dict()["model.norm.weight"] + saved.lm_head.weight.sum())
    # a checkpoint that does not match its config is refused (not initialized randomly in silence)
    sd = saved.state_dict()
    del sd["model.norm.weight"]
    torch.save(sd, d / "pytorch_model.bin")
    for f in d.glob("model*.safetensors*"):
        f.unlink()
    args = tl.parse_args(["--model", str(d)])
    with pytest.raises(ValueError, match=r"the weights do not match .*missing_keys.*model.norm.weight"):
        tl.build_model(tl.load_config(args), args, torch.device("cpu"))


def test_config_only_directory_is_refused_on_the_command_line(tl, tmp_path):
    """Before any process group: every rank would print the same one-line error."""
    _llama_config(tl, 1).save_pretrained(tmp_path / "cfg_only")
    p = subprocess.run([sys.executable, str(SCRIPT), "--model", "cfg_only"], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert p.returncode == 2, (p.stdout, p.stderr[-3000:])
    assert ("error: --model 'cfg_only' has a config.json but no weights" in p.stderr
            and "pass --random-init" in p.stderr), p.stderr[-3000:]


# ------------------------------------------------------- 2 ranks under torchrun
def _health(out: str) -> str:
    """The health report rank 0 printed at the end of a run."""
    assert "graphcomp health report" in out, out
    return out.split("graphcomp health report", 1)[1]


def test_resume_gives_the_uninterrupted_runs_next_losses(tmp_path, tl):
    _llama_config(tl, 1).save_pretrained(tmp_path / "one_layer")  # (config.json only)
    common = ["--model", "one_layer", "--random-init", "--steps", "6", "--grad-accum", "2", "--seq-len", "32",
              "--ckpt-interval", "3", "--log-interval", "2"]
    out = _launch(tmp_path, *common, "--ckpt-dir", "a", "--metrics-file", "a.jsonl", "--health-file", "h{rank}.json")
    assert "[train] model: one_layer; weights: random (seed 0)" in out, out
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["step_00000003", "step_00000006"]
    lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert [ln.split(" |")[0] for ln in lines] == ["step 2/6", "step 4/6", "step 6/6"], out
    for field in ("loss ", "lr ", "grad-norm ", "tok/s", "MFU n/a", "max RSS", "s/step"):
        assert all(field in ln for ln in lines), (field, lines)
    counters = json.loads(out.split("[train] graphcomp counters: ")[1].splitlines()[0])
    assert counters["frames_compiled"] == 1 and "recompiles" not in counters, counters  # no graph break
    assert counters["bytes_gathered:float32"] > 0 and counters["collective_buckets"] >= 1, counters
    # the health report: one graph, nothing to fix; on CPU no CUDA graphs (said, not a problem)
    health = _health(out)
    for line in ("compile     : 1 frame(s), 0 graph break(s), 0 recompile(s)",
                 "whole step  : not one graph: no CUDA device", "optimizer   : reference (no CUDA device)",
                 "tokens/s/rank (2 rank(s))", "MFU         : n/a", "max RSS (CPU)", "exposed comm: not measured",
                 "problems    : none found"):
        assert line in health, (line, health)
    for r in (0, 1):  # every rank's report as JSON ('{rank}' in --health-file)
        rep = json.loads((tmp_path / f"h{r}.json").read_text())
        assert rep["compile"]["frames"] == 1 and rep["problems"] == [], rep
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


def test_loaded_weights_give_the_eager_models_first_loss(tmp_path, tl):
    """A saved 2-layer Llama, trained from its directory on a token file: the first
    step's loss (the mean of the ranks' losses, as logged) is the unsharded eager
    model's loss on the same global batch, which the test rebuilds from the example's
    own data class. ``--option``s reach graphcomp.Config: the dumps exist and record
    the options; cudagraphs='off' is the reason the health report gives."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)  # (not the example's --seed: random weights would give another loss)
    model = AutoModelForCausalLM.from_config(_llama_config(tl, 2), attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # peaked predictions: a first loss far from a random init's ln(vocab)
    model.save_pretrained(tmp_path / "init")
    vocab = model.config.vocab_size
    np.random.default_rng(0).integers(0, vocab, 20_000, dtype=np.uint32).tofile(tmp_path / "tokens.bin")
    argv = ["--model", "init", "--data", "tokens.bin", "--data-dtype", "uint32", "--steps", "3", "--seq-len", "32",
            "--batch-size", "2"]  # (3 steps: train_step decides about the whole step at the third)
    out = _launch(tmp_path, *argv, "--metrics-file", "m.jsonl", "--ckpt-dir", "ck", "--option", "dump_dir=dumps",
                  "--option", "cudagraphs=off")
    assert f"[train] model: init; weights: loaded from init ({len(model.state_dict())} tensors)" in out, out
    assert "data file" in out, out

    cwd = os.getcwd()
    os.chdir(tmp_path)  # (the run's relative paths)
    try:
        args = tl.parse_args(argv)
        batch = torch.cat([tl.Batches(args, vocab, r, 2).step_batch(0, 1, torch.device("cpu")) for r in range(2)])
    finally:
        os.chdir(cwd)
    assert batch.shape == (4, 32)
    with torch.no_grad():
        expected = float(model(input_ids=batch, labels=batch).loss)
    assert abs(expected - math.log(vocab)) > 0.5, expected
    m = _metrics(tmp_path / "m.jsonl")
    assert m[1]["loss"] == pytest.approx(expected, rel=1e-5), (m[1]["loss"], expected)
    assert m[2]["loss"] != m[1]["loss"]

    # the options reached graphcomp.Config on every rank
    for rank in (0, 1):
        summary = json.loads((tmp_path / "dumps" / f"rank{rank}" / "summary.json").read_text())
        config = summary["frames"][0]["config"]
        assert config["codegen"] == "eager" and config["cudagraphs"] == "off" and config["dump_dir"] == "dumps"
        assert (tmp_path / "dumps" / f"rank{rank}" / "frame000").is_dir()
    health = _health(out)
    assert "whole step  : not one graph: cudagraphs='off'" in health and "problems    : none found" in health, health

    trainer = json.loads((tmp_path / "ck" / "step_00000003" / "trainer.json").read_text())
    assert trainer["data"] == {"kind": "file", "seed": 0, "tokens": 20_000}
    assert trainer["next_micro_batch"] == 3 and trainer["world_size"] == 2
