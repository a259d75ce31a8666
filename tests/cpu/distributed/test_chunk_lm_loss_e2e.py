"""chunk_lm_loss end to end: the project's Llama and a Hugging Face Llama train
the same with the pass on and off (losses, first-step gradients, final
parameters; fp32 rtol 1e-5), in both codegens, and sharded on 2 gloo ranks (the
head's gradient still reaches its reduce-scatter; its weight is no longer
gathered again for the backward)."""

import pytest
import torch

import graphcomp
from graphcomp.models import Llama, synthetic_batch


CHUNK = 5  # tokens per chunk: 32-token micro-batches run in 7 chunks
RTOL, ATOL = 1e-5, 1e-6


def _loss_record(frame):
    return next(p for p in frame["stages"]["dynamo"]["passes"] if p["name"] == "chunk_lm_loss")


def _train_llama(on, codegen, steps=3):
    torch._dynamo.reset()
    graphcomp.reset()
    torch.manual_seed(0)
    m = Llama("tiny")
    cm = torch.compile(m, backend="graphcomp", options={
        "codegen": codegen, "passes": {"chunk_lm_loss": on}, "loss_chunk_tokens": CHUNK})
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    losses, grads = [], None
    for step in range(steps):
        tok, tgt = synthetic_batch(m.cfg, 2, 16, seed=step)
        if step == 1:
            tgt[:, :5] = -100  # ignored targets
        loss = cm(tok, tgt)
        loss.backward()
        if step == 0:
            grads = [p.grad.clone() for p in m.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses), grads, [p.detach().clone() for p in m.parameters()], graphcomp.frame_summaries()


def _close(a, b, rtol=RTOL, atol=ATOL):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_llama_trains_the_same_with_the_pass(codegen):
    off = _train_llama(False, codegen)
    on = _train_llama(True, codegen)
    torch.testing.assert_close(on[0], off[0], rtol=RTOL, atol=0)
    _close(on[1], off[1])
    _close(on[2], off[2])
    (frame,) = on[3]
    rec = _loss_record(frame)
    assert rec["changed"] and rec["counts"]["linear_cross_entropy"] == 1 and rec["counts"]["chunks"] == 7
    assert frame["stages"]["fwd"]["ops_out"].get("graphcomp.linear_cross_entropy.default") == 1
    assert _loss_record(off[3][0])["reason"] == "disabled in Config.passes"
    assert "graphcomp.linear_cross_entropy.default" not in off[3][0]["stages"]["fwd"]["ops_out"]


# ---------------------------------------------------------- Hugging Face Llama
def _hf_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=131, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _train_hf(on, codegen, steps=3):
    torch._dynamo.reset()
    graphcomp.reset()
    m = _hf_model()
    cm = torch.compile(m, backend="graphcomp", options={
        "codegen": codegen, "passes": {"chunk_lm_loss": on}, "loss_chunk_tokens": CHUNK})
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    losses, logits, grads = [], [], None
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 131, (2, 16), generator=g)
        labels = ids.clone()
        labels[0, :4] = -100
        kw = {"num_items_in_batch": torch.tensor(25)} if step == 2 else {}  # reduction "sum" / n
        out = cm(input_ids=ids, labels=labels, **kw)
        out.loss.backward()
        if step == 0:
            grads = [p.grad.clone() for p in m.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.detach())
        logits.append(out.logits.detach())
    return torch.stack(losses), grads, [p.detach().clone() for p in m.parameters()], logits, graphcomp.frame_summaries()


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_hf_llama_trains_the_same_with_the_pass(codegen):
    """HF returns the logits, so they stay (form 2): only their fp32 copy, the
    log-probabilities and the gradient's fp32 buffers are chunked. The eager codegen
    also takes the third step's ``num_items_in_batch`` (reduction "sum" / n, a second
    frame); the Inductor one stops after two steps (one frame: two Inductor compiles
    fewer, about 15 s of the CI suite)."""
    steps = 3 if codegen == "eager" else 2
    off = _train_hf(False, codegen, steps)
    on = _train_hf(True, codegen, steps)
    torch.testing.assert_close(on[0], off[0], rtol=RTOL, atol=0)
    _close(on[1], off[1])
    _close(on[2], off[2])
    _close(on[3], off[3])  # the returned logits
    recs = [_loss_record(f) for f in on[4]]
    # mean, and (eager codegen) sum / n
    assert sum(r["counts"].get("cross_entropy", 0) for r in recs) == len(recs) == (2 if steps == 3 else 1)
    assert all("linear_cross_entropy" not in r["counts"] for r in recs)


