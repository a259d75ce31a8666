"""The CUDA calls the CUDA-graph runtime makes, in one seam (``CudaDevice``).

The runtime never calls ``torch.cuda`` for graphs, pools or streams directly: it
goes through ``RUNTIME.device``, an instance of :class:`CudaDevice`. The CPU tests
replace it with a stand-in that runs the captured function at every "replay"
(tests/cpu/_fakecuda.py), which is how the runner's decisions are tested without a GPU.
"""

from __future__ import annotations

from typing import Any

import torch


def _default_generator() -> Any:
    """The current device's default CUDA generator (the one every capture registers)."""
    try:
        return torch.cuda.default_generators[torch.cuda.current_device()]
    except Exception:  # noqa: BLE001 - no CUDA: nothing to restore
        return None


class CudaDevice:
    """The CUDA calls the runner makes, in one place (tests swap in a CPU stand-in)."""

    def pool_handle(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def new_stream(self) -> Any:
        return torch.cuda.Stream()

    def current_stream(self) -> Any:
        return torch.cuda.current_stream()

    def wait(self, waiter: Any, on: Any) -> None:
        waiter.wait_stream(on)

    def stream(self, s: Any) -> Any:
        return torch.cuda.stream(s)

    def new_event(self, external: bool = False) -> Any:
        """A CUDA event; ``external``: recorded inside a capture it becomes an event
        record node that work outside the graph can wait for (``cudaEventRecordExternal``)."""
        from graphcomp import _compat

        return _compat.cuda_event(external=external)

    def record_event(self, ev: Any) -> None:
        ev.record(torch.cuda.current_stream())

    def wait_event(self, waiter: Any, ev: Any) -> None:
        waiter.wait_event(ev)

    def new_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def capture(self, g: Any, pool: Any, stream: Any, fn: Any, inputs: list[Any], replay_inputs: list[Any]) -> Any:
        """Capture ``fn(inputs)`` into ``g`` on ``stream`` in ``pool``; returns its
        outputs. ``fn`` consumes ``inputs`` (boxed). ``replay_inputs`` is the
        runner's static input list (a CUDA graph reads addresses, not this list).
        As ``torch.cuda.graph`` (synchronize and free cached blocks first), except
        that a failure always ends the capture and restores the current stream, so
        the process stays usable for eager execution."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        rng = _default_generator()
        rng_before = rng.clone_state() if rng is not None else None
        with torch.cuda.stream(stream):
            g.capture_begin(pool=pool)
            try:
                out = fn(inputs)
                g.capture_end()
            except BaseException:
                try:
                    g.capture_end()
                except Exception:  # noqa: BLE001 - the capture is invalid anyway
                    pass
                if rng is not None:
                    # a capture that fails before its end leaves the default generator in
                    # capture mode (torch ends it in capture_end's epilogue, which the
                    # failure skips): the next random op outside a capture would raise
                    # "Offset increment outside graph capture encountered unexpectedly"
                    rng.graphsafe_set_state(rng_before)
                raise
        return out

    def capture_active(self) -> bool:
        """A graph is being captured on the current stream (False when CUDA cannot
        say: at interpreter exit, teardown still drops its graphs)."""
        try:
            return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        except Exception:  # noqa: BLE001 - a CUDA context being torn down
            return False

    def reset_graph(self, g: Any) -> None:
        """``g.reset()`` for a graph's owner, refused while another graph is being
        captured: under CUDA's global capture mode destroying a graph invalidates the
        capture in progress, and the error shows only at a later kernel launch ("operation
        failed due to a previous error during capture"), far from its cause. Other
        errors of a reset are ignored (the graph is dropped either way)."""
        if self.capture_active():
            raise RuntimeError("graphcomp: a CUDA graph would be reset while another graph is being captured (it "
                               "would invalidate that capture); the reset must wait until the capture ends")
        try:
            g.reset()
        except Exception:  # noqa: BLE001 - pragma: no cover (a reset that fails leaves nothing to free)
            pass

    def trial_capture(self, stream: Any, fn: Any, inputs: list[Any]) -> None:
        """Capture ``fn`` on a copy of ``inputs`` (nothing consumed) into a
        throwaway graph and pool, instantiate and replay it once, then free it all:
        whatever capture, instantiation or the first replay would raise, raises here
        while the caller still holds every input (it can run the call eagerly).
        Costs one more run of the piece and a capture, at capture time only."""
        g = torch.cuda.CUDAGraph()
        outs = self.capture(g, torch.cuda.graph_pool_handle(), stream, fn, list(inputs), [])
        with torch.cuda.stream(stream):
            g.replay()
        stream.synchronize()
        del outs
        g.reset()
        del g
        torch.cuda.empty_cache()

    def pin_pool(self, pool: Any) -> Any:
        from graphcomp import _compat

        dev = torch.cuda.current_device()
        _compat.pin_pool(dev, pool)
        return dev

    def unpin_pool(self, pool: Any, token: Any) -> None:
        from graphcomp import _compat

        _compat.unpin_pool(token, pool)

    def synchronize(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def available(self) -> bool:
        return torch.cuda.is_available()

    device_type = "cuda"
    """The tensors' device type graphs are captured for (a stand-in device says "cpu")."""

    def supports_if_nodes(self) -> bool:
        """Whether a capture can contain a conditional (IF) node (CUDA >= 12.4)."""
        from graphcomp import _compat

        return _compat.cuda_graph_if_supported()

    def run_if(self, g: Any, pred: Any, fn: Any) -> None:
        """Inside the capture of ``g``: capture ``fn()`` into an IF node that runs
        at replay only while ``pred`` (a 0-dim bool device tensor) is true."""
        from graphcomp import _compat

        with _compat.cuda_graph_if(g, pred):
            fn()
