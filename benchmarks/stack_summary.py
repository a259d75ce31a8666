"""Summarize a stack-sample file written by benchmarks/stack_sampler (``STACKS=<s>`` in
gpu_session.sh): one line per sample with its time, the innermost frame of this
repository (graphcomp/ or benchmarks/) and the innermost frame, then the seconds per
innermost repository frame (each sample counts for the interval since the previous one).
A sample whose main thread waits in the autograd engine counts the working thread's
stack (on CUDA the backward, and its lazy compile, run on an autograd device thread).

    python -m benchmarks.stack_summary benchmarks/results/...-stacks-....txt[.gz] [--top 15]
    python -m benchmarks.stack_summary FILE --inclusive torch/_inductor/ [--top 30]

``--inclusive PREFIX`` adds the seconds each function under PREFIX was on the stack
(inclusive: a function and everything it called; a sample counts once per function).
"""
from __future__ import annotations

import argparse
import gzip
import re
from collections import Counter

_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
_OURS = ("/graphcomp/", "/benchmarks/")


def _short(path: str) -> str:
    for key in ("site-packages/", "/graphcomp/", "/benchmarks/"):
        i = path.rfind(key)
        if i >= 0:
            return path[i + len(key):] if key == "site-packages/" else path[i + 1:]
    return path


def parse(text: str) -> list[tuple[float, list[tuple[str, int, str]]]]:
    """[(t seconds, [(path, line, function), outermost first])] per sample."""
    samples = []
    for block in text.split("=== t=")[1:]:
        head, _, body = block.partition("\n")
        t = float(head.rstrip("s"))
        main, *threads = body.split("--- thread ")
        frames = _frames(main)
        if frames and frames[-1][2] in _WAITING and threads:
            # the main thread waits for the autograd engine: count the thread that works
            frames = frames + _frames(threads[0].partition("\n")[2])
        samples.append((t, frames))
    return samples


_WAITING = ("_engine_run_backward", "run_backward")


def _frames(body: str) -> list[tuple[str, int, str]]:
    return [(m["path"], int(m["line"]), m["func"]) for m in _FRAME.finditer(body)]


def inclusive(samples: list[tuple[float, list[tuple[str, int, str]]]], prefix: str, top: int = 30) -> str:
    """Seconds each function under ``prefix`` (a path fragment) was on the stack."""
    spent, prev = Counter(), 0.0
    for t, frames in samples:
        for key in {f"{_short(p)} {fn}" for p, _, fn in frames if prefix in p}:
            spent[key] += t - prev
        prev = t
    lines = [f"inclusive seconds under {prefix!r} ({len(samples)} samples, {prev:.0f} s):"]
    lines += [f"{s:7.1f}s  {where}" for where, s in spent.most_common(top)]
    return "\n".join(lines)


def innermost_ours(frames: list[tuple[str, int, str]]) -> str:
    for path, line, func in reversed(frames):
        if any(k in path for k in _OURS) and "stack_sampler" not in path:
            return f"{_short(path)}:{line} {func}"
    return "-"


def summarize(samples: list[tuple[float, list[tuple[str, int, str]]]], top: int = 15) -> str:
    lines, spent, prev = [], Counter(), 0.0
    for t, frames in samples:
        ours = innermost_ours(frames)
        leaf = f"{_short(frames[-1][0])}:{frames[-1][1]} {frames[-1][2]}" if frames else "-"
        lines.append(f"{t:7.0f}s  {ours:<55}  {leaf}")
        spent[ours] += t - prev
        prev = t
    lines.append("")
    lines.append(f"seconds per innermost repository frame ({len(samples)} samples):")
    for where, s in spent.most_common(top):
        lines.append(f"{s:7.0f}s  {where}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--inclusive", metavar="PREFIX", help="also the inclusive seconds per function under PREFIX")
    a = ap.parse_args(argv)
    opener = gzip.open if a.file.endswith(".gz") else open
    with opener(a.file, "rt") as f:
        samples = parse(f.read())
    print(summarize(samples, a.top))
    if a.inclusive:
        print()
        print(inclusive(samples, a.inclusive, a.top))


if __name__ == "__main__":
    main()
