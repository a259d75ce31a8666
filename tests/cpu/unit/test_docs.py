"""The documentation stays true to the code and to itself: the generated options
reference matches the code, the README stays a short product page, every relative
link resolves, and the pages describe current behaviour (no work history)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from graphcomp.tools import options_doc

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
GENERATED = ROOT / "docs" / "options.md"

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks."""
    return _FENCE.sub("", text)


def test_options_md_is_generated_from_the_code():
    assert GENERATED.exists(), f"docs/options.md is missing: {options_doc.REGENERATE}"
    assert GENERATED.read_text(encoding="utf-8") == options_doc.render(), (
        f"docs/options.md is stale (Config's field docstrings, the passes or graphcomp/env.py changed): "
        f"regenerate it with `{options_doc.REGENERATE}`")


def test_options_doc_check_flags_a_stale_file(tmp_path, capsys):
    good = tmp_path / "options.md"
    good.write_text(options_doc.render(), encoding="utf-8")
    assert options_doc.main(["--check", "--path", str(good)]) == 0
    stale = tmp_path / "stale.md"
    stale.write_text(options_doc.render() + "an edit by hand\n", encoding="utf-8")
    assert options_doc.main(["--check", "--path", str(stale)]) == 1
    assert options_doc.REGENERATE in capsys.readouterr().err
    assert options_doc.main(["--check", "--path", str(tmp_path / "absent.md")]) == 1


def test_options_doc_covers_every_config_field_and_pass():
    import dataclasses

    from graphcomp.compiler.pipeline import PASS_ORDER
    from graphcomp.config import Config

    text = options_doc.render()
    fields = [f["name"] for f in options_doc.config_fields()]
    assert fields == [f.name for f in dataclasses.fields(Config)]
    for name in fields:
        assert f"\n### {name}\n" in text, name
    for name in PASS_ORDER:
        assert f"| `{name}` |" in text, name
    assert options_doc.render() == text  # deterministic


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= 400, f"README.md has {n} lines; keep it a product page (at most 400) and move reference material to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    text = _prose(page.read_text(encoding="utf-8"))
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor within the page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"


# Work history belongs in benchmarks/results/README.md and git, not on these pages.


# (history words in the README and docs/: tests/cpu/unit/test_history_words.py)
