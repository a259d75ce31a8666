"""A CPU stand-in for the CUDA-graph device, for tests of the runner and of whole
models through it (no GPU here).

``FakeDevice`` replaces ``graphcomp.runtime.RUNTIME.device``: a "capture" runs the
piece (its collectives recorded, not run, as under stream capture) and keeps its
outputs as the graph's memory; a "replay" runs the piece again
into that memory and, as the worst case of one shared pool, scribbles over memory a
real replay could overwrite (see ``FakeGraph``), so a missing liveness check shows
up as NaNs. ``trial_capture`` runs the piece with ``in_capture`` set, so an op that
fails only under capture can be simulated. ``install_pretend_cuda`` makes
partition_graph treat CPU graphs as CUDA graphs (it splits them and the runners
capture through the fake device).
"""

from __future__ import annotations

import contextlib

import torch

from graphcomp import _compat, runtime
from graphcomp.runtime import capture, manager
from graphcomp.runtime.static import memory_of


def replay_whole_step(graph, fn, outputs):
    """A stand-in replay of a graphcomp.capture_step graph: the step function again,
    as its capture ran it (a whole step being recorded into ``graph``: the runners
    inline, the optimizer step recorded inline), its results written into the
    captured outputs (what a CUDA replay overwrites)."""
    rec = capture.Recording("step", graph, None)
    manager.RUNTIME.recordings.append(rec)
    try:
        with manager.RUNTIME.capturing():
            new = fn([])
    finally:
        manager.RUNTIME.recordings.remove(rec)
    with torch.no_grad():
        for o, n in zip(outputs, new):
            if isinstance(o, torch.Tensor):
                o.copy_(n)


class FakeGraph:
    """Replays into its captured output memory, and, as the worst case of a shared
    pool, scribbles over (a) every pool output of graphs captured after it (their
    memory may overlap this graph's scratch space: it was free while this one was
    captured) and (b) the output memory of graphs captured before it whose returned
    tensors had died by the end of its capture call (freed: it may have reused them)."""

    def __init__(self, device):
        self.device = device
        self.fn = None
        self.inputs = None  # the runner's static list (static slots filled before a replay)
        self.first_inputs = None  # the capture's own inputs, for the replay of the capture call
        self.memory = None  # the output memory (what the pool holds)
        self.returned = []  # (weak ref to the returned tensor's storage, memory tensor)
        self.freed = None  # memory of earlier graphs' outputs this one may overwrite
        self.released = False
        self.whole_step = False  # a graphcomp.capture_step graph (see FakeDevice.capture)
        self.skip_next = False

    def replay(self):
        if self.whole_step:  # graphcomp.capture_step's graph: the step function again, into its outputs
            if self.skip_next:
                self.skip_next = False
                return
            replay_whole_step(self, self.fn, self.memory)
            return
        ins = list(self.inputs)
        if self.first_inputs is not None:
            ins = [a if a is not None else b for a, b in zip(ins, self.first_inputs)]
            self.first_inputs = None
        new = self.fn(ins)
        del ins
        for o, n in zip(self.memory, new):
            if isinstance(o, torch.Tensor):
                if o.stride() == n.stride():  # (the memory a kernel wrote: also for expanded outputs)
                    memory_of(o).copy_(memory_of(n))
                else:
                    o.copy_(n)
        del new
        caps = self.device.captured
        me = caps.index(self)
        if self.freed is None:  # the end of the capture call
            # (minus memory its own outputs or another live tensor took over)
            own = {m.untyped_storage().data_ptr() for m in self.memory if isinstance(m, torch.Tensor)}
            own |= {m.untyped_storage().data_ptr() for g in caps for w, m in g.returned if not w.expired()}
            self.freed = [m for g in caps[:me] for w, m in g.returned
                          if w.expired() and m.untyped_storage().data_ptr() not in own]
        for t in self.freed:
            t.fill_(float("nan") if t.is_floating_point() else -7)
        for g in caps[me + 1:]:
            for t in g.pool_outputs():
                t.fill_(float("nan") if t.is_floating_point() else -7)

    def pool_outputs(self):
        return [m for _w, m in self.returned]

    def reset(self):
        self.released = True

    # (owners reset graphs through FakeDevice.reset_graph, which refuses under capture)


