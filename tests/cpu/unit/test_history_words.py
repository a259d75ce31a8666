"""The library, the examples, the README and docs/ say what the code does, not its
history: no commit hashes, run dates, labels of numbered work rounds ("the twelfth
session", "round 2") or issue numbers ("issue 17"). Measurements live in
benchmarks/results/ and are linked, not retold.

Allowed: a full URL (``https://github.com/pytorch/pytorch/issues/174704`` is how
another project's issue is cited) and a path under ``benchmarks/results/`` (a result
file's name carries its date and commit); both are blanked before the scan, so a hit
never falls inside one.

Tests are not scanned: their names and docstrings may cite the bug they pin."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

# Blanked (replaced by spaces, so columns stay put) before the scan.
_ALLOWED = re.compile(
    r"https?://[^\s)>\]`'\"]+"  # a URL, up to whitespace or a closing bracket/quote
    r"|benchmarks/results/[^\s)>\]`'\"]*"  # a path to a result file or folder
)

# A standalone 7-12 character lowercase hex token (not part of a longer word, not
# after "0x"); _is_commit adds: at least one digit and at least two letters a-f.
_HEX = re.compile(r"(?<![\w.])(?<!0x)[0-9a-f]{7,12}(?![\w])")

_DATE = re.compile(r"(?<!\d)20\d\d-\d\d-\d\d(?!\d)")

_ORDINAL = (
    r"(?:(?:twenty|thirty|forty|fifty)[- ])?"
    r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|"
    r"twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|"
    r"nineteenth|twentieth|thirtieth|fortieth|fiftieth)"
    r"|\d+(?:st|nd|rd|th)"
)
_ROUND = re.compile(
    rf"\b(?:{_ORDINAL})[\s-]+(?:session|round)s?\b"  # "twelfth session", "third-round"
    r"|\b(?:session|round)s?[\s-]*#?\d+\b",  # "session 22", "round 2", "sessions 20-22"
    re.IGNORECASE,
)

_ISSUE = re.compile(
    r"\bissues?[\s-]*#\s*\d+"  # "issue #4", "issues #4"
    r"|\bissue[\s-]*\d+\b"  # "issue 17", "Issue 17's"
    r"|\bissues\s+\d+(?:\s*(?:,|and|&|-)\s*\d+)+"  # "issues 3 and 4", "issues 3-5"
    # "#1234" after a tracker's name: "PR #12", "pytorch#174704", "pytorch/pytorch#174704"
    r"|\b(?:PRs?|pull(?:\s+request)?|pytorch|torch|torchtitan|deepspeed|megatron|"
    r"transformers|accelerate|triton|fsdp|nccl|[\w.-]+/[\w.-]+)\s*#\d{2,}",
    re.IGNORECASE,
)


def _is_commit(tok: str) -> bool:
    letters = sum(c in "abcdef" for c in tok)
    return letters >= 2 and any(c.isdigit() for c in tok)


def scan(text: str) -> list[tuple[int, str, str]]:
    """Every history word in ``text`` as ``(line_no, kind, match)``, lines numbered
    from 1; kind is "commit", "date", "round" or "issue"."""
    hits = []
    for no, line in enumerate(text.splitlines(), 1):
        line = _ALLOWED.sub(lambda m: " " * len(m.group()), line)
        for m in _HEX.finditer(line):
            if _is_commit(m.group()):
                hits.append((no, "commit", m.group()))
        for kind, rx in (("date", _DATE), ("round", _ROUND), ("issue", _ISSUE)):
            hits.extend((no, kind, m.group()) for m in rx.finditer(line))
    return hits


def _scanned_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "graphcomp", "examples", "README.md", "docs"],
        capture_output=True, text=True, cwd=REPO, check=True, timeout=60,
    ).stdout.split()
    return sorted(
        f for f in out
        if (f.startswith(("graphcomp/", "examples/")) and f.endswith(".py"))
        or f == "README.md"
        or (f.startswith("docs/") and f.endswith(".md"))
    )


def test_no_history_words_in_code_and_docs():
    files = _scanned_files()
    assert any(f.startswith("graphcomp/") for f in files), files
    report = []
    for f in files:
        path = REPO / f
        if not path.exists():  # deleted in the work tree, not yet in the index
            continue
        for no, kind, match in scan(path.read_text(encoding="utf-8")):
            report.append(f"{f}:{no}: {kind}: {match!r}")
    assert not report, (
        f"{len(report)} history word(s): say what the code does, link measurements in "
        "benchmarks/results/ instead of retelling them\n" + "\n".join(report)
    )


PLANTED = "measured at f8cbb5c on 2026-11-28 in the twelfth session (issue 17)"

ALONE = [
    ("commit", "the fix at 93cb459 made it faster", "93cb459"),
    ("commit", "(3afa62a)", "3afa62a"),
    ("commit", "see 0619bae for the numbers", "0619bae"),
    ("date", "run on 2026-11-22 with 2 GPUs", "2026-11-22"),
    ("round", "the twenty-second session kept it", "twenty-second session"),
    ("round", "Session 22 measured it", "Session 22"),
    ("round", "since round 2", "round 2"),
    ("round", "in the second round of reviews", "second round"),
    ("round", "a third-round fix", "third-round"),
    ("round", "the 12th session", "12th session"),
    ("issue", "fixes issue #4", "issue #4"),
    ("issue", "Issue 17's rule", "Issue 17"),
    ("issue", "see pytorch#174704", "pytorch#174704"),
    ("issue", "see PR #123", "PR #123"),
    ("issue", "issues 3 and 4", "issues 3 and 4"),
]

CLEAN = [
    "mask = x & 0xdeadbeef",
    "seed ^= 0x9e3779b97f4a",
    "a decade of facades: added, accede, deface, efface",
    "the cache key is the sha256 of the graph (hashlib.sha256(data).hexdigest())",
    "torch.float8_e4m3fn and torch.float8_e5m2 downcasts",
    "requires torch >= 2.13.0 (2.13.0.dev20261128+cpu works)",
    "bf16 parameters, fp32 master weights, 1e-5 eps",
    "aten.add.Tensor, aten._foreach_add_.Scalar, torch.ops._c10d_functional.all_gather_into_tensor",
    "the first step compiles; a second rank waits",
    "the round-trip through bf16 and its rounding error; round(x, 2); round up",
    "each rank must issue a collective in the same order",
    "every rank issues the same gathers",
    "it issues two all-gathers per step",
    "see https://github.com/pytorch/pytorch/issues/174704 and "
    "https://github.com/pytorch/pytorch/pull/12345#issuecomment-1",
    "the numbers: benchmarks/results/2026-11-26-W2-2gpu-w10s20-4adcaf5.md",
    "ranks 0-3; 12 sessions; a session object; graphcomp.session",
    "layers.10.attn; model.layers[3]; id 1234567; port 29500",
    "a 64-bit hash like cafe0123cafe0123 is longer than a commit",
]


def test_scanner_finds_a_planted_line():
    hits = scan(PLANTED)
    kinds = {kind: match for _, kind, match in hits}
    assert len(hits) == 4
    assert kinds == {"commit": "f8cbb5c", "date": "2026-11-28", "round": "twelfth session", "issue": "issue 17"}
    assert scan("line one\n" + PLANTED)[0][0] == 2
    wrong = [(line, scan(line)) for kind, line, match in ALONE if scan(line) != [(1, kind, match)]]
    wrong += [(line, scan(line)) for line in CLEAN if scan(line)]
    assert not wrong, "\n".join(f"{line!r}: {hits}" for line, hits in wrong)
