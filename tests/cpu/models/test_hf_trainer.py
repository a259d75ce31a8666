"""GraphcompTrainer (graphcomp/integrations/hf_trainer.py): Hugging Face's Trainer
training a sharded, graphcomp-compiled model.

* 2 gloo ranks: a tiny Llama (2 layers, hidden 32, vocabulary 128) trained 4 steps by
  the Trainer subclass with TrainingArguments' own optimizer (fused AdamW), gradient
  accumulation 2, clipping that is active at every step and a linear schedule, with
  ``codegen="eager"``: losses, logged gradient norms, the evaluation loss and the final
  parameters match an unsharded eager reference (plain PyTorch on the same global
  batches, the same AdamW). The model was sharded, graphcomp compiled the training
  frame, Trainer holds the compiled module (no DDP anywhere) and accelerate prepared
  no model. The comparison is tight for AdamW here: the gradients agree to ~1e-7
  relative and no element's gradient is near zero in this model, so the sign-like
  first steps do not amplify rounding.
* Save + resume: the run writes checkpoint-2 and checkpoint-4; a new Trainer on a new
  model resumes from checkpoint-2 (weights from model.safetensors, the sharded AdamW
  state from its DCP directory, the scheduler) and ends bitwise equal to the
  uninterrupted run: the same graphs on the same single-threaded ranks repeat every
  floating-point operation, and DCP restores the tensors exactly. checkpoint-4's
  weights load with ``from_pretrained``.
* An optimizer built before sharding and configurations that would train wrong
  (FSDP, DeepSpeed, fp16, ranks Trainer does not see) raise named errors.

The two rank tests share one task (``run_once``): one compile for the run, one for the
resumed run.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="GraphcompTrainer needs accelerate (transformers' Trainer runs on it); "
                    "`make install` installs it from constraints/cpu.txt")

SEQ, VOCAB, BS, GA, STEPS, LR, CLIP = 16, 128, 2, 2, 4, 1e-2, 0.5
WORLD = 2
GLOBAL = BS * GA * WORLD  # rows per optimizer step
EVAL_ROWS = 4


def _model():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def _rows(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def _dataset(ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": r, "labels": r} for r in ids]


def _args(out: str, **kw):
    """Data in a known order (sequential sampler, no shuffling): each rank's micro-batch
    k holds rows of dataset batch k*world + rank, so optimizer step s covers dataset
    rows [s*GLOBAL, (s+1)*GLOBAL), the reference's global batch."""
    import transformers

    base = dict(output_dir=out, use_cpu=True, per_device_train_batch_size=BS, per_device_eval_batch_size=BS,
                gradient_accumulation_steps=GA, max_steps=STEPS, max_grad_norm=CLIP, learning_rate=LR,
                lr_scheduler_type="linear", logging_steps=1, save_strategy="steps", save_steps=2, report_to=[],
                train_sampling_strategy="sequential", dataloader_drop_last=True, seed=0, disable_tqdm=True)
    return transformers.TrainingArguments(**{**base, **kw})


@pytest.fixture
def clean_accelerate():
    """Trainer's setup leaves accelerate's process-wide state, environment variables
    and transformers' log level behind: restore them (in the test process and, through
    ``_restoring``, in the shared ranks)."""
    with _restoring():
        yield


class _restoring:
    def __enter__(self):
        import transformers

        self.env = dict(os.environ)
        self.verbosity = transformers.logging.get_verbosity()
        transformers.logging.disable_progress_bar()

    def __exit__(self, *exc):
        import transformers
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        for k in set(os.environ) - set(self.env):
            del os.environ[k]
        os.environ.update(self.env)
        transformers.logging.set_verbosity(self.verbosity)
        transformers.logging.enable_progress_bar()
        return False


