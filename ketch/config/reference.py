"""The configuration reference page (docs/reference/config.md), generated from the schema.

Every key of `KetchConfig` with its type, default, allowed range (`RANGES`), the defaults of the commands and
of the built-in run where they differ, and the doc text written under the field in the schema's modules
(`schema.py` and `sections/`; read from the source: a dataclass keeps no attribute docstrings at run time).

    make reference                              # python -m ketch.config.reference docs/reference/config.md
    python -m ketch.config.reference            # print the page
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from ketch.config import schema
from ketch.config.constraints import RANGES
from ketch.config.loader import load_config
from ketch.config.sections import algorithm, model, reward, roles, rollout, trainer

PAGE = Path("docs/reference/config.md")
REGENERATE = "make reference"
SCHEMA_MODULES = (schema, model, roles, rollout, reward, algorithm, trainer)


def schema_source() -> str:
    """The source of the schema's modules, one after the other."""
    return "\n".join(inspect.getsource(module) for module in SCHEMA_MODULES)


def field_docs(source: str) -> dict[tuple[str, str], str]:
    """`{(class name, field name): doc}` for every field of every class in `source` that has a string right
    below it; the doc's lines are joined into one paragraph."""
    docs = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for field, below in zip(node.body, [*node.body[1:], None], strict=True):
            if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and _is_string(below):
                docs[(node.name, field.target.id)] = " ".join(below.value.value.split())
    return docs


def class_docs(source: str) -> dict[str, str]:
    """`{class name: docstring}` of the classes in `source` that have one, as one paragraph each."""
    return {
        node.name: " ".join(doc.split())
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef) and (doc := ast.get_docstring(node))
    }


def _is_string(node: ast.stmt | None) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


@dataclasses.dataclass(frozen=True)
class Key:
    """One row of the reference: a key of the config (a leaf or a section) and what the page says about it."""

    path: str
    owner: type
    name: str
    kind: Any
    default: Any
    doc: str | None


def keys(docs: dict[tuple[str, str], str], section: Any = None, prefix: str = "") -> list[Key]:
    """Every key of `section` (default: a default `KetchConfig`) and of its sub-sections, in schema order."""
    section = schema.KetchConfig() if section is None else section
    hints = typing.get_type_hints(type(section))
    found = []
    for f in dataclasses.fields(section):
        value, path = getattr(section, f.name), f"{prefix}{f.name}"
        found.append(Key(path, type(section), f.name, hints[f.name], value, docs.get((type(section).__name__, f.name))))
        if dataclasses.is_dataclass(value):
            found += keys(docs, value, f"{path}.")
    return found


def undocumented(docs: dict[tuple[str, str], str]) -> list[str]:
    """The keys (sections included) that have no doc text in the schema."""
    return [key.path for key in keys(docs) if not key.doc]


def other_defaults(paths: list[str]) -> dict[str, list[tuple[str, Any]]]:
    """`{key: [(where, value), ...]}` for the keys of `paths` whose value differs from the schema default in the
    config that `ketch train` with no arguments (the built-in run), `ketch sft` or `ketch rm` load."""
    general = schema.KetchConfig()
    loaded = {
        "`ketch train` (built-in run)": load_config(),
        "`ketch sft`": load_config(command="sft"),
        "`ketch rm`": load_config(command="rm"),
    }
    found: dict[str, list[tuple[str, Any]]] = {}
    for where, config in loaded.items():
        for path in paths:
            if (value := _get(config, path)) != _get(general, path):
                found.setdefault(path, []).append((where, value))
    return found


def _get(config: schema.KetchConfig, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), config)


def type_text(kind: Any) -> str:
    """An annotation as the page writes it: `int | None`, `"fsdp" | "megatron"`, `list[str]`."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is Literal:
        return " | ".join(f'"{a}"' for a in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(type_text(a) for a in args)}]"
    if kind is type(None):
        return "None"
    if kind is Any:
        return "any"
    return getattr(kind, "__name__", str(kind))


def value_text(value: Any) -> str:
    """A value as it is written in a YAML file or an override: `null`, `true`, `[0.9, 0.999]`, `{}`."""
    if isinstance(value, str) and value:
        return value
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()


def range_text(key: Key) -> str:
    """The allowed interval of a numeric key, with its hint where `RANGES` gives one; empty for other keys."""
    allowed = RANGES.get(key.owner, {}).get(key.name)
    if allowed is None:
        return ""
    interval, hint = allowed if isinstance(allowed, tuple) else (allowed, "")
    return f"`{interval}`" + (f" ({hint})" if hint else "")


def render() -> str:
    """The whole reference page, from the schema as installed."""
    source = schema_source()
    every, intros = keys(field_docs(source)), class_docs(source)
    differs = other_defaults([key.path for key in every if not _is_section(key)])
    lines = [
        "# Configuration reference",
        "",
        f"Generated from `ketch/config/schema.py` and `sections/` by `{REGENERATE}`; do not edit it by hand (a test",
        "checks that it is current). Set a key on the command line as `key.path=value` or `--key.path value`, or in",
        "a YAML file of sections given with `--config-path`; `ketch config show` prints the resolved configuration.",
        "",
        "**Default** is the schema's, which a config file or overrides start from. Where `ketch train` with no",
        "YAML file on the built-in task and model, `ketch sft` or `ketch rm` start from another value, the",
        "**Doc** cell says so. **Range** is what `ketch/config/constraints.py` accepts (`[` includes the bound, `(`",
        "excludes it); a value outside it stops the run before it starts.",
    ]
    for section in (key for key in every if _is_section(key)):
        intro = " ".join(filter(None, [section.doc, intros.get(type(section.default).__name__)]))
        lines += ["", f"## {section.path}", "", _cell(intro), ""]
        lines += ["| key | type | default | range | doc |", "| --- | --- | --- | --- | --- |"]
        for key in every:
            if key.path.rpartition(".")[0] == section.path and not _is_section(key):
                lines.append("| " + " | ".join(_cell(c) for c in _row(key, differs.get(key.path, []))) + " |")
    return "\n".join(lines) + "\n"


def _is_section(key: Key) -> bool:
    return dataclasses.is_dataclass(key.default)


def _row(key: Key, elsewhere: list[tuple[str, Any]]) -> list[str]:
    """The cells of `key`'s row; `elsewhere`: the commands that start from another value, with it."""
    doc = key.doc or ""
    if elsewhere:
        doc += " " + "; ".join(f"{where}: `{value_text(v)}`" for where, v in elsewhere) + "."
    default = value_text(key.default)
    return [f"`{key.path}`", type_text(key.kind), f"`{default}`" if default else "", range_text(key), doc]


def _cell(text: str) -> str:
    """`text` in a table cell: its pipes escaped, which Markdown then shows as pipes outside code spans (a pipe
    inside one would show its backslash, so types are written without code spans)."""
    return text.replace("|", "\\|")


def main(argv: list[str]) -> None:
    page = render()
    if not argv:
        print(page, end="")
        return
    Path(argv[0]).write_text(page)


if __name__ == "__main__":
    main(sys.argv[1:])
