"""Train a Hugging Face causal language model with graphcomp: a complete script to copy.

    # 2 CPU ranks (gloo), the built-in tiny preset (random weights), synthetic data:
    torchrun --nproc-per-node 2 examples/train_llm.py --model tiny-llama --steps 20

    # 8 GPUs (NCCL), the weights of a local HF model directory, a token file:
    torchrun --nproc-per-node 8 examples/train_llm.py --model /models/my-llama \
        --data train.bin --data-dtype uint16 --batch-size 4 --seq-len 2048 \
        --grad-accum 4 --steps 1000 --ckpt-dir ckpt --ckpt-interval 200

    # continue from the latest complete checkpoint (same --steps; another number of
    # ranks reshards the state and changes the global batch):
    torchrun --nproc-per-node 8 examples/train_llm.py ... --ckpt-dir ckpt --resume

    # any graphcomp.Config field: --option KEY=VALUE (VALUE is JSON, else a string);
    # --codegen, --cudagraphs and --dump-dir are shorthands of their --option
    torchrun ... examples/train_llm.py --option codegen=eager --option dump_dir=dumps \
        --option memory_budget=0.8 --option 'passes={"remat": false}'

The same command runs on CPUs (gloo) and GPUs (NCCL, one per rank); nothing is
downloaded. What it does, in order:

* model: a preset of this file (``--model tiny-llama``: random weights), or a local
  model directory (``--model DIR``): its weights are loaded
  (``AutoModelForCausalLM.from_pretrained``: ``model.safetensors``,
  ``pytorch_model.bin`` or their sharded index files). A directory with a
  ``config.json`` but no weights is an error unless ``--random-init`` asks for random
  weights from its config (``--random-init`` also ignores weights that are there).
  Start-up says which: ``weights: loaded from DIR (N tensors)`` or ``weights: random
  (seed S)``. The model is built with ``attn_implementation="sdpa"``, ``use_cache=False``.
* ``graphcomp.shard(model, param_dtype=bf16 on GPU)``: parameters become dim-0
  shards (fp32 master weights, bf16 compute); AdamW (``fused`` on CUDA) and a cosine
  learning rate with linear warm-up (``LambdaLR``) are built on the shards.
* ``graphcomp.train_step(model, opt, max_norm=--clip, grad_accum=--grad-accum,
  scheduler=sched, options=--option...)``: one call is one optimizer step (forward
  and the model's own ``labels=`` loss compiled with graphcomp, backward over the
  micro-batches, clipping, AdamW and the scheduler; on CUDA the whole step becomes
  one CUDA graph when that is safe).
* data: synthetic sequences by default (learnable: each row is an arithmetic
  progression of token ids), or ``--data FILE.bin``, a memory-mapped flat array of
  uint16/uint32 token ids. Row ``i`` of global micro-batch ``g`` is drawn from a
  generator seeded with ``(--seed, g, i)``, so the stream depends only on the step:
  a resumed run reads exactly what the uninterrupted run would have read.
* checkpoints (``--ckpt-dir``, every ``--ckpt-interval`` steps): the train step's
  ``state_dict()`` (model, optimizer, scheduler, step) with
  ``torch.distributed.checkpoint`` plus ``trainer.json`` (world size, data), written
  to ``step_NNNNNNNN.tmp`` and renamed to ``step_NNNNNNNN`` only after every rank
  finished, so a crash mid-save never leaves a checkpoint ``--resume`` would pick up.
* a progress line every ``--log-interval`` steps (rank 0): step, loss, lr, grad
  norm, tokens/s, MFU estimate, memory; ``--metrics-file`` also writes every step
  as a JSON line.
* at the end (rank 0): graphcomp's counters and a health report
  (``graphcomp.tools.health``): graph breaks, recompiles, pieces run eagerly and
  CUDA-graph fallbacks with their reasons, whether the whole step is one graph,
  the optimizer step's mode, tokens/s/GPU, MFU, peak memory, and one thing to try
  for each problem found.

Options: ``python examples/train_llm.py --help``.
"""

from __future__ import annotations

import argparse
import dataclasses
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