# ----------------------------------------------------------------- the rank task
def _train_and_resume(rank: int, world: int, out: str) -> dict:
    import graphcomp
    from graphcomp.errors import OptimizerParamsError
    from graphcomp.integrations.hf_trainer import GraphcompOptimizer, GraphcompTrainer, _LossOnly
    from graphcomp.sharding.shard import is_sharded

    train = _dataset(_rows(GLOBAL * STEPS, seed=1))
    evals = _dataset(_rows(EVAL_ROWS, seed=2))
    res: dict = {}
    with _restoring():
        try:  # an optimizer over the unsharded parameters
            m = _model()
            GraphcompTrainer(model=m, args=_args(out), train_dataset=train,
                             optimizers=(torch.optim.AdamW(m.parameters()), None))
        except OptimizerParamsError as e:
            res["early_optimizer"] = str(e)

        tr = GraphcompTrainer(model=_model(), args=_args(out), train_dataset=train,
                              graphcomp_options={"codegen": "eager"})
        tr.train()
        res["frames"] = graphcomp.counters.get("frames_compiled", 0)
        ddp = torch.nn.parallel.DistributedDataParallel
        res["wiring"] = {
            "sharded": tr.sharded and is_sharded(tr.model),
            "compiled_loss_only": isinstance(getattr(tr.model_wrapped, "_orig_mod", None), _LossOnly)
            and tr.model_wrapped._orig_mod.model is tr.model,
            "ddp": any(isinstance(x, ddp) for x in (tr.model_wrapped, *tr.model_wrapped.modules())),
            "accelerate_models": len(tr.accelerator._models),
            "optimizer": (isinstance(tr.optimizer, GraphcompOptimizer), type(tr.torch_optimizer).__name__,
                          tr.torch_optimizer.param_groups[0].get("fused")),
        }
        res["eval"] = tr.evaluate(evals)["eval_loss"]
        # evaluation hands accelerate the model itself, which it leaves as it is (no
        # wrapper, no autocast patched into its forward)
        res["eval_wiring"] = (all(x is tr.model for x in tr.accelerator._models),
                              "_original_forward" in vars(tr.model))
        res["log"] = tr.state.log_history
        res["params"] = graphcomp.full_state_dict(tr.model)
        res["ckpt"] = sorted(os.listdir(os.path.join(out, "checkpoint-2")))

        tr2 = GraphcompTrainer(model=_model(), args=_args(out), train_dataset=train,
                               graphcomp_options={"codegen": "eager"})
        tr2.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
        res["resumed_log"] = tr2.state.log_history
        res["resumed_params"] = graphcomp.full_state_dict(tr2.model)
    return res


@pytest.fixture(scope="module")
def ranks2(shared_ranks2):
    return shared_ranks2.view(timeout=420)


@pytest.fixture(scope="module")
def run(ranks2, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf_trainer"))
    return out, lambda: ranks2.run_once(_train_and_resume, out)


def _reference():
    """Plain PyTorch on the global batches: the unsharded model, fused AdamW with
    TrainingArguments' defaults, clip_grad_norm_, the linear schedule."""
    import transformers

    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True)
    sched = transformers.get_linear_schedule_with_warmup(opt, 0, STEPS)
    ids = _rows(GLOBAL * STEPS, seed=1)
    losses, norms = [], []
    for s in range(STEPS):
        b = ids[s * GLOBAL:(s + 1) * GLOBAL]
        loss = m(input_ids=b, labels=b).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        e = _rows(EVAL_ROWS, seed=2)
        eval_loss = float(m(input_ids=e, labels=e).loss)
    return losses, norms, eval_loss, {k: v.detach().clone() for k, v in m.state_dict().items()}


def _steps(log: list[dict]) -> list[dict]:
    return [e for e in log if "loss" in e and "grad_norm" in e]


def _assert_params_close(got: dict, ref: dict, rtol: float) -> None:
    assert set(got) == set(ref), set(got) ^ set(ref)
    for k, v in ref.items():
        err = float((got[k].float() - v.float()).norm())
        assert err <= rtol * float(v.float().norm()), f"{k}: |diff| {err:.3g} > {rtol} * |ref| {float(v.norm()):.3g}"


