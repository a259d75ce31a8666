"""Worker of tests/gpu/test_hf_trainer_gpu.py: GraphcompTrainer under torchrun.

    torchrun --standalone --nproc-per-node 2 tests/gpu/hf_trainer_worker.py OUTDIR [CODEGEN]

(1 or 2 ranks; with one, the worker shards the model itself, see ``_trainer``.)

(``CODEGEN``: graphcomp's ``codegen`` option, default ``inductor``.)

Each rank writes ``OUTDIR/hf_trainer.rank<R>.json``:

* ``fp32``: a tiny Llama trained 6 steps by GraphcompTrainer (Trainer's fused AdamW,
  gradient accumulation 2, clipping active, linear schedule, Inductor, CUDA graphs on
  where there is a GPU) against an unsharded eager reference on the same global
  batches (computed on every rank): losses, logged norms, the largest relative error of
  a parameter tensor; graphcomp's counters of the run; the optimizer step's mode;
* ``bf16``: the same model with ``bf16=True`` (bf16 compute over fp32 master weights),
  8 steps with a checkpoint at step 4, then a new Trainer on a new model resumed from
  it: both runs' logged losses, the counters of each run.

On a machine without CUDA it runs on gloo CPU ranks (``use_cpu=True``), a dry run of
the script.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

SEQ, VOCAB, BS, GA, LR, CLIP = 64, 512, 2, 2, 1e-3, 0.5


def _model():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def _rows(n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))


def _args(out: str, steps: int, **kw):
    import transformers

    base = dict(output_dir=out, use_cpu=not torch.cuda.is_available(), per_device_train_batch_size=BS,
                gradient_accumulation_steps=GA, max_steps=steps, max_grad_norm=CLIP, learning_rate=LR,
                lr_scheduler_type="linear", logging_steps=1, save_strategy="no", report_to=[],
                train_sampling_strategy="sequential", dataloader_drop_last=True, seed=0, disable_tqdm=True)
    return transformers.TrainingArguments(**{**base, **kw})


def _steps(log: list[dict]) -> list[dict]:
    return [{"step": e["step"], "loss": e["loss"], "grad_norm": e["grad_norm"]} for e in log
            if "loss" in e and "grad_norm" in e]


def _trainer(out: str, steps: int, train: list, opts: dict, **kw):
    """A GraphcompTrainer of a new model. With one rank Trainer does not shard (there
    is nothing to shard over): the model is sharded here first, over the one-rank
    group accelerate starts under torchrun, so that the sharded path runs (DTensor
    shards, the captured step over them, the DCP checkpoint)."""
    import graphcomp
    from graphcomp.integrations.hf_trainer import GraphcompTrainer

    args = _args(out, steps, **kw)
    model = _model()
    if int(os.environ["WORLD_SIZE"]) == 1:
        model.to(args.device)  # (args.device starts the process group)
        graphcomp.shard(model, param_dtype=torch.bfloat16 if args.bf16 else None)
    return GraphcompTrainer(model=model, args=args, train_dataset=train, graphcomp_options=opts)


def _fresh() -> None:
    import graphcomp

    torch._dynamo.reset()
    graphcomp.reset()


def _reference(steps: int, world: int, device: torch.device) -> tuple[list[float], list[float], dict]:
    import transformers

    m = _model().to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.0, fused=True)
    sched = transformers.get_linear_schedule_with_warmup(opt, 0, steps)
    g = BS * GA * world
    ids = _rows(g * steps).to(device)
    losses, norms = [], []
    for s in range(steps):
        b = ids[s * g:(s + 1) * g]
        loss = m(input_ids=b, labels=b).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms, {k: v.detach().float().cpu() for k, v in m.state_dict().items()}


def main(out: str, codegen: str = "inductor") -> None:
    import graphcomp
    import transformers

    transformers.logging.disable_progress_bar()
    res: dict = {}
    opts = {"codegen": codegen}
    world = int(os.environ["WORLD_SIZE"])
    n = BS * GA * world

    # fp32 parity
    steps = 6
    train = [{"input_ids": r, "labels": r} for r in _rows(n * steps)]
    _fresh()
    t0 = time.time()
    tr = _trainer(os.path.join(out, "fp32"), steps, train, opts)
    tr.train()
    rank = dist.get_rank()
    got = graphcomp.full_state_dict(tr.model)
    ref_losses, ref_norms, ref_params = _reference(steps, world, tr.args.device)
    res["fp32"] = {
        "seconds": time.time() - t0, "device": str(tr.args.device), "log": _steps(tr.state.log_history),
        "ref_losses": ref_losses, "ref_norms": ref_norms,
        "param_rel_err": max(float((got[k].float() - v).norm() / v.norm()) for k, v in ref_params.items()),
        "counters": dict(graphcomp.counters), "optimizer": tr.optimizer.stats(), "sharded": tr.sharded,
    }
    del tr

    # bf16, checkpoint at step 4, resume
    steps = 8
    train = [{"input_ids": r, "labels": r} for r in _rows(n * steps)]
    bf16_out = os.path.join(out, "bf16")
    _fresh()
    t0 = time.time()
    tr = _trainer(bf16_out, steps, train, opts, bf16=True, save_strategy="steps", save_steps=4)
    tr.train()
    res["bf16"] = {"seconds": time.time() - t0, "log": _steps(tr.state.log_history),
                   "counters": dict(graphcomp.counters), "optimizer": tr.optimizer.stats(),
                   "master_dtype": str(tr.model.lm_head._parameters["weight"].dtype)}
    del tr
    _fresh()
    t0 = time.time()
    tr = _trainer(bf16_out, steps, train, opts, bf16=True, save_strategy="steps", save_steps=4)
    tr.train(resume_from_checkpoint=os.path.join(bf16_out, "checkpoint-4"))
    res["resumed"] = {"seconds": time.time() - t0, "log": _steps(tr.state.log_history),
                      "counters": dict(graphcomp.counters), "optimizer": tr.optimizer.stats()}
    del tr
    graphcomp.runtime.teardown()
    Path(out, f"hf_trainer.rank{rank}.json").write_text(json.dumps(res, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
