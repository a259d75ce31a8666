"""backend.drop_unread_gathers: a parameter gather whose value nothing reads (the model
read only the parameter's dtype, device or shape) leaves the Dynamo graph before the
gathers decompose into collectives, with the ``to_local`` only it read; gathers
something reads, and inputs other nodes read, stay. (End to end, on 2 ranks:
tests/cpu/distributed/test_sharding.py::test_weight_read_for_its_dtype_is_gathered_once.)"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphcomp.compiler.backend import drop_unread_gathers


def _gather(g: fx.Graph, op, local: fx.Node, *extra) -> fx.Node:
    return g.call_function(op, (local, 3, [3, 4], None, torch.float32, "0", 2, *extra))


def test_unread_gathers_and_their_to_local_leave_the_graph():
    gather, table = torch.ops.graphcomp.gather_shard.default, torch.ops.graphcomp.gather_table.default
    g = fx.Graph()
    x, w, emb = g.placeholder("x"), g.placeholder("w"), g.placeholder("emb")
    dead_local = g.call_method("to_local", (w,))
    _gather(g, gather, dead_local)  # `w.dtype` read: the gather's value unused
    live = _gather(g, gather, g.call_method("to_local", (w,)))
    shared_local = g.call_method("to_local", (emb,))
    _gather(g, table, shared_local, "0", 0, 2, False)  # unread table gather...
    head = _gather(g, gather, shared_local)  # ...whose to_local another gather reads
    y = g.call_function(torch.mm, (x, live))
    g.output(g.call_function(torch.add, (y, head)))
    gm = fx.GraphModule(torch.nn.Module(), g)

    assert drop_unread_gathers(gm) == 2
    gm.graph.lint()
    calls = [(n.op, n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert calls.count(("call_function", gather)) == 2 and ("call_function", table) not in calls
    assert calls.count(("call_method", "to_local")) == 2  # w's live one, and emb's (still read)
    assert dead_local not in gm.graph.nodes and shared_local in gm.graph.nodes
    assert drop_unread_gathers(gm) == 0  # nothing left to drop
