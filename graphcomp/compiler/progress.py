"""Progress of a long compile: what it is doing, said while it does it.

A frame's compile runs through phases (the passes of each stage, Inductor's code
generation of each stage). :class:`CompileProgress` times each phase into the frame's
summary (``phase_seconds``) and, while a phase lasts longer than ``INTERVAL_S``, logs
an INFO line every ``INTERVAL_S`` seconds naming the frame, the phase and the time so
far, so that a compile of minutes is never mistaken for a hang::

    graphcomp: frame 0 still compiling: Inductor bwd for 20 s (41 s since the frame started)

The lines come from a timer thread that exists only while a phase is open.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

INTERVAL_S = 10.0
"""Seconds between two progress lines of one phase."""


class CompileProgress:
    def __init__(self, frame_id: int, seconds: dict[str, float]):
        self.frame_id = frame_id
        self.seconds = seconds  # phase -> seconds, accumulated (the frame summary's phase_seconds)
        self.t0 = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time ``name`` and report it every ``INTERVAL_S`` while it runs."""
        start = time.perf_counter()
        done = threading.Event()

        def report() -> None:
            while not done.wait(INTERVAL_S):
                now = time.perf_counter()
                log.info("graphcomp: frame %d still compiling: %s for %.0f s (%.0f s since the frame started)",
                         self.frame_id, name, now - start, now - self.t0)

        timer = threading.Thread(target=report, name=f"graphcomp-progress-{self.frame_id}", daemon=True)
        timer.start()
        try:
            yield
        finally:
            done.set()
            timer.join()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
