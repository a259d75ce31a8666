"""``graphcomp.shard(model, mesh=..., dp_dim="dp")`` over a model tensor
parallelism placed on ``mesh["tp"]`` (2-D: data parallel x tensor parallel).

Training parity: 4 gloo ranks as a 2x2 mesh and 2 ranks as tp=2 (dp=1), the
reference Llama (``graphcomp.models.tp_plan``: sequence parallel; loss parallel on
the 2x2 mesh) and transformers' Llama (``benchmarks.hf_models.tp_plan``), each with
every pass on and every pass off, 10 SGD steps against an unsharded eager reference
on the global batch (fp32: losses rtol 1e-5, parameters and step-1 gradients 1e-4).
SGD, as in test_sharded_training: its update is linear in the gradient, so the
parameter error stays at the gradient's rounding level. One layer per model keeps
the compiles short (the CPU suite's budget).

Also: the TP collectives are the same ops with passes on and off (the passes leave
them alone), state dict / DCP / clip_grad_norm_ on the 2-D mesh, one Inductor case,
and the ValueErrors for bad meshes and plans.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch


STEPS = 10
GB, SEQ = 4, 16  # global batch (sequences), sequence length (divisible by tp: sequence parallel)
LR = 0.5
LOSS_RTOL, PARAM_RTOL, GRAD_RTOL = 1e-5, 1e-4, 1e-4
PASSES = ("chunk_lm_loss", "fuse_allgather_downcast", "fuse_grad_upcast", "bucket_collectives", "schedule_free",
          "remat", "schedule_prefetch", "zero_copy_buckets", "partition_graph", "cudagraphs")


@pytest.fixture(scope="module")
def ranks2(shared_ranks2):
    return shared_ranks2.view(timeout=600)


@pytest.fixture(scope="module")
def ranks4(shared_ranks4):
    return shared_ranks4.view(timeout=600)


# ----------------------------------------------------------------- models
def _build(kind: str):
    """The unsharded fp32 model, identical on every rank and in the reference."""
    if kind == "llama":
        from graphcomp.models import Llama, get_config

        torch.manual_seed(0)
        return Llama(get_config("tiny-tp").with_(n_layers=1))
    from benchmarks.hf_models import build_model

    return build_model("llama", "tiny", seed=0, dropout=0.0, layers=1)


def _batch(kind: str, model, step: int) -> dict:
    if kind == "llama":
        from graphcomp.models import synthetic_batch

        tok, tgt = synthetic_batch(model.cfg, GB, SEQ, seed=step)
        return {"tokens": tok, "targets": tgt}
    from benchmarks.hf_models import make_batch

    return make_batch(model, GB, SEQ, seed=step)


def _loss(kind: str, model, batch: dict) -> torch.Tensor:
    if kind == "llama":
        return model(batch["tokens"], batch["targets"])
    return model(**batch).loss


def _reference(kind: str, steps: int = STEPS):
    model = _build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads1 = [], None
    for step in range(steps):
        loss = _loss(kind, model, _batch(kind, model, step))
        loss.backward()
        if step == 0:
            grads1 = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, grads1


# ----------------------------------------------------------------- ranks
def _mesh(world: int, dp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))


def _parallelize(kind: str, model, mesh, loss_parallel: bool) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    if kind == "llama":
        from graphcomp.models import tp_plan

        plan = tp_plan(model, sequence_parallel=True, loss_parallel=loss_parallel)
    else:
        from benchmarks.hf_models import tp_plan

        plan = tp_plan(model)
    parallelize_module(model, mesh["tp"], plan)


def full_grads(model) -> dict[str, torch.Tensor | None]:
    """Every sharded parameter's gradient as a full tensor of its logical shape (collective)."""
    from graphcomp.sharding.shard import _INFO_ATTR, _logical_dtensor

    out = {}
    for mod in model.modules():
        for name, info in (mod.__dict__.get(_INFO_ATTR) or {}).items():
            g = mod._parameters[name].grad
            out[info.fqn] = None if g is None else _logical_dtensor(g, info).full_tensor()
    return out


def _collective_kinds(frames) -> dict[str, collections.Counter]:
    """(kind, dtype) counts of the compiled fwd/bwd graphs' collectives, TP and graphcomp's apart."""
    out = {"tp": collections.Counter(), "dp": collections.Counter()}
    for f in frames:
        for stage in ("fwd", "bwd"):
            for c in f["stages"].get(stage, {}).get("collectives", []):
                out["tp" if c["foreign"] else "dp"][f"{stage}:{c['kind']}:{c['dtype']}"] += 1
    return out


