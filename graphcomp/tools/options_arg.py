"""``--option KEY=VALUE``: any ``graphcomp.Config`` field from a command line (the
example, ``graphcomp demo``)."""

from __future__ import annotations

import dataclasses
import json


def parse_options(items: list[str], shorthands: dict | None = None) -> dict:
    """``--option KEY=VALUE`` items -> graphcomp.Config options. VALUE is parsed as JSON
    (``16``, ``0.8``, ``true``, ``null``, ``["aten.nonzero"]``, ``{"remat": false}``),
    else kept as a string (``codegen=eager``); mappings given twice are merged.
    ``shorthands``: the values of ``--codegen``, ``--cudagraphs``, ``--dump-dir`` (an
    ``--option`` of the same key must agree). An unknown KEY names the valid ones; a
    bad VALUE raises graphcomp.Config's error."""
    import graphcomp

    valid = [f.name for f in dataclasses.fields(graphcomp.Config)]
    options: dict = {}
    for item in items:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"--option {item!r}: expected KEY=VALUE (e.g. --option codegen=eager)")
        if key not in valid:
            raise ValueError(f"--option {key}: not a graphcomp.Config field; valid keys: {', '.join(valid)}")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        if isinstance(value, dict) and isinstance(options.get(key), dict):
            value = {**options[key], **value}
        options[key] = value
    for key, value in (shorthands or {}).items():
        if key in options and options[key] != value:
            raise ValueError(f"--{key.replace('_', '-')} {value} and --option {key}={json.dumps(options[key])} "
                             "disagree: give one of them")
        options[key] = value
    try:
        graphcomp.Config.from_options(options)
    except ValueError as e:  # a bad value: Config's error, which names the field and its valid values
        raise ValueError(f"--option: {e}") from None
    return options
