"""The batches and fine-tuning set-ups users bring, on 2 gloo ranks, against an
unsharded eager reference (a tiny Hugging Face Llama, one decoder layer, eager
codegen: each scenario compiles its own frames).

* packed: several documents per row, ``position_ids`` restarting, no mask: the
  compiled model's logits of every document equal that document run alone
  (attention does not cross documents);
* varlen: sequence lengths from two buckets, changing between steps: one compile
  per bucket (``graphcomp.counters['frames_compiled']``; transformers' attention
  masks specialize the graph on the length, so every distinct length compiles once:
  bucketing bounds the compiles);
* accumulation: right-padded rows (``attention_mask``, ``-100`` labels), two
  micro-batches per step, each loss weighted by the global token count
  (``num_items_in_batch``): the gradients equal the global token mean's;
* frozen base: LoRA-style adapters on a frozen, sharded base, padded rows: only the
  adapters get gradients, and the backward reduce-scatters only their gradients;
* eval between steps: ``model.eval()`` + ``torch.no_grad()`` forward and
  ``generate()`` between training steps, and training goes on without recompiling
  its frame.

The data-parallel objective is the mean over ranks of each rank's loss (the
gradients are averaged over ranks), so the reference computes that: the sum over
rank chunks of the chunk's loss, divided by the world size.
"""

from __future__ import annotations

import pytest
import torch

from _sharded import full_grads

pytest.importorskip("transformers")

from benchmarks import hf_models as zoo  # noqa: E402

WORLD, LR = 2, 0.05


def _model(seed=0):
    return zoo.build_model("llama", "tiny", seed=seed, dropout=0.0, layers=1)


