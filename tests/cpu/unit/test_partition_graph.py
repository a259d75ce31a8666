"""partition_graph: the capturability predicate (one test per reason), the split,
and a property test that the split module computes what the original does."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_map

from graphcomp.analysis import memory
from graphcomp.passes import regions
from graphcomp.config import Config
from graphcomp.compiler.pipeline import PassContext, PassRecord
from graphcomp.compiler.plan import Piece, SplitPlan, StageInputs
from graphcomp.runtime.static import classify_static_inputs, output_users

import graphcomp.passes.partition_graph as pg
from graphcomp.passes.cudagraphs import CudaGraphsRequired, cudagraphs as cudagraphs_pass

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


# ------------------------------------------------------------------ helpers
def cudaify(gm: fx.GraphModule, cpu_nodes=()) -> fx.GraphModule:
    """Re-stamp every node's fake value on device 'cuda' (no GPU needed), except
    the nodes named in ``cpu_nodes``."""
    for n in gm.graph.nodes:
        v = n.meta.get("val")

        def conv(t, n=n):
            if isinstance(t, torch.Tensor) and hasattr(t, "fake_mode"):
                dev = "cpu" if n.name in cpu_nodes else "cuda"
                with t.fake_mode:
                    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=dev)
            return t

        n.meta["val"] = tree_map(conv, v)
    return gm


def fake_trace(fn, *args, mode="symbolic"):
    return make_fx(fn, tracing_mode=mode)(*args)


def reasons_by_node(gm, **kw):
    _, _, reasons = pg.plan_pieces(gm, **kw)
    return {r.node: r for r in reasons}


def ctx_for(stage="fwd", **options):
    cfg = Config.from_options(options)
    ctx = PassContext(config=cfg, frame_id=0, stage=stage)
    return ctx


def run_partition(gm, stage="fwd", **options):
    ctx = ctx_for(stage, **options)
    ctx.record = PassRecord(name="partition_graph", stage=stage, enabled=True)
    out = pg.partition_graph(gm, ctx).gm
    return out, ctx


def _x():
    return torch.randn(8, 4)


# ------------------------------------------------------- one test per reason
def test_reason_cpu():
    gm = cudaify(fake_trace(lambda x: (x.sin() * 2).cos(), _x()), cpu_nodes={"mul"})
    r = reasons_by_node(gm)
    assert r["mul"].kind == "cpu"
    # the consumer of a CPU tensor also sees it (CPU input)
    assert r["cos"].kind in ("cpu", "device_copy")
    assert "sin" not in r


def test_reason_host_sync_item():
    def f(x):
        s = x.sum().item()
        return x * s

    gm = cudaify(fake_trace(f, _x()))
    r = reasons_by_node(gm)
    lsd = [n for n in gm.graph.nodes if n.target is aten._local_scalar_dense.default]
    assert lsd and r[lsd[0].name].kind == "host_sync"
    assert "_local_scalar_dense" in r[lsd[0].name].detail


def test_reason_data_dependent_nonzero():
    gm = cudaify(fake_trace(lambda x: x.nonzero().sum(), _x()))
    nz = next(n for n in gm.graph.nodes if n.target is aten.nonzero.default)
    assert reasons_by_node(gm)[nz.name].kind == "data_dependent"


def test_integer_index_is_capturable_boolean_mask_is_not():
    """aten.index.Tensor is tagged dynamic_output_shape because a boolean mask makes
    the shape data-dependent; with integer index tensors (transformers' causal-mask
    construction, MoE routing) the shape is static and the op is captured."""
    idx = torch.tensor([0, 2, 1])
    gm = cudaify(fake_trace(lambda x, i: x[i, None] * 2, _x(), idx))
    ix = [n for n in gm.graph.nodes if n.target is aten.index.Tensor]
    assert ix and ix[0].name not in reasons_by_node(gm)
    gm2 = cudaify(fake_trace(lambda x: x[x > 0].sum(), _x()))
    r = reasons_by_node(gm2)
    masked = [n for n in gm2.graph.nodes if n.target is aten.index.Tensor]
    cut = [n for n in gm2.graph.nodes if n.name in r and r[n.name].kind in ("data_dependent", "unbacked_shape")]
    assert masked and cut, (gm2.graph, r)


def test_known_host_sync_custom_op_is_cut():
    """transformers' fp32 grouped_mm fallback reads its offsets on the host inside a
    custom op (no tag says so): cut up front instead of failing at capture."""
    pytest.importorskip("transformers.integrations.moe")
    op = torch.ops.transformers.grouped_mm_fallback.default
    x, w, offs = torch.randn(6, 4), torch.randn(2, 4, 3), torch.tensor([2, 6], dtype=torch.int32)
    gm = cudaify(fake_trace(lambda x, w, o: op(x, w, o) * 2, x, w, offs, mode="fake"))
    node = next(n for n in gm.graph.nodes if n.target is op)
    r = reasons_by_node(gm)[node.name]
    assert r.kind == "host_sync" and "tolist" in r.detail


def test_reason_unbacked_shape():
    def f(x):
        n = x.sum().to(torch.int64).item()
        torch._check(n >= 0)
        torch._check(n <= 100)
        return x.new_zeros(n) + 1

    gm = cudaify(fake_trace(f, torch.ones(3, 3)))
    r = reasons_by_node(gm)
    z = [n for n in gm.graph.nodes if n.op == "call_function" and "zeros" in str(n.target) or "full" in str(n.target)]
    assert z, gm.graph
    assert r[z[0].name].kind == "unbacked_shape", r


def test_reason_device_copy():
    gm = cudaify(fake_trace(lambda x: x.sin().to(torch.float64).cos(), _x(), mode="fake"), cpu_nodes={"_to_copy"})
    r = reasons_by_node(gm)
    assert r["_to_copy"].kind == "device_copy"
    assert "cuda" in r["_to_copy"].detail and "cpu" in r["_to_copy"].detail


def test_reason_cudagraph_unsafe_tag():
    lib = torch.library.Library("gctest_pg", "FRAGMENT")  # noqa: TOR901
    lib.define("unsafe(Tensor x) -> Tensor", tags=(torch.Tag.cudagraph_unsafe,))
    lib.impl("unsafe", lambda x: x.clone(), "CompositeExplicitAutograd")
    lib._register_fake("unsafe", lambda x: torch.empty_like(x)) if hasattr(lib, "_register_fake") else \
        torch.library.register_fake("gctest_pg::unsafe", lambda x: torch.empty_like(x), lib=lib)
    gm = cudaify(fake_trace(lambda x: torch.ops.gctest_pg.unsafe(x.sin()).cos(), _x(), mode="fake"))
    r = reasons_by_node(gm)
    node = next(n for n in gm.graph.nodes if "unsafe" in str(n.target))
    assert r[node.name].kind == "cudagraph_unsafe"


def test_reason_user_split_op():
    gm = cudaify(fake_trace(lambda x: x.sin().cos().exp(), _x(), mode="fake"))
    for spelling in ("aten.cos", "aten::cos", "aten.cos.default", "cos"):
        r = reasons_by_node(gm, split_ops=[spelling])
        assert r["cos"].kind == "user_split_op" and spelling in r["cos"].detail
        assert set(r) == {"cos"}


def test_reason_rng_with_generator():
    g = fx.Graph()
    x = g.placeholder("x")
    gen = g.placeholder("gen")  # a user generator passed into the graph
    b = g.call_function(aten.bernoulli.p, (x, 0.5), {"generator": gen})
    b2 = g.call_function(aten.bernoulli.p, (x, 0.5))
    g.output((b, b2))
    gm = fx.GraphModule({}, g)
    with torch._subclasses.FakeTensorMode():
        v = torch.empty(4, device="cuda")
    for n in gm.graph.nodes:
        if n.op != "output" and n.name != "gen":
            n.meta["val"] = v
    r = reasons_by_node(gm)
    assert r[b.name].kind == "rng"
    assert b2.name not in r  # default-generator RNG is graph-safe (philox offsets advance per replay)


def test_reason_collective_pair_stays_together():
    def f(x):
        ag = c10d.all_gather_into_tensor(x, 2, "g0")
        s = x.sum().item()  # a host sync between the collective and its wait
        w = c10d.wait_tensor(ag)
        return w * s

    gm = cudaify(fake_trace(f, _x()))
    assign, rows, reasons = pg.plan_pieces(gm)
    r = {x.node: x for x in reasons}
    ag = next(n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default)
    w = next(n for n in gm.graph.nodes if n.target is c10d.wait_tensor.default)
    assert r[ag.name].kind == "collective_pair" and r[w.name].kind == "collective_pair"
    assert rows[assign[ag]]["mode"] == "eager" and rows[assign[w]]["mode"] == "eager"


def test_collective_pair_without_cut_is_captured_together():
    def f(x):
        w = c10d.wait_tensor(c10d.all_gather_into_tensor(x, 2, "g0"))
        return (w.sin() * 2).cos()

    gm = cudaify(fake_trace(f, _x(), mode="fake"))
    assign, rows, reasons = pg.plan_pieces(gm)
    assert reasons == [] and len(rows) == 1 and rows[0]["mode"] == "cudagraph"


def test_reason_too_small_joins_eager_neighbours():
    def f(x):
        a = x.sum().item()
        y = x * a  # a 1-node capturable run between two syncs
        b = y.sum().item()
        return y.sin().cos().exp().tanh() + b

    gm = cudaify(fake_trace(f, _x()))
    _, rows, reasons = pg.plan_pieces(gm, min_piece_nodes=3)
    assert "too_small" in {r.kind for r in reasons}
    assert rows[-1]["mode"] == "cudagraph"
    _, rows1, reasons1 = pg.plan_pieces(gm, min_piece_nodes=1)
    assert "too_small" not in {r.kind for r in reasons1}
    assert sum(r["mode"] == "cudagraph" for r in rows1) > sum(r["mode"] == "cudagraph" for r in rows)


# --------------------------------------------------------------- the pass
def test_no_split_without_cuda_tensors():
    gm = fake_trace(lambda x: x.sum().item() * x, _x())
    code = gm.code
    out, ctx = run_partition(gm)
    assert out is gm and out.code == code
    assert "no CUDA tensors" in ctx.record.reason
    assert "fwd" not in ctx.frame.splits


def test_no_split_when_cudagraphs_off():
    gm = cudaify(fake_trace(lambda x: x.sum().item() * x, _x()))
    out, ctx = run_partition(gm, cudagraphs="off")
    assert out is gm and "cudagraphs off" in ctx.record.reason
    out, ctx = run_partition(gm, passes={"cudagraphs": False})
    assert out is gm and "cudagraphs off" in ctx.record.reason


def test_split_plan_rows_and_reasons_recorded():
    def f(x):
        y = x.sin().cos().exp()
        s = y.sum().item()
        return (y * s).tanh().sigmoid().neg()

    gm = cudaify(fake_trace(f, _x()))
    out, ctx = run_partition(gm)
    rows = ctx.frame.splits["fwd"].rows()
    assert [r["mode"] for r in rows] == ["cudagraph", "eager", "cudagraph"]
    assert "host_sync" in rows[1]["reason"]
    assert all(set(r) >= {"piece", "mode", "nodes", "reason"} for r in rows)
    reasons = ctx.frame.splits["fwd"].reasons
    assert all(isinstance(r, pg.SplitReason) for r in reasons)
    with pytest.raises(Exception):
        reasons[0].kind = "x"  # frozen
    subs = [n.target for n in out.graph.nodes if n.op == "call_module"]
    assert subs == ["piece_0", "piece_1", "piece_2"]
    assert [p.name for p in ctx.frame.splits["fwd"].pieces] == subs and ctx.frame.splits["fwd"].split is out
    assert ctx.record.counts["cut:host_sync"] >= 1


def test_cudagraphs_require_raises_naming_reason():
    gm = cudaify(fake_trace(lambda x: x.sin().cos().exp() * x.sum().item(), _x()))
    out, ctx = run_partition(gm, cudagraphs="require")
    ctx.record = PassRecord(name="cudagraphs", stage="fwd", enabled=True)
    with pytest.raises(CudaGraphsRequired, match="host_sync"):
        cudagraphs_pass(out, ctx)


def test_config_conflicts_and_validation():
    with pytest.raises(ValueError, match="Config.cudagraphs: 'require' conflicts"):
        Config.from_options({"cudagraphs": "require", "passes": {"cudagraphs": False}})
    with pytest.raises(ValueError, match="Config.cudagraphs: invalid value"):
        Config.from_options({"cudagraphs": "on"})
    with pytest.raises(ValueError, match="Config.min_piece_nodes: must be >= 1"):
        Config.from_options({"min_piece_nodes": 0})
    with pytest.raises(ValueError, match="Config.max_captures: must be >= 1"):
        Config.from_options({"max_captures": 0})
    with pytest.raises(ValueError, match=r"Config.split_ops\[0\]: expected str"):
        Config.from_options({"split_ops": [3]})
    with pytest.raises(ValueError, match="Config.split_ops: invalid op name"):
        Config.from_options({"split_ops": [""]})
    with pytest.raises(ValueError, match="Config.split_ops: expected a list"):
        Config.from_options({"split_ops": "aten.nonzero"})
    for k, v in (("check_static_inputs", "sometimes"), ("on_address_change", "ignore")):
        with pytest.raises(ValueError, match=rf"Config.{k}: invalid value"):
            Config.from_options({k: v})


# ------------------------------------------------- static-input classification
def test_static_input_classification():
    def f(w, b, x):
        h = (x @ w).relu().sin()  # piece 0 (captured)
        s = h.sum().item()  # piece 1 (eager)
        y = (h * s + b).cos().exp()  # piece 2 (captured): h from piece 0, b param, s scalar
        return y.sum(), y

    args = (torch.randn(4, 4), torch.randn(4), torch.randn(2, 4))
    gm = cudaify(fake_trace(f, *args))
    out, ctx = run_partition(gm, min_piece_nodes=1)
    captured = {p.name for p in ctx.frame.splits["fwd"].captured()}
    kinds = classify_static_inputs(out, [0, 1], captured, "fwd")
    calls = {n.target: n for n in out.graph.nodes if n.op == "call_module"}
    for name, ks in kinds.items():
        for a, k in zip(calls[name].args, ks):
            if a.name in ("w_1", "b_1", "w", "b"):
                assert k == "param", (name, a, k)
            elif a.name in ("x_1", "x"):
                assert k == "copy"
    last = sorted(captured)[-1]
    assert "piece_output" in kinds[last] or "copy" in kinds[last]
    # the piece-1 (eager) result feeding piece 2 is copied; piece 0's output h is static
    src = {a.name: k for a, k in zip(calls[last].args, kinds[last])}
    assert any(k == "piece_output" for k in src.values()), src
    assert any(k in ("copy", "scalar") for n_, k in src.items() if n_ not in ("w_1", "b_1")), src
    # bwd: static indices are saved tensors
    kb = classify_static_inputs(out, [0, 1], captured, "bwd")
    assert "saved" in kb[sorted(captured)[0]]
    # clone policy: user-visible outputs of captured pieces
    clones = output_users(out, [0])
    assert clones and all(isinstance(v, set) for v in clones.values())
    # backward: every output that leaves the stage (a gradient) is planned as visible.
    # The runner hands those out of the pool uncopied only under the pool ledger, which
    # sees a kept gradient (zero_grad(set_to_none=False)) before the next forward replay
    # could overwrite it (that replay's scratch memory may overlap the backward's
    # outputs) and switches the backward to copying. A gradient missing from this set
    # would not be switched: a kept one would re-capture the pieces every step.
    from graphcomp.passes.cudagraphs import plan_runners

    split = ctx.frame.splits["fwd"]
    bwd_plan = SplitPlan("bwd", out, split.source, split.pieces, split.reasons)  # the same graph, as a backward
    plan_runners(bwd_plan, [0, 1], None)
    plan = {p.name: p for p in bwd_plan.captured()}
    leaving = output_users(out, None)
    assert plan and any(leaving.get(n) for n in plan)
    for name, p in plan.items():
        assert set(p.clone_outputs) == leaving.get(name, set()), (name, p)


# ------------------------------------------------- property: split == original
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

UNARY = [torch.sin, torch.cos, torch.tanh, torch.neg, lambda t: t * 2, lambda t: t + 1, torch.relu]


def _random_program(ops):
    def f(x, y):
        vals = [x, y]
        for kind, i, j, k in ops:
            a, b = vals[i % len(vals)], vals[j % len(vals)]
            if kind == 0:
                vals.append(UNARY[k % len(UNARY)](a))
            elif kind == 1:
                vals.append(a + b)
            elif kind == 2:
                vals.append(a * b)
            elif kind == 3:
                p, q = torch.split(a, 2, dim=0)  # multi-output node + getitems
                vals.append(torch.cat([q, p]))
            else:
                m, v = torch.var_mean(a, dim=0, keepdim=True)
                vals.append(a - m + v)
        return tuple(vals[-3:]) + (vals[2 % len(vals)],)

    return f


op_st = st.tuples(st.integers(0, 4), st.integers(0, 30), st.integers(0, 30), st.integers(0, 30))


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(op_st, min_size=1, max_size=14), mask=st.integers(0, 2**16 - 1), min_nodes=st.integers(1, 3))
def test_split_module_equals_original(ops, mask, min_nodes):
    f = _random_program(ops)
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    gm = make_fx(f)(x, y)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    bad = {n.name for i, n in enumerate(nodes) if (mask >> (i % 16)) & 1}

    def pred(n):
        return pg.SplitReason(n.name, "user_split_op", "random") if n.name in bad else None

    assign, rows, _ = pg.plan_pieces(gm, min_piece_nodes=min_nodes, predicate=pred)
    split = pg.split_graph(gm, assign)
    # modes alternate; every node assigned
    assert all(a["mode"] != b["mode"] for a, b in zip(rows, rows[1:]))
    assert set(assign) == {n for n in gm.graph.nodes if n.op not in ("placeholder", "output")}
    # the collective/order invariant: pieces appear in order
    order = [n.target for n in split.graph.nodes if n.op == "call_module"]
    assert order == sorted(order, key=lambda s: int(s.split("_")[1]))
    ref = gm(x, y)
    got = split(x, y)
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    # and through the codegen (eager pieces, output normalisation, glue)
    from graphcomp.compiler.codegen import compile_pieces

    plan = SplitPlan("fwd", split, gm, [Piece(r["piece"], r["mode"], r["nodes"], r["reason"]) for r in rows], [])
    run = compile_pieces(plan, StageInputs(), Config(), lambda p, ins, s: (lambda a: p(*a)))
    got2 = run([x, y])
    for a, b in zip(ref, got2):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_getitem_stays_with_its_source():
    def f(x):
        a, b = torch.split(x, 4)
        return a.sin(), b.cos()

    gm = make_fx(f)(_x())
    split_node = next(n for n in gm.graph.nodes if "split" in str(n.target))

    def pred(n):
        return pg.SplitReason(n.name, "user_split_op", "t") if n is split_node else None

    assign, rows, reasons = pg.plan_pieces(gm, predicate=pred)
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem:
            assert assign[n] == assign[split_node]


def test_tensor_constant_reaches_the_pieces_through_the_glue():
    """A tensor constant (``get_attr``, e.g. one AOTAutograd lifted from DTensor
    code in a tensor-parallel graph) is hoisted by split_module into the glue graph
    and passed to the piece that reads it: the glue runs it (this raised
    NotImplementedError on 2 GPUs with TP) and the runner plan treats it as a
    static input (its address never changes), not as an input to copy."""
    from graphcomp.compiler.codegen import compile_pieces
    from graphcomp.runtime.static import classify_static_inputs

    def f(x):
        c = torch.tensor([2.0, 3.0, 4.0])  # traced as a lifted constant (get_attr)
        return ((x * c).sin() + c,)

    gm = make_fx(f)(torch.randn(3))
    assert any(n.op == "get_attr" for n in gm.graph.nodes)
    sin = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.sin.default)

    def pred(n):
        return pg.SplitReason(n.name, "user_split_op", "t") if n is sin else None

    assign, rows, _ = pg.plan_pieces(gm, min_piece_nodes=1, predicate=pred)
    split = pg.split_graph(gm, assign)
    assert [n.op for n in split.graph.nodes].count("get_attr") == 1  # hoisted into the glue
    x0 = torch.tensor([1.0, -1.0, 0.5])
    ref = gm(x0)
    plan = SplitPlan("fwd", split, gm, [Piece(r["piece"], r["mode"], r["nodes"], r["reason"]) for r in rows], [])
    run = compile_pieces(plan, StageInputs(), Config(), lambda p, ins, s: (lambda a: p(*a)))
    got = run([x0.clone()])
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    captured = {str(n.target) for n in split.graph.nodes if n.op == "call_module"}
    kinds = classify_static_inputs(split, [], captured, "fwd")
    consts = [k for name, ks in kinds.items() for k, arg in zip(ks, next(
        n for n in split.graph.nodes if n.op == "call_module" and str(n.target) == name).args)
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr"]
    assert consts and all(k == "param" for k in consts), kinds


def test_host_scalar_constant_is_folded_and_its_consumer_captured():
    """DTensor's vocab-parallel embedding writes a lifted ``torch.tensor(0)`` under
    its mask: ``lift_fresh_copy`` of a 0-dim CPU constant, read by ``index_put`` on
    the device. Both were cut into an eager piece on every call (TP=2 on 2 H100s,
    2026-11-25). The constant is folded into a ``get_attr`` and the consumer stays
    in the captured piece; a CPU scalar that is not a constant (a graph input) still
    cuts, and the split computes what the graph did."""

    def f(x, m):
        y = x.clone()
        y[m] = torch.tensor(0.0)  # lift_fresh_copy(_tensor_constant) -> index_put
        return (y.sin(), y.cos() + torch.full([], 2.0))

    x = torch.randn(8, 4)
    m = x > 0
    gm = cudaify(fake_trace(f, x, m, mode="fake"),
                 cpu_nodes={"_tensor_constant0", "lift_fresh_copy", "full"})
    ops = [pg._short_name(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "lift_fresh_copy" in ops and "full" in ops, ops
    put = next(n.name for n in gm.graph.nodes if n.name.startswith("index_put"))
    before = reasons_by_node(gm)
    assert before["lift_fresh_copy"].kind == "cpu" and before[put].kind == "cpu" and before["add"].kind == "cpu"
    folded = pg.fold_host_constants(gm)
    assert sorted(folded) == ["full", "lift_fresh_copy"], folded
    assert [n.op for n in gm.graph.nodes].count("get_attr") == 2  # the original constant is gone
    assert reasons_by_node(gm) == {}  # one captured piece
    for n in gm.graph.nodes:  # the folded values, not fakes
        if n.op == "get_attr":
            v = getattr(gm, n.target)
            assert v.device.type == "cpu" and v.dim() == 0 and not hasattr(v, "fake_mode")
    assert sorted(float(getattr(gm, n.target)) for n in gm.graph.nodes if n.op == "get_attr") == [0.0, 2.0]
    # the split (real values on CPU) computes what f does
    assign, rows, _ = pg.plan_pieces(gm, predicate=lambda n: pg.SplitReason(n.name, "user_split_op", "t")
                                     if n.name == "sin" else None)
    split = pg.split_graph(gm, assign)
    for got, want in zip(split(x, m), f(x, m)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _masked_zero_on_meta():
    """``y[m] = torch.tensor(0.0)`` (a lifted host constant written under a mask, as
    DTensor's vocab-parallel embedding does) traced with fake tensors on the meta
    device, which stands in for CUDA here; returns (x, graph)."""

    def f(x, m):
        y = x.clone()
        y[m] = torch.tensor(0.0)
        return (y.sin(),)

    x = torch.randn(8, 4, device="meta")
    return x, fake_trace(f, x, torch.ones(8, 4, dtype=torch.bool, device="meta"), mode="fake")


def test_host_constant_moves_to_its_users_device():
    """A folded constant whose users all compute on one device is stored there
    (Inductor would otherwise copy it in with a pageable host-to-device copy at
    run time, which fails under capture: TP + Inductor on 2 H200s, 2026-11-26).
    The ``meta`` device stands in for CUDA on this machine."""

    x, gm = _masked_zero_on_meta()
    fake_mode = next(n.meta["val"].fake_mode for n in gm.graph.nodes if hasattr(n.meta.get("val"), "fake_mode"))
    with fake_mode:  # as inside a compile (a real tensor's move must step out of it)
        assert pg.fold_host_constants(gm) == ["lift_fresh_copy"]
    consts = [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert len(consts) == 1, consts
    c = consts[0]
    assert getattr(gm, c.target).device.type == "meta" and c.meta["val"].device.type == "meta"
    assert all(u.meta["val"].device.type == "meta" for u in c.users)
    (out,) = gm(x, torch.ones(8, 4, dtype=torch.bool, device="meta"))
    assert out.device.type == "meta" and out.shape == (8, 4)


def test_host_constant_for_eager_code_stays_on_the_host():
    """For eager FX code the folded constant stays on the host even where its
    users compute on a device: index_put with a boolean mask reads a device value
    with .item() (a sync, not capturable: TP with eager codegen on 2 H200s,
    2026-11-26), a host one as a launch scalar."""

    x, gm = _masked_zero_on_meta()
    assert pg.fold_host_constants(gm, to_users_device=False) == ["lift_fresh_copy"]
    consts = [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert len(consts) == 1 and getattr(gm, consts[0].target).device.type == "cpu", gm.code
    assert reasons_by_node(gm) == {}  # read as a launch scalar: no cut


def test_partition_folds_for_the_codegen_that_runs_the_graph(monkeypatch):
    """partition_graph asks for the device move only when Inductor compiles the pieces."""
    seen = []
    real = pg.fold_host_constants
    monkeypatch.setattr(pg, "fold_host_constants", lambda gm, to_users_device=True: seen.append(to_users_device) or real(gm, to_users_device))
    for codegen in ("eager", "inductor"):
        gm = cudaify(fake_trace(lambda x: (x.sin(),), torch.randn(4), mode="fake"), cpu_nodes=set())
        run_partition(gm, codegen=codegen, cudagraphs="auto")
    assert seen == [False, True], seen


def test_host_constant_used_on_the_host_stays_there():
    """A folded constant read by a device copy (its user computes on the host side
    of the copy) stays a host constant: the copy moves it, as the model wrote."""

    def f(x):
        c = torch.tensor(2.0) + 1
        return (x * c.to(x.device),)

    gm = fake_trace(f, torch.randn(4, device="meta"), mode="fake")
    folded = pg.fold_host_constants(gm)
    assert "add" in folded, (folded, gm.code)
    consts = [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert consts and all(getattr(gm, n.target).device.type == "cpu" for n in consts), gm.code
    assert any(pg._short_name(u.target) == "_to_copy" for n in consts for u in n.users), gm.code


def test_cpu_scalar_graph_input_still_cuts():
    def f(x, s):
        return ((x * s).sin(),)

    gm = cudaify(fake_trace(f, torch.randn(4), torch.tensor(3.0), mode="fake"), cpu_nodes={"s_1"})
    assert pg.fold_host_constants(gm) == []
    r = reasons_by_node(gm)
    assert r["mul"].kind == "cpu", r


# ------------------------------------------------------------------ compile regions
def _blocks_graph(n_blocks=3, inflight_across=False, mode="fake", layers=None):
    """A forward of ``n_blocks`` identical blocks, each gathering its weight (issue,
    wait, 3 matmul+relu); with ``inflight_across`` block k's gather is issued before
    block k-1's compute (prefetch), so no point between blocks is free of it.
    ``mode``: make_fx's tracing mode ("symbolic": symbolic shapes). ``layers``: the
    matmul+relu count of each block instead (blocks that differ; ``n_blocks`` is then
    its length)."""
    layers = [3] * n_blocks if layers is None else list(layers)

    def f(x, *shards):
        if not inflight_across:
            for s, n in zip(shards, layers):
                w = c10d.wait_tensor(c10d.all_gather_into_tensor(s, 2, "g")).view(8, 8)
                for _ in range(n):
                    x = torch.relu(x @ w)
            return x
        pending = c10d.all_gather_into_tensor(shards[0], 2, "g")
        for k in range(len(shards)):
            w = c10d.wait_tensor(pending).view(8, 8)
            if k + 1 < len(shards):
                pending = c10d.all_gather_into_tensor(shards[k + 1], 2, "g")
            for _ in range(layers[k]):
                x = torch.relu(x @ w)
        return x

    return fake_trace(f, torch.randn(4, 8), *[torch.randn(32) for _ in layers], mode=mode)


def _nodes(gm):
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def _gathers_in_flight(nodes, p):
    """Gathers issued before position ``p`` and not yet waited there."""
    issued = sum(1 for n in nodes[:p] if n.target is c10d.all_gather_into_tensor.default)
    return issued - sum(1 for n in nodes[:p] if n.target is c10d.wait_tensor.default)


def test_region_cuts_follow_waits_and_skip_inflight_spans():
    gm = _blocks_graph(3)
    nodes = _nodes(gm)
    cuts = regions.region_cuts(nodes, min_nodes=4)
    # one cut after each block's wait except the first (whose region would be too small): before blocks 2 and 3
    assert len(cuts) == 2
    for p in cuts:
        assert nodes[p - 1].target is not c10d.all_gather_into_tensor.default
        assert _gathers_in_flight(nodes, p) == 0, "a collective is in flight across a region cut"
    # with prefetch, the cut moves past the next issue's wait: still nothing in flight across a cut
    gm2 = _blocks_graph(3, inflight_across=True)
    nodes2 = _nodes(gm2)
    for p in regions.region_cuts(nodes2, min_nodes=4):
        assert _gathers_in_flight(nodes2, p) == 0
    # a last region below min_nodes joins the one before; min_nodes above the graph: no cut
    assert regions.region_cuts(nodes, min_nodes=len(nodes)) == []


def test_plan_pieces_regions_and_identical_region_keys():
    from graphcomp.compiler.codegen import piece_example_inputs, region_key

    gm = _blocks_graph(4)
    assign, rows, _ = pg.plan_pieces(gm, region_min_nodes=4, capture=False)
    assert [r["mode"] for r in rows] == ["eager"] * len(rows) and len(rows) == 4
    split = pg.split_graph(gm, assign)
    keys = []
    for r in rows:
        sub = getattr(split, f"piece_{r['piece']}")
        keys.append(region_key(sub, piece_example_inputs(sub), []))
    # the middle blocks are the same region (renamed nodes, same shapes): one key
    assert keys[1] == keys[2] and None not in keys
    # other static inputs give another key
    assert region_key(getattr(split, "piece_1"), piece_example_inputs(getattr(split, "piece_1")), [0]) != keys[1]


def test_region_cuts_move_to_where_the_fewest_bytes_cross():
    """Each block computes ``h = relu(x @ a)``, then waits for its prefetched weight
    (the next block's gather is issued right after), so the anchor, the first point
    after a wait with nothing in flight, sits mid-block where ``x`` and ``h`` are live.
    With ``in_flight_ok`` (regions inside a captured piece) the cuts move to where only
    ``x`` crosses, right after the block's first matmul (an extern kernel: its output
    is in memory anyway, and in-flight gathers cost nothing either); without it a cut
    never leaves a collective in flight."""
    from tests.cpu._graphs import trace

    def f(x, a, *shards):
        pending = c10d.all_gather_into_tensor(shards[0], 2, "g")
        for k in range(len(shards)):
            h = torch.relu(x @ a)
            w = c10d.wait_tensor(pending).view(8, 8)
            if k + 1 < len(shards):
                pending = c10d.all_gather_into_tensor(shards[k + 1], 2, "g")
            x = torch.relu(h @ w) + x
        return x

    gm = trace(f, torch.randn(4, 8), torch.randn(8, 8), *[torch.randn(32) for _ in range(4)])
    nodes = _nodes(gm)
    anchors = regions._anchor_cuts(nodes, 4)[0]
    cost = regions.crossing_bytes(nodes)
    moved = regions.region_cuts(nodes, min_nodes=4, in_flight_ok=True)
    assert len(moved) == len(anchors) == 4
    # the middle blocks: right after x @ a, the next block's gather in flight
    for p in moved[1:]:
        assert anchors[0] < p and p not in anchors
        mm = nodes[p - 1]
        assert mm.target is torch.ops.aten.mm.default and mm.args[1].op == "placeholder", mm
        assert nodes[p].target is torch.ops.aten.relu.default
        assert _gathers_in_flight(nodes, p) == 1
        assert cost[p] == 4 * 8 * 4  # x; the matmul's output and the gather are extern kernels' buffers
    assert all(cost[a] == 2 * 4 * 8 * 4 for a in anchors[1:])  # x and h
    # without in_flight_ok nothing is in flight across a cut: the middle anchors stay
    # (every point of a block's first half has its gather in flight)
    kept = regions.region_cuts(nodes, min_nodes=4)
    assert kept[1:3] == anchors[1:3]
    for p in kept:
        assert _gathers_in_flight(nodes, p) == 0
    # captured pieces: cut in flight, and counted
    _, rows, _ = pg.plan_pieces(gm, region_min_nodes=4, predicate=lambda n: None, capture=True)
    assert rows[0]["regions"] == 5 and rows[0]["region_cuts_in_flight"] >= 3


def test_crossing_bytes_counts_only_values_inductor_kernels_make():
    """A matmul's output, a collective's and a custom op's are extern kernels' buffers
    (in memory whatever the cut); a pointwise value and a view of one are not."""
    from tests.cpu._graphs import trace

    def f(x, w, s):
        y = x @ w            # extern
        z = torch.relu(y)    # Inductor
        v = z.view(2, 16)    # a view of an Inductor value
        g = c10d.wait_tensor(c10d.all_gather_into_tensor(s, 2, "g"))
        return (v.sum() + g.sum() + y.sum(),)

    gm = trace(f, torch.randn(4, 8), torch.randn(8, 8), torch.randn(4))
    by = {n.name: n for n in _nodes(gm)}
    assert memory.makes_own_buffer(by["mm"]) and memory.makes_own_buffer(by["wait_tensor"])
    assert not memory.makes_own_buffer(by["relu"]) and not memory.makes_own_buffer(by["view"])
    # before the first sum, the matmul's output (read by the last sum), the gathered
    # values and relu's view all cross; only the (4, 8) fp32 view counts
    nodes = _nodes(gm)
    cost = regions.crossing_bytes(nodes)
    p = nodes.index(by["sum_1"])
    assert cost[p] == 4 * 8 * 4 and cost[nodes.index(by["relu"])] == 0


def _const_graph(value, numel=1):
    """x * c with ``c`` a module constant (get_attr), as partition_graph's folded host constants."""
    g = fx.Graph()
    x = g.placeholder("x")
    c = g.get_attr("_graphcomp_host_const_0")
    g.output(g.call_function(aten.mul.Tensor, (x, c)))
    root = torch.nn.Module()
    root.register_buffer("_graphcomp_host_const_0", torch.full((numel,) if numel > 1 else (), float(value)))
    gm = fx.GraphModule(root, g)
    return gm, [torch.randn(4) if numel == 1 else torch.randn(numel)]


def test_region_key_compares_constants_by_value_and_refuses_symbolic_inputs():
    from graphcomp.compiler.codegen import REGION_CONST_NUMEL, region_key

    a, ex = _const_graph(3.0)
    b, _ = _const_graph(3.0)
    b.register_buffer("_graphcomp_host_const_0", torch.tensor(3.0))
    c, _ = _const_graph(4.0)
    assert region_key(a, ex, []) is not None
    assert region_key(a, ex, []) == region_key(b, ex, [])  # same code, same constant value
    assert region_key(a, ex, []) != region_key(c, ex, [])  # another value: compiled again
    big, ex_big = _const_graph(1.0, numel=REGION_CONST_NUMEL + 1)
    assert region_key(big, ex_big, []) is None  # large constants are not compared
    sym = fake_trace(lambda x: x.sin(), torch.randn(4), mode="symbolic")
    ex = [n.meta["val"] for n in sym.graph.nodes if n.op == "placeholder"]
    assert region_key(sym, ex, []) is None


def test_region_key_takes_generator_inputs_by_device():
    """On CUDA, AOTAutograd passes each checkpointed attention's RNG state in as a
    ``torch.Generator`` (``fwd_rng_state_<i>``, one per block): the twin blocks'
    regions take different generators and still share one key (W3 on 2 H200s, 41bfeff:
    every region "not reusable: input 15 is a Generator" before this)."""
    from graphcomp.compiler.codegen import NotReusable, region_key, region_key_parts

    g = fx.Graph()
    x, gen = g.placeholder("x"), g.placeholder("fwd_rng_state_0")
    g.output(g.call_function(aten.bernoulli.default, (x,), {"generator": gen}))
    gm = fx.GraphModule(torch.nn.Module(), g)
    x0 = torch.rand(4)
    k1 = region_key(gm, [x0, torch.Generator().manual_seed(1)], [])
    k2 = region_key(gm, [x0, torch.Generator().manual_seed(2)], [])
    assert k1 is not None and k1 == k2
    with pytest.raises(NotReusable, match="input 1 is a str"):
        region_key_parts(gm, [x0, "not an input kind"], [])


def test_captured_regions_with_folded_host_constants_share_one_key():
    """On CUDA, partition_graph folds host constants (a CPU ``full([], v)``) into module
    constants, which the glue graph passes to the pieces; identical blocks still give
    one region key (their constants are inputs, so one compiled function serves
    every block)."""
    from tests.cpu._graphs import trace

    from graphcomp.compiler.codegen import _region_assign, piece_example_inputs, region_key

    def f(x, *shards):
        for s in shards:
            w = c10d.wait_tensor(c10d.all_gather_into_tensor(s, 2, "g")).view(8, 8)
            for _ in range(3):
                x = torch.relu(x @ w) + torch.full([], 2.0)
        return x

    gm = trace(f, torch.randn(4, 8), *[torch.randn(32) for _ in range(4)])
    fulls = {n.name for n in gm.graph.nodes if n.name.startswith("full")}
    assert len(fulls) == 12
    gm = cudaify(gm, cpu_nodes=fulls)
    out, ctx = run_partition(gm, "fwd", codegen="inductor", compile_regions=True, region_min_nodes=4)
    split = ctx.frame.splits["fwd"]
    # captured: one piece (one CUDA graph), divided into 4 compile regions
    assert [p.mode for p in split.pieces] == ["cudagraph"]
    assert split.pieces[0].regions == 4 and split.pieces[0].row()["regions"] == 4
    assert ctx.record.counts["regions"] == 4 and ctx.record.counts["pieces"] == 1
    glue_consts = [n for n in split.split.graph.nodes if n.op == "get_attr"]
    assert len(glue_consts) == 12  # the folded constants, read by the glue graph
    piece = getattr(split.split, split.pieces[0].name)
    assign = _region_assign(piece)
    assert sorted(set(assign.values())) == [0, 1, 2, 3]
    inner = pg.split_graph(piece, assign)
    keys = []
    for name, region in inner.named_children():
        keys.append(region_key(region, piece_example_inputs(region), []))
    assert len(keys) == 4 and None not in keys and keys[1] == keys[2]


def test_config_region_min_nodes_must_be_positive():
    with pytest.raises(ValueError, match="region_min_nodes"):
        Config.from_options({"region_min_nodes": 0})
    assert Config.from_options({"compile_regions": True}).compile_regions is True


def _gathered_blocks(n_blocks, symbolic=False):
    """``_blocks_graph`` stamped on CUDA: one region per block with ``region_min_nodes=4``."""
    return cudaify(_blocks_graph(n_blocks, mode="symbolic" if symbolic else "fake"))


@pytest.mark.parametrize("n_blocks, auto_min, expect", [(6, 6, 6), (6, 7, 1), (5, 16, 1)])
def test_compile_regions_auto_cuts_deep_captured_graphs_only(n_blocks, auto_min, expect):
    """``compile_regions="auto"`` (the default) keeps the regions of a captured Inductor
    graph that cuts into at least ``region_auto_min`` of them, and compiles a shallower
    graph whole (one piece, no region tags, no ``regions`` count), saying so."""
    assert Config().compile_regions == "auto" and Config().region_auto_min == 16
    gm = _gathered_blocks(n_blocks)
    _, ctx = run_partition(gm, "fwd", codegen="inductor", region_min_nodes=4, region_auto_min=auto_min)
    split = ctx.frame.splits["fwd"]
    assert [p.mode for p in split.pieces] == ["cudagraph"]
    assert split.pieces[0].regions == expect
    piece = getattr(split.split, split.pieces[0].name)
    tagged = {n.meta.get(regions.REGION_META) for n in piece.graph.nodes if n.op not in ("placeholder", "output")}
    if expect > 1:
        assert ctx.record.counts["regions"] == expect and tagged == set(range(expect))
        assert not any("compile_regions='auto'" in n for n in ctx.record.notes)
    else:
        assert "regions" not in ctx.record.counts and tagged == {None}
        assert any(f"region_auto_min={auto_min}" in n for n in ctx.record.notes)
    # compile_regions=True keeps them whatever the count; False never cuts
    _, on = run_partition(_gathered_blocks(n_blocks), "fwd", codegen="inductor", region_min_nodes=4,
                          compile_regions=True, region_auto_min=auto_min)
    assert on.frame.splits["fwd"].pieces[0].regions == n_blocks
    _, off = run_partition(_gathered_blocks(n_blocks), "fwd", codegen="inductor", region_min_nodes=4,
                           compile_regions=False, region_auto_min=1)
    assert off.frame.splits["fwd"].pieces[0].regions == 1 and "regions" not in off.record.counts


def test_compile_regions_auto_leaves_uncaptured_eager_and_symbolic_graphs_whole():
    """``"auto"`` only regions captured pieces with static shapes under Inductor: with
    CUDA graphs off nothing is split (``True`` would make each region an eager
    piece), eager codegen gets no regions, and a graph with symbolic shapes (whose
    regions are never reused) compiles whole."""
    gm = _gathered_blocks(6)
    out, ctx = run_partition(gm, "fwd", codegen="inductor", region_min_nodes=4, region_auto_min=2, cudagraphs="off")
    assert out is gm and "fwd" not in ctx.frame.splits
    _, forced = run_partition(_gathered_blocks(6), "fwd", codegen="inductor", region_min_nodes=4, cudagraphs="off",
                              compile_regions=True)
    assert [p.mode for p in forced.frame.splits["fwd"].pieces] == ["eager"] * 6
    _, eager = run_partition(_gathered_blocks(6), "fwd", codegen="eager", region_min_nodes=4, region_auto_min=2)
    assert eager.frame.splits["fwd"].pieces[0].regions == 1
    _, sym = run_partition(_gathered_blocks(6, symbolic=True), "fwd", codegen="inductor", region_min_nodes=4,
                           region_auto_min=2)
    assert sym.frame.splits["fwd"].pieces[0].regions == 1
    assert any("symbolic shapes" in n for n in sym.record.notes)


def _tagged_piece(block_layers):
    """One captured piece of blocks with ``block_layers[k]`` matmul + relu layers
    (``_blocks_graph``) divided into one compile region per block (tags set by
    ``partition_graph`` with ``compile_regions=True``)."""
    gm = cudaify(_blocks_graph(layers=block_layers))
    _, ctx = run_partition(gm, "fwd", codegen="inductor", compile_regions=True, region_min_nodes=4)
    split = ctx.frame.splits["fwd"]
    assert split.pieces[0].regions == len(block_layers)
    return getattr(split.split, split.pieces[0].name)


@pytest.mark.parametrize("block_layers, composed, compiles", [
    ((3, 3, 3, 3, 3, 3), True, 3),   # first, middle (reused 3 times), last block: 3 of 6 compiled
    ((2, 3, 4, 5, 6, 7), False, 1),  # every block different: the piece compiles whole, once
])
def test_auto_regions_compile_the_piece_whole_when_most_regions_would_compile(block_layers, composed, compiles):
    """The codegen under ``compile_regions="auto"``: a piece ``partition_graph`` divided
    into regions is compiled region by region only when at most half of its regions
    need their own compile; otherwise it compiles whole (nothing compiled region by
    region first), counted in ``region_pieces_compiled_whole``. ``True`` always composes."""
    from graphcomp.compiler import codegen
    from graphcomp.session import SESSION

    piece = _tagged_piece(block_layers)
    for mode in ("auto", True):
        compiled = []

        def compile_piece(gm, ex, sidx):
            compiled.append(gm)
            return lambda args: None

        before = SESSION.counters["region_pieces_compiled_whole"]
        out = codegen._compile_composed("p", piece, [], codegen._region_assign(piece), compile_piece, False, {}, {},
                                        auto=mode == "auto")
        whole = SESSION.counters["region_pieces_compiled_whole"] - before
        if mode == "auto" and not composed:
            assert out is None and compiled == [] and whole == 1
        else:
            assert out is not None and whole == 0
            assert len(compiled) == (compiles if composed else len(block_layers))


def test_regions_to_compile_counts_new_keys_and_unreusable_regions():
    from graphcomp.compiler.codegen import _hash_parts, _regions_to_compile

    a, b = ["code a"], ["code b"]
    assert _regions_to_compile([a, a, b, a], {}) == 2
    assert _regions_to_compile([a, a, b], {_hash_parts(a): None}) == 1  # compiled for an earlier piece
    assert _regions_to_compile([a, "not reusable: a submodule", "not reusable: a submodule"], {}) == 3


def test_config_compile_regions_values():
    for bad in ("on", 1, None):
        with pytest.raises(ValueError, match="compile_regions"):
            Config.from_options({"compile_regions": bad})
    with pytest.raises(ValueError, match="region_auto_min"):
        Config.from_options({"region_auto_min": 0})


def test_region_assign_needs_every_node_tagged_and_two_regions():
    """The codegen composes a piece from regions only when partition_graph tagged
    every node and found at least two regions; otherwise the piece compiles whole."""
    from graphcomp.compiler.codegen import _region_assign

    gm = fx.symbolic_trace(lambda x: (x.sin() * 2).cos())
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    assert _region_assign(gm) == {}
    for i, n in enumerate(body):
        n.meta[regions.REGION_META] = 0 if i < 2 else 1
    assert sorted(_region_assign(gm).values()) == [0, 0, 1]
    del body[1].meta[regions.REGION_META]
    assert _region_assign(gm) == {}
    for n in body:
        n.meta[regions.REGION_META] = 0
    assert _region_assign(gm) == {}  # one region: nothing to compose


@pytest.mark.parametrize("lazy_split_module", [True, False])
def test_split_graph_returns_lazy_modules_whatever_split_module_builds(monkeypatch, lazy_split_module):
    """The glue and its pieces come back as lazy GraphModules (a recompile marks the
    code stale; it is generated when first run or read), also where torch's
    split_module ignores the lazy setting and builds plain GraphModules (torch 2.11;
    simulated here by turning the setting off), and they compute what the graph did."""
    import contextlib

    from torch.fx._lazy_graph_module import _LazyGraphModule

    from graphcomp import _compat

    if not lazy_split_module:
        monkeypatch.setattr(_compat, "lazy_graph_modules", contextlib.nullcontext)

    def f(x, y):
        a = torch.sin(x) + y
        b = a.relu() * 2
        c = torch.cos(b) - x
        return b, c

    x, y = torch.randn(4, 3), torch.randn(4, 3)
    gm = make_fx(f)(x, y)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    cut = nodes[2].name

    def pred(n):
        return pg.SplitReason(n.name, "user_split_op", "test") if n.name == cut else None

    assign, rows, _ = pg.plan_pieces(gm, predicate=pred)
    split = pg.split_graph(gm, assign)
    pieces = [m for _, m in split.named_children()]
    assert len(pieces) == len(rows) >= 2
    assert isinstance(split, _LazyGraphModule) and all(isinstance(p, _LazyGraphModule) for p in pieces)
    assert [n.target for n in split.graph.nodes if n.op == "call_module"] == [f"piece_{i}" for i in range(len(rows))]
    for a, b in zip(gm(x, y), split(x, y)):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert "piece_0" in split.code  # the code is there when read


@settings(max_examples=30, deadline=None)
@given(blocks=st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.booleans()), min_size=2, max_size=6),
       prefetch=st.booleans(), min_nodes=st.integers(1, 12), in_flight_ok=st.booleans())
