"""Tools: Python functions the model may call, each with a JSON schema, found by name or in a user's file.

A tool's schema comes from its signature and docstring (the first paragraph describes the tool, an
`Args:` section describes each parameter) or is given to `@tool(parameters=...)`. A tools file
(`rollout.multi_turn.tools=[path/to/tools.py]`) contributes its `@tool` functions or, when it has none,
every public function defined in it.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ketch.user_code import UserFileImportError, import_user_file

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}

_REGISTRY: dict[str, Tool] = {}
"""Built-in and user-registered tools by name (`register_tool`)."""


class ToolError(ValueError):
    """A tool or tools file that cannot be used: the message names the tool or file and the fix."""


@dataclass(frozen=True)
class Tool:
    """A callable tool: `fn(**arguments) -> str`, described to the model by `schema` (OpenAI function format)."""

    name: str
    fn: Callable[..., Any]
    description: str
    parameters: dict[str, Any]

    @property
    def schema(self) -> dict[str, Any]:
        """`{"type": "function", "function": {name, description, parameters}}`, as chat templates take `tools`."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


def tool(
    fn: Callable | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    parameters: dict[str, Any] | None = None,
) -> Callable:
    """Mark `fn` as a tool: bare (`@tool`) or with overrides (`@tool(name=..., parameters=...)`).

    What is not given is read from `fn`: its name, its docstring's first paragraph (the description) and `Args:`
    section, and its signature's annotations (the JSON schema of the parameters).

    Args:
        fn: The function, when used bare.
        name: The tool's name (default: the function's).
        description: What the tool does, for the model.
        parameters: The JSON schema of the arguments (an `object` schema).

    Returns:
        `fn` marked (used bare), else a decorator that marks the function it gets and returns it.
    """

    def wrap(f: Callable) -> Callable:
        f.__ketch_tool__ = make_tool(f, name, description, parameters)
        return f

    return wrap(fn) if fn is not None else wrap


def make_tool(fn: Callable, name: str | None = None, description: str | None = None, parameters=None) -> Tool:
    """A `Tool` for `fn`; what is not given is read from its signature and docstring."""
    doc_description, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
    return Tool(
        name=name or fn.__name__,
        fn=fn,
        description=description if description is not None else doc_description,
        parameters=parameters if parameters is not None else _parameters(fn, arg_docs),
    )


def register_tool(fn: Callable | Tool) -> Callable | Tool:
    """Register a tool under its name, for `rollout.multi_turn.tools=[name]`; usable as a decorator.

    A registered name is replaced.

    Args:
        fn: A function (marked with `@tool` or not) or a `Tool`.

    Returns:
        `fn`, unchanged.
    """
    t = fn if isinstance(fn, Tool) else getattr(fn, "__ketch_tool__", None) or make_tool(fn)
    _REGISTRY[t.name] = t
    return fn


def resolve_tools(entries: list[str]) -> dict[str, Tool]:
    """The tools named by `rollout.multi_turn.tools`: registered names and `.py` files, by tool name."""
    tools: dict[str, Tool] = {}
    for entry in entries:
        found = load_tools_file(entry) if entry.endswith(".py") else [_registered(entry)]
        for t in found:
            if t.name in tools:
                raise ToolError(f"rollout.multi_turn.tools: two tools are named {t.name!r} ({entry!r} adds the second)")
            tools[t.name] = t
    return tools


def _registered(name: str) -> Tool:
    if name not in _REGISTRY:
        raise ToolError(
            f"rollout.multi_turn.tools: unknown tool {name!r}; registered tools: {sorted(_REGISTRY)}, "
            "or give a path/to/tools.py file"
        )
    return _REGISTRY[name]


def load_tools_file(path_text: str) -> list[Tool]:
    """The tools of a user's file: its `@tool` functions, else every public function defined in it."""
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise ToolError(f"rollout.multi_turn.tools: the tools file {path} does not exist")
    module = _import_file(path)
    own = [v for k, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__]
    marked = [f.__ketch_tool__ for f in own if hasattr(f, "__ketch_tool__")]
    found = marked or [make_tool(f) for f in own if not f.__name__.startswith("_")]
    if not found:
        raise ToolError(f"rollout.multi_turn.tools: the tools file {path} defines no public function to use as a tool")
    return found


def _import_file(path: Path) -> types.ModuleType:
    try:
        return import_user_file(path, "ketch_tools", reuse=True)
    except UserFileImportError as err:
        if err.cause is None:
            raise ToolError(f"rollout.multi_turn.tools: {path} cannot be imported as a Python module") from err
        raise ToolError(
            f"rollout.multi_turn.tools: importing the tools file {path} failed: {type(err.cause).__name__}: {err.cause}"
        ) from err.cause


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description: the first paragraph, {argument: its text in the `Args:` section})."""
    description = doc.split("\n\n")[0].replace("\n", " ").strip()
    args: dict[str, str] = {}
    section = re.search(r"^(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?)+)", doc, re.MULTILINE)
    if section:
        current = None
        for line in section.group(1).splitlines():
            match = re.match(r"\s+(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)", line)
            if match and (current is None or len(line) - len(line.lstrip()) <= _indent(section.group(1))):
                current = match.group(1)
                args[current] = match.group(2).strip()
            elif current is not None:
                args[current] = f"{args[current]} {line.strip()}".strip()
    return description, args


def _indent(block: str) -> int:
    first = block.splitlines()[0]
    return len(first) - len(first.lstrip())


def _parameters(fn: Callable, arg_docs: dict[str, str]) -> dict[str, Any]:
    """A JSON schema object of `fn`'s parameters, from their annotations, defaults and docstring text."""
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        prop = _json_type(hints.get(name, str))
        if name in arg_docs:
            prop["description"] = arg_docs[name]
        properties[name] = prop
        if param.default is param.empty:
            required.append(name)
    return {"type": "object", "properties": properties, "required": required}


def _json_type(annotation: Any) -> dict[str, Any]:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return {"type": _JSON_TYPES.get(type(args[0]), "string"), "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        return _json_type(kept[0]) if len(kept) == 1 else {}
    if origin is list:
        return {"type": "array", "items": _json_type(args[0])} if args else {"type": "array"}
    return {"type": _JSON_TYPES.get(origin or annotation, "string")}
