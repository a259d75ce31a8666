"""HF model families on the GPU with CUDA graphs (tests/gpu/hf_zoo_worker.py via
hf_zoo_driver.py): fp32 parity against the unsharded eager reference and bf16
training that reaches a steady state (no fallback, no re-capture after warm-up),
on 1 GPU and, where there are 2, on 2. About 3 minutes on an H100 for the first 8
families of ``FAMILIES`` (jobs overlap: compiles are CPU-bound).

``GC_ZOO_FAMILIES`` (a comma list; unset or empty: every family) picks the families the
1- and 2-GPU runs train; the others' tests skip. tests/gpu/session.sh runs the zoo
in two halves (steps ``zoo``/``zoo2`` and ``zoob``/``zoo2b``, :data:`HALVES`), each
well inside a device call's 10 minutes."""

from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

pytest.importorskip("transformers")

from benchmarks.hf_models import FAMILIES  # noqa: E402
from hf_zoo_driver import run_job  # noqa: E402

LOSS, GRAD, PARAM = 1e-4, 1e-3, 1e-3  # issue 12's parity bar (fp32)
HALVES = (tuple(FAMILIES)[:8], tuple(FAMILIES)[8:])  # (session.sh's zoo / zoob steps)
SELECTED = tuple(f for f in (os.environ.get("GC_ZOO_FAMILIES") or ",".join(FAMILIES)).split(",") if f)
_unknown = sorted(set(SELECTED) - set(FAMILIES))
if _unknown:
    raise ValueError(f"GC_ZOO_FAMILIES: unknown families {_unknown}; valid: {sorted(FAMILIES)}")


def _run_jobs(name: str, families, nproc: int, workers: int, tmp_path_factory, extra_env: dict | None = None) -> dict:
    """Every (family, mode) job on ``nproc`` GPUs, ``workers`` at a time, by (family, mode)."""
    from concurrent.futures import ThreadPoolExecutor

    base = os.environ.get("GC_ZOO_OUT")  # keep the per-job JSON and logs (GPU sessions)
    out = os.path.join(base, name) if base else str(tmp_path_factory.mktemp(name))
    os.makedirs(out, exist_ok=True)
    jobs = [(f, m) for f in families for m in ("parity", "bf16")]
    with ThreadPoolExecutor(workers) as ex:
        res = list(ex.map(lambda j: run_job(j[0], j[1], out, nproc, 420, extra_env), jobs))
    return {(r["family"], r["mode"]): r for r in res}


def _result(r: dict, family: str) -> dict:
    d = r.get("result", {})
    assert d.get("ok"), f"{family}: {d.get('error')}\n{d.get('traceback', '')[-3000:]}\nlog: {r['log']}"
    return d


def _check_parity(d: dict) -> None:
    assert d["loss_max_rel"] <= LOSS and d["grad_max_rel"] <= GRAD and d["param_max_rel"] <= PARAM, d
    assert d["counters"].get("captures", 0) > 0 and d["counters"].get("capture_failures", 0) == 0, d["counters"]


def _check_steady_state(d: dict, family: str) -> None:
    assert d["finite"], d["losses"]
    a = d["after_warmup"]
    assert a["cudagraph_fallbacks"] == 0 and a["recaptures"] == 0 and a["hazard_recaptures"] == 0, (family, a, d["warnings"])
    assert a["captures"] == 0 and a["capture_failures"] == 0, (family, a)
    end = d["counters_end"]
    assert end.get("pieces_captured", 0) > 0 and end.get("replays", 0) > 0, end
    if family != "mixtral-eager":
        assert end.get("pieces_turned_eager", 0) == 0, (family, end, d["warnings"])


@pytest.fixture(scope="module", params=[1, 2], ids=["1gpu", "2gpu"])
def zoo_results(request, tmp_path_factory):
    nproc = request.param
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    return _run_jobs(f"zoo{nproc}", SELECTED, nproc, max(1, 8 // nproc), tmp_path_factory)


def _selected(family: str) -> None:
    if family not in SELECTED:
        pytest.skip(f"{family} is not in GC_ZOO_FAMILIES")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp32_parity_with_cuda_graphs(zoo_results, family):
    _selected(family)
    _check_parity(_result(zoo_results[(family, "parity")], family))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_training_reaches_cuda_graph_steady_state(zoo_results, family):
    _selected(family)
    _check_steady_state(_result(zoo_results[(family, "bf16")], family), family)


# shard(embedding="exchange") on 2 GPUs: Llama's embed_tokens exchanges tokens; GPT-2's
# wte is tied to lm_head and stays gathered, its position embedding wpe exchanges.
EXCHANGED = {"llama": ["model.embed_tokens"], "gpt2": ["transformer.wpe"]}


@pytest.fixture(scope="module")
def exchange_results(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    return _run_jobs("zoo2-exchange", EXCHANGED, 2, 4, tmp_path_factory, {"GC_ZOO_EMBEDDING": "exchange"})


@pytest.mark.parametrize("family", sorted(EXCHANGED))
def test_embedding_exchange_parity_2gpu(exchange_results, family):
    d = _result(exchange_results[(family, "parity")], family)
    assert d["exchanged"] == EXCHANGED[family], d["exchanged"]
    _check_parity(d)


@pytest.mark.parametrize("family", sorted(EXCHANGED))
def test_embedding_exchange_bf16_steady_state_2gpu(exchange_results, family):
    d = _result(exchange_results[(family, "bf16")], family)
    assert d["exchanged"] == EXCHANGED[family], d["exchanged"]
    _check_steady_state(d, family)


# Deep models at the defaults (2 GPUs, or 1): 20 blocks of the "small" size (d=1024:
# one gather bucket per block). On 2 GPUs each stage graph cuts into more than
# region_auto_min regions at the blocks' gathers, so compile_regions="auto" compiles
# them region by region inside captured pieces; on 1 GPU there are no per-block gathers
# to cut at, and "auto" compiles the graphs whole. Parity and the bf16 steady state as
# above, and the regions taken and reused (2 GPUs) or not taken (1).
DEEP = ("gpt2", "llama")


@pytest.fixture(scope="module")
def deep_results(tmp_path_factory):
    """(GPUs used, results): on 2 GPUs where there are 2, else 1."""
    nproc = min(2, torch.cuda.device_count())
    if nproc < 1:
        pytest.skip("needs a GPU")
    return nproc, _run_jobs(f"zoo{nproc}-deep", DEEP, nproc, 4, tmp_path_factory,
                            {"GC_ZOO_SIZE": "small", "GC_ZOO_LAYERS": "20"})


def _check_regions(counters: dict, nproc: int) -> None:
    if nproc == 1:  # no collective waits to cut at: the graphs compile whole
        assert counters.get("regions", 0) == 0 and counters.get("pieces_captured", 0) > 0, counters
        return
    assert counters.get("regions", 0) >= 2 * 16, counters  # forward and backward, each >= region_auto_min
    assert counters.get("regions_reused", 0) > counters.get("regions_compiled", 0), counters
    assert counters.get("regions_not_reusable", 0) == 0, counters


@pytest.mark.parametrize("family", DEEP)
def test_deep_model_parity_with_auto_regions(deep_results, family):
    nproc, res = deep_results
    d = _result(res[(family, "parity")], family)
    _check_parity(d)
    _check_regions(d["counters"], nproc)


@pytest.mark.parametrize("family", DEEP)
def test_deep_model_bf16_steady_state_with_auto_regions(deep_results, family):
    nproc, res = deep_results
    d = _result(res[(family, "bf16")], family)
    _check_steady_state(d, family)
    _check_regions(d["counters_end"], nproc)
