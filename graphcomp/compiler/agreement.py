"""Rank agreement: ranks compare the collectives they are about to issue, so that
ranks whose Python took different paths fail with an error naming the first
differing collective instead of hanging until the process-group timeout.

Compile time (``Config.rank_agreement``, on by default). After the passes of a
forward or backward graph, each rank groups the graph's collectives by process
group and, for every group with more than one member, publishes the sequence in
the default process group's store under
``graphcomp/agree/<epoch>/<group>/<dynamo frame id>/<stage>/<compile #>/<rank>``, then
waits, at most ``Config.rank_agreement_timeout`` seconds, for every other member's
entry of the same frame, stage and compile::

    rank 0: set(agree/1/0/0/fwd/0/0, [ag f32 4096 B, ag f32 96 B, ...]) ─┐ each waits for
    rank 1: set(agree/1/0/0/fwd/0/1, [ag f32 4096 B, ag f32 96 B, ag f32 96 B]) ─┘ the other's
    compare: first difference -> RankDivergence on both ranks

A recompile on one rank alone (it saw a new input shape) does not wait: when the
other members' latest entry for the frame holds the same sequence it passes at once
(see :func:`check_compiled`).

A row is what must agree for the collective to match across ranks: kind, op,
dtype, bytes on the wire, and the plan decisions (bucket and the parameters in it,
fused downcast, reshard after forward, prefetch distance); the source line (from
``node.meta['stack_trace']``) is carried for the message only. Only the store is
used (no collective), so a rank that never compiles the graph cannot deadlock
the check: its peers raise after the timeout.

Eager (``GRAPHCOMP_DEBUG=1``). Outside compiled graphs, every all-gather and
reduce-scatter that ``graphcomp.shard`` / ``graphcomp.sharding.gather_scope`` issue is
checked the same way just before it is issued (kind, dtype, shape, the Python
line), under ``graphcomp/eager/<group>/<n>/<rank>``: a step whose ranks read
different weights fails at the first differing gather. It costs one store round
trip per collective: a debugging aid, off unless the variable is set.
"""

from __future__ import annotations

import datetime
import json
import logging
import traceback
from typing import Any

from graphcomp import _compat, env
from graphcomp.analysis import graph_utils
from graphcomp.errors import RankDivergence
from graphcomp.session import SESSION

log = logging.getLogger(__name__)

