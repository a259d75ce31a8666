"""graphcomp.analysis.memory: the static memory model on hand-built graphs."""

import pytest
import torch

from _graphs import gather, trace

from graphcomp.analysis import memory


def _node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


def test_lifetimes_and_peak():
    # x: 4 KiB input (live throughout); a, b: 4 KiB each; a dies after b is made
    def f(x):
        a = x * 2
        b = a + 1
        c = b.sum()
        return c

    gm = trace(f, torch.randn(1024))
    est = memory.estimate(gm)
    assert est.inputs_bytes == 4096
    # while b is computed, x, a and b are live
    assert est.peak_bytes == 3 * 4096
    assert est.peak_node == "add"
    tl = memory.timeline(gm)
    names = [n.name for n in gm.graph.nodes]
    assert tl[names.index("mul")] == 2 * 4096
    assert tl[names.index("sum_1")] == 2 * 4096 + 4  # a is dead, b still read by sum


def test_views_share_storage_and_outputs_live_to_the_end():
    def f(x):
        a = x * 2  # 4 KiB
        v = a.view(32, 32).t()  # views of a: no new storage
        big = torch.ones(2048)  # 8 KiB, allocated after v
        return v, big.sum()

    gm = trace(f, torch.randn(1024))
    nodes, live, size = memory.intervals(gm)
    a = _node(gm, "mul")
    assert memory.storage_root(_node(gm, "t")) is a
    assert live[a] == [(nodes.index(a), len(nodes) - 1)]  # returned through a view: lives to the end
    est = memory.estimate(gm)
    assert est.peak_bytes == 4096 + 4096 + 8192 + 4  # x, a (once), big and its sum
    assert est.peak_node == "sum_1"


def test_gather_and_wait_count_once():
    def f(s):
        w = gather(s, 4, "g", shape=(8, 16))
        return (w * 2).sum()

    gm = trace(f, torch.randn(2, 16))
    est = memory.estimate(gm)
    # shard 128 B + gathered 512 B (wait aliases the collective) + mul 512 B
    assert est.peak_bytes == 128 + 512 + 512


def test_reshard_splits_a_joint_lifetime():
    # a joint-like graph: w is used in "forward" and again in "backward" (after tangents)
    def f(s, x, tangents_1):
        w = gather(s, 2, "g", shape=(64, 64))  # 16 KiB
        y = x @ w
        big = torch.ones(8192) * y.sum()  # 32 KiB, forward only
        fw_out = big.sum()
        gx = tangents_1 @ w.t()  # backward use of w
        return fw_out, gx

    gm = trace(f, torch.randn(32, 64), torch.randn(4, 64), torch.randn(4, 64))
    coll = next(n for n in gm.graph.nodes if "all_gather" in n.name)
    keep = memory.estimate(gm)
    resh = memory.estimate(gm, reshard={coll})
    assert resh.peak_bytes == keep.peak_bytes - 64 * 64 * 4
    bwd = memory.backward_nodes(gm)
    tang = next(n for n in gm.graph.nodes if n.name.startswith("tangents"))
    assert tang in bwd and coll not in bwd


def test_summary_json_says_where():
    def f(x):
        return (x * 2 + 1).sum()

    gm = trace(f, torch.randn(256))
    s = memory.summary(gm)
    assert s["peak_bytes"] == 3 * 1024 and s["peak_op"] == "aten.add.Tensor"
    assert s["largest_live"][0]["bytes"] == 1024


def test_budget_resolution():
    gm = trace(lambda x: x + 1, torch.randn(4))
    assert memory.resolve_budget(None, gm) is None
    assert memory.resolve_budget(1000, gm) == 1000
    with pytest.raises(ValueError, match="memory_budget"):
        memory.resolve_budget(0.5, gm)  # a fraction is defined for CUDA only


def test_inspect_shows_estimated_peak_per_stage():
    from graphcomp.tools.inspect_dumps import format_frame

    gm = trace(lambda x: (x * 2 + 1).sum(), torch.randn(256))
    frame = {"frame": 0, "stages": {"fwd": {"nodes_in": 5, "nodes_out": 5, "passes": [], "collectives": [],
                                            "memory": memory.summary(gm)}}}
    text = format_frame(frame)
    assert "est. peak" in text and "3.0 KiB" in text and "add (aten.add.Tensor" in text


def test_non_persistent_inputs_die_after_last_use():
    """With the persistent inputs named (parameters), other inputs (saved
    activations, tangents) are freed after their last use, as the compiled graph
    frees them under AOTAutograd's boxed calling convention."""
    def f(w, act):
        a = act * 2  # act's last use
        b = torch.ones(2048)  # 8 KiB, after act died
        return (a * w).sum() + b.sum()

    gm = trace(f, torch.randn(1024), torch.randn(1024))
    w, act = [n for n in gm.graph.nodes if n.op == "placeholder"]
    all_live = memory.estimate(gm)
    only_w = memory.estimate(gm, persistent={w})
    assert all_live.peak_bytes - only_w.peak_bytes == 4096  # act is no longer counted at the peak
    nodes, live, _ = memory.intervals(gm, persistent={w})
    assert live[w] == [(0, len(nodes) - 1)]
    assert live[act] == [(0, nodes.index(_node(gm, "mul")))]


def test_collective_input_until_wait_or_only_until_issued():
    def f(x):
        buf = x * 2  # 4 KiB: the collective's input
        out = torch.ops._c10d_functional.reduce_scatter_tensor.default(buf, "sum", 4, "g")
        big = torch.ones(4096)  # 16 KiB allocated while the collective is in flight
        s = big.sum()
        w = torch.ops._c10d_functional.wait_tensor.default(out)
        return w.sum() + s

    gm = trace(f, torch.randn(1024))
    held = memory.estimate(gm)
    issued = memory.estimate(gm, inputs_until_wait=False)
    assert held.peak_bytes - issued.peak_bytes == 4096  # buf counted at the peak only when held to the wait
    s = memory.summary(gm)
    assert s["peak_bytes"] == held.peak_bytes and s["peak_bytes_allocated"] == issued.peak_bytes