# Built-in model presets (LlamaConfig keyword arguments), always random weights.
# "tiny-llama" trains in seconds on CPU ranks; the others match graphcomp's benchmark
# workloads W1 and W2.
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
# weight files of a save_pretrained directory, in the order from_pretrained prefers them
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", default="tiny-llama",
                   help=f"a preset ({', '.join(PRESETS)}; random weights) or a local model directory "
                        "(save_pretrained: config.json and weights, which are loaded)")
    m.add_argument("--random-init", action="store_true",
                   help="random weights from --model DIR's config.json (needed when DIR holds no weights)")
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
    t.add_argument("--seed", type=int, default=0, help="random weights and data sampling")
    d = p.add_argument_group("data")
    d.add_argument("--data", help="a flat binary file of token ids (default: synthetic data)")
    d.add_argument("--data-dtype", choices=sorted(DATA_DTYPES), default="uint16")
    c = p.add_argument_group("compile")
    c.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a graphcomp.Config field for graphcomp.train_step (repeatable); VALUE is JSON, else a "
                        "string: --option codegen=eager --option dump_dir=dumps --option max_captures=16")
    c.add_argument("--codegen", choices=["inductor", "eager"], help="shorthand for --option codegen=...")
    c.add_argument("--cudagraphs", choices=["auto", "off", "require"], help="shorthand for --option cudagraphs=...")
    c.add_argument("--dump-dir", help="shorthand for --option dump_dir=... (read with `graphcomp inspect DIR`)")
    k = p.add_argument_group("checkpoints and logs")
    k.add_argument("--ckpt-dir", help="where step_NNNNNNNN checkpoints go (a directory every rank can reach)")
    k.add_argument("--ckpt-interval", type=int, default=0, help="save every N steps (0: only at the end)")
    k.add_argument("--keep", type=int, default=0, help="keep the newest N checkpoints (0: all)")
    k.add_argument("--resume", nargs="?", const="latest",
                   help="continue from the latest complete checkpoint in --ckpt-dir, or from the given one")
    k.add_argument("--log-interval", type=int, default=1)
    k.add_argument("--metrics-file", help="rank 0 appends one JSON line per step (step, loss, lr, grad_norm)")
    k.add_argument("--health-file", help="write the end-of-run health report as JSON here; '{rank}' in the "
                                         "name gives every rank its own file (else rank 0 writes it)")
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
    from graphcomp.tools.options_arg import parse_options

    try:  # bad input is refused here, on every rank, before any process group exists
        short = {k: getattr(args, k) for k in ("codegen", "cudagraphs", "dump_dir") if getattr(args, k) is not None}
        args.options = parse_options(args.option, short)
        args.weights = resolve_model(args)
    except ValueError as e:
        p.error(str(e))
    return args


# ---------------------------------------------------------------------------- model
def weight_files(directory: Path) -> list[Path]:
    """The weight files of a save_pretrained directory (an index file with its shards)."""
    for name in WEIGHT_FILES:
        f = directory / name
        if f.is_file():
            if name.endswith(".index.json"):
                shards = sorted(set(json.loads(f.read_text())["weight_map"].values()))
                return [f] + [directory / s for s in shards]
            return [f]
    return []


def count_tensors(files: list[Path]) -> int:
    """Tensors stored in a weight file (or named by an index file)."""
    f = files[0]
    if f.name.endswith(".index.json"):
        return len(json.loads(f.read_text())["weight_map"])
    if f.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(f), framework="pt") as sf:
            return len(list(sf.keys()))
    return len(torch.load(f, map_location="cpu", mmap=True, weights_only=True))


def resolve_model(args: argparse.Namespace) -> list[Path] | None:
    """The weight files to load (None: random weights); raises ValueError for a
    --model that is neither a preset nor a model directory, a directory without
    config.json, or one without weights and without --random-init."""
    if args.model in PRESETS:
        return None
    d = Path(args.model)
    if not d.is_dir():
        raise ValueError(f"--model {args.model!r} is neither a preset ({', '.join(PRESETS)}) nor a local directory "
                         "(this script never downloads)")
    if not (d / "config.json").is_file():
        raise ValueError(f"--model {args.model!r}: no config.json in that directory (a save_pretrained directory "
                         "has config.json and its weights)")
    files = weight_files(d)
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"--model {args.model!r}: {files[0].name} names {missing[0].name}, which is not there")
    if not files and not args.random_init:
        raise ValueError(f"--model {args.model!r} has a config.json but no weights ({', '.join(WEIGHT_FILES)}): "
                         "pass --random-init to train it from random weights, or point --model at a directory "
                         "with weights")
    return None if args.random_init else files


