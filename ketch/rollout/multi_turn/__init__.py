"""Multi-turn, tool-using rollouts (`rollout.multi_turn.enable=true`): a turn loop around the `hf` or `vllm`
backend, tools with JSON schemas, tool-call parsers, environments, and the trajectory metrics."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

from ketch.config.schema import KetchConfig
from ketch.rollout.base import Rollout
from ketch.rollout.multi_turn import builtin_tools  # noqa: F401  (registers `calculate` and `python`)
from ketch.rollout.multi_turn.environment import Environment, ToolEnvironment
from ketch.rollout.multi_turn.loop import MultiTurnRollout
from ketch.rollout.multi_turn.metrics import trajectory_metrics
from ketch.rollout.multi_turn.parsers import ToolCall, get_parser, register_parser
from ketch.rollout.multi_turn.tools import Tool, ToolError, make_tool, register_tool, resolve_tools, tool
from ketch.rollout.multi_turn.trajectory import TRAJECTORY_COLUMNS

__all__ = [
    "TRAJECTORY_COLUMNS",
    "Environment",
    "MultiTurnRollout",
    "Tool",
    "ToolCall",
    "ToolEnvironment",
    "ToolError",
    "environment_factory",
    "get_parser",
    "make_tool",
    "register_parser",
    "register_tool",
    "resolve_tools",
    "tool",
    "tool_schemas",
    "trajectory_metrics",
    "turn_stop_strings",
    "with_multi_turn",
]


def with_multi_turn(backend: Rollout, config: KetchConfig, tokenizer, processor=None) -> Rollout:
    """`backend` wrapped in the turn loop when `rollout.multi_turn.enable`, else `backend` itself; `processor`: a
    vision-language model's (its tools may answer with images)."""
    if not config.rollout.multi_turn.enable:
        return backend
    new_environment = environment_factory(config, tokenizer, images=processor is not None)
    return MultiTurnRollout(backend, config, tokenizer, new_environment, processor)


def environment_factory(config: KetchConfig, tokenizer, images: bool = False):
    """A function making one fresh environment per trajectory: the user's class
    (`rollout.multi_turn.environment`), else a `ToolEnvironment` over `rollout.multi_turn.tools` (`images`: its
    tools may answer with images, which the model takes).
    The tools and the environment are loaded here, so a broken file stops the run at start-up (`preflight` calls
    it before any tokenizer loads, with `tokenizer=None`: the `auto` tool-call format then reads no chat template)."""
    mt = config.rollout.multi_turn
    if mt.environment:
        return load_environment_class(mt.environment)
    tools = resolve_tools(list(mt.tools))
    parser = get_parser(mt.format, getattr(tokenizer, "chat_template", None))
    return lambda: ToolEnvironment(tools, parser, mt.tool_timeout, images)


def turn_stop_strings(config: KetchConfig, tokenizer) -> tuple[str, ...]:
    """The strings after which a turn of the tool environment ends (the parser's end of a tool call), for
    demonstrations that match the rollout; none without `rollout.multi_turn.enable` or with a user environment."""
    mt = config.rollout.multi_turn
    if not mt.enable or mt.environment:
        return ()
    return get_parser(mt.format, getattr(tokenizer, "chat_template", None)).stop


def tool_schemas(config: KetchConfig) -> dict[str, dict] | None:
    """The JSON schemas of the tool environment's tools by name, which the rollout shows the model in the prompt
    (for demonstrations rendered the same way); None without `rollout.multi_turn.enable` or with a user
    environment."""
    mt = config.rollout.multi_turn
    if not mt.enable or mt.environment:
        return None
    return {name: t.schema for name, t in resolve_tools(list(mt.tools)).items()}


def load_environment_class(spec: str) -> type:
    """The class `Name` of `spec = "path/to/env.py:Name"`."""
    path_text, _, name = spec.rpartition(":")
    path = Path(path_text).expanduser().resolve()
    if not path_text or not path.is_file():
        raise ToolError(f"rollout.multi_turn.environment={spec!r}: give path/to/env.py:ClassName of an existing file")
    module_name = f"ketch_env_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
        raise ToolError(f"rollout.multi_turn.environment: importing {path} failed: {problem}") from exc
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and hasattr(cls, "reset") and hasattr(cls, "step")):
        raise ToolError(f"rollout.multi_turn.environment={spec!r}: {path} has no class {name!r} with reset and step")
    return cls