def test_persistent_inputs_of_stage_graphs():
    def fwd(p0, p1, x):
        return (x * p0 + p1).sum()

    gm = trace(fwd, torch.randn(4), torch.randn(4), torch.randn(4))
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert memory.persistent_inputs(gm, "fwd", [0, 1]) == set(phs[:2])
    assert memory.persistent_inputs(gm, "fwd", None) is None
    bwd = torch.fx.symbolic_trace(lambda primals_1, mul, tangents_1: (tangents_1 * primals_1 + mul,))
    phs = {n.name: n for n in bwd.graph.nodes if n.op == "placeholder"}
    assert memory.persistent_inputs(bwd, "bwd", [0, 1]) == {phs["primals_1"]}


def test_fused_model_drops_pointwise_intermediates_and_reuses_in_place():
    # y = (x * 2 + 1).exp() read by a matmul: Inductor computes mul/add/exp in one
    # kernel, so only its output is allocated; s = y.sum() reads y (no new buffer)
    def f(x, w):
        a = x * 2  # fused into exp's kernel
        b = a + 1  # fused
        y = b.exp()  # materialized: a matmul reads it
        z = y @ w
        r = torch.relu(z)  # pointwise, same size as z, z's last reader: written in place of z
        return r, (r * r).sum()  # r is returned: materialized; r * r fuses into the sum

    x, w = torch.randn(64, 64), torch.randn(64, 64)
    gm = trace(f, x, w)
    plain = memory.estimate(gm)
    fused = memory.estimate(gm, fused=True)
    nodes, live, size = memory.intervals(gm, fused=True)
    assert size[_node(gm, "mul")] == 0 and size[_node(gm, "add")] == 0
    assert size[_node(gm, "exp")] == 64 * 64 * 4
    mm, relu = _node(gm, "mm"), _node(gm, "relu")
    (s, e), = live[mm]
    assert e == nodes.index(relu) - 1  # relu writes into mm's buffer
    assert size[_node(gm, "mul_1")] == 0  # r * r: computed inside the sum's kernel
    # unfused: x, w and two 16 KiB values at every step; at the sum also its 4 B
    assert plain.peak_bytes == 4 * 16384 + 4 and plain.peak_node == "sum_1"
    # fused: x, w, y and z while the matmul runs; relu reuses z, so never 5 buffers
    assert fused.peak_bytes == 4 * 16384 and fused.peak_node == "mm"
    assert memory.timeline(gm, fused=True)[nodes.index(relu)] == 3 * 16384  # x, w, z (now r)


def test_fused_value_keeps_its_inputs_alive_until_the_kernel_runs():
    # a is read by mul (fused away); mul's kernel is the one computing `out` later,
    # after big is allocated: a must still be live there
    def f(x):
        a = x.exp()  # materialized: a view (reshape) of it is returned below
        m = a * 3  # fused into its consumer
        big = torch.ones(4096)  # 16 KiB
        out = m.sum() + big.sum()
        return out, a.view(-1)

    gm = trace(f, torch.randn(1024))
    nodes, live, size = memory.intervals(gm, fused=True)
    assert size[_node(gm, "mul")] == 0
    # exp is live through the end (returned through a view) in both models
    assert live[_node(gm, "exp")][0][1] == len(nodes) - 1
    x_only = memory.estimate(gm, fused=True)
    assert x_only.peak_bytes >= 4096 + 4096 + 16384  # x, a, big at once


def test_summary_reports_the_inductor_estimate():
    def f(x):
        return ((x * 2) + 1).sum()

    gm = trace(f, torch.randn(1024))
    s = memory.summary(gm)
    assert s["peak_bytes_allocated"] == 3 * 4096  # x, mul and add materialized
    assert s["peak_bytes_inductor"] == 4096 + 4  # x and the sum only


def test_timeline_for_charts_keeps_the_peak_and_marks_collectives():
    def f(x):
        return (x * 2 + 1).sum()

    gm = trace(f, torch.randn(256))
    s = memory.summary(gm)
    tl = s["timeline"]
    assert tl["num_nodes"] == len(gm.graph.nodes) and tl["step"] == 1
    assert tl["bytes"] == memory.timeline(gm)  # one point per node: the whole timeline
    assert max(tl["bytes"]) == s["peak_bytes"] and max(tl["bytes_inductor"]) == s["peak_bytes_inductor"]
    assert tl["collectives"] == []
    g = trace(lambda s: (gather(s, 4, "g", shape=(8, 16)) * 2).sum(), torch.randn(2, 16))
    tl = memory.summary(g)["timeline"]
    idx = [i for i, n in enumerate(g.graph.nodes) if "all_gather" in str(n.target)]
    assert tl["collectives"] == [[i, "all_gather"] for i in idx] and idx


def test_timeline_buckets_keep_each_buckets_maximum():
    assert memory.bucket_max([1, 5, 2, 2, 9, 0, 3], 3) == [5, 9, 3]
    nodes = list(trace(lambda x: x + 1, torch.randn(4)).graph.nodes)
    tl = memory.timeline_summary(nodes * 100, list(range(len(nodes) * 100)), [7] * (len(nodes) * 100), points=10)
    n = len(nodes) * 100
    assert tl["step"] == -(-n // 10) and len(tl["bytes"]) <= 10
    assert tl["bytes"][-1] == n - 1 and tl["bytes_inductor"] == [7] * len(tl["bytes"])