def _padded_batch(seed, lengths, seq):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (len(lengths), seq), generator=g)
    mask = torch.zeros(len(lengths), seq, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    ids = ids.masked_fill(mask == 0, 0)  # the pad token
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _rows(b, rank, world=WORLD):
    n = next(iter(b.values())).shape[0] // world
    return {k: (v[rank * n:(rank + 1) * n] if isinstance(v, torch.Tensor) and v.dim() else v) for k, v in b.items()}


def _sgd_steps(model, step_losses, steps):
    """``steps`` SGD steps; ``step_losses(s)`` runs step ``s``'s forwards and
    backwards and returns its (detached) loss. Returns losses and step-1 gradients."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, g1 = [], None
    for s in range(steps):
        losses.append(float(step_losses(s)))
        if s == 0:
            g1 = full_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, g1


class LoRALinear(torch.nn.Module):
    """``base(x) + scale * up(down(x))``: a frozen base Linear and a trainable rank-r
    adapter (PEFT's LoRA layer, written out: the CPU suite does not install peft)."""

    def __init__(self, base: torch.nn.Linear, r: int = 4, scale: float = 2.0):
        super().__init__()
        self.base, self.scale = base, scale
        self.down = torch.nn.Linear(base.in_features, r, bias=False)
        self.up = torch.nn.Linear(r, base.out_features, bias=False)
        torch.nn.init.normal_(self.up.weight, std=0.02)  # (PEFT starts at zero; nonzero tests more)

    def forward(self, x):
        return self.base(x) + self.scale * self.up(self.down(x))


def _lora(model):
    torch.manual_seed(1)
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers:
        for name in ("q_proj", "v_proj"):
            setattr(layer.self_attn, name, LoRALinear(getattr(layer.self_attn, name)))
    return model


# ----------------------------------------------------------------- scenarios
# Each scenario: run(model, call, rank, world) -> (losses, step-1 grads, extra); `call`
# is the compiled model on the ranks and the model itself in the reference, which
# passes rank chunks one after another (rank=None: every chunk, summed / world).

def _device(model):
    return next(model.parameters()).device


def _chunks(b, rank, world, device="cpu"):
    """The reference's chunks (every rank's rows) or one rank's rows, on ``device``."""
    out = [_rows(b, r, world) for r in range(world)] if rank is None else [_rows(b, rank, world)]
    return [{k: v.to(device) for k, v in c.items()} for c in out]


def _backward(model, call, batch, rank, world):
    """Forward and backward of ``batch``'s chunks (a rank's rows, or every rank's rows
    in the reference, each loss / world); returns the loss (detached, summed)."""
    tot = 0.0
    for c in _chunks(batch, rank, world, _device(model)):
        loss = call(**c).loss / (world if rank is None else 1)
        loss.backward()
        tot += float(loss.detach())
    return tot


def _scenario_padded(model, call, rank, world):
    batches = [_padded_batch(s, [16, 11, 7, 13], 16) for s in range(2)]

    def step(s):
        return _backward(model, call, batches[s], rank, world)

    return (*_sgd_steps(model, step, 2), None)


def _packed_row(seed, docs):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randint(3, 128, (n,), generator=g) for n in docs]
    pos = torch.cat([torch.arange(n) for n in docs])
    labels = torch.cat(parts).clone()
    start = 0
    for n in docs:
        labels[start] = -100  # (no document predicts the next one's first token)
        start += n
    return parts, torch.cat(parts), pos, labels


def _scenario_packed(model, call, rank, world):
    rows = [_packed_row(10 + i, docs) for i, docs in enumerate([[5, 7, 4], [9, 7], [3, 6, 7], [16]])]
    b = {"input_ids": torch.stack([r[1] for r in rows]), "position_ids": torch.stack([r[2] for r in rows]),
         "labels": torch.stack([r[3] for r in rows])}

    def step(s):
        return _backward(model, call, b, rank, world)

    extra = None
    if rank is not None:  # every document's logits, packed (compiled) and alone (eager, same weights)
        with torch.no_grad():
            mine = rows[rank * 2:(rank + 1) * 2]
            got = call(**{k: v.to(_device(model)) for k, v in _rows(b, rank, world).items() if k != "labels"}).logits
            extra = [(got[i], [p for p in r[0]]) for i, r in enumerate(mine)]
    losses, g1 = _sgd_steps(model, step, 2)
    return losses, g1, extra


def _scenario_varlen(model, call, rank, world):
    lengths = [8, 16, 8, 16, 16]  # two buckets

    def step(s):
        b = zoo.make_batch(model, 4, lengths[s], seed=20 + s)
        return _backward(model, call, b, rank, world)

    return (*_sgd_steps(model, step, len(lengths)), None)


def _scenario_accumulation(model, call, rank, world):
    micro = [[_padded_batch(30 + 2 * s + k, [16, 5, 12, 9], 16) for k in range(2)] for s in range(2)]

    def step(s):
        count = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in micro[s])  # the tokens that are predicted
        tot = 0.0
        for mb in micro[s]:
            for c in _chunks(mb, rank, world, _device(model)):
                # a rank's loss: its tokens' sum / (global count / world), so the mean over
                # ranks (what data parallelism averages) is the global token mean; the
                # reference's chunks: their sum / global count, summed
                n = torch.tensor(count / (world if rank is not None else 1), dtype=torch.float32, device=_device(model))
                loss = call(**c, num_items_in_batch=n).loss
                loss.backward()
                tot += float(loss.detach())
        return tot

    return (*_sgd_steps(model, step, 2), None)


def _scenario_eval(model, call, rank, world):
    batches = [zoo.make_batch(model, 4, 12, seed=40 + s) for s in range(3)]
    evals = []

    def step(s):
        if s > 0:  # evaluation between training steps
            model.eval()
            with torch.no_grad():
                c = _chunks(batches[0], rank, world, _device(model))[0]
                evals.append(float(call(input_ids=c["input_ids"]).logits.float().square().mean()))
                model.generate(c["input_ids"][:1, :4], max_new_tokens=3, do_sample=False)
            model.train()
        return _backward(model, call, batches[s], rank, world)

    losses, g1 = _sgd_steps(model, step, 3)
    return losses, g1, evals


SCENARIOS = {"packed": _scenario_packed, "varlen": _scenario_varlen,
             "accumulation": _scenario_accumulation, "frozen_base": _scenario_padded, "eval": _scenario_eval}


def _build(name):
    m = _model()
    return _lora(m) if name == "frozen_base" else m


def _reference(name):
    """losses, step-1 gradients, the scenario's extra, final parameters."""
    m = _build(name)
    losses, g1, extra = SCENARIOS[name](m, m, None, WORLD)
    return losses, g1, extra, {k: v.detach() for k, v in m.state_dict().items()}


