"""fuse_allgather_downcast on hand-built graphs: exact op counts, dtypes, no-op cases."""

import torch

from _graphs import c10d, counts, gather, run_pass, trace, world1_group

C = "_c10d_functional.all_gather_into_tensor.default"
CONV = "prims.convert_element_type.default"
TOCOPY = "aten._to_copy.default"


def _ag_dtypes(gm):
    return [n.args[0].meta["val"].dtype for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]


def test_param_dtype_cast_moves_before_gather():
    def f(s1, s2, x):
        w1 = gather(s1, 2, "g", rows=5, shape=(5, 4)).to(torch.bfloat16)
        w2 = gather(s2, 2, "g", rows=7).to(torch.bfloat16)
        return (x.to(torch.bfloat16) @ w1.t()).sum() + w2.sum()

    gm = trace(f, torch.randn(3, 4), torch.randn(4), torch.randn(2, 4))
    before = counts(gm)
    assert before[TOCOPY] == 3 and before[C] == 2 and before[CONV] == 0
    gm, rec = run_pass("fuse_allgather_downcast", gm)
    after = counts(gm)
    assert after[C] == 2
    assert after[CONV] == 2  # one cast per shard, before the gather
    assert after[TOCOPY] == 1  # only the activation cast is left
    assert _ag_dtypes(gm) == [torch.bfloat16, torch.bfloat16]
    assert rec.counts["gathers_fused"] == 2
    # wire bytes saved: (6*4 + 8) gathered elements x 2 bytes
    assert rec.counts["bytes_saved"] == (6 * 4 + 8) * 2
    for n in gm.graph.nodes:
        if n.target is c10d.wait_tensor.default:
            assert n.meta["val"].dtype == torch.bfloat16


def test_autocast_style_double_cast_same_dtype_is_fused_once():
    def f(s, x):
        w = gather(s, 2, "g", rows=6, shape=(6, 4))
        return (x @ w.to(torch.float16).t()).sum() + w.to(torch.float16).sum()

    gm = trace(f, torch.randn(3, 4), torch.randn(2, 4, dtype=torch.float16))
    gm, rec = run_pass("fuse_allgather_downcast", gm)
    assert counts(gm)[TOCOPY] == 0 and counts(gm)[CONV] == 1
    assert _ag_dtypes(gm) == [torch.float16]


def test_noop_cases_leave_graph_unchanged():
    def uncast(s, x):  # gathered weight used in its own dtype
        return (x @ gather(s, 2, "g", rows=6, shape=(6, 4)).t()).sum()

    def widen(s):  # cast to a wider dtype
        return gather(s, 2, "g").to(torch.float64).sum()

    def mixed(s):  # used cast and uncast
        w = gather(s, 2, "g")
        return w.to(torch.bfloat16).sum() + w.sum()

    def none(x):  # no collective at all
        return x.to(torch.bfloat16).sum()

    cases = [
        (uncast, (torch.randn(3, 4), torch.randn(2, 4)), "skipped:used_uncast"),
        (widen, (torch.randn(3, 4),), "skipped:not_narrower"),
        (mixed, (torch.randn(3, 4),), "skipped:used_uncast"),
        (none, (torch.randn(3),), None),
    ]
    for fn, args, key in cases:
        gm = trace(fn, *args)
        code = gm.code
        gm, rec = run_pass("fuse_allgather_downcast", gm)
        assert gm.code == code, fn.__name__
        assert rec.reason, fn.__name__
        if key:
            assert rec.counts[key] == 1, (fn.__name__, rec.counts)
        else:
            assert "no all_gather_into_tensor" in rec.reason


def test_semantics_on_a_real_world1_group():
    with world1_group() as group:
        def f(s, x):
            w = gather(s, 1, group, rows=5, shape=(5, 4)).to(torch.bfloat16)
            return x.to(torch.bfloat16) @ w.t()

        s, x = torch.randn(5, 4), torch.randn(3, 4)
        gm = trace(f, s, x)
        ref = gm(s, x)
        gm, _ = run_pass("fuse_allgather_downcast", gm)
        torch.testing.assert_close(gm(s, x), ref, rtol=0, atol=0)  # cast commutes with a copy: bitwise
