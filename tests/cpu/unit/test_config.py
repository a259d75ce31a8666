"""Config validation: every bad-option path is a ValueError naming the field and the valid values."""

from pathlib import Path

import pytest
import torch

import graphcomp
import graphcomp.compiler.pipeline
from graphcomp.config import Config, field_docs
from graphcomp.models import TinyMLP

OPTIONS_MD = Path(__file__).resolve().parents[3] / "docs" / "options.md"
PASSES_MD = Path(__file__).resolve().parents[3] / "docs" / "passes.md"


def test_defaults_validate():
    cfg = Config.from_options(None)
    assert cfg.codegen == "inductor" and cfg.passes == {}


def test_unknown_option_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown graphcomp option\(s\) \['bogus'\]; valid options: .*codegen"):
        Config.from_options({"bogus": 1})


def test_unknown_pass_lists_valid_passes():
    with pytest.raises(ValueError, match=r"Config.passes: unknown pass name\(s\) \['no_such_pass'\]; valid passes:"):
        Config.from_options({"passes": {"no_such_pass": True}})


@pytest.mark.parametrize(
    "opts, pattern",
    [
        ({"codegen": "tvm"}, r"Config.codegen: invalid value 'tvm'; valid values: \['inductor', 'eager'\]"),
        ({"debug": "yes"}, r"Config.debug: expected bool, got str"),
        ({"dump_dir": 3}, r"Config.dump_dir: 3 does not match"),
        ({"passes": ["x"]}, r"Config.passes: expected a mapping, got list"),
    ],
)
def test_bad_values_name_the_field(opts, pattern):
    with pytest.raises(ValueError, match=pattern):
        Config.from_options(opts)


def test_pass_flag_must_be_bool():
    name = next(iter(graphcomp.compiler.pipeline.registered_passes()), None)
    if name is None:
        pytest.skip("no pass registered")
    with pytest.raises(ValueError, match=rf"Config.passes\['{name}'\]: expected bool"):
        Config.from_options({"passes": {name: 1}})


def test_env_dump_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("GRAPHCOMP_DUMP_DIR", str(tmp_path))
    assert Config.from_options({}).dump_dir == str(tmp_path)
    assert Config.from_options({"dump_dir": None}).dump_dir is None  # explicit wins


def test_bad_option_surfaces_through_torch_compile():
    m = torch.compile(TinyMLP(), backend="graphcomp", options={"codgen": "eager"})
    with pytest.raises(Exception, match=r"unknown graphcomp option\(s\) \['codgen'\]"):
        m(torch.randn(2, 16))


def test_mode_is_rejected():
    m = torch.compile(TinyMLP(), backend="graphcomp", mode="max-autotune")
    with pytest.raises(Exception, match=r"graphcomp does not take torch.compile\(mode='max-autotune'\)"):
        m(torch.randn(2, 16))


def test_every_field_has_a_docstring_and_is_in_the_options_reference():
    text = OPTIONS_MD.read_text()
    docs = field_docs()
    for name in docs:
        assert f"\n### {name}\n" in text, (f"Config.{name} is missing from docs/options.md: "
                                          f"python -m graphcomp.tools.options_doc > docs/options.md")
    import dataclasses

    assert set(docs) == {f.name for f in dataclasses.fields(Config)}, "every Config field needs a docstring"


def test_every_pass_is_documented():
    text = PASSES_MD.read_text()
    for name in graphcomp.compiler.pipeline.registered_passes():
        assert f"\n## {name}\n" in text, f"pass {name} has no section in docs/passes.md"


def test_every_field_is_in_exactly_one_group():
    """``config.GROUPS`` (how docs/options.md presents the fields) covers every field
    once: a new field must be given a group."""
    import dataclasses

    from graphcomp.config import GROUPS, Config

    listed = [n for names in GROUPS.values() for n in names]
    assert sorted(listed) == sorted(f.name for f in dataclasses.fields(Config)), (
        set(listed) ^ {f.name for f in dataclasses.fields(Config)})
    assert len(listed) == len(set(listed))
