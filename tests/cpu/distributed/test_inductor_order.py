"""Inductor keeps the order graphcomp scheduled (Config.inductor_memory_reorder).

Inductor's ``reorder_for_peak_memory`` replaces a graph's node order with another
topological order when its estimate of the peak is lower. On the tiny Llama sharded
over 2 ranks with small buckets and every gather prefetched, it did so for both
graphs: the forward's gathers went back next to their uses and every backward
reduce-scatter moved to the end of the backward, each waited at once (read from
Inductor's generated code). graphcomp's default keeps its own order there; the
option lets Inductor reorder, and the counters say which happened. Either way the
numbers are the same: only the order of independent kernels changes.
"""

import re

import pytest
import torch


SCHEDULE = {"bucket_bytes": 8192, "prefetch_bytes": 10**9}  # many buckets, all prefetched


def _code_order(code: str) -> str:
    """Inductor's generated ``call``: "G" a gather issued, "R" a reduce-scatter
    issued, "w" a wait, "." any other kernel or op call, in program order."""
    seq = []
    for line in code[code.index("def call("):].splitlines():
        if "all_gather_into_tensor" in line and "=" in line:
            seq.append("G")
        elif "reduce_scatter_tensor" in line and "=" in line:
            seq.append("R")
        elif "wait_tensor" in line:
            seq.append("w")
        elif re.search(r"\bcpp_fused\w*\(|extern_kernels\.\w+\(|aten\.\w+\(", line):
            seq.append(".")
    return "".join(seq)


def _train(rank, world, options):
    import logging

    import graphcomp
    from graphcomp.models import Llama, synthetic_batch

    codes: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if "def call(" in msg:
                codes.append(msg)

    torch._logging.set_logs(output_code=True)
    handler = Keep()
    logging.getLogger("torch._inductor").addHandler(handler)

    torch._dynamo.reset()
    graphcomp.reset()
    torch.manual_seed(0)
    m = Llama("tiny")
    graphcomp.shard(m, param_dtype=torch.bfloat16)
    # (compile_once off: every rank must run Inductor's scheduler for its record)
    cm = torch.compile(m, backend="graphcomp", options={"codegen": "inductor", "compile_once": False, **SCHEDULE,
                                                        **options})
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    losses = []
    for step in range(2):
        tok, tgt = synthetic_batch(m.cfg, 2, 16, seed=step + 10 * rank)
        loss = cm(tok, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    records = {st: f["stages"][st].get("inductor_memory_reorder")
               for f in graphcomp.frame_summaries() for st in ("fwd", "bwd") if st in f["stages"]}
    c = graphcomp.counters
    logging.getLogger("torch._inductor").removeHandler(handler)
    torch._logging.set_logs()
    orders = [_code_order(code) for code in dict.fromkeys(codes)]  # forward, then backward
    return losses, records, c["inductor_memory_reorders"], c["inductor_memory_orders_kept"], orders


@pytest.fixture(scope="module")
def ranks2(shared_ranks2):
    return shared_ranks2.view(timeout=300)


def test_default_keeps_graphcomps_order_and_the_option_lets_inductor_reorder(ranks2):
    kept = ranks2.run(_train, {})
    moved = ranks2.run(_train, {"inductor_memory_reorder": True})
    for (l_kept, rec_kept, n_re, n_kept, o_kept), (l_moved, rec_moved, m_re, m_kept, o_moved) in zip(kept, moved):
        fwd, bwd = o_kept
        # graphcomp's order in the generated code: every forward gather issued before
        # the first run of compute (prefetch_bytes holds them all; single ops between
        # gathers are their input casts); the first backward reduce-scatter issued
        # before the last run of compute, not after it. Inductor's order here (torch
        # 2.13): ..GwwGw........Gww.Gww..Gw..... and .....Rww.Rww.Rww.Rw...
        assert fwd.rindex("G") < fwd.index("..."), fwd
        assert bwd.index("R") < bwd.rindex("..."), bwd
        assert o_moved != o_kept
        # default: the pass does not run on graphs with graphcomp's collectives
        assert rec_kept == {"fwd": {"allowed": False, "graphs": 0, "replaced": 0},
                            "bwd": {"allowed": False, "graphs": 0, "replaced": 0}}
        assert (n_re, n_kept) == (0, 0)
        # allowed: torch 2.13's pass replaces the order of both graphs here
        assert rec_moved["fwd"]["allowed"] and rec_moved["fwd"]["graphs"] == 1
        assert rec_moved["fwd"]["replaced"] == 1 and rec_moved["bwd"]["replaced"] == 1
        assert m_re == 2 and m_kept == 0
        assert l_kept == l_moved  # reordering independent kernels changes no number


def test_inspect_says_whose_order_ran():
    from graphcomp.tools.inspect_dumps import format_frame

    def stage(rec):
        return {"nodes_in": 1, "nodes_out": 1, "passes": [], "collectives": [], "inductor_memory_reorder": rec}

    frame = {"frame": 0, "stages": {"fwd": stage({"allowed": False, "graphs": 0, "replaced": 0}),
                                    "bwd": stage({"allowed": True, "graphs": 2, "replaced": 1})}}
    text = format_frame(frame)
    assert ("Inductor node order (inductor_memory_reorder): fwd: graphcomp's order kept (Inductor's "
            "reorder_for_peak_memory off); bwd: Inductor replaced the order of 1 of 2 graph(s)") in text
    from graphcomp.tools.inspect_html import _frame

    page = _frame(frame)
    assert "<dt>Inductor node order</dt><dd>fwd: graphcomp&#x27;s order kept" in page
    frame["stages"]["fwd"].pop("inductor_memory_reorder")
    frame["stages"]["bwd"].pop("inductor_memory_reorder")
    assert "Inductor node order" not in format_frame(frame)  # eager codegen, or no collectives
    assert "Inductor node order" not in _frame(frame)
