"""Compile once across ranks, and the compile cache across runs (Config.compile_once,
Config.cache_dir; graphcomp/compiler/artifacts.py), on 2 gloo ranks with Inductor.

Every run gives each rank an FX-graph cache of its own, empty (as on a machine of its
own): what a rank does not compile itself must come from rank 0 through the store, or
from the cache directory. Inductor's C++ kernels stay in the shared cache (keyed by
their source), so runs after the first skip g++."""

import os
import warnings

import pytest
import torch


def _train(rank, world, tmp, tag, options, corrupt=None):
    import graphcomp
    from torch._inductor import codecache
    from graphcomp.models import Llama, synthetic_batch

    fx_dir = os.path.join(tmp, f"fxgraph-{tag}-rank{rank}")
    os.makedirs(fx_dir, exist_ok=True)
    saved = codecache.FxGraphCache._get_tmp_dir
    codecache.FxGraphCache._get_tmp_dir = staticmethod(lambda: fx_dir)
    from graphcomp import env

    saved_user_dir = env._INDUCTOR_CACHE_DIR_AT_IMPORT
    # Inductor's C++ kernels stay in this pool's shared cache (tests/cpu/unit/test_artifacts.py
    # checks that cache_dir moves it): runs after the first skip g++
    env._INDUCTOR_CACHE_DIR_AT_IMPORT = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or "unchanged"
    try:
        torch._dynamo.reset()
        graphcomp.reset()
        torch.manual_seed(0)
        m = Llama("tiny")
        graphcomp.shard(m)
        cm = torch.compile(m, backend="graphcomp", options={"codegen": "inductor", **options})
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        losses = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(2):
                tok, tgt = synthetic_batch(m.cfg, 2, 16, seed=step + 10 * rank)
                loss = cm(tok, tgt)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
        records = {st: f["stages"][st].get("artifacts") for f in graphcomp.frame_summaries()
                   for st in ("fwd", "bwd") if st in f["stages"]}
        params = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in m.named_parameters()}
        return {"losses": losses, "records": records, "params": params,
                "warnings": [str(w.message) for w in caught if "graphcomp" in str(w.message)]}
    finally:
        codecache.FxGraphCache._get_tmp_dir = saved
        env._INDUCTOR_CACHE_DIR_AT_IMPORT = saved_user_dir


@pytest.fixture(scope="module")
def ranks2(shared_ranks2):
    return shared_ranks2.view(timeout=400)


def _same(a, b):
    assert a["losses"] == b["losses"]
    for n in a["params"]:
        assert torch.equal(a["params"][n], b["params"][n]), n


def _sources(res):
    return [{st: r["source"] for st, r in out["records"].items()} for out in res]


def test_compile_once_and_the_cache_dir(ranks2, tmp_path):
    tmp, cache = str(tmp_path), str(tmp_path / "cache")
    every = ranks2.run(_train, tmp, "every", {"compile_once": False})
    assert _sources(every) == [{"fwd": "compiled", "bwd": "compiled"}] * 2

    # compile once: rank 1 compiles nothing itself (no FX-graph miss), bitwise the same training
    once = ranks2.run(_train, tmp, "once", {"cache_dir": cache})
    assert _sources(once) == [{"fwd": "compiled", "bwd": "compiled"}, {"fwd": "rank 0", "bwd": "rank 0"}]
    for st, r in once[1]["records"].items():
        assert r["fx_graph_cache_misses"] == 0 and r["fx_graph_cache_hits"] >= 1, (st, r)
    for a, b in zip(every, once):
        _same(a, b)
    entries = sorted(os.listdir(cache))
    assert len(entries) == 2 and all(e.endswith(".gcart") for e in entries), entries  # written by rank 0

    # a new job with the cache: every rank loads from the directory, no compile anywhere
    warm = ranks2.run(_train, tmp, "warm", {"cache_dir": cache})
    assert _sources(warm) == [{"fwd": "cache_dir", "bwd": "cache_dir"}] * 2
    assert all(r["fx_graph_cache_misses"] == 0 for out in warm for r in out["records"].values())
    for a, b in zip(every, warm):
        _same(a, b)
    # (a corrupt entry: tests/cpu/unit/test_artifacts.py)