def test_trainer_matches_eager_reference_2ranks(run):
    _, go = run
    res = go()
    ref_losses, ref_norms, ref_eval, ref_params = _reference()
    for r in res:
        assert "early_optimizer" in r, "an optimizer built before sharding was accepted"
        assert r["wiring"] == {"sharded": True, "compiled_loss_only": True, "ddp": False, "accelerate_models": 0,
                               "optimizer": (True, "AdamW", True)}, r["wiring"]
        assert r["eval_wiring"] == (True, False), r["eval_wiring"]
        assert r["frames"] > 0, "graphcomp compiled no frame"
        steps = _steps(r["log"])
        assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
        assert min(ref_norms) > CLIP  # clipping is active at every step
        torch.testing.assert_close(torch.tensor([e["loss"] for e in steps]), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor([e["grad_norm"] for e in steps]), torch.tensor(ref_norms),
                                   rtol=1e-5, atol=0)
        lrs = [e["learning_rate"] for e in steps]
        assert lrs == pytest.approx([LR * (1 - s / STEPS) for s in range(STEPS)], rel=1e-9), lrs
        assert r["eval"] == pytest.approx(ref_eval, rel=1e-5)
        _assert_params_close(r["params"], ref_params, rtol=2e-5)


def test_save_and_resume_is_bitwise_and_loads_with_from_pretrained_2ranks(run):
    import transformers

    out, go = run
    res = go()
    for r in res:
        assert {"model.safetensors", "config.json", "optimizer_dcp", "scheduler.pt", "trainer_state.json",
                "graphcomp_trainer.json"} <= set(r["ckpt"]), r["ckpt"]
        assert "optimizer.pt" not in r["ckpt"]  # (rank 0's shards only: not written)
        steps, resumed = _steps(r["log"]), _steps(r["resumed_log"])
        assert [e["step"] for e in resumed] == list(range(1, STEPS + 1))  # steps 1-2 from trainer_state.json
        assert [(e["loss"], e["grad_norm"]) for e in resumed] == [(e["loss"], e["grad_norm"]) for e in steps]
        for k, v in r["params"].items():
            assert torch.equal(r["resumed_params"][k], v), k
    loaded = transformers.LlamaForCausalLM.from_pretrained(os.path.join(out, "checkpoint-4"))
    sd = loaded.state_dict()
    for k, v in res[0]["params"].items():
        assert torch.equal(sd[k], v), k


# --------------------------------------------------------- named errors, one process
def _make_error_args(tmp_path, case: str):
    if case == "deepspeed":
        # TrainingArguments(deepspeed=...) needs the deepspeed package to construct; the
        # object it makes carries the config in .deepspeed
        a = _args(str(tmp_path), max_steps=1)
        a.deepspeed = {"zero_optimization": {"stage": 3}}
        return a
    kw = {"fsdp": {"fsdp": True}, "fp16": {"fp16": True}}[case]
    return _args(str(tmp_path), max_steps=1, **kw)


@pytest.mark.parametrize("case", ["fsdp", "deepspeed", "fp16"])
def test_conflicting_training_arguments_raise(tmp_path, clean_accelerate, case):
    from graphcomp.errors import TrainerConfigError
    from graphcomp.integrations.hf_trainer import GraphcompTrainer

    args = _make_error_args(tmp_path, case)
    with pytest.raises(TrainerConfigError, match=case):
        GraphcompTrainer(model=_model(), args=args, train_dataset=_dataset(_rows(4, seed=1)))


def test_ranks_the_trainer_does_not_see_raise(tmp_path, clean_accelerate, monkeypatch):
    """A torchrun job of 2 ranks on CPU without use_cpu=True: accelerate sets up one
    process, and each rank would train on the whole dataset."""
    from graphcomp.errors import TrainerConfigError
    from graphcomp.integrations.hf_trainer import GraphcompTrainer

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(TrainerConfigError, match="use_cpu=True"):
        GraphcompTrainer(model=_model(), args=_args(str(tmp_path), use_cpu=False, max_steps=1),
                         train_dataset=_dataset(_rows(4, seed=1)))
