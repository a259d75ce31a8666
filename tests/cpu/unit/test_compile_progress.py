"""A long compile says what it is doing: every phase of a frame's compile (the passes
of each stage, Inductor's code generation) is timed into the frame's summary, and a
phase that lasts longer than ``progress.INTERVAL_S`` logs an INFO line naming the
frame, the phase and the time so far (10 s by default; a short interval here)."""

from __future__ import annotations

import logging
import time

import torch

import graphcomp
from graphcomp.compiler import progress


def test_every_phase_of_a_frame_is_timed_into_its_summary():
    f = torch.compile(lambda x: (x.sin() * 2).cos().sum(), backend="graphcomp", options={"codegen": "eager"})
    f(torch.randn(8, requires_grad=True)).backward()
    (frame,) = graphcomp.frame_summaries()
    phases = frame["phase_seconds"]
    assert {"dynamo passes", "joint passes", "fwd passes", "bwd passes"} <= set(phases), phases
    assert all(s >= 0 for s in phases.values())
    # the health report lists them too (longest first)
    from graphcomp.tools.health import format_health, health_report

    report = health_report()
    assert set(report["compile"]["phase_seconds"]) == set(phases)
    assert "compile     : 1 frame(s)" in format_health(report) and " s: " in format_health(report)


def test_a_phase_longer_than_the_interval_logs_its_progress(monkeypatch, caplog):
    monkeypatch.setattr(progress, "INTERVAL_S", 0.02)
    seconds: dict[str, float] = {}
    p = progress.CompileProgress(7, seconds)
    with caplog.at_level(logging.INFO, logger="graphcomp.compiler.progress"):
        with p.phase("Inductor bwd"):
            time.sleep(0.15)
        with p.phase("fwd passes"):
            pass
    lines = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("graphcomp: frame 7 still compiling: Inductor bwd for ") for m in lines), lines
    assert not any("fwd passes" in m for m in lines), lines  # (shorter than the interval: silent)
    assert seconds["Inductor bwd"] >= 0.15 and set(seconds) == {"Inductor bwd", "fwd passes"}