def _train(rank: int, world: int, cfg: dict) -> dict:
    import contextlib

    import torch.distributed as dist
    from torch.distributed.tensor.parallel import loss_parallel

    import graphcomp
    from graphcomp.sharding.shard import full_state_dict
    from graphcomp.session import SESSION as STATE

    kind, dp, lp = cfg["kind"], cfg["dp"], cfg.get("loss_parallel", False)
    mesh = _mesh(world, dp)
    model = _build(kind)
    _parallelize(kind, model, mesh, lp)
    graphcomp.shard(model, mesh=mesh, dp_dim="dp")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    options = {"codegen": cfg.get("codegen", "eager"), "bucket_bytes": 12288,
               "passes": {p: cfg["passes"] for p in PASSES}}
    cm = torch.compile(model, backend="graphcomp", options=options)
    dpr = mesh["dp"].get_local_rank()
    losses, grads1 = [], None
    for step in range(cfg.get("steps", STEPS)):
        batch = {k: v[dpr::dp] for k, v in _batch(kind, model, step).items()}  # this dp rank's sequences
        with loss_parallel() if lp else contextlib.nullcontext():
            loss = _loss(kind, cm, batch)
            loss.backward()
        if step == 0:
            grads1 = full_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        loss = (loss.to_local() if hasattr(loss, "to_local") else loss).clone()
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        losses.append(float(loss) / dp)
    from graphcomp.sharding.shard import _INFO_ATTR

    infos = {id(i): i for m in model.modules() for i in (m.__dict__.get(_INFO_ATTR) or {}).values()}.values()
    padded_bytes = sum(math.prod(i.padded_shape) * 4 for i in infos if i.world_size > 1)
    return {"losses": losses, "params": full_state_dict(model), "grads1": grads1, "padded_bytes": padded_bytes,
            "counters": dict(graphcomp.counters), "collectives": _collective_kinds(STATE.frames.to_json())}


def _check(res: list[dict], ref, loss_rtol=LOSS_RTOL, param_rtol=PARAM_RTOL, grad_rtol=GRAD_RTOL) -> None:
    ref_losses, ref_params, ref_grads = ref
    for r in res:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=loss_rtol, atol=0)
        assert set(r["params"]) == set(ref_params)
        for k, v in ref_params.items():
            torch.testing.assert_close(r["params"][k], v, rtol=param_rtol, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
        assert set(r["grads1"]) == set(ref_grads)
        for k, g in ref_grads.items():
            atol = 1e-6 * g.abs().max().item()
            torch.testing.assert_close(r["grads1"][k], g, rtol=grad_rtol, atol=atol, msg=lambda m, k=k: f"grad {k}: {m}")


def _parity_on_and_off(pool, world: int, dp: int, kind: str, **extra) -> tuple[dict, dict]:
    ref = _reference(kind)
    on = pool.run(_train, {"kind": kind, "dp": dp, "passes": True, **extra})
    _check(on, ref)
    off = pool.run(_train, {"kind": kind, "dp": dp, "passes": False, **extra})
    _check(off, ref)
    # the passes leave the tensor-parallel collectives alone: the same ops, dtypes
    # and counts with every pass on as with every pass off
    assert on[0]["collectives"]["tp"] == off[0]["collectives"]["tp"] and on[0]["collectives"]["tp"]
    return on[0], off[0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "hf"])