def test_region_cuts_properties(blocks, prefetch, min_nodes, in_flight_ok):
    """On random block graphs (matmuls and pointwise ops before and after each
    block's gather wait, some with a multi-output ``var_mean`` and its getitems, the
    gathers prefetched a block ahead or not): the moved cuts are as many as the
    anchors, strictly increasing inside the graph, each region holds compute nodes,
    no cut separates a node from its getitems, and without ``in_flight_ok`` none
    leaves a collective in flight."""
    from tests.cpu._graphs import trace

    def f(x, a, *shards):
        pending = c10d.all_gather_into_tensor(shards[0], 2, "g") if prefetch else None
        for k, (pre, split, post) in enumerate(blocks):
            for _ in range(pre):
                x = torch.relu(x @ a)
            w = c10d.wait_tensor(pending if prefetch else c10d.all_gather_into_tensor(shards[k], 2, "g")).view(8, 8)
            if prefetch and k + 1 < len(blocks):
                pending = c10d.all_gather_into_tensor(shards[k + 1], 2, "g")
            if split:
                v, m = torch.var_mean(x, dim=-1, keepdim=True)
                x = (x - m) * v
            x = torch.relu(x @ w) + x
            if post:
                x = x * 2
        return x

    gm = trace(f, torch.randn(4, 8), torch.randn(8, 8), *[torch.randn(32) for _ in blocks])
    nodes = _nodes(gm)
    pos = {n: i for i, n in enumerate(nodes)}
    anchors = regions._anchor_cuts(nodes, min_nodes)[0]
    cuts = regions.region_cuts(nodes, min_nodes, in_flight_ok=in_flight_ok)
    assert len(cuts) == len(anchors)
    assert all(0 < p < len(nodes) for p in cuts) and cuts == sorted(set(cuts))
    for lo, hi in zip([0, *cuts], [*cuts, len(nodes)]):
        assert any(regions.is_compute(m) for m in nodes[lo:hi])
    for n in nodes:
        items = [pos[u] for u in n.users if u.target is operator.getitem]
        for p in cuts:
            assert not (items and pos[n] < p <= max(items)), (n, p)
    if not in_flight_ok:
        for p in cuts:
            assert _gathers_in_flight(nodes, p) == 0, p
