"""Tool-call parsers: find the calls in an assistant turn's text, in the model family's own format.

`hermes` (Qwen 2.5/3, Hermes, and the built-in tiny model): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
any number per turn; generation stops after `</tool_call>`. `llama3`: the turn is one JSON object
`{"name": ..., "parameters": {...}}` (or several separated by `;`), optionally after `<|python_tag|>`; the model
ends it with its own stop token. `rollout.multi_turn.format=auto` picks from the chat template.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; `error` is set (and `name`/`arguments` may be empty) when the call text is malformed."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


Parser = Callable[[str], list[ToolCall]]

_PARSERS: dict[str, Parser] = {}


def register_parser(name: str, stop: tuple[str, ...] = ()) -> Callable[[Parser], Parser]:
    """Decorator registering `fn(text) -> list[ToolCall]` as the parser of `rollout.multi_turn.format=name`.

    A registered name is replaced.

    Args:
        name: The format's name.
        stop: The strings that end a tool call, where generation of the turn stops (kept as `fn.stop`).

    Returns:
        A decorator that registers `fn` and returns it.
    """

    def wrap(fn: Parser) -> Parser:
        fn.stop = tuple(stop)
        _PARSERS[name] = fn
        return fn

    return wrap


def get_parser(name: str, chat_template: str | None = None) -> Parser:
    """The parser `name`; `auto` chooses from the chat template (Llama 3 markers, else hermes)."""
    if name == "auto":
        name = "llama3" if chat_template and "<|python_tag|>" in chat_template else "hermes"
    if name not in _PARSERS:
        raise ValueError(f"unknown tool-call format {name!r} (rollout.multi_turn.format); known: {sorted(_PARSERS)}")
    return _PARSERS[name]


@register_parser("hermes", stop=("</tool_call>",))
def parse_hermes(text: str) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` block (an unclosed last one too) as a call."""
    bodies = re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.DOTALL)
    return [_from_json(body, "arguments") for body in bodies]


@register_parser("llama3")
def parse_llama3(text: str) -> list[ToolCall]:
    """A turn that is a JSON object (after an optional `<|python_tag|>`) is a call; `;` separates several.
    Text that does not start with `{` is no call."""
    body = text.replace("<|python_tag|>", "").strip()
    calls, decoder, pos = [], json.JSONDecoder(), 0
    while body.startswith("{", pos):
        try:
            call, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as exc:
            return [*calls, _malformed(body[pos:], exc)]
        calls.append(_from_object(call, body, "parameters"))
        pos = len(body) - len(body[pos:].lstrip().lstrip(";").lstrip())
    return calls


def _from_json(body: str, arguments_key: str) -> ToolCall:
    body = body.strip()
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return _malformed(body, exc)
    return _from_object(call, body, arguments_key)


def _malformed(body: str, exc: json.JSONDecodeError) -> ToolCall:
    return ToolCall("", error=f"the tool call is not valid JSON ({exc.msg} at character {exc.pos}): {body[:200]}")


def _from_object(call: Any, body: str, arguments_key: str) -> ToolCall:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("", error=f'a tool call must be a JSON object with a string "name"; got {body[:200]}')
    arguments = call.get(arguments_key, call.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], error=f'the "{arguments_key}" of a tool call must be a JSON object')
    return ToolCall(call["name"], arguments)