def _on_ranks(rank, world, names):
    import torch.distributed as dist

    import graphcomp
    from graphcomp.sharding.shard import full_state_dict

    out = {}
    for name in names:
        torch._dynamo.reset()
        graphcomp.reset()
        m = _build(name)
        graphcomp.shard(m)
        cm = torch.compile(m, backend="graphcomp", options={"codegen": "eager"})
        losses, g1, extra = SCENARIOS[name](m, cm, rank, world)
        lt = torch.tensor(losses)
        dist.all_reduce(lt)  # the reference's loss: the mean over ranks of the ranks' losses
        losses = [float(x) / world for x in lt]
        frames = [f for f in graphcomp.frame_summaries()]
        rs = sum(1 for f in frames for c in f["stages"].get("bwd", {}).get("collectives", [])
                 if "reduce_scatter" in str(c))
        out[name] = {"losses": losses, "g1": g1, "params": full_state_dict(m), "extra": extra,
                     "frames": len(frames), "compiled": graphcomp.counters["frames_compiled"],
                     "reduce_scatters": rs,
                     "trainable": sorted(n for n, p in m.named_parameters() if p.requires_grad)}
    return out


@pytest.fixture(scope="module")
def results(shared_ranks2):
    return shared_ranks2.view(timeout=600).run(_on_ranks, list(SCENARIOS))


def _close(name, got, ref, rtol, floor):
    err = float((got.float() - ref.float()).norm())
    scale = max(float(ref.float().norm()), floor)
    assert err <= rtol * scale, f"{name}: |diff| {err:.3g} > {rtol} * {scale:.3g}"


def _check_parity(name, results, rtol=1e-5):
    ref_losses, ref_g1, ref_extra, ref_params = _reference(name)
    gmax = max(float(g.norm()) for g in ref_g1.values())
    pmax = max(float(p.float().norm()) for p in ref_params.values())
    for r in results:
        res = r[name]
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref_losses), rtol=rtol, atol=0)
        assert set(res["g1"]) == set(ref_g1), set(ref_g1) ^ set(res["g1"])
        for k in ref_g1:
            _close(f"{name} grad {k}", res["g1"][k], ref_g1[k], rtol * 10, 1e-3 * gmax)
        for k, v in ref_params.items():
            if k in res["params"]:
                _close(f"{name} param {k}", res["params"][k], v, rtol * 10, 1e-3 * pmax)
    return ref_extra


def test_padded_micro_batches_accumulated_with_token_weighted_losses_2ranks(results):
    """Right-padded rows (attention mask, -100 labels), two micro-batches per step."""
    _check_parity("accumulation", results)


def test_packed_documents_do_not_attend_across_2ranks(results):
    _check_parity("packed", results)
    ref = _model()
    with torch.no_grad():
        for r in results:
            for logits, docs in r["packed"]["extra"]:
                start = 0
                for doc in docs:
                    alone = ref(input_ids=doc.unsqueeze(0)).logits[0]
                    torch.testing.assert_close(logits[start:start + len(doc)], alone, rtol=1e-4, atol=1e-5)
                    start += len(doc)


def test_bucketed_sequence_lengths_compile_once_per_bucket_2ranks(results):
    _check_parity("varlen", results)
    for r in results:
        assert r["varlen"]["compiled"] == 2, r["varlen"]["compiled"]


def test_frozen_base_trains_adapters_and_reduces_only_their_gradients_2ranks(results):
    _check_parity("frozen_base", results)
    for r in results:
        res = r["frozen_base"]
        assert res["trainable"] and all(".down." in n or ".up." in n for n in res["trainable"]), res["trainable"]
        assert set(res["g1"]) == set(res["trainable"])
        # one reduce-scatter per adapter weight at most (the bucketing pass may join them), none for the base
        assert 0 < res["reduce_scatters"] <= len(res["trainable"]), res["reduce_scatters"]


def test_evaluation_and_generate_between_steps_2ranks(results):
    ref_evals = _check_parity("eval", results)
    for r in results:
        res = r["eval"]
        assert len(res["extra"]) == 2
        # rank 0's rows are the reference's first chunk: its evaluation matches
        if r is results[0]:
            torch.testing.assert_close(torch.tensor(res["extra"]), torch.tensor(ref_evals), rtol=1e-5, atol=0)
        # the training frame compiled once; evaluation adds its own (no_grad) frame, generate runs eagerly
        assert res["compiled"] <= 3, res["compiled"]