# what must be equal across ranks (the source line, and the graph-input names a bucket
# holds, which shift with a recompile's symbolic inputs, are for the message only).
# ``prefetch_ahead`` is shown but not compared: it counts the local compute nodes a
# gather runs ahead of its first use, which says nothing about the order of the
# collectives (the rows' order does). CUDA ranks with the same collectives can count
# differently (the cause is not known; on CPU ranks both graphs hold the same ops).
ROW_FIELDS = ("kind", "op", "dtype", "bytes", "bucket", "fused_downcast", "resharded")
SHOWN_FIELDS = ROW_FIELDS + ("prefetch_ahead",)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def sequences(colls: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The rows of ``colls`` (``graph_utils.collectives``) per process-group name, in
    graph order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for c in colls:
        if c.get("group") is None:
            continue
        row = {k: c.get(k) for k in SHOWN_FIELDS}
        row["params"] = c.get("params")
        row["source"] = c.get("source")
        out.setdefault(c["group"], []).append(row)
    return out


def _describe(row: dict[str, Any] | None, n: int) -> str:
    if row is None:
        return f"(nothing: its graph issues only {n} collective(s) on this group)"
    s = f"{row['kind']} {row['dtype']} {row['bytes']} B"
    extras = [f"{k}={row[k]}" for k in ("bucket", "params", "fused_downcast", "resharded", "prefetch_ahead")
              if row.get(k) not in (None, False)]
    if row.get("shape") is not None:
        extras.insert(0, f"shape {row['shape']}")
    if extras:
        s += " (" + ", ".join(str(e) for e in extras) + ")"
    return s + f", issued at {row.get('source') or 'an unknown line (no stack trace)'}"


def first_difference(mine: list[dict[str, Any]], theirs: list[dict[str, Any]],
                     fields: tuple[str, ...] = ROW_FIELDS) -> int | None:
    """Index of the first row that differs in ``fields`` (or that one side lacks), or
    None when the sequences agree."""
    for i in range(max(len(mine), len(theirs))):
        a = mine[i] if i < len(mine) else None
        b = theirs[i] if i < len(theirs) else None
        if a is None or b is None or any(a.get(k) != b.get(k) for k in fields):
            return i
    return None


def _exchange(prefix: str, entries: dict[str, dict[str, Any]], timeout_s: float) -> dict[str, dict[int, dict[str, Any]]]:
    """Eager check: publish ``entries`` (group -> this rank's payload) as this rank's
    next entry on each group and collect every other member's entry of the same
    number; returns group -> {rank: payload}. Every entry is published before any
    wait, so ranks checking several groups cannot wait on each other in a cycle."""
    store = _compat.default_store()
    rank = _rank()
    todo: list[tuple[str, str, list[int]]] = []
    for g, payload in sorted(entries.items()):
        members = _compat.group_ranks(g)
        if members is None or len(members) < 2 or rank not in members:
            continue
        key = f"{prefix}:{g}"
        n = SESSION.agree_seq.get(key, 0)
        SESSION.agree_seq[key] = n + 1
        base = f"graphcomp/{prefix}/{g}/{n}"
        store.set(f"{base}/{rank}", json.dumps(payload, default=str))
        todo.append((g, base, [r for r in members if r != rank]))
    return {g: {r: _wait_for(store, f"{base}/{r}", timeout_s, g, r, entries[g]) for r in others}
            for g, base, others in todo}


def _compare(what: str, mine: dict[str, dict[str, Any]], got: dict[str, dict[int, dict[str, Any]]],
             fields: tuple[str, ...], hint: str, offset: int = 0) -> None:
    rank = _rank()
    for g, others in sorted(got.items()):
        a = mine[g]["rows"]
        for r, payload in sorted(others.items()):
            b = payload["rows"]
            i = first_difference(a, b, fields)
            if i is None:
                continue
            ra = a[i] if i < len(a) else None
            rb = b[i] if i < len(b) else None
            SESSION.counters.add("rank_divergences")
            raise RankDivergence(
                f"graphcomp: ranks disagree on the collectives of {what} on process group {g!r}: "
                f"collective #{i + offset} differs.\n"
                f"  rank {rank}: {_describe(ra, len(a))}\n"
                f"  rank {r} ({payload.get('what', '?')}): {_describe(rb, len(b))}\n"
                f"{hint}"
            )


COMPILED_HINT = (
    "Ranks whose Python takes different paths (a data-dependent branch, a weight read on one rank only, "
    "different input shapes) compile graphs with different collectives and would hang in the first one "
    "that differs. Make every rank run the same code on the same shapes. (Config.rank_agreement=False "
    "skips this check.)"
)


def _wait_for(store: Any, key: str, timeout_s: float, g: str, r: int, mine: dict[str, Any]) -> dict[str, Any]:
    """The entry ``key`` of member ``r``, waited for up to ``timeout_s``; a
    ``RankDivergence`` describing ``mine`` (its ``what``, and its ``rows`` or its
    own ``about`` sentence) when it does not come."""
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - DistStoreError (timeout) or a closed store
        rows = mine.get("rows", [])
        about = mine.get("about") or (
            f"This rank (rank {_rank()}) is about to issue {len(rows)} collective(s) there; the first: "
            f"{_describe(rows[0] if rows else None, 0)}.")
        raise RankDivergence(
            f"graphcomp: rank {r} did not publish {mine.get('kind', 'the collective sequence')} of "
            f"{mine.get('what', 'this graph')} on process group {g!r} within {timeout_s:g} s "
            f"({type(e).__name__}: {e}). {about} Rank {r} compiled no matching graph: it took another "
            f"Python path, compiles its frames in another order, is still compiling, or died. Make every rank "
            f"run the same code, or raise Config.rank_agreement_timeout if its compile is just slow."
        ) from None
    return json.loads(store.get(key))


def note_frame() -> None:
    """Called for every graph the backend compiles: after ``torch._dynamo.reset()``
    Dynamo's frame ids restart at 0, and a new epoch begins, so that the new
    compiles' keys never meet the previous epoch's store entries (a stale entry of
    the same frame id would read as a divergence on one rank while the other goes
    on: a hang). A reset is seen as the first compile (compile number 0) of a frame id at
    or below the highest one compiled so far: Dynamo numbers new code objects
    upwards, so only a restart gives an old id a first compile again. (Dynamo's
    frame 0 need not reach the backend: a graph break before any op, HF Mixtral's
    eager experts loop; several graphs of one compile, split at graph breaks, call
    this once each with the same id.)"""
    cid = _compat.dynamo_compile_id()
    if cid is None:
        return
    seq = SESSION.agree_seq
    ctx = _compat.dynamo_compile_context()
    if ctx is not None and ctx is SESSION.agree_compile:
        seq["graph_in_compile"] = seq.get("graph_in_compile", 0) + 1
        return  # another graph of the same Dynamo compile
    SESSION.agree_compile = ctx
    seq["graph_in_compile"] = 0
    if cid[1] == 0 and cid[0] <= seq.get("max_frame", -1):
        seq["epoch"] = seq.get("epoch", 0) + 1
        seq["max_frame"] = cid[0]
    seq["max_frame"] = max(seq.get("max_frame", -1), cid[0])


def frame_store_id(frame_id: int) -> str:
    """A name for the graph being compiled that is the same on every rank compiling
    the same code: the epoch, Dynamo's frame id and compile number, and the graph's
    index within that compile (graph breaks); the backend's own frame counter where
    Dynamo has no compile id."""
    cid = _compat.dynamo_compile_id()
    seq = SESSION.agree_seq
    if cid is None:
        return f"{seq.get('epoch', 0)}/own{frame_id}"
    return f"{seq.get('epoch', 0)}/{cid[0]}/{cid[1]}/{seq.get('graph_in_compile', 0)}"


def check_compiled(frame_id: int, stage: str, colls: list[dict[str, Any]], cfg: Any) -> None:
    """Compile-time agreement for one stage graph (see the module docstring).

    An entry is keyed by the epoch (see :func:`note_frame`), Dynamo's frame id (the
    same code object on every rank), its compile number and the stage; each rank
    also points ``.../latest`` at its newest compile of the frame. Against each
    other member: its entry for the same compile decides, waited for up to
    ``rank_agreement_timeout``; except that a recompile (compile number > 0) whose
    entry the member lacks passes at once when the member's latest compile of the
    frame holds the same sequence (one rank saw a new input shape: the same
    collectives, and no peer will compile to match)."""
    store = _compat.default_store()
    if not cfg.rank_agreement or store is None:
        return
    seqs = sequences(colls)
    if not seqs:
        return
    rank = _rank()
    cid = _compat.dynamo_compile_id() or (-1, frame_id)
    epoch = SESSION.agree_seq.get("epoch", 0)
    what = f"the {stage} graph of frame {frame_id}" + (f" (recompile #{cid[1]})" if cid[1] > 0 else "")
    todo = []
    for g, rows in sorted(seqs.items()):
        members = _compat.group_ranks(g)
        if members is None or len(members) < 2 or rank not in members:
            continue
        base = f"graphcomp/agree/{epoch}/{g}/{cid[0]}/{stage}"
        mine = {"what": what, "rows": rows}
        store.set(f"{base}/{cid[1]}/{rank}", json.dumps(mine, default=str))
        store.set(f"{base}/latest/{rank}", str(cid[1]))
        todo.append((g, base, mine, [r for r in members if r != rank]))
    for g, base, mine, others in todo:  # (every entry is published before any wait)
        got: dict[int, dict[str, Any]] = {}
        for r in others:
            same = f"{base}/{cid[1]}/{r}"
            if cid[1] > 0 and not store.check([same]) and store.check([f"{base}/latest/{r}"]):
                latest = store.get(f"{base}/latest/{r}").decode()
                theirs = json.loads(store.get(f"{base}/{latest}/{r}"))
                if first_difference(mine["rows"], theirs["rows"]) is None:
                    log.info("graphcomp: %s compiled on rank %d only; its collectives on group %r match "
                             "rank %d's compile #%s", what, rank, g, r, latest)
                    continue
            got[r] = _wait_for(store, same, cfg.rank_agreement_timeout, g, r, mine)
        _compare(what, {g: mine}, {g: got}, ROW_FIELDS, COMPILED_HINT)
    if todo:
        SESSION.counters.add("rank_agreement_checks")
        log.debug("graphcomp: %s agrees across ranks on %d group(s)", what, len(todo))


def agree_kept(group: str | None, function: str, digest: str, kept: list[int], n_groups: int, cfg: Any,
               plan: str = "its keep plan (reshard_after_forward='auto')", counted: str = "gathers",
               namespace: str = "keep", about: str | None = None) -> list[int]:
    """``reshard_after_forward="auto"`` at the first compile of a graph of
    ``function``: every member of ``group`` publishes the gather groups its own
    estimate keeps and all keep the intersection, so that ranks whose first inputs
    differ in shape (their estimates differ near the budget) issue the same gathers.
    Keeping fewer never breaks a rank's budget (the estimate only grows as gathers
    are kept).

    ``plan``, ``counted``, ``namespace`` and ``about`` name another plan of the same shape (a set
    of indices every rank must hold alike; ``defer_weight_grads`` agrees on a count as
    ``range(k)``) in messages and store keys.

    Entries are numbered per function (the k-th graph of it this rank plans: the
    graphs of a function split at graph breaks come in the same order on every
    rank), not by the graph's gathers (``digest``, in the entry), so that ranks
    whose graphs differ meet at once: they keep their own plans, and the
    compile-time agreement of the forward graph (:func:`check_compiled`) then names
    the first differing collective and its source line, on every rank, instead of
    both waiting out the timeout on keys the other never writes. A member that does
    not publish within ``rank_agreement_timeout`` raises ``RankDivergence``. Without
    rank agreement, a store, or another member: ``kept`` as it is."""
    store = _compat.default_store()
    members = _compat.group_ranks(group) if group is not None else None
    if not cfg.rank_agreement or store is None or members is None or len(members) < 2:
        return kept
    rank = _rank()
    if rank not in members:
        return kept
    epoch = SESSION.agree_seq.get("epoch", 0)
    seq = f"{namespace}:{epoch}:{group}:{function}"
    n = SESSION.agree_seq.get(seq, 0)  # (graphcomp.reset() forgets the plans, not the store)
    SESSION.agree_seq[seq] = n + 1
    base = f"graphcomp/{namespace}/{epoch}/{group}/{function}/{n}"
    what = f"graph #{n} of function {function} (its {counted}: {digest})"
    mine = {"kind": plan, "what": what, "digest": digest,
            "kept": kept, "rows": [],
            "about": f"This rank (rank {rank}) " + (about or f"keeps {len(kept)} of its {n_groups} gathers for "
                                                              "the backward.")}
    store.set(f"{base}/{rank}", json.dumps(mine))
    out = set(kept)
    for r in members:
        if r == rank:
            continue
        theirs = _wait_for(store, f"{base}/{r}", cfg.rank_agreement_timeout, group, r, mine)
        if theirs.get("digest") != digest:
            log.warning("graphcomp: rank %d planned other gathers for %s (theirs: %s): each rank keeps its own "
                        "plan; the forward graph's rank agreement names the difference", r, what,
                        theirs.get("digest"))
            return kept
        out &= set(theirs["kept"])
    return sorted(out)


def _python_source() -> str | None:
    frames = [(f.filename, f.lineno or 0, f.line or "") for f in traceback.extract_stack()[:-2]]
    return graph_utils.user_frame(frames)


def check_eager(kind: str, group_name: str, dtype: Any, shape: tuple[int, ...]) -> None:
    """``GRAPHCOMP_DEBUG=1``: before an eager collective of graphcomp's, check that
    every member of ``group_name`` is about to issue the same one."""
    if not env.debug() or _compat.default_store() is None:
        return
    import math

    import torch

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    row = {"kind": kind, "dtype": str(dtype).replace("torch.", ""), "bytes": nbytes, "shape": list(shape),
           "source": _python_source()}
    mine = {group_name: {"what": "eager code", "rows": [row]}}
    n = SESSION.agree_seq.get(f"eager:{group_name}", 0)  # (the number this check gets: the message counts from 0)
    got = _exchange("eager", mine, env.agree_timeout())
    _compare("eager code since the process started (GRAPHCOMP_DEBUG=1 checks every gather and "
             "reduce-scatter outside compiled graphs; shard shapes and bytes)",
             mine, got, ("kind", "dtype", "shape"),
             "Ranks read different sharded parameters outside compiled graphs (a data-dependent branch or "
             "loop, a weight read on one rank only); the next collective would hang or mix data. Make "
             "every rank read the same parameters in the same order, or put the module under a gather "
             "scope (graphcomp.shard does for every module that owns parameters).", offset=n)