class FakeDevice(manager.CudaDevice):
    def __init__(self):
        self.capturing_seen = []
        self.captured = []  # graphs in capture order (FakeGraph.replay scribbles on later ones)
        self.pins = []
        self.trials = 0
        self.in_capture = False
        self.pools = 0
        self.graphs_by_pool = {}  # pool -> graphs captured into it

    def pool_handle(self):
        self.pools += 1
        return ("pool", self.pools)

    def new_stream(self):
        return object()

    def current_stream(self):
        return object()

    def wait(self, a, b):
        pass

    def stream(self, s):
        return contextlib.nullcontext()

    def new_event(self, external=False):
        return object()

    def record_event(self, ev):
        pass

    def wait_event(self, waiter, ev):
        pass

    def new_graph(self):
        return FakeGraph(self)

    def capture(self, g, pool, stream, fn, inputs, replay_inputs):
        """Runs ``fn`` (its outputs are the graph's memory) and returns tensors that
        alias that memory without owning it, as the pool's outputs would be: their
        death is what frees the memory (tracked by weak reference)."""
        from torch.multiprocessing.reductions import StorageWeakRef

        # torch's rule (CUDACachingAllocator beginAllocateToPool): a capture into a pool
        # id that graphs used before needs one of them alive, or a pin of the pool
        used = self.graphs_by_pool.setdefault(pool, [])
        if used and all(x.released for x in used) and pool not in self.pins:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED (stand-in: a capture into a pool "
                               "whose graphs were all reset, not pinned)")
        used.append(g)
        rec = capture.recording()
        if rec is not None and rec.kind == "step" and rec.graph is g:
            # a whole training step (impure: it updates parameters): its capture call's
            # step runs here, for real, once (a CUDA capture executes nothing and the
            # capture call then replays); every later replay runs the step function again
            g.fn, g.whole_step, g.skip_next = fn, True, True
            self.in_capture = True  # (a graph reset now would break the capture: reset_graph refuses)
            try:
                g.memory = list(fn(inputs))
            finally:
                self.in_capture = False
            return list(g.memory)
        g.fn, g.inputs = fn, replay_inputs
        g.first_inputs = list(inputs)
        refs = [StorageWeakRef(a.untyped_storage()) for a in inputs if isinstance(a, torch.Tensor)]
        # a CUDA capture executes nothing: an input the piece writes in place (BatchNorm's
        # running statistics) keeps its value; the replay that follows is the one write
        written = [(a, a._version, a.clone()) for a in inputs if isinstance(a, torch.Tensor)]
        self.in_capture = True
        try:
            with _compat.collectives_not_run():  # (a capture records collectives, does not run them)
                g.memory = list(fn(inputs))
        finally:
            self.in_capture = False
            with torch.no_grad():
                for a, version, before in written:
                    # (compiled kernels write without bumping the version counter: compare values too)
                    if a._version != version or not torch.equal(a, before):
                        a.copy_(before)
            del written
        self.captured.append(g)
        # an output aliases an input only if it is on that (live) storage itself; the
        # graph's stash of its inputs is dropped at its first replay, so compare ids
        live_in = {r.cdata for r in refs}
        ins = {m.untyped_storage().data_ptr() for m in g.memory
               if isinstance(m, torch.Tensor) and m.untyped_storage()._cdata in live_in}
        out, views = [], {}
        for k, m in enumerate(g.memory):
            if not isinstance(m, torch.Tensor) or m.untyped_storage().data_ptr() in ins:
                out.append(m)
                if isinstance(m, torch.Tensor):
                    g.memory[k] = None  # a view of an input is not graph memory (a real graph holds no tensors)
                continue
            st = m.untyped_storage()
            if st.data_ptr() not in views:
                views[st.data_ptr()] = torch._C._construct_storage_from_data_pointer(st.data_ptr(), m.device, st.nbytes())
                g.returned.append((StorageWeakRef(views[st.data_ptr()]), m))
            out.append(torch.empty((0,), dtype=m.dtype).set_(views[st.data_ptr()], m.storage_offset(), m.shape, m.stride()))
        return out

    def trial_capture(self, stream, fn, inputs):
        """As the CUDA device's: capture ``fn`` on a copy of the input list into a
        throwaway graph (``self.in_capture`` True: ops that fail only under capture
        test it; collectives recorded, not run), then replay that graph once (``fn``
        again: the collectives it recorded run now, unless the caller records them)."""
        self.trials += 1
        self.in_capture = True
        try:
            with _compat.collectives_not_run():  # (a capture records collectives, does not run them)
                fn(list(inputs))
        finally:
            self.in_capture = False
        fn(list(inputs))  # the replay

    def capture_active(self):
        return self.in_capture

    def pin_pool(self, pool):
        self.pins.append(pool)
        return len(self.pins)

    def unpin_pool(self, pool, token):
        self.pins.remove(pool)

    def synchronize(self):
        pass

    def available(self):
        return True


def install_fake_device(monkeypatch):
    """Generator for a fixture: the fake device installed, the runtime reset around."""
    runtime.reset()
    dev = FakeDevice()
    monkeypatch.setattr(runtime.RUNTIME, "device", dev)
    monkeypatch.setattr(manager, "check_nccl_env", lambda: True)
    monkeypatch.setattr(_compat, "wrap_destroy_process_group", lambda: True)
    yield dev
    runtime.reset()
    runtime.RUNTIME.device = manager.CudaDevice()


def install_pretend_cuda(monkeypatch):
    """Pretend the CPU graphs hold CUDA tensors, so partition_graph splits them and
    the runners (on the stand-in device) capture/replay."""
    import graphcomp.passes.partition_graph as pg

    monkeypatch.setattr(pg, "has_cuda_tensors", lambda gm: True)
    real = pg.uncapturable_reason

    def pred(node, split_ops=()):
        r = real(node, split_ops)
        return None if r is not None and r.kind in ("cpu", "device_copy") else r

    monkeypatch.setattr(pg, "uncapturable_reason", pred)
    monkeypatch.setattr(torch._dynamo.config, "capture_scalar_outputs", True)


@contextlib.contextmanager
def fake_cuda_runtime():
    """Both of the above outside a pytest fixture (a DistPool rank's task): CPU graphs
    split as CUDA ones, their pieces captured and replayed on the stand-in device;
    everything undone on exit. Yields the device."""
    from _pytest.monkeypatch import MonkeyPatch

    mp = MonkeyPatch()
    gen = install_fake_device(mp)
    dev = next(gen)
    install_pretend_cuda(mp)
    try:
        yield dev
    finally:
        next(gen, None)
        mp.undo()