def test_2x2_mesh_trains_like_the_unsharded_reference(ranks4, kind):
    on, off = _parity_on_and_off(ranks4, 4, 2, kind, loss_parallel=kind == "llama")
    # graphcomp's own collectives (over dp) are bucketed with the passes on, not off
    assert on["counters"]["collective_buckets"] > 0 and off["counters"].get("collective_buckets", 0) == 0
    assert on["counters"]["gathers_resharded"] > 0 and off["counters"].get("gathers_resharded", 0) == 0
    assert on["collectives"]["dp"] != off["collectives"]["dp"]  # (bucketed: fewer, larger)
    # bytes_gathered counts graphcomp's parameter gathers only (not TP's activation
    # gathers): passes off, each tp-local parameter once, padded; on, re-gathers too
    assert off["counters"]["bytes_gathered:float32"] == off["padded_bytes"] > 0
    assert on["counters"]["bytes_gathered:float32"] > off["padded_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "hf"])
def test_tp2_dp1_trains_like_the_unsharded_reference(ranks2, kind):
    on, off = _parity_on_and_off(ranks2, 2, 1, kind)
    for r in (on, off):  # dp=1: graphcomp issues no collective; every one in the graphs is TP's
        assert not r["collectives"]["dp"]
        assert not any(k.startswith("bytes_gathered") for k in r["counters"])
        assert r["counters"].get("gathers_resharded", 0) == 0 and r["counters"].get("collective_buckets", 0) == 0


@pytest.mark.slow
def test_tp2_inductor(ranks2):
    """Inductor codegen, every pass on: fp32 within Inductor's reassociation noise."""
    ref = _reference("llama")
    res = ranks2.run(_train, {"kind": "llama", "dp": 1, "passes": True, "codegen": "inductor"})
    _check(res, ref, loss_rtol=1e-4, param_rtol=1e-4, grad_rtol=1e-3)


# ----------------------------------------------------------------- state
def _state(rank: int, world: int, tmp: str) -> dict:
    """Uncompiled 2-D sharding on 2x2 (an odd tp-local row count: uneven dp chunks
    inside tp shards): state dict values, DCP round trip (same layout, and into a
    1-D sharded model: the offsets must be right), plain full tensors, clip norm."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import graphcomp
    from graphcomp.models import Llama, get_config, synthetic_batch
    from graphcomp.sharding.shard import full_state_dict

    cfg = get_config("tiny-tp").with_(n_layers=1, vocab_size=130, ffn_dim=78)  # 130/2 = 65, 78/2 = 39 rows per tp rank
    mesh = _mesh(world, 2)

    def build(seed, two_d=True):
        torch.manual_seed(seed)
        m = Llama(cfg)
        ref = Llama(cfg)
        ref.load_state_dict(m.state_dict())
        if two_d:
            _parallelize("llama", m, mesh, loss_parallel=False)
            graphcomp.shard(m, mesh=mesh, dp_dim="dp")
        else:
            graphcomp.shard(m)
        return m, ref

    model, ref = build(0)
    out = {"placements": {k: str(tuple(p.placements)) for k, p in model.named_parameters()}}
    sd, rsd = model.state_dict(), ref.state_dict()
    out["state_dict"] = {k: (tuple(v.shape) == tuple(rsd[k].shape), bool(torch.equal(v.full_tensor(), rsd[k])))
                         for k, v in sd.items() if k in rsd}
    dcp.save(sd, checkpoint_id=tmp)
    m2, _ = build(1)
    sd2 = m2.state_dict()
    dcp.load(sd2, checkpoint_id=tmp)
    m2.load_state_dict(sd2)
    m1d, _ = build(2, two_d=False)  # the same checkpoint into a 1-D sharding over all 4 ranks
    sd1 = m1d.state_dict()
    dcp.load(sd1, checkpoint_id=tmp)
    m1d.load_state_dict(sd1)
    m3, _ = build(3)
    m3.load_state_dict(rsd)  # plain full tensors
    f = full_state_dict(model)
    out["reloaded"] = {name: all(torch.equal(f[k], g[k]) for k in f)
                       for name, g in (("dcp", full_state_dict(m2)), ("dcp_into_1d", full_state_dict(m1d)),
                                       ("plain", full_state_dict(m3)))}
    tok, tgt = synthetic_batch(cfg, GB, SEQ, seed=0)
    dpr = mesh["dp"].get_local_rank()
    model(tok[dpr::2], tgt[dpr::2]).backward()
    ref(tok, tgt).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
    rnorm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.1)
    out["norm"] = (float(norm.full_tensor()), float(rnorm))
    g = full_grads(model)
    out["clipped_grad_err"] = max(float((g[k] - p.grad).abs().max()) for k, p in ref.named_parameters())
    dist.barrier()
    return out


@pytest.mark.slow
def test_state_dict_dcp_and_clip_on_the_2x2_mesh(ranks4, tmp_path):
    res = ranks4.run(_state, str(tmp_path / "ckpt"))
    for r in res:
        p = r["placements"]
        assert p["layers.0.attn.wq.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"  # colwise
        assert p["layers.0.attn.wo.weight"] == "(Shard(dim=0), Shard(dim=1))"  # rowwise
        assert p["layers.0.attn_norm.weight"] == "(Shard(dim=0), Replicate())"  # SequenceParallel
        assert all(shape_ok and equal for shape_ok, equal in r["state_dict"].values()), r["state_dict"]
        assert r["reloaded"] == {"dcp": True, "dcp_into_1d": True, "plain": True}
        n, rn = r["norm"]
        assert rn > 0.1 and n == pytest.approx(rn, rel=1e-5)  # global over dp and tp, and it clipped
        assert r["clipped_grad_err"] < 1e-6


# ----------------------------------------------------------------- bad input
# (pg1: a 1-rank gloo group in this process, meshes of size 1 on every dimension:
# tests/cpu/conftest.py)
def _tp_model(mesh_tp):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from graphcomp.models import TinyMLP

    m = TinyMLP(dim=4, hidden=6, out=4)
    parallelize_module(m, mesh_tp, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return m


def test_bad_meshes_and_plans_are_value_errors(pg1):
    from torch.distributed.device_mesh import init_device_mesh

    import graphcomp
    from graphcomp.models import TinyMLP
    from graphcomp.session import SESSION as STATE

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"no dimension 'dq'; its dimensions are \('dp', 'tp'\)"):
        graphcomp.shard(_tp_model(mesh["tp"]), mesh=mesh, dp_dim="dq")
    with pytest.raises(ValueError, match=r"a 2-D mesh needs dp_dim="):
        graphcomp.shard(_tp_model(mesh["tp"]), mesh=mesh)
    with pytest.raises(ValueError, match="either group= or mesh="):
        graphcomp.shard(TinyMLP(), group=mesh["dp"].get_group(), mesh=mesh, dp_dim="dp")
    with pytest.raises(ValueError, match="dp_dim='dp' names a dimension of mesh=, which is missing"):
        graphcomp.shard(TinyMLP(), dp_dim="dp")
    # a plan that leaves a parameter on a mesh that is not a dimension of this one
    other = init_device_mesh("cpu", (1,), mesh_dim_names=("model",))
    with pytest.raises(ValueError, match=r"'fc1.weight' is a DTensor on DeviceMesh\(dims=\('model',\).*not a dimension"):
        graphcomp.shard(_tp_model(other), mesh=mesh, dp_dim="dp")
    # ... or two parameters on two different dimensions of one mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    # (names no other mesh here has: DTensor reuses a structurally equal 1-rank mesh)
    mesh3 = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("data", "tensor", "context"))
    m3 = TinyMLP(dim=4, hidden=6, out=4)
    parallelize_module(m3.fc1, mesh3["tensor"], ColwiseParallel())
    parallelize_module(m3.fc2, mesh3["context"], RowwiseParallel())
    with pytest.raises(ValueError, match=r"leaves parameter 'fc2.weight' on a different mesh \(DeviceMesh\(dims=\('context',\)"):
        graphcomp.shard(m3, mesh=mesh3, dp_dim="data")
    # tensor parallelism applied on the dimension graphcomp shards over
    with pytest.raises(ValueError, match=r"'fc1.weight' is already sharded over the mesh dimension .*'dp'.*twice"):
        graphcomp.shard(_tp_model(mesh["dp"]), mesh=mesh, dp_dim="dp")
    # sharding twice over the same dimension
    model = graphcomp.shard(_tp_model(mesh["tp"]), mesh=mesh, dp_dim="dp")
    with pytest.raises(ValueError, match=r"already sharded over the mesh dimension 'dp'.*twice over the same"):
        graphcomp.shard(model, mesh=mesh, dp_dim="dp")
    # the dp group, marked "beside TP" (other groups are TP's). Entries of groups an
    # earlier test in this process sharded over stay until that group is destroyed:
    # only this mesh's dp group is checked
    assert STATE.shard_groups.get(mesh["dp"].get_group().group_name) is True, STATE.shard_groups


def test_shard_groups_are_forgotten_with_the_process_group():
    import torch.distributed as dist

    from graphcomp.sharding import mesh as mesh_sharding
    from graphcomp.session import SESSION as STATE

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh_sharding.register("7", True)
        mesh_sharding.register("7", False)  # a 1-D sharding over the same group: still beside TP
        assert mesh_sharding.shard_groups() == {"7": True}
    finally:
        dist.destroy_process_group()  # group names are reused by the next groups: forgotten
    assert not STATE.shard_groups


def _uneven(rank: int, world: int) -> str:
    import graphcomp
    from graphcomp.models import Llama, get_config

    mesh = _mesh(world, 1)
    m = Llama(get_config("tiny-tp").with_(n_layers=1, vocab_size=131))
    _parallelize("llama", m, mesh, loss_parallel=False)
    try:
        graphcomp.shard(m, mesh=mesh, dp_dim="dp")
    except ValueError as e:
        return str(e)
    return "no error"


def _hsdp(rank: int, world: int) -> str:
    """A mesh whose other dimension has 2 ranks and no TP parameter on it would
    train those ranks apart (HSDP's replicas): refused."""
    import graphcomp
    from graphcomp.models import TinyMLP

    mesh = _mesh(world, 1)  # ("dp"=1, "tp"=2)
    try:
        graphcomp.shard(TinyMLP(), mesh=mesh, dp_dim="dp")
    except ValueError as e:
        return str(e)
    return "no error"


def test_uneven_tp_shards_and_replica_dimensions_are_value_errors(ranks2):
    msgs = ranks2.run(_hsdp)
    assert all("has dimension(s) [('tp', 2)] besides 'dp' (sharded) and no tensor-parallel parameter" in m
               and "HSDP) is not supported" in m for m in msgs), msgs
    msgs = ranks2.run(_uneven)
    assert all("'tok_emb.weight' (shape (131, 32)) is sharded unevenly" in m and "dim 0 of size 131 over 2" in m
               for m in msgs), msgs


def test_one_dimensional_mesh_is_the_1d_path(pg1):
    """``mesh=`` a 1-D mesh of plain parameters: the 1-D layout on that mesh, no foreign groups."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import graphcomp
    from graphcomp.models import TinyMLP
    from graphcomp.session import SESSION as STATE

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    m = graphcomp.shard(TinyMLP(), mesh=mesh)
    p = m.fc1._parameters["weight"]
    assert p.device_mesh is mesh and tuple(p.placements) == (Shard(0),)
    assert STATE.shard_groups == {mesh.get_group().group_name: False}  # nothing is foreign


# ----------------------------------------------------------------- benchmark harness
def test_bench_tp_refuses_what_has_no_tp_plan_before_starting_ranks():
    from benchmarks import run

    with pytest.raises(SystemExit, match="--tp runs graphcomp's Llama workloads"):
        run.main(["--workload", "hf-llama", "--tp", "2"])
    with pytest.raises(SystemExit, match="--tp must be >= 1"):
        run.main(["--workload", "smoke-tp", "--tp", "0"])


def _train_through_graph_runtime(rank: int, world: int, cfg: dict) -> dict:
    """``_train`` with the graphs split and every capturable piece run through the
    CUDA-graph runtime on the CPU stand-in device (tests/cpu/_fakecuda.py)."""
    from _fakecuda import fake_cuda_runtime

    import graphcomp

    with fake_cuda_runtime():
        out = _train(rank, world, cfg)
    out["host_constants_folded"] = sum(
        p.get("counts", {}).get("host_constants_folded", 0) for f in graphcomp.frame_summaries()
        for st in f["stages"].values() for p in st.get("passes", []) if p["name"] == "partition_graph")
    return out


def test_tp2_through_the_cuda_graph_runtime(ranks2):
    """TP=2 with the graphs split and their pieces captured and replayed (stand-in
    device): the glue passes the pieces what tensor parallel's graphs hold besides
    inputs (the 2-GPU run raised NotImplementedError on a tensor constant in the
    glue), and training matches the unsharded reference as with the runtime off."""
    ref = _reference("llama")
    res = ranks2.run(_train_through_graph_runtime, {"kind": "llama", "dp": 1, "passes": True})
    _check(res, ref)
    for r in res:
        c = r["counters"]
        assert c.get("captures", 0) > 0 and c.get("replays", 0) > c.get("captures", 0), c
        assert c.get("cudagraph_fallbacks", 0) == 0 and c.get("capture_failures", 0) == 0, c
        assert c.get("pieces_eager", 0) == 0 and c.get("pieces_turned_eager", 0) == 0, c
        # the vocab-parallel embedding's lifted torch.tensor(0) (one per forward use):
        # folded into tensor constants, so no CPU op cuts an eager piece (2 H100s, 1c186b8)
        assert r["host_constants_folded"] >= 1, r["host_constants_folded"]
