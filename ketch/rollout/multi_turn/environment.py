"""Environments: what answers the model between its turns. `ToolEnvironment` runs the model's tool calls;
a user's class (`rollout.multi_turn.environment=path/to/env.py:Name`) can be any task with the same two methods.

With partial rollouts (`rollout.partial`) a trajectory continues in a later `generate` call, maybe in another
process or after a resume, so an environment is never kept between calls: each call makes a new one and brings it
to where the trajectory was (`restore_environment`). It calls `reset(row)` with the same row, then the class's
optional `restore(messages)` hook with the conversation up to the environment's last answer; a class without the
hook gets `step` again on each of the model's turns in that conversation, in order, and each replayed answer must be
the one the conversation holds (so `reset` and `step` must answer the same conversation the same way; an environment
that samples its answers, or whose steps have effects that must not happen twice, defines `restore`).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol

from ketch.data.conversation import prompt_messages, row_tool_names
from ketch.data.images import message_content
from ketch.rollout.multi_turn.metrics import ERROR_PREFIX
from ketch.rollout.multi_turn.parsers import Parser, ToolCall
from ketch.rollout.multi_turn.tools import Tool

Message = dict[str, Any]

_CALLS = ThreadPoolExecutor(max_workers=64, thread_name_prefix="ketch-tool")
"""Runs tool calls; a call past its timeout is abandoned (its thread finishes on its own; the code tool's
subprocess is killed by its own limit)."""


class Environment(Protocol):
    """One trajectory's counterpart. `reset(row)` gets the dataset row (its columns by name) and returns the
    opening messages; `step(messages)` gets the conversation so far (the model's turn last) and returns
    (messages to append, reward or None, done). Optional attributes: `tools` (JSON schemas the chat template
    shows the model), `stop` (strings after which the model's turn ends, e.g. the end of a tool call),
    `stats` (numbers summed into the rollout metrics) and the method `restore(messages)`, which partial rollouts call
    after `reset(row)` to continue a conversation (see the module docstring)."""

    def reset(self, row: dict[str, Any]) -> list[Message]: ...

    def step(self, messages: list[Message]) -> tuple[list[Message], float | None, bool]: ...


def restore_environment(env: Environment, row: dict[str, Any], messages: list[Message]) -> None:
    """Bring a new `env` to the state it had after answering the last of `messages` (the opening messages, then
    each model turn followed by the environment's answer): `reset(row)`, then `restore(messages)` where the class
    defines it, else `step` replayed on each model turn.

    Raises:
        ValueError: If a replayed answer differs from the one `messages` holds (or says the conversation was done):
            the environment does not answer a conversation the same way twice.
    """
    opening = env.reset(row)
    if hasattr(env, "restore"):
        env.restore(messages)
        return
    if list(opening) != messages[: len(opening)]:
        raise ValueError(
            f"reset(row) now opens with {list(opening)!r}, not with the carried {messages[: len(opening)]!r}: a "
            "carried conversation continues only where reset answers the same row the same way (or the environment "
            "defines restore(messages))"
        )
    turn = len(opening)
    while turn < len(messages):
        answer, _, done = env.step(messages[: turn + 1])
        held = messages[turn + 1 : turn + 1 + len(answer)]
        if done or list(answer) != held:
            raise ValueError(
                f"replaying step on the carried conversation's message {turn} gave {list(answer)!r} (done={done}), "
                f"not the carried {held!r}: define restore(messages) for an environment whose answers vary"
            )
        turn += 1 + len(answer)


def row_messages(row: dict[str, Any]) -> list[Message]:
    """The row's prompt as chat messages (a plain string prompt becomes one user message)."""
    prompt = row.get("raw_prompt")
    if prompt is None:
        raise ValueError("a multi-turn rollout needs each row's raw_prompt (the dataset's prompt column)")
    return prompt_messages(prompt)


class ToolEnvironment:
    """Parses the model's tool calls, runs them concurrently with a per-call timeout and answers with one tool
    message per call; done when a turn has no call. A tool returns text or, where the model takes images (`images`),
    an image or a list of text and images (`ketch.data.images.message_content`), which its message's content list
    holds. A failing call (bad JSON, unknown tool, bad arguments, an exception, a timeout, a result that is neither,
    an image that cannot be read) is answered with an error message the model reads."""

    def __init__(self, tools: dict[str, Tool], parser: Parser, timeout: float, images: bool = False):
        self.all_tools, self.parser, self.timeout, self.images = tools, parser, timeout, images
        self.stop = getattr(parser, "stop", ())
        self.tools_by_name = tools
        self.stats = {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "tool_time": 0.0}

    @property
    def tools(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools_by_name.values()]

    def reset(self, row: dict[str, Any]) -> list[Message]:
        """The row's prompt; a `tools` column or `extra_info["tools"]` (a list of names) limits the tools."""
        allowed = row_tool_names(row)
        if allowed is not None:
            unknown = [name for name in allowed if name not in self.all_tools]
            if unknown:
                raise ValueError(f"the row allows tools {unknown} that are not loaded (rollout.multi_turn.tools)")
            self.tools_by_name = {name: self.all_tools[name] for name in allowed}
        return row_messages(row)

    def restore(self, messages: list[Message]) -> None:
        """Nothing to restore after `reset(row)` (which picks the row's tools): no tool call's state outlives its
        turn, and the carried conversation's calls are not run again."""

    def step(self, messages: list[Message]) -> tuple[list[Message], None, bool]:
        calls = self.parser(messages[-1]["content"])
        if not calls:
            return [], None, True
        start = time.perf_counter()
        futures = [_CALLS.submit(self._run, call) for call in calls]
        replies = [self._result(call, future, start) for call, future in zip(calls, futures, strict=True)]
        self.stats["tool_calls"] += len(calls)
        self.stats["tool_time"] += time.perf_counter() - start
        messages = [{"role": "tool", "name": c.name, "content": r} for c, r in zip(calls, replies, strict=True)]
        return messages, None, False

    def _run(self, call: ToolCall) -> str | list[dict[str, Any]]:
        if call.error is not None:
            raise ValueError(call.error)
        if call.name not in self.tools_by_name:
            raise LookupError(f"unknown tool {call.name!r}; available: {', '.join(self.tools_by_name) or 'none'}")
        result = self.tools_by_name[call.name].fn(**call.arguments)
        if isinstance(result, str):
            return result
        if not self.images:
            raise TypeError(f"tool {call.name!r} returned {type(result).__name__}, not text")
        try:
            return message_content(result)
        except TypeError as err:
            raise TypeError(f"tool {call.name!r} returned {type(result).__name__}, not text or images: {err}") from None
        except ValueError as err:
            raise ValueError(f"tool {call.name!r} returned an image that cannot be read: {err}") from None

    def _result(self, call: ToolCall, future, start: float) -> str | list[dict[str, Any]]:
        try:
            return future.result(timeout=max(0.0, self.timeout - (time.perf_counter() - start)))
        except FutureTimeout:
            self.stats["tool_timeouts"] += 1
            self.stats["tool_errors"] += 1
            return f"{ERROR_PREFIX}tool {call.name!r} timed out after {self.timeout:g} s"
        except Exception as exc:  # the model sees every failure as the tool's reply
            self.stats["tool_errors"] += 1
            return f"{ERROR_PREFIX}{type(exc).__name__}: {exc}"
