"""Common mistakes around sharding raise a named error instead of training nothing.

An optimizer built before ``graphcomp.shard(model)`` holds the parameters shard
replaced: its steps would update tensors the model no longer uses. It raises
``OptimizerParamsError`` at its first step (a plain loop), when captured
(``graphcomp.optim.capture``) and in ``graphcomp.train_step``, naming the parameter.

The other mistakes of docs/troubleshooting.md "Common mistakes": a shard's ``.data``
replaced, the model moved to another device after ``shard``, parameters frozen
mid-training, a checkpoint of another shape, parameters added after ``shard``,
FSDP's ``no_sync()``."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import graphcomp
from graphcomp.errors import OptimizerParamsError, ShardedModelError


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_optimizer_built_before_shard_raises_at_its_first_step(pg1):
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    graphcomp.shard(m)
    m(torch.ones(3, 4)).sum().backward()
    with pytest.raises(OptimizerParamsError, match=r"AdamW holds 4 parameter\(s\) that graphcomp.shard replaced "
                                                   r"with shards \(the first: '0.weight'\).*after graphcomp.shard"):
        opt.step()


def test_optimizer_built_after_shard_steps_and_changes_the_shards(pg1):
    m = _model()
    graphcomp.shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = [p.detach().clone() for p in m.parameters()]
    for _ in range(2):  # (the check runs once per optimizer; later steps skip it)
        m(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert any(not torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_captured_optimizer_and_train_step_refuse_a_stale_optimizer(pg1):
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    graphcomp.shard(m)
    with pytest.raises(OptimizerParamsError, match="graphcomp.optim.capture: AdamW holds 4 parameter"):
        graphcomp.optim.capture(opt, max_norm=1.0)
    with pytest.raises(OptimizerParamsError, match="graphcomp.train_step: AdamW holds 4 parameter"):
        graphcomp.train_step(m, opt)


def test_graphcomps_own_hook_does_not_count_as_a_step_hook(pg1):
    """The check is a global step pre-hook; captured optimizer steps fall back on step
    hooks (they would run at capture only), so graphcomp's own is not counted."""
    from graphcomp import _compat

    m = _model()
    graphcomp.shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    assert _compat.optimizer_step_hooks(opt) == 0
    h = opt.register_step_pre_hook(lambda *a: None)
    assert _compat.optimizer_step_hooks(opt) == 1
    h.remove()


# ------------------------------------------------- a sharded parameter replaced
def test_assigning_a_new_parameter_to_a_sharded_name_raises(pg1):
    m = _model()
    graphcomp.shard(m)
    with pytest.raises(AttributeError, match=r"cannot assign to '0.weight': it is sharded.*load_state_dict"):
        m[0].weight = torch.nn.Parameter(torch.zeros(8, 4))


def test_shard_data_replaced_with_another_shape_raises_at_its_next_use(pg1):
    """``param.data = t`` on a shard changes the DTensor's shape but not its local
    shard: the new values were ignored and the backward failed in autograd."""
    m = _model()
    graphcomp.shard(m)
    m[0]._parameters["weight"].data = torch.zeros(3, 3)
    msg = (r"'0.weight' was changed after graphcomp.shard: its shard has shape \(3, 3\), expected \(8, 4\) "
           r"\(logical shape \(8, 4\)\).*load_state_dict")
    with pytest.raises(ShardedModelError, match=msg):
        m(torch.ones(2, 4))  # eager forward (the gather scope)
    with pytest.raises(ShardedModelError, match=msg):
        m[0].weight  # a read outside a forward
    with pytest.raises(ShardedModelError, match=msg):
        with torch.no_grad():
            m(torch.ones(2, 4))


def test_shard_data_replaced_raises_in_a_compiled_forward(pg1):
    m = _model()
    graphcomp.shard(m)
    m[0]._parameters["weight"].data = torch.zeros(3, 3)
    c = torch.compile(m, backend="graphcomp")
    with pytest.raises(ShardedModelError, match="'0.weight' was changed after graphcomp.shard"):
        c(torch.ones(2, 4))


# --------------------------------------------------- device and dtype after shard
def test_moving_a_sharded_model_to_another_device_raises_before_anything_moves(pg1):
    m = _model()
    graphcomp.shard(m)
    with pytest.raises(ShardedModelError, match=r"cannot move sharded parameter '0.bias' from cpu to meta.*"
                                                r"before sharding"):
        m.to("meta")
    with pytest.raises(ShardedModelError, match="from cpu to meta"):
        m.to_empty(device="meta")
    assert all(p.device.type == "cpu" for p in m.parameters())
    m.to("cpu")  # no-ops still work
    m.float()
    assert m(torch.ones(2, 4)).shape == (2, 2)


