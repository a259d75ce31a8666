"""Summarize a stack-sample file written by benchmarks/stack_sampler (``STACKS=<s>`` in
gpu_session.sh): one line per sample with its time, the innermost frame of this
repository (graphcomp/ or benchmarks/) and the innermost frame, then the seconds per
innermost repository frame (each sample counts for the interval since the previous one).

    python -m benchmarks.stack_summary benchmarks/results/...-stacks-....txt [--top 15]
"""
from __future__ import annotations

import argparse
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
        frames = [(m["path"], int(m["line"]), m["func"]) for m in _FRAME.finditer(body)]
        samples.append((t, frames))
    return samples


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
    a = ap.parse_args(argv)
    with open(a.file) as f:
        print(summarize(parse(f.read()), a.top))


if __name__ == "__main__":
    main()