# ------------------------------------------------------------ sharded, 2 ranks
def _train_sharded_with_collectives(rank, world, cfg):
    from test_sharded_training import _train_sharded

    losses, params, counters = _train_sharded(rank, world, cfg)
    colls = [(st, c["kind"], c["dtype"], c["bytes"], c.get("params"))
             for f in graphcomp.frame_summaries() for st, d in f["stages"].items() for c in d["collectives"]]
    return losses, params, counters, colls


@pytest.fixture(scope="module")
def ranks2(shared_ranks2):
    return shared_ranks2.view(timeout=300)


def _bwd(colls, kind):
    """(dtype, bytes) of the backward graphs' collectives of one kind, sorted."""
    return sorted((d, b) for st, k, d, b, _ in colls if st == "bwd" and k == kind)


def _cfg(on, **kw):
    return {"fuse": True, "bucket": True, "passes": {"chunk_lm_loss": on},
            "options": {"loss_chunk_tokens": CHUNK}, "steps": 4, **kw}


def test_sharded_fp32_matches_the_unsharded_reference(ranks2):
    from test_sharded_training import _reference

    ref_losses, ref_params = _reference(4, 1)
    res = ranks2.run(_train_sharded_with_collectives, _cfg(True))
    for losses, params, counters, _ in res:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
        for k, v in ref_params.items():
            torch.testing.assert_close(params[k], v, rtol=RTOL, atol=ATOL, msg=lambda s, k=k: f"{k}: {s}")
        assert counters["lm_losses_chunked"] == 1


def test_sharded_bf16_head_gradient_still_reduce_scattered_and_not_regathered(ranks2):
    """bf16 parameters (fused downcast, buckets): the pass changes only the loss.
    Every gradient still has its reduce-scatter; the backward gathers the head
    weight no more (the op computed its gradient in the forward)."""
    on = ranks2.run(_train_sharded_with_collectives, _cfg(True, param_dtype=torch.bfloat16, bucket=False))
    off = ranks2.run(_train_sharded_with_collectives, _cfg(False, param_dtype=torch.bfloat16, bucket=False))
    for (l_on, p_on, _, c_on), (l_off, p_off, _, c_off) in zip(on, off):
        torch.testing.assert_close(torch.tensor(l_on), torch.tensor(l_off), rtol=1e-3, atol=0)
        for k in p_off:
            torch.testing.assert_close(p_on[k], p_off[k], rtol=1e-2, atol=1e-4, msg=lambda s, k=k: f"{k}: {s}")
        assert _bwd(c_on, "reduce_scatter") == _bwd(c_off, "reduce_scatter")
        assert len(_bwd(c_on, "reduce_scatter")) == 21  # one per trainable parameter
        ag = [b for _, b in _bwd(c_off, "all_gather")], [b for _, b in _bwd(c_on, "all_gather")]
        head_bytes = 132 * 32 * 2  # 131 rows padded to 2 x 66, bf16 on the wire
        assert len(ag[0]) == len(ag[1]) + 1
        missing = list(ag[0])
        for b in ag[1]:
            missing.remove(b)
        assert missing == [head_bytes]


def test_sharded_backward_issues_its_first_gather_before_the_head_reduce_scatter(ranks2):
    """The head's reduce-scatter is ready at the top of the backward (the chunked loss
    made its gradient in the forward). With every gather bucket over the prefetch cap
    (as W2's LM head is), the backward's first gather -- the one its first compute
    waits for -- is still issued first: before, the reduce-scatter went first and the
    gather queued behind it (2 H200s, W2: 2 ms + 1 ms exposed per step)."""
    cfg = _cfg(True, param_dtype=torch.bfloat16, bucket=True, steps=1)
    cfg["options"] = {**cfg["options"], "prefetch_bytes": 4096}  # under every bucket (smallest 7.7 KB)
    for _, _, counters, colls in ranks2.run(_train_sharded_with_collectives, cfg):
        kinds = [(k, b) for st, k, _, b, _ in colls if st == "bwd"]
        assert kinds[0][0] == "all_gather" and kinds[1] == ("reduce_scatter", 132 * 32 * 4), kinds[:4]
