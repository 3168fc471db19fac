"""Build a `KetchConfig` from defaults, a YAML file and command-line overrides, with clear errors.

Order of precedence: built-in defaults < the command's own defaults (`COMMAND_DEFAULTS`, e.g. `ketch rm`
trains on the built-in preference pairs) < the built-in demo's settings (`BUILTIN_RUN_DEFAULTS`, only for
`ketch train` with no YAML file on the built-in task and model) < YAML file (`--config-path FILE`) < overrides.
Overrides may be spelled `key.path=value`, `--key.path=value` or `--key.path value`; values are parsed as YAML
(`a.b=[1,2]`, `x=null`, `flag=true`). A key given twice in the YAML file, or twice on a typed command line (in
any spelling, or as a key and inside its section), is an error; a command-line key that replaces one of the YAML
file is logged.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from ketch.config.constraints import validate
from ketch.config.errors import ConfigError
from ketch.config.schema import BUILTIN_RUN_DEFAULTS, COMMAND_DEFAULTS, KetchConfig

__all__ = ["ConfigError", "load_config", "parse_overrides", "to_dict", "to_yaml"]

logger = logging.getLogger("ketch")


def load_config(
    config_path: str | Path | None = None,
    overrides: list[str] | None = None,
    command: str = "train",
    *,
    typed: bool = False,
) -> KetchConfig:
    """Merge the defaults of `command`, the YAML file and the overrides into a validated, frozen `KetchConfig`.

    Args:
        config_path: A YAML file of settings (None: none).
        overrides: `key.path=value` strings (also `--key.path=value`, or `--key.path` then `value`); values are
            parsed as YAML.
        command: The command whose defaults apply: `train`, `sft`, `rm` (see `COMMAND_DEFAULTS`).
        typed: The overrides are a command line a person typed (`ketch ...` passes True), where a key given twice
            is an error; code that composes override lists (a base, then changes) gets the last value.

    Returns:
        The config.

    Raises:
        ConfigError: For an unknown key, a value of the wrong type or out of range, keys that cannot run
            together, a key given twice in the YAML file (or on a typed command line), or a YAML file that is
            missing or does not parse.
    """
    tree = _as_tree(KetchConfig())
    for key, value in parse_overrides(list(COMMAND_DEFAULTS.get(command, ()))):
        _merge(tree, _nest(key, value), source=f"defaults of ketch {command}")
    if command == "train" and config_path is None and _runs_builtin_task(tree, overrides or []):
        for key, value in parse_overrides(list(BUILTIN_RUN_DEFAULTS)):
            _merge(tree, _nest(key, value), source="defaults of the built-in run")
        logger.info("the built-in run's own settings apply under the overrides: %s", " ".join(BUILTIN_RUN_DEFAULTS))
    from_file = {}
    if config_path is not None:
        keys = _merge(tree, _read_yaml(Path(config_path)), source=str(config_path))
        from_file = {key: _get(tree, key) for key in keys}
    given: dict[str, Any] = {}
    for key, value in parse_overrides(overrides or []):
        for path in _merge(tree, _nest(key, value), source="command line"):
            if typed and path in given:
                raise ConfigError(
                    f"{path} is given twice on the command line ({given[path]!r}, then {_get(tree, path)!r}); "
                    "give it once"
                )
            given[path] = _get(tree, path)
    for path in given.keys() & from_file.keys():
        logger.info("%s=%r from the command line replaces %r from %s", path, given[path], from_file[path], config_path)
    _derived_defaults(tree, given.keys() | from_file.keys())
    config = _build(KetchConfig, tree, prefix="")
    validate(config)
    return config


def _derived_defaults(tree: _Tree, set_keys: set[str]) -> None:
    """Defaults that follow from other settings, where the key is not set (in `set_keys`), each said in an INFO line.
    An FP8 rollout (`rollout.quantization=fp8` or `rollout.kv_cache_dtype=fp8`) samples from FP8-rounded weights or
    cache, and partial rollouts (`rollout.partial.enable`) train on tokens of older weights: token-level truncated
    importance sampling corrects both (`actor.rollout_is=token`), with the old-log-prob pass it needs (the built-in
    run's `actor.old_log_prob_from_rollout=true` turned off). The exact mode (`rollout.exact_log_probs=true`) keeps
    each layer's whole attention matrices for the backward, which recomputing the layers frees
    (`model.gradient_checkpointing=true`; the 0.5B shape's update ran out of 80 GB without)."""
    fp8 = "fp8" in (_get(tree, "rollout.quantization"), _get(tree, "rollout.kv_cache_dtype"))
    off_policy = "FP8 rollout" if fp8 else "partial rollouts" if _get(tree, "rollout.partial.enable") else None
    derived = [
        ("actor.rollout_is", "token", lambda: off_policy and _get(tree, "actor.rollout_is") is None, off_policy),
        ("actor.old_log_prob_from_rollout", False, lambda: off_policy and _get(tree, "actor.rollout_is"), off_policy),
        ("model.gradient_checkpointing", True, lambda: _get(tree, "rollout.exact_log_probs"), "exact log-probs"),
    ]
    for key, value, applies, reason in derived:
        if applies() and key not in set_keys and _get(tree, key) != value:
            _merge(tree, _nest(key, value), source=f"the {reason}'s default")
            logger.info("%s: %s=%s by default (set %s to change it)", reason, key, value, key)


def _runs_builtin_task(tree: _Tree, overrides: list[str]) -> bool:
    """Whether `overrides` leave data.train_files and model.path of `tree` (the defaults) as they are."""
    given = copy.deepcopy(tree)
    for key, value in parse_overrides(overrides):
        _merge(given, _nest(key, value), source="command line")
    return all(_get(given, key) == _get(tree, key) for key in ("data.train_files", "model.path"))


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """Turn `['--a.b', '1', 'c.d=[1,2]', '--e=x']` into `[('a.b', 1), ('c.d', [1, 2]), ('e', 'x')]`."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        body = arg[2:] if arg.startswith("--") else arg
        if "=" in body:
            key, raw = body.split("=", 1)
        elif arg.startswith("--") and i + 1 < len(args):
            key, raw = body, args[i + 1]
            i += 1
        else:
            raise ConfigError(f"cannot read override {arg!r}: write it as key.path=value or --key.path value")
        if not key:
            raise ConfigError(f"override {arg!r} has no key before '='")
        pairs.append((key, _parse_value(raw)))
        i += 1
    return pairs


def _parse_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (given by --config-path)")
    try:
        node = yaml.compose(path.read_text(), Loader=yaml.SafeLoader)
        twice = _keys_given_twice(node) if node is not None else []
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from err
    if twice:
        raise ConfigError(f"config file {path} gives {'; '.join(twice)}; give each key once")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, found {type(data).__name__}")
    return data


def _keys_given_twice(node: yaml.Node, prefix: str = "") -> list[str]:
    """`key twice (lines 3 and 9)` for each key that a mapping of the YAML document `node` repeats."""
    if not isinstance(node, yaml.MappingNode):
        return []
    found, lines = [], {}
    for key_node, value_node in node.value:
        path = f"{prefix}{key_node.value}"
        if path in lines:
            found.append(f"{path} twice (lines {lines[path]} and {key_node.start_mark.line + 1})")
        lines.setdefault(path, key_node.start_mark.line + 1)
        found += _keys_given_twice(value_node, f"{path}.")
    return found


def _nest(dotted: str, value: Any) -> dict:
    node: Any = value
    for part in reversed(dotted.split(".")):
        node = {part: node}
    return node


class _Tree(dict):
    """A dict of one schema section; values that are `_Tree`s are sub-sections, the rest are leaves."""


def _as_tree(section: Any) -> _Tree:
    return _Tree(
        {
            f.name: _as_tree(v) if dataclasses.is_dataclass(v := getattr(section, f.name)) else v
            for f in dataclasses.fields(section)
        }
    )


def _merge(tree: dict, update: dict, source: str, prefix: str = "") -> list[str]:
    """Write `update` over `tree`, checking keys against the schema; returns the dotted keys of the leaves set."""
    keys = []
    for key, value in update.items():
        path = f"{prefix}{key}"
        if key not in tree:
            raise ConfigError(_unknown_key_message(path, tree, prefix, source))
        if isinstance(tree[key], _Tree):
            if not isinstance(value, dict):
                raise ConfigError(f"{path} is a section of keys ({', '.join(tree[key])}), got {value!r} ({source})")
            keys += _merge(tree[key], value, source, prefix=f"{path}.")
        else:
            tree[key] = value
            keys.append(path)
    return keys


def _get(tree: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def _unknown_key_message(path: str, tree: dict, prefix: str, source: str) -> str:
    valid = [f"{prefix}{k}" for k in tree]
    every = _all_keys(_as_tree(KetchConfig()))
    leaf = path.rsplit(".", 1)[-1]
    same_leaf = [k for k in every if k.rsplit(".", 1)[-1] == leaf]
    close = list(dict.fromkeys(difflib.get_close_matches(path, valid + every, n=3, cutoff=0.6) + same_leaf))[:4]
    hint = f"; did you mean {' or '.join(close)}?" if close else f"; valid keys here: {', '.join(valid)}"
    return f"unknown config key {path!r} ({source}){hint}"


def _all_keys(tree: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in tree.items():
        keys.append(f"{prefix}{key}")
        if isinstance(value, _Tree):
            keys += _all_keys(value, f"{prefix}{key}.")
    return keys


def _build(cls: type, tree: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        kind = hints[f.name]
        value = tree[f.name]
        if dataclasses.is_dataclass(kind):
            kwargs[f.name] = _build(kind, value, f"{path}.")
        else:
            kwargs[f.name] = _coerce(value, kind, path)
    return cls(**kwargs)


def _coerce(value: Any, kind: Any, path: str) -> Any:
    """Check `value` against the annotation `kind`, converting only where it is lossless."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, option, path)
            except ConfigError:
                continue
        raise _type_error(path, value, kind)
    if origin is Literal:
        if isinstance(value, bool) and ("on" if value else "off") in args:
            return "on" if value else "off"  # YAML reads a bare off (on) as false (true)
        if value not in args:
            raise ConfigError(f"{path}={value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is list:
        items = value if isinstance(value, list) else [value] if value is not None else None
        if items is None:
            raise _type_error(path, value, kind)
        return [_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(items)]
    if origin is dict or kind is dict:
        if not isinstance(value, dict):
            raise _type_error(path, value, kind)
        return dict(value)
    if kind is Any:
        return value
    return _coerce_scalar(value, kind, path)


def _coerce_scalar(value: Any, kind: type, path: str) -> Any:
    if kind is float and isinstance(value, int | float | str) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            raise _type_error(path, value, kind) from None
    if kind is str and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise _type_error(path, value, kind)


def _type_error(path: str, value: Any, kind: Any) -> ConfigError:
    expected = getattr(kind, "__name__", None) or str(kind).replace("typing.", "")
    return ConfigError(f"{path}={value!r} has type {type(value).__name__}, expected {expected}")


def to_dict(config: KetchConfig) -> dict:
    """The config as plain nested dicts (for YAML, JSON and checkpoints)."""
    return dataclasses.asdict(config)


def to_yaml(config: KetchConfig) -> str:
    """The resolved config as YAML, sections in schema order."""
    return yaml.safe_dump(to_dict(config), sort_keys=False, default_flow_style=None)
