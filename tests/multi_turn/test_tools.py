"""Tools, schemas, parsers and the tool environment's answers to bad calls."""

from __future__ import annotations

import re
from typing import Literal

import pytest

from ketch.config import load_config
from ketch.data import build_char_tokenizer
from ketch.rollout.multi_turn import ToolEnvironment, ToolError, environment_factory, get_parser, make_tool
from ketch.rollout.multi_turn.parsers import parse_hermes, parse_llama3
from ketch.rollout.multi_turn.tools import load_tools_file, resolve_tools
from ketch.trainer.ppo import PPOTrainer


def lookup(city: str, days: int = 1, unit: Literal["C", "F"] = "C", exact: bool | None = None) -> str:
    """Look up the weather.

    Args:
        city: the city's name.
        days: how many days ahead,
            counted from today.
    """
    return city


def test_a_schema_comes_from_the_signature_and_the_docstring():
    schema = make_tool(lookup).schema
    assert schema == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up the weather.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "the city's name."},
                    "days": {"type": "integer", "description": "how many days ahead, counted from today."},
                    "unit": {"type": "string", "enum": ["C", "F"]},
                    "exact": {"type": "boolean"},
                },
                "required": ["city"],
            },
        },
    }


def test_parsers_read_hermes_and_llama3_calls():
    text = 'I call.<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "b"}</tool_call>'
    assert [(c.name, c.arguments, c.error) for c in parse_hermes(text)] == [("a", {"x": 1}, None), ("b", {}, None)]
    assert parse_hermes("no call here") == []
    bad = parse_hermes('<tool_call>{"name": "a", "arguments": </tool_call>')
    assert len(bad) == 1 and bad[0].error.startswith("the tool call is not valid JSON")
    calls = parse_llama3('<|python_tag|>{"name": "a", "parameters": {"x": 2}}; {"name": "b", "parameters": {}}')
    assert [(c.name, c.arguments) for c in calls] == [("a", {"x": 2}), ("b", {})]
    assert parse_llama3("The answer is 4.") == []
    assert get_parser("auto", "{{ '<|python_tag|>' }}") is parse_llama3
    assert get_parser("auto", "<tool_call>") is parse_hermes


BAD_TOOLS = '''
import time

def fails(x: int) -> str:
    """Always raises."""
    raise RuntimeError(f"cannot handle {x}")

def slow() -> str:
    """Sleeps past the timeout."""
    time.sleep(6)
    return "late"

def number() -> str:
    """Returns an int, not text."""
    return 4

def echo(text: str) -> str:
    """Echoes."""
    return text
'''


def call(name: str, arguments: str = "{}") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


def test_every_bad_call_becomes_an_error_reply_that_is_counted(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(BAD_TOOLS)
    tools = resolve_tools([str(path)])
    assert sorted(tools) == ["echo", "fails", "number", "slow"]
    env = ToolEnvironment(tools, parse_hermes, timeout=2.0)
    env.reset({"raw_prompt": "hi"})
    turn = "".join(
        [call("fails", '{"x": 3}'), call("slow"), call("number"), call("nope"), "<tool_call>{oops</tool_call>"]
    )
    turn += call("echo", '{"text": "fine"}') + call("echo", '{"wrong": 1}')
    replies, reward, done = env.step([{"role": "assistant", "content": turn}])
    assert reward is None and not done
    contents = [r["content"] for r in replies]
    assert contents[0] == "error: RuntimeError: cannot handle 3"
    assert contents[1] == "error: tool 'slow' timed out after 2 s"
    assert contents[2] == "error: TypeError: tool 'number' returned int, not text"
    assert contents[3] == "error: LookupError: unknown tool 'nope'; available: fails, slow, number, echo"
    assert contents[4].startswith("error: ValueError: the tool call is not valid JSON")
    assert contents[5] == "fine"
    assert contents[6].startswith("error: TypeError: echo() got an unexpected keyword argument 'wrong'")
    assert env.stats["tool_calls"] == 7 and env.stats["tool_errors"] == 6 and env.stats["tool_timeouts"] == 1
    assert env.step([{"role": "assistant", "content": "#### 4"}]) == ([], None, True)


def test_a_row_limits_its_tools():
    env = ToolEnvironment(resolve_tools(["calculate", "python"]), parse_hermes, timeout=5)
    env.reset({"raw_prompt": "hi", "extra_info": {"tools": ["calculate"]}})
    assert [t["function"]["name"] for t in env.tools] == ["calculate"]
    replies, _, _ = env.step([{"role": "assistant", "content": call("python", '{"code": "print(1)"}')}])
    assert replies[0]["content"] == "error: LookupError: unknown tool 'python'; available: calculate"


def test_a_tools_file_that_does_not_import_stops_the_run_at_start_up(tiny_config, tmp_path):
    path = tmp_path / "broken_tools.py"
    path.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ToolError, match=re.escape(f"importing the tools file {path} failed: ModuleNotFoundError")):
        load_tools_file(str(path))
    config = tiny_config("rollout.multi_turn.enable=true", f"rollout.multi_turn.tools=[{path}]")
    with pytest.raises(ToolError, match=r"broken_tools\.py failed"):
        PPOTrainer(config)
    config = load_config(overrides=["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[nope]"])
    with pytest.raises(ToolError, match="unknown tool 'nope'"):
        environment_factory(config, build_char_tokenizer())