def load_config(args: argparse.Namespace):
    """The model config: a --model preset or the config.json of a --model directory."""
    from transformers import AutoConfig, LlamaConfig

    if args.model in PRESETS:
        cfg = LlamaConfig(**PRESETS[args.model])
    else:
        cfg = AutoConfig.from_pretrained(args.model, local_files_only=True)
    cfg.use_cache = False
    return cfg


def build_model(cfg, args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, str]:
    """The model, identical on every rank, and how its weights came: loaded from
    ``args.weights`` (resolve_model's files), or random from ``args.seed``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    kw = dict(attn_implementation="sdpa", dtype=torch.float32)
    if args.weights:
        model, info = AutoModelForCausalLM.from_pretrained(args.model, config=cfg, local_files_only=True,
                                                           output_loading_info=True, **kw)
        bad = {k: sorted(v)[:5] for k, v in info.items() if k in ("missing_keys", "mismatched_keys") and v}
        if bad:  # (from_pretrained would initialize those randomly, with a warning only)
            raise ValueError(f"--model {args.model!r}: the weights do not match the model of its config.json: {bad}")
        how = f"loaded from {args.model} ({count_tensors(args.weights)} tensors)"
    else:
        model = AutoModelForCausalLM.from_config(cfg, **kw)
        how = f"random (seed {args.seed})"
    model.config.use_cache = False
    return model.to(device), how


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

    def step_batch(self, step: int, grad_accum: int, device: torch.device) -> torch.Tensor:
        """This rank's input ids of optimizer step ``step``: its ``grad_accum``
        micro-batches stacked along dim 0 (graphcomp.train_step splits them again)."""
        return torch.cat([self.get(step * grad_accum + k, device)[0] for k in range(grad_accum)])


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


def save_checkpoint(args, done: int, step, data: Batches, rank: int, world: int) -> Path:
    """``step.state_dict()`` (model, optimizer, scheduler, steps) with DCP, and
    ``trainer.json``, into ``step_NNNNNNNN.tmp``, renamed once every rank is done."""
    import torch.distributed.checkpoint as dcp

    final = Path(args.ckpt_dir) / f"step_{done:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed before
        tmp.mkdir(parents=True)
    dist.barrier()
    trainer = {"step": done, "world_size": world, "data": data.describe(),
               # the data position: micro-batch g = step * grad_accum + micro reads rows seeded (seed, g, i)
               "next_micro_batch": done * args.grad_accum, "stream": stream_shape(args)}
    dcp.save(step.state_dict(), checkpoint_id=str(tmp))
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


def load_checkpoint(path: Path, args, step, data: Batches, world: int) -> int:
    """Load a checkpoint into ``step`` (a graphcomp.TrainStep); returns its step."""
    import torch.distributed.checkpoint as dcp

    trainer = json.loads((path / "trainer.json").read_text())
    if trainer["world_size"] != world and dist.get_rank() == 0:  # DCP reshards the state; the batch changes
        print(f"[train] checkpoint {path} was written by {trainer['world_size']} ranks, this run has {world}: "
              f"the state is resharded; the global batch is now {world * args.batch_size * args.grad_accum} "
              f"sequences (was {trainer['world_size'] * args.batch_size * args.grad_accum})", flush=True)
    if trainer["data"] != data.describe():
        raise ValueError(f"checkpoint {str(path)!r} was trained on data {trainer['data']}, this run reads "
                         f"{data.describe()}: the data stream would not continue (same --data and --seed)")
    if trainer["stream"] != stream_shape(args):
        raise ValueError(f"checkpoint {str(path)!r} was trained with {trainer['stream']}, this run has "
                         f"{stream_shape(args)}: resume with the same --batch-size, --seq-len and --grad-accum")
    state = step.state_dict()  # (also creates the optimizer state to load into)
    dcp.load(state, checkpoint_id=str(path))
    step.load_state_dict(state)
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
    from graphcomp.tools.health import format_health, health_report

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
        model, weights = build_model(cfg, args, device)
        n_params = sum(p.numel() for p in model.parameters())  # before sharding: logical sizes
        data = Batches(args, cfg.vocab_size, rank, world)
        compute = {"auto": torch.bfloat16 if use_cuda else None, "bf16": torch.bfloat16, "fp32": None}[args.dtype]
        graphcomp.shard(model, param_dtype=compute)  # parameters are now dim-0 shards (DTensors)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                weight_decay=args.weight_decay, fused=use_cuda or None)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))
        step = graphcomp.train_step(model, opt, max_norm=args.clip or None, grad_accum=args.grad_accum,
                                    scheduler=sched, options=args.options)

        tokens_per_step = world * args.batch_size * args.seq_len * args.grad_accum
        fpt, peak = flops_per_token(cfg, n_params, args.seq_len), peak_flops(args, device)
        say(f"[train] {world} rank(s) on {'cuda/nccl' if use_cuda else 'cpu/gloo'}; "
            f"{type(model).__name__} {n_params / 1e6:.2f}M parameters; compute dtype "
            f"{compute or torch.float32}; {tokens_per_step} tokens/step; data {data.describe()['kind']}")
        say(f"[train] model: {args.model}" + (" (preset)" if args.model in PRESETS else "") + f"; weights: {weights}")
        if args.options:
            say(f"[train] graphcomp options: {json.dumps(args.options)}")

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
                start = load_checkpoint(path, args, step, data, world)
                say(f"[train] resumed from {path} at step {start}")

        pending: list[tuple[int, torch.Tensor, torch.Tensor | None, float]] = []  # (step, loss, grad norm, lr)
        t_last, steps_since = time.perf_counter(), 0
        t_first, timed_steps = None, 0  # throughput over the run after its first step (which compiles)
        for i in range(start, args.steps):
            lr = sched.get_last_lr()[0]
            x = data.step_batch(i, args.grad_accum, device)  # grad_accum micro-batches, split by train_step
            loss = step(input_ids=x, labels=x)  # labels = inputs: the model shifts them by one position
            done = i + 1
            norm = step.last_norm
            pending.append((done, loss, None if norm is None else norm.detach(), lr))
            steps_since += 1
            if t_first is None:
                if done < args.steps:
                    loss.item()  # (the first step finished: time the rest)
                t_first = time.perf_counter()
            else:
                timed_steps += 1

            if done % args.log_interval == 0 or done == args.steps:
                losses = torch.stack([p[1] for p in pending])
                dist.all_reduce(losses)  # one host sync per log interval
                losses = (losses / world).tolist()
                norms = [None if p[2] is None else float(p[2]) for p in pending]
                dt = time.perf_counter() - t_last
                tps = steps_since * tokens_per_step / dt
                mfu = f"{100 * fpt * tps / world / peak:.1f}%" if peak else "n/a"
                say(f"step {done}/{args.steps} | loss {losses[-1]:.4f} | lr {pending[-1][3]:.2e} | "
                    f"grad-norm {norms[-1] if norms[-1] is None else format(norms[-1], '.3f')} | "
                    f"{tps:,.0f} tok/s ({tps / world:,.0f}/rank) | MFU {mfu} | "
                    f"{memory_text(device)} | {dt / steps_since:.3f} s/step"
                    + (" (includes compile)" if done - steps_since == start else ""))
                if rank == 0 and args.metrics_file:
                    with open(args.metrics_file, "a") as f:
                        for (s, _, _, l_r), loss_v, norm_v in zip(pending, losses, norms):
                            f.write(json.dumps({"step": s, "loss": loss_v, "grad_norm": norm_v, "lr": l_r}) + "\n")
                pending, t_last, steps_since = [], time.perf_counter(), 0

            if args.ckpt_dir and ((args.ckpt_interval and done % args.ckpt_interval == 0) or done == args.steps):
                t_save = time.perf_counter()
                path = save_checkpoint(args, done, step, data, rank, world)
                say(f"[train] checkpoint {path}")
                t_last += time.perf_counter() - t_save  # the save is not training time
                if t_first is not None:
                    t_first += time.perf_counter() - t_save
        # what graphcomp did (frames compiled, CUDA-graph captures/replays/fallbacks, bytes gathered)
        say(f"[train] graphcomp counters: {json.dumps(dict(sorted(graphcomp.counters.items())))}")
        tps = mfu_v = None
        if timed_steps:
            tps = timed_steps * tokens_per_step / (time.perf_counter() - t_first)
            mfu_v = fpt * tps / world / peak if peak else None
        report = health_report(step, tokens_per_s=tps, mfu=mfu_v, world=world)
        say(format_health(report))
        if args.health_file and (rank == 0 or "{rank}" in args.health_file):
            Path(args.health_file.replace("{rank}", str(rank))).write_text(json.dumps(report, indent=1, default=str))
    finally:
        teardown()  # release CUDA graphs (and their NCCL work) first
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
