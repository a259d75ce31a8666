"""Train a Hugging Face causal language model with graphcomp: a complete script to copy.

    # 2 CPU ranks (gloo), the built-in tiny preset, synthetic data:
    torchrun --nproc-per-node 2 examples/train_llm.py --model tiny-llama --steps 20

    # 8 GPUs (NCCL), a local HF model directory's config (random init), a token file:
    torchrun --nproc-per-node 8 examples/train_llm.py --model /models/my-llama \
        --data train.bin --data-dtype uint16 --batch-size 4 --seq-len 2048 \
        --grad-accum 4 --steps 1000 --ckpt-dir ckpt --ckpt-interval 200

    # continue from the latest complete checkpoint (same world size and --steps):
    torchrun --nproc-per-node 8 examples/train_llm.py ... --ckpt-dir ckpt --resume

The same command runs on CPUs (gloo) and GPUs (NCCL, one per rank); nothing is
downloaded. What it does, in order:

* model: ``AutoModelForCausalLM.from_config`` (random init, identical on every rank)
  from a preset of this file (``--model tiny-llama``), a local model directory
  (``--model DIR``) or a config file (``--config config.json``); ``--init-from``
  loads local weights (a ``save_pretrained`` directory or a ``.safetensors`` file).
  The model is built with ``attn_implementation="sdpa"`` and ``use_cache=False``.
* ``graphcomp.shard(model, param_dtype=bf16 on GPU)``: parameters become dim-0
  shards (fp32 master weights, bf16 compute); then the loss function is compiled
  with ``torch.compile(..., backend="graphcomp")``. Only the loss leaves the
  compiled region (the logits never become an output).
* AdamW, gradient accumulation (``--grad-accum``), ``clip_grad_norm_`` (global norm
  over all shards), cosine learning rate with linear warm-up.
* data: synthetic sequences by default (learnable: each row is an arithmetic
  progression of token ids), or ``--data FILE.bin``, a memory-mapped flat array of
  uint16/uint32 token ids. Row ``i`` of global micro-batch ``g`` is drawn from a
  generator seeded with ``(--seed, g, i)``, so the stream depends only on the step:
  a resumed run reads exactly what the uninterrupted run would have read.
* checkpoints (``--ckpt-dir``, every ``--ckpt-interval`` steps): model, optimizer,
  scheduler, step and data position with ``torch.distributed.checkpoint``, written
  to ``step_NNNNNNNN.tmp`` and renamed to ``step_NNNNNNNN`` only after every rank
  finished, so a crash mid-save never leaves a checkpoint ``--resume`` would pick up.
* a progress line every ``--log-interval`` steps (rank 0): step, loss, lr, grad
  norm, tokens/s, MFU estimate, memory; ``--metrics-file`` also writes every step
  as a JSON line.

Options: ``python examples/train_llm.py --help``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import resource
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

# Built-in model presets (LlamaConfig keyword arguments). "tiny-llama" trains in
# seconds on CPU ranks; the others match graphcomp's benchmark workloads W1 and W2.
PRESETS: dict[str, dict] = {
    "tiny-llama": dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
    "llama-134m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024),
    "llama-1.5b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
                       rope_theta=500000.0),
}

# Dense bf16 peak FLOP/s per GPU, for the MFU estimate (first match of the device name
# wins, so "H200" is tried before "H20"). Override with --peak-tflops.
PEAK_BF16_FLOPS = [("H200", 989.4e12), ("H100", 989.4e12), ("H800", 989.4e12), ("A100", 312e12),
                   ("A800", 312e12), ("L40S", 362.05e12), ("L4", 121e12), ("A10", 125e12)]

CKPT_RE = re.compile(r"^step_(\d{8})$")
DATA_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", help=f"a preset ({', '.join(PRESETS)}) or a local model directory with "
                                   "config.json (default: --init-from's directory, else tiny-llama)")
    m.add_argument("--config", help="a local config.json (overrides --model)")
    m.add_argument("--init-from", help="local weights: a save_pretrained directory or a .safetensors file "
                                       "(default: random init)")
    m.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="compute dtype of the gathered parameters (master weights stay fp32); "
                        "auto = bf16 on GPU, fp32 on CPU")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=20, help="optimizer steps in total (the lr schedule's length)")
    t.add_argument("--batch-size", type=int, default=2, help="sequences per rank per micro-batch")
    t.add_argument("--seq-len", type=int, default=64)
    t.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    t.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    t.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr = lr * this (end of the cosine)")
    t.add_argument("--warmup-steps", type=int, default=2, help="linear warm-up from lr/warmup to lr")
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--clip", type=float, default=1.0, help="max global grad norm (0: no clipping)")
    t.add_argument("--seed", type=int, default=0, help="model init and data sampling")
    d = p.add_argument_group("data")
    d.add_argument("--data", help="a flat binary file of token ids (default: synthetic data)")
    d.add_argument("--data-dtype", choices=sorted(DATA_DTYPES), default="uint16")
    c = p.add_argument_group("compile")
    c.add_argument("--codegen", choices=["inductor", "eager"], default="inductor",
                   help="graphcomp's code generation (eager: no Inductor, fast to compile)")
    c.add_argument("--cudagraphs", choices=["auto", "off", "require"], default="auto")
    c.add_argument("--dump-dir", help="graphcomp graph dumps (read with `graphcomp inspect DIR`)")
    c.add_argument("--no-compile", action="store_true", help="run the sharded model eagerly")
    k = p.add_argument_group("checkpoints and logs")
    k.add_argument("--ckpt-dir", help="where step_NNNNNNNN checkpoints go (a directory every rank can reach)")
    k.add_argument("--ckpt-interval", type=int, default=0, help="save every N steps (0: only at the end)")
    k.add_argument("--keep", type=int, default=0, help="keep the newest N checkpoints (0: all)")
    k.add_argument("--resume", nargs="?", const="latest",
                   help="continue from the latest complete checkpoint in --ckpt-dir, or from the given one")
    k.add_argument("--log-interval", type=int, default=1)
    k.add_argument("--metrics-file", help="rank 0 appends one JSON line per step (step, loss, lr, grad_norm)")
    k.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per rank for the MFU estimate")
    k.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "grad_accum", "log_interval"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("ckpt_interval", "keep", "warmup_steps"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.resume and not args.ckpt_dir and args.resume == "latest":
        p.error("--resume without a path needs --ckpt-dir")
    return args


# ---------------------------------------------------------------------------- model
def load_config(args: argparse.Namespace):
    """The model config: --config file, a --model preset, or a --model directory."""
    from transformers import AutoConfig, LlamaConfig

    if args.config:
        if not os.path.isfile(args.config):
            raise ValueError(f"--config {args.config!r} is not a file")
        cfg = AutoConfig.from_pretrained(args.config, local_files_only=True)
    elif args.model is None and args.init_from and os.path.isdir(args.init_from):
        cfg = AutoConfig.from_pretrained(args.init_from, local_files_only=True)
    elif (args.model or "tiny-llama") in PRESETS:
        cfg = LlamaConfig(**PRESETS[args.model or "tiny-llama"])
    elif os.path.isdir(args.model):
        cfg = AutoConfig.from_pretrained(args.model, local_files_only=True)
    else:
        raise ValueError(f"--model {args.model!r} is neither a preset ({', '.join(PRESETS)}) nor a local "
                         "directory with a config.json (this script never downloads)")
    cfg.use_cache = False
    return cfg


def build_model(cfg, args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """Random init from ``args.seed`` (identical on every rank), or local weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    kw = dict(attn_implementation="sdpa", dtype=torch.float32)
    if args.init_from and os.path.isdir(args.init_from):
        model = AutoModelForCausalLM.from_pretrained(args.init_from, config=cfg, local_files_only=True, **kw)
    else:
        model = AutoModelForCausalLM.from_config(cfg, **kw)
        if args.init_from:
            if not args.init_from.endswith(".safetensors") or not os.path.isfile(args.init_from):
                raise ValueError(f"--init-from {args.init_from!r}: expected a save_pretrained directory "
                                 "or a .safetensors file")
            from safetensors.torch import load_file

            missing, unexpected = model.load_state_dict(load_file(args.init_from), strict=False)
            tied = set(getattr(model, "_tied_weights_keys", None) or ())  # absent from the file when tied
            if unexpected or [k for k in missing if k not in tied]:
                raise ValueError(f"--init-from {args.init_from!r} does not match the model: "
                                 f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.config.use_cache = False
    return model.to(device)


class CausalLMLoss(torch.nn.Module):
    """The compiled function: tokens in, mean next-token loss out."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def flops_per_token(cfg, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 * (parameters outside the input embedding) for the
    matmuls of forward and backward, plus 12 * layers * hidden * seq for attention
    scores and values (the PaLM paper's estimate; activation recomputation, e.g.
    graphcomp re-gathering weights, is not counted)."""
    emb = cfg.vocab_size * cfg.hidden_size
    return 6 * (n_params - emb) + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq_len


def peak_flops(args: argparse.Namespace, device: torch.device) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((f for key, f in PEAK_BF16_FLOPS if key in name), None)
    return None


# ----------------------------------------------------------------------------- data
class Batches:
    """Micro-batch ``g`` (``step * grad_accum + micro``) of rank ``r``: rows
    ``r*B .. r*B+B-1`` of a global micro-batch of ``world*B`` rows; row ``i`` is drawn
    from a generator seeded with ``(seed, g, i)``. A pure function of the position."""

    def __init__(self, args: argparse.Namespace, vocab_size: int, rank: int, world: int):
        self.seq, self.batch, self.rank, self.world = args.seq_len, args.batch_size, rank, world
        self.seed, self.vocab = args.seed, vocab_size
        self.tokens = None
        if args.data:
            path = Path(args.data)
            if not path.is_file():
                raise ValueError(f"--data {args.data!r} is not a file")
            dt = np.dtype(DATA_DTYPES[args.data_dtype])
            if path.stat().st_size % dt.itemsize:
                raise ValueError(f"--data {args.data!r}: {path.stat().st_size} bytes is not a whole number of "
                                 f"{args.data_dtype} tokens; is --data-dtype right (uint16, uint32)?")
            self.tokens = np.memmap(path, dtype=dt, mode="r")
            if len(self.tokens) < self.seq:
                raise ValueError(f"--data {args.data!r} holds {len(self.tokens)} tokens, fewer than "
                                 f"--seq-len {self.seq}")

    def describe(self) -> dict:
        return {"kind": "file" if self.tokens is not None else "synthetic", "seed": self.seed,
                "tokens": None if self.tokens is None else int(len(self.tokens))}

    def _row(self, g: int, i: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + g) * 65_537 + i)
        if self.tokens is None:
            start, stride = torch.randint(0, self.vocab, (2,), generator=gen).tolist()
            return (start + (stride % 7 + 1) * torch.arange(self.seq)) % self.vocab
        off = int(torch.randint(0, len(self.tokens) - self.seq + 1, (1,), generator=gen))
        row = torch.from_numpy(self.tokens[off:off + self.seq].astype(np.int64))
        if int(row.max()) >= self.vocab:
            raise ValueError(f"--data: token id {int(row.max())} at offset {off} is >= the model's vocab_size "
                             f"{self.vocab}; wrong --data-dtype or tokenizer?")
        return row

    def get(self, g: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.rank * self.batch
        x = torch.stack([self._row(g, first + j) for j in range(self.batch)]).to(device, non_blocking=True)
        return x, x  # labels = inputs: the model shifts them by one position


# ---------------------------------------------------------------------- checkpoints
def lr_lambda(args: argparse.Namespace):
    def f(step: int) -> float:  # multiplier of args.lr for optimizer step `step` (0-based)
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        span = max(1, args.steps - args.warmup_steps)
        progress = min(1.0, (step - args.warmup_steps) / span)
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def complete_checkpoints(ckpt_dir: str) -> list[Path]:
    """Complete checkpoints (renamed from .tmp, with DCP's .metadata), oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    out = [p for p in root.iterdir() if CKPT_RE.match(p.name) and (p / ".metadata").is_file()
           and (p / "trainer.json").is_file()]
    return sorted(out, key=lambda p: int(CKPT_RE.match(p.name).group(1)))


def save_checkpoint(args, step: int, model, opt, sched, data: Batches, rank: int, world: int) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = Path(args.ckpt_dir) / f"step_{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed before
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, opt)
    trainer = {"step": step, "scheduler": sched.state_dict(), "world_size": world, "data": data.describe(),
               # the data position: micro-batch g = step * grad_accum + micro reads rows seeded (seed, g, i)
               "next_micro_batch": step * args.grad_accum, "stream": stream_shape(args)}
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    if rank == 0:
        (tmp / "trainer.json").write_text(json.dumps(trainer, indent=1))
    dist.barrier()  # every rank's shards and DCP's .metadata are on disk
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if args.keep:
            for old in complete_checkpoints(args.ckpt_dir)[:-args.keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def stream_shape(args: argparse.Namespace) -> dict:
    """What must not change on resume for the data stream to continue where it was."""
    return {"batch_size": args.batch_size, "seq_len": args.seq_len, "grad_accum": args.grad_accum}


def load_checkpoint(path: Path, args, model, opt, sched, data: Batches, world: int) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    trainer = json.loads((path / "trainer.json").read_text())
    if trainer["world_size"] != world:
        raise ValueError(f"checkpoint {str(path)!r} was written by {trainer['world_size']} ranks, this run has "
                         f"{world}: graphcomp's optimizer state is padded per world size, resume with "
                         f"{trainer['world_size']} ranks")
    if trainer["data"] != data.describe():
        raise ValueError(f"checkpoint {str(path)!r} was trained on data {trainer['data']}, this run reads "
                         f"{data.describe()}: the data stream would not continue (same --data and --seed)")
    if trainer["stream"] != stream_shape(args):
        raise ValueError(f"checkpoint {str(path)!r} was trained with {trainer['stream']}, this run has "
                         f"{stream_shape(args)}: resume with the same --batch-size, --seq-len and --grad-accum")
    model_sd, optim_sd = get_state_dict(model, opt)  # also creates the optimizer state to load into
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.load_state_dict(trainer["scheduler"])
    return int(trainer["step"])


# ------------------------------------------------------------------------ the loop
def memory_text(device: torch.device) -> str:
    if device.type == "cuda":
        return (f"mem {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB peak alloc, "
                f"{torch.cuda.max_memory_reserved(device) / 2**30:.2f} GiB reserved")
    return f"mem {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB max RSS"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import graphcomp
    from graphcomp.runtime import teardown

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()
                                         and torch.cuda.device_count() > local_rank)
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)  # noqa: E731

    try:
        cfg = load_config(args)
        model = build_model(cfg, args, device)
        n_params = sum(p.numel() for p in model.parameters())  # before sharding: logical sizes
        data = Batches(args, cfg.vocab_size, rank, world)
        compute = {"auto": torch.bfloat16 if use_cuda else None, "bf16": torch.bfloat16, "fp32": None}[args.dtype]
        graphcomp.shard(model, param_dtype=compute)  # parameters are now dim-0 shards (DTensors)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                weight_decay=args.weight_decay, fused=use_cuda or None)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))
        loss_fn = CausalLMLoss(model)
        if not args.no_compile:
            options = {"codegen": args.codegen, "cudagraphs": args.cudagraphs}
            if args.dump_dir:
                options["dump_dir"] = args.dump_dir
            loss_fn = torch.compile(loss_fn, backend="graphcomp", options=options)

        tokens_per_step = world * args.batch_size * args.seq_len * args.grad_accum
        fpt, peak = flops_per_token(cfg, n_params, args.seq_len), peak_flops(args, device)
        say(f"[train] {world} rank(s) on {'cuda/nccl' if use_cuda else 'cpu/gloo'}; "
            f"{type(model).__name__} {n_params / 1e6:.2f}M parameters; compute dtype "
            f"{compute or torch.float32}; {tokens_per_step} tokens/step; data {data.describe()['kind']}")

        start = 0
        if args.resume:
            if args.resume == "latest":
                found = complete_checkpoints(args.ckpt_dir)
                path = found[-1] if found else None
            else:
                path = Path(args.resume)
                if not ((path / ".metadata").is_file() and (path / "trainer.json").is_file()):
                    raise ValueError(f"--resume {args.resume!r} is not a complete checkpoint directory")
            if path is None:
                say(f"[train] no complete checkpoint in {args.ckpt_dir}: starting from step 0")
            else:
                start = load_checkpoint(path, args, model, opt, sched, data, world)
                say(f"[train] resumed from {path} at step {start}")

        pending: list[tuple[int, torch.Tensor, torch.Tensor, float]] = []  # (step, loss, grad norm, lr)
        t_last, steps_since = time.perf_counter(), 0
        for step in range(start, args.steps):
            lr = sched.get_last_lr()[0]
            loss_sum = torch.zeros((), device=device)
            for micro in range(args.grad_accum):
                x, y = data.get(step * args.grad_accum + micro, device)
                loss = loss_fn(x, y)
                (loss / args.grad_accum).backward()
                loss_sum += loss.detach()
            if args.clip > 0:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            done = step + 1
            pending.append((done, loss_sum / args.grad_accum, norm.detach(), lr))
            steps_since += 1

            if done % args.log_interval == 0 or done == args.steps:
                losses = torch.stack([p[1] for p in pending])
                dist.all_reduce(losses)  # one host sync per log interval
                losses = (losses / world).tolist()
                norms = torch.stack([p[2] for p in pending]).tolist()
                dt = time.perf_counter() - t_last
                tps = steps_since * tokens_per_step / dt
                mfu = f"{100 * fpt * tps / world / peak:.1f}%" if peak else "n/a"
                say(f"step {done}/{args.steps} | loss {losses[-1]:.4f} | lr {pending[-1][3]:.2e} | "
                    f"grad-norm {norms[-1]:.3f} | {tps:,.0f} tok/s ({tps / world:,.0f}/rank) | MFU {mfu} | "
                    f"{memory_text(device)} | {dt / steps_since:.3f} s/step"
                    + (" (includes compile)" if done - steps_since == start else ""))
                if rank == 0 and args.metrics_file:
                    with open(args.metrics_file, "a") as f:
                        for (s, _, _, l_r), loss_v, norm_v in zip(pending, losses, norms):
                            f.write(json.dumps({"step": s, "loss": loss_v, "grad_norm": norm_v, "lr": l_r}) + "\n")
                pending, t_last, steps_since = [], time.perf_counter(), 0

            if args.ckpt_dir and ((args.ckpt_interval and done % args.ckpt_interval == 0) or done == args.steps):
                t_save = time.perf_counter()
                path = save_checkpoint(args, done, model, opt, sched, data, rank, world)
                say(f"[train] checkpoint {path}")
                t_last += time.perf_counter() - t_save  # the save is not training time
        # what graphcomp did (frames compiled, CUDA-graph captures/replays/fallbacks, bytes gathered)
        say(f"[train] graphcomp counters: {json.dumps(dict(sorted(graphcomp.counters.items())))}")
    finally:
        teardown()  # release CUDA graphs (and their NCCL work) first
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
