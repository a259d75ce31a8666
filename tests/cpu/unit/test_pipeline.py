"""Pipeline: order rules, toggles, records, silent no-op detection, debug lint."""

import operator

import pytest
import torch
import torch.fx as fx

from graphcomp.compiler import pipeline
from graphcomp.config import Config
from graphcomp.compiler.pipeline import PassContext, PassResult, PassSpec, pass_order, run_stage, temporary_registry


def _noop(reason):
    def fn(gm, ctx):
        return ctx.unchanged(gm, reason)

    return fn


def spec(name, fn=None, stages=("joint", "fwd", "bwd"), **kw):
    return PassSpec(name=name, fn=fn or _noop(f"{name}: nothing"), stages=frozenset(stages), **kw)


def _gm():
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x) + 1

    return fx.symbolic_trace(M())


def test_order_follows_rules_and_is_stable():
    specs = [
        spec("c", last=True),
        spec("a"),
        spec("b", before=("a",)),
        spec("d", after=("a",)),
        spec("e"),
    ]
    with temporary_registry(*specs):
        assert pass_order() == ["b", "a", "d", "e", "c"]
        assert pass_order() == pass_order()


def test_stage_filter():
    with temporary_registry(spec("j", stages=("joint",)), spec("f", stages=("fwd", "bwd"))):
        assert pass_order("joint") == ["j"]
        assert pass_order("fwd") == ["f"]
        assert pass_order("inference") == []  # inference frames run the joint passes by stage name "inference"


def test_cycle_and_bad_rules_are_errors():
    with temporary_registry(spec("a", after=("b",)), spec("b", after=("a",))):
        with pytest.raises(ValueError, match=r"cycle among \['a', 'b'\]"):
            pass_order()
    with temporary_registry(spec("a", after=("zzz",))):
        with pytest.raises(ValueError, match=r"after='zzz', which is not a registered pass"):
            pass_order()
    with temporary_registry(spec("a", last=True), spec("b", last=True)):
        with pytest.raises(ValueError, match=r"more than one pass declares last=True"):
            pass_order()


def test_invalid_stage_rejected_at_registration():
    with pytest.raises(ValueError, match=r"invalid stages \['forward'\]; valid stages"):
        pipeline.register_pass("x", stages=("forward",))


def _relu_to_sigmoid(gm, ctx):
    for n in gm.graph.nodes:
        if n.target is torch.relu:
            n.target = torch.sigmoid
            ctx.count("rewritten")
    return ctx.changed(gm)


def test_records_toggles_and_semantics():
    specs = [spec("rewrite", _relu_to_sigmoid), spec("idle")]
    with temporary_registry(*specs):
        cfg = Config.from_options({"passes": {"idle": False}})
        ctx = PassContext(config=cfg, frame_id=0, stage="fwd")
        gm, recs = run_stage(_gm(), ctx)
        x = torch.randn(5)
        torch.testing.assert_close(gm(x), torch.sigmoid(x) + 1)
        r0, r1 = recs
        assert (r0.name, r0.enabled, r0.changed, r0.counts) == ("rewrite", True, True, {"rewritten": 1})
        assert r0.op_diff == {"relu": -1, "sigmoid": 1}
        assert (r1.name, r1.enabled, r1.changed, r1.reason) == ("idle", False, False, "disabled in Config.passes")


def test_noop_pass_keeps_graph_and_says_why():
    with temporary_registry(spec("idle")):
        gm0 = _gm()
        code = gm0.code
        gm, (rec,) = run_stage(gm0, PassContext(config=Config.from_options({}), frame_id=0, stage="fwd"))
        assert gm.code == code and rec.changed is False and rec.reason == "idle: nothing"


def test_silent_noop_is_flagged():
    import graphcomp

    with temporary_registry(spec("silent", lambda gm, ctx: PassResult(gm, changed=False))):
        _, (rec,) = run_stage(_gm(), PassContext(config=Config.from_options({}), frame_id=0, stage="fwd"))
    assert "no reason given" in rec.reason
    assert graphcomp.counters["silent_noop_passes"] == 1


def test_pass_returning_wrong_type_is_an_error():
    with temporary_registry(spec("bad", lambda gm, ctx: None)):
        with pytest.raises(TypeError, match=r"pass 'bad' returned NoneType"):
            run_stage(_gm(), PassContext(config=Config.from_options({}), frame_id=0, stage="fwd"))


def test_debug_lint_names_the_broken_pass():
    def breaks(gm, ctx):
        relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
        add = next(n for n in gm.graph.nodes if n.target is operator.add)
        relu.args = (add,)  # use before definition: invalid graph
        return ctx.changed(gm)

    with temporary_registry(spec("breaker", breaks)):
        cfg = Config.from_options({"debug": True})
        with pytest.raises(RuntimeError, match=r"graphcomp pass 'breaker' produced an invalid graph"):
            run_stage(_gm(), PassContext(config=cfg, frame_id=0, stage="fwd"))
