"""The batches and fine-tuning set-ups of tests/cpu/models/test_user_batches.py on one
GPU: graphcomp at its defaults (Inductor, CUDA graphs "auto") on a sharded tiny
Hugging Face Llama against the unsharded eager model on the same GPU, fp32.

Scenarios: packed documents (position ids restarting), bucketed sequence lengths,
padded micro-batches accumulated with token-weighted losses, a frozen base with
LoRA adapters (hand-written, and PEFT's ``get_peft_model``), evaluation and
``generate()`` between training steps. Each: losses within 1e-4, step-1 gradients
and final parameters within 1e-3 of their norms (Inductor's kernels round
differently from eager ones), pieces captured, no CUDA-graph fallback.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")

_HERE = Path(__file__).resolve()
sys.path[:0] = [str(_HERE.parents[2]), str(_HERE.parents[1] / "cpu"), str(_HERE.parents[1] / "cpu" / "models")]

import test_user_batches as ub  # noqa: E402


def _rel(a, b):
    return float((a.float() - b.float()).norm()) / max(float(b.float().norm()), 1e-6)


def _peft_lora(model):
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                          init_lora_weights="gaussian")
    return peft.get_peft_model(model, cfg)


def _run(name, build, compiled):
    import graphcomp

    torch._dynamo.reset()
    graphcomp.reset()
    m = build().cuda()
    call = m
    if compiled:
        graphcomp.shard(m)
        call = torch.compile(m, backend="graphcomp")
    losses, g1, extra = ub.SCENARIOS[name](m, call, 0 if compiled else None, 1)
    params = graphcomp.full_state_dict(m) if compiled else {k: v.detach() for k, v in m.state_dict().items()}
    return losses, g1, extra, params, dict(graphcomp.counters)


CASES = {**{n: (n, lambda n=n: ub._build(n)) for n in ub.SCENARIOS},
         "peft_lora": ("frozen_base", lambda: _peft_lora(ub._model()))}


@pytest.mark.parametrize("case", sorted(CASES))
def test_user_batches_match_eager_with_cuda_graphs_1gpu(world1, case):
    name, build = CASES[case]
    ref_losses, ref_g1, ref_extra, ref_params, _ = _run(name, build, compiled=False)
    losses, g1, extra, params, c = _run(name, build, compiled=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    assert set(g1) == set(ref_g1), set(g1) ^ set(ref_g1)
    for k in ref_g1:
        assert _rel(g1[k], ref_g1[k]) < 1e-3, (k, _rel(g1[k], ref_g1[k]))
    for k, v in ref_params.items():
        if k in params:
            assert _rel(params[k].to(v.device), v) < 1e-3, (k, _rel(params[k].to(v.device), v))
    assert c.get("pieces_captured", 0) >= 1 and c.get("replays", 0) >= 1, c
    assert c.get("cudagraph_fallbacks", 0) == 0 and c.get("capture_failures", 0) == 0, c
    if name == "packed":  # every document's logits, packed and compiled, equal the document alone
        ref = ub._model().cuda()
        with torch.no_grad():
            for logits, docs in extra:
                start = 0
                for doc in docs:
                    alone = ref(input_ids=doc.unsqueeze(0).cuda()).logits[0]
                    torch.testing.assert_close(logits[start:start + len(doc)], alone, rtol=1e-4, atol=1e-4)
                    start += len(doc)
    if name == "varlen":
        assert c.get("frames_compiled") == 2, c
    if name == "eval":
        torch.testing.assert_close(torch.tensor(extra), torch.tensor(ref_extra), rtol=1e-4, atol=0)
