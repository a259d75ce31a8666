"""Hand-built aten graphs with functional collectives, for pass unit tests.

Graphs are traced with ``make_fx(tracing_mode="fake")`` so every node carries a
fake ``meta['val']`` like the graphs AOTAutograd hands the passes. The collective
group is a name only: shapes come from the ``group_size`` argument, so a graph can
model any world size without a process group. ``run_world1`` executes a graph on
a real single-rank gloo group for semantics checks.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from graphcomp.config import Config
from graphcomp.compiler.pipeline import PassContext, get_pass
from graphcomp.compiler.plan import FramePlan

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


def trace(fn, *args):
    """``fn`` traced to an aten graph, its collectives marked foreign or not as the
    pipeline marks a stage graph (from the groups ``shard`` registered)."""
    from graphcomp.analysis import graph_utils
    from graphcomp.compiler.compile_env import CompileEnv
    from graphcomp.session import SESSION

    gm = make_fx(fn, tracing_mode="fake")(*args)
    graph_utils.mark_foreign(gm, CompileEnv.of_session(SESSION).is_foreign_group)
    return gm


def gather(shard, world, group, rows=None, shape=None):
    """shard -> all_gather -> wait -> slice(rows) -> view(shape): one parameter access."""
    full = c10d.wait_tensor(c10d.all_gather_into_tensor(shard, world, group))
    if rows is not None:
        full = full[:rows]
    if shape is not None:
        full = full.view(shape)
    return full


def reduce_scatter(g, world, group):
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(g, "sum", world, group))


def run_pass(name, gm, stage="joint", code_id=None, **options):
    cfg = Config.from_options(options)
    # hand-built graphs are CPU graphs: test the reordering passes on them anyway
    ctx = PassContext(config=cfg, frame_id=0, stage=stage, frame=FramePlan(prefetch_cpu_graphs=True, zero_copy_cpu_graphs=True,
                                                                                code_id=code_id))
    from graphcomp.compiler.pipeline import PassRecord

    ctx.record = PassRecord(name=name, stage=stage, enabled=True)
    from graphcomp.analysis import graph_utils

    graph_utils.mark_foreign(gm, ctx.env.is_foreign_group)  # (as run_stage does)
    gm = get_pass(name).fn(gm, ctx).gm
    gm.graph.lint()
    gm.recompile()
    return gm, ctx.record


def counts(gm):
    from graphcomp.analysis.graph_utils import op_counts

    return op_counts(gm)


@contextlib.contextmanager
def world1_group():
    """A real single-rank gloo process group in this process."""
    if dist.is_initialized():
        yield dist.group.WORLD.group_name
        return
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()
