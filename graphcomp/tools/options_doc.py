"""``docs/options.md``, generated: every ``graphcomp.Config`` field, the passes, the
environment variables.

::

    python -m graphcomp.tools.options_doc > docs/options.md    # regenerate
    python -m graphcomp.tools.options_doc --check              # exit 1 when docs/options.md is stale

A dataclass field's docstring (the string literal under the field) is not kept at run
time, so the fields are read with ``ast`` from ``graphcomp/config.py``: name, type
annotation (closed choices spelled out), default and docstring, in source order. The
pass table comes from :func:`graphcomp.compiler.pipeline.registered_passes` (run order,
stages, default on/off, the first paragraph of the pass module's docstring); the
environment variables from the table in ``graphcomp/env.py``'s module docstring.

The output depends only on those sources: no dates, no machine names, the same bytes
on every run.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import sys
from pathlib import Path

_PKG = Path(__file__).resolve().parents[1]
CONFIG_PY = _PKG / "config.py"
ENV_PY = _PKG / "env.py"
DEFAULT_OUT = _PKG.parent / "docs" / "options.md"
REGENERATE = "python -m graphcomp.tools.options_doc > docs/options.md"

_STAGE_ORDER = ("dynamo", "joint", "inference", "fwd", "bwd")


def _md(text: str) -> str:
    """reST inline literals (````x````) as markdown code spans."""
    return re.sub(r"``(.+?)``", r"`\1`", text, flags=re.S)


def _cell(text: str) -> str:
    """Text for one markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Module-level type aliases (``Codegen = Literal[...]``) by name, as source text."""
    out: dict[str, str] = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Subscript)):
            out[node.targets[0].id] = ast.unparse(node.value)
    return out


def _type_text(ann: ast.expr, aliases: dict[str, str]) -> str:
    class Expand(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.AST:
            if node.id in aliases:
                return ast.parse(aliases[node.id], mode="eval").body
            return node

    return ast.unparse(Expand().visit(ast.parse(ast.unparse(ann), mode="eval").body))


def _default_text(value: ast.expr | None) -> str:
    """The default as markdown: a code span, and the size for byte counts."""
    if value is None:
        return "(required)"
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "field":
        for kw in value.keywords:
            if kw.arg == "default_factory" and isinstance(kw.value, ast.Name):
                return "`" + {"dict": "{}", "list": "[]", "set": "set()"}.get(kw.value.id, f"{kw.value.id}()") + "`"
            if kw.arg == "default":
                return f"`{ast.unparse(kw.value)}`"
    text = f"`{ast.unparse(value)}`"
    if isinstance(value, ast.BinOp):  # 64 * 2 ** 20: say the size too
        try:
            n = eval(compile(ast.Expression(value), "<default>", "eval"), {"__builtins__": {}}, {})  # noqa: S307 - constants only
        except Exception:  # noqa: BLE001 - not a constant expression: show it as written
            return text
        if isinstance(n, int) and n > 0 and n % 2**20 == 0:
            return f"{text} ({n // 2**20} MiB)"
    return text


def config_fields(path: Path = CONFIG_PY) -> list[dict[str, str]]:
    """``[{"name", "type", "default", "doc"}]`` for every field of ``Config``, in
    source order, read from ``path`` with ``ast``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases = _aliases(tree)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    fields: list[dict[str, str]] = []
    body = cls.body
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        doc = ""
        nxt = body[i + 1] if i + 1 < len(body) else None
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            doc = inspect.cleandoc(nxt.value.value)
        fields.append({"name": node.target.id, "type": _type_text(node.annotation, aliases),
                       "default": _default_text(node.value), "doc": doc})
    return fields


def env_table(path: Path = ENV_PY) -> str:
    """The markdown table in ``graphcomp/env.py``'s module docstring."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    rows = [line for line in doc.splitlines() if line.lstrip().startswith("|")]
    return _md("\n".join(r.strip() for r in rows))


def _summary(name: str, doc: str) -> str:
    """The first paragraph of a pass docstring, without its ``name (stages):`` head."""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    return re.sub(rf"^{re.escape(name)}\s*\([^)]*\)\s*:\s*", "", para)


def pass_rows() -> list[dict[str, str]]:
    """``[{"name", "stages", "default", "summary"}]`` in run order."""
    from graphcomp.compiler.pipeline import registered_passes

    rows = []
    for name, spec in registered_passes().items():
        stages = ", ".join(s for s in _STAGE_ORDER if s in spec.stages)
        rows.append({"name": name, "stages": stages, "default": "on" if spec.default else "off",
                     "summary": _md(_summary(name, spec.doc))})
    return rows


def render() -> str:
    """The whole of ``docs/options.md``."""
    fields = config_fields()
    out = [
        "# Options reference",
        "",
        f"<!-- Generated by `{REGENERATE}` from the field docstrings of",
        "graphcomp/config.py, the pass registry and graphcomp/env.py. Do not edit by hand. -->",
        "",
        "`torch.compile(model, backend=\"graphcomp\", options={...})` and",
        "`graphcomp.train_step(..., options={...})` take these keys (the fields of",
        "`graphcomp.Config`). An unknown key or pass name, a wrong type or a value outside",
        "a closed set raises a `ValueError` naming the field and the valid values.",
        "",
        "## `graphcomp.Config` fields",
        "",
        "Grouped by concern (`graphcomp.config.GROUPS`); the keys are flat.",
    ]
    from graphcomp.config import GROUPS

    by_name = {f["name"]: f for f in fields}
    for group, names in GROUPS.items():
        out += ["", f"**{group}**", "", "| option | type | default |", "|---|---|---|"]
        for name in names:
            f = by_name[name]
            out.append(f"| [`{f['name']}`](#{f['name']}) | `{_cell(f['type'])}` | {_cell(f['default'])} |")
    for group, names in GROUPS.items():
        out += ["", f"## {group}"]
        for name in names:
            f = by_name[name]
            out += ["", f"### {f['name']}", "", f"Type `{f['type']}`, default {f['default']}.", ""]
            out.append(_md(f["doc"]) if f["doc"] else "(no docstring)")
    out += [
        "",
        "## Passes",
        "",
        "In the order they run. Switch one with `options={\"passes\": {NAME: True | False}}`;",
        "[passes.md](passes.md) says what each matches and when it is a no-op.",
        "",
        "| pass | stages | default | what it does |",
        "|---|---|---|---|",
    ]
    for r in pass_rows():
        out.append(f"| `{r['name']}` | {r['stages']} | {r['default']} | {_cell(r['summary'])} |")
    out += ["", "## Environment variables", "", env_table(), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphcomp.tools.options_doc",
                                description="Print docs/options.md (the Config, pass and environment reference).")
    p.add_argument("--check", action="store_true",
                   help="compare with the file instead of printing; exit 1 when it is stale")
    p.add_argument("--path", type=Path, default=DEFAULT_OUT, help="the file --check compares (default: docs/options.md)")
    args = p.parse_args(argv)
    text = render()
    if not args.check:
        sys.stdout.write(text)
        return 0
    try:
        current = args.path.read_text(encoding="utf-8")
    except FileNotFoundError:
        current = None
    if current != text:
        what = "is missing" if current is None else "is stale (Config, the passes or env.py changed)"
        print(f"{args.path} {what}: regenerate it with `{REGENERATE}`", file=sys.stderr)
        return 1
    print(f"{args.path} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