def test_a_dtype_change_after_shard_converts_the_shards_and_trains(pg1):
    """``model.double()`` after shard converts the shards in place (the Parameter objects,
    hence an optimizer built after it, stay valid), as for a plain model."""
    ref = _model().double()
    m = _model()
    graphcomp.shard(m)
    params = list(m.parameters())
    m.double()
    assert [id(p) for p in m.parameters()] == [id(p) for p in params]
    assert all(p.dtype == torch.float64 for p in m.parameters())
    x = torch.ones(3, 4, dtype=torch.float64)
    out = m(x)
    torch.testing.assert_close(out, ref(x))
    out.sum().backward()
    assert m[0]._parameters["weight"].grad.dtype == torch.float64


# ------------------------------------------------------- freezing mid-training
def test_freezing_a_parameter_mid_training_is_logged_and_stops_its_updates(pg1, caplog):
    m = _model()
    graphcomp.shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    step = graphcomp.train_step(m, opt, loss_fn=lambda mod, x: mod(x).sum(), max_norm=None)
    x = torch.ones(2, 4)
    step(x)
    m[0].requires_grad_(False)  # (m[0].weight is the gathered tensor: freeze the module or its parameters())
    frozen = m[0]._parameters["weight"].detach().clone()
    other = m[2]._parameters["weight"].detach().clone()
    with caplog.at_level(logging.WARNING, logger="graphcomp"):
        step(x)
        step(x)
    warned = [r.getMessage() for r in caplog.records if "requires_grad changed" in r.getMessage()]
    assert len(warned) == 1 and "2 parameter(s)" in warned[0] and "'0.weight' is now frozen" in warned[0]
    assert torch.equal(frozen, m[0]._parameters["weight"].detach())
    assert not torch.equal(other, m[2]._parameters["weight"].detach())
    assert step.params == [m[2]._parameters["weight"], m[2]._parameters["bias"]]


def test_freezing_drops_a_whole_step_graph(pg1):
    class _Whole:
        released = False

        def release(self):
            self.released = True

        def __bool__(self):
            return True

    m = _model()
    graphcomp.shard(m)
    step = graphcomp.train_step(m, torch.optim.SGD(m.parameters(), lr=0.1), loss_fn=lambda mod, x: mod(x).sum())
    whole = step._whole = _Whole()
    step._calls = 5
    m[2]._parameters["bias"].requires_grad_(False)
    step._trainable_changed()
    assert whole.released and step._whole is None and step._calls == 0


# ------------------------------------------------ a checkpoint of another shape
def test_loading_a_checkpoint_of_another_shape_names_the_parameter_and_both_shapes(pg1):
    m = _model()
    graphcomp.shard(m)
    other = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2)).state_dict()
    with pytest.raises(RuntimeError, match=r"size mismatch for 0.weight: copying a param with shape \(6, 4\) from "
                                           r"checkpoint, the \(unsharded\) shape in current model is \(8, 4\)"):
        m.load_state_dict(other)
    with pytest.raises(RuntimeError, match="size mismatch for 2.weight"):
        m.load_state_dict(other, strict=False)


# ------------------------------------------------ parameters added after shard
def test_a_module_added_after_shard_is_refused_on_several_ranks_and_logged_on_one(pg1, caplog):
    m = _model()
    graphcomp.shard(m)
    m.extra = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="graphcomp"):
        graphcomp.train_step(m, opt)
    assert any("2 trainable parameter(s) of the sharded model are not sharded (the first: 'extra.weight')"
               in r.getMessage() for r in caplog.records)
    # the same model sharded over 2 ranks (only the check reads world_size)
    infos = m[0].__dict__["_graphcomp_shard_info"]
    infos["weight"] = dataclasses.replace(infos["weight"], world_size=2)
    with pytest.raises(ShardedModelError, match=r"not sharded \(the first: 'extra.weight'\).*not be reduced across "
                                                r"the 2 ranks.*before graphcomp.shard\(model\)"):
        graphcomp.train_step(m, opt)
    m.extra.requires_grad_(False)  # frozen: nothing to reduce
    graphcomp.train_step(m, torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1))


def test_no_sync_is_not_a_graphcomp_model_method(pg1):
    m = _model()
    graphcomp.shard(m)
    with pytest.raises(AttributeError, match="no_sync"):
        m.no_sync()
