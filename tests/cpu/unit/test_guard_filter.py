"""``graphcomp.guard_filter`` (opt-in ``guard_filter_fn``): drops Dynamo's DTensor spec
guards and mesh-aliasing guards of the parameters ``graphcomp.shard`` owns, keeps
every other guard (another DTensor's spec included), and changes no result."""

from __future__ import annotations

import torch

import graphcomp
from graphcomp.models import Llama, LlamaConfig, synthetic_batch

CFG = LlamaConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=24, max_seq_len=16)


def _train(filter_fn, steps=3):
    torch._dynamo.reset()
    graphcomp.reset()
    torch.manual_seed(0)
    m = Llama(CFG)
    graphcomp.shard(m)
    seen: list[tuple[str, bool]] = []

    def recording(entries):
        flags = filter_fn(entries) if filter_fn else [True] * len(entries)
        seen.extend((e.guard_type, f) for e, f in zip(entries, flags))
        return flags

    cm = torch.compile(m, backend="graphcomp", options={"codegen": "eager", "guard_filter_fn": recording})
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for s in range(steps):
        tok, tgt = synthetic_batch(CFG, batch=2, seq_len=8, seed=s)
        loss = cm(tok, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), seen, dict(graphcomp.counters)


def test_sharded_parameters_spec_guards_dropped_and_results_unchanged(pg1):
    ref, seen_ref, c_ref = _train(None)
    got, seen, c = _train(graphcomp.guard_filter)
    n_params = len(list(Llama(CFG).parameters()))
    dropped = [t for t, keep in seen if not keep]
    assert dropped.count("DTENSOR_SPEC_MATCH") == n_params, dropped  # one per sharded parameter
    assert set(dropped) <= {"DTENSOR_SPEC_MATCH", "DUPLICATE_INPUT"}, set(dropped)
    # the filter saw the same guards as the unfiltered compile, and kept all the others
    assert sorted(t for t, _ in seen) == sorted(t for t, _ in seen_ref)
    assert all(keep for t, keep in seen if t not in ("DTENSOR_SPEC_MATCH", "DUPLICATE_INPUT"))
    assert any(t == "TENSOR_MATCH" for t, keep in seen if keep)  # tensor metadata guards stay
    assert torch.equal(got, ref)
    assert c.get("frames_compiled") == c_ref.get("frames_compiled") == 1, (c, c_ref)  # no recompile either way


def test_other_dtensors_keep_their_spec_guards(pg1):
    """A DTensor that graphcomp.shard did not create (here: an input) keeps its spec
    guard, even on the mesh shard uses and with an equal spec."""
    from torch.distributed.tensor import DTensor, Shard

    m = Llama(CFG)
    graphcomp.shard(m)
    owned = next(m.parameters())
    x = DTensor.from_local(torch.ones(4), owned.device_mesh, [Shard(0)], run_check=False)
    seen = []

    def recording(entries):
        flags = graphcomp.guard_filter(entries)
        seen.extend((e.guard_type, e.value, f) for e, f in zip(entries, flags))
        return flags

    torch._dynamo.reset()
    f = torch.compile(lambda t: t * 2, backend="eager", options={"guard_filter_fn": recording})
    f(x)
    specs = [(v, keep) for t, v, keep in seen if t == "DTENSOR_SPEC_MATCH"]
    assert specs and all(keep for _, keep in specs), specs
    # and the owned parameter's spec object is recognized, by identity only
    from graphcomp.compiler.guard_filter import _SPECS, _owned

    assert _owned(_SPECS, owned._spec) and not _owned(_SPECS, x._spec)
