"""Load a user reward function from `reward.function=path/to/file.py:fn`."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from ketch.user_code import UserFileImportError, import_user_file

SIGNATURE = "fn(data_source, solution_str, ground_truth, extra_info) -> float | dict"


class RewardFunctionError(ValueError):
    """`reward.function` cannot be loaded: the message names the file, the function and the cause."""


def load_reward_function(spec: str) -> Callable:
    """Import `path/to/file.py` of `spec = "path/to/file.py:fn"` and return its function `fn`."""
    path_text, colon, name = spec.rpartition(":")
    if not colon or not path_text or not name.isidentifier():
        raise RewardFunctionError(
            f"reward.function={spec!r} is not of the form path/to/file.py:function_name "
            f"(the function must be {SIGNATURE})"
        )
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise RewardFunctionError(f"reward.function={spec!r}: file {path} does not exist")
    module = _import_file(path, spec)
    if not hasattr(module, name):
        defined = [k for k, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__]
        raise RewardFunctionError(
            f"reward.function={spec!r}: {path} has no {name!r}; functions defined there: {', '.join(defined) or 'none'}"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardFunctionError(
            f"reward.function={spec!r}: {name!r} in {path} is a {type(fn).__name__}, not a function; "
            f"it must be {SIGNATURE}"
        )
    _check_arguments(fn, name, spec)
    return fn


def _import_file(path: Path, spec: str) -> ModuleType:
    """Execute `path` as a fresh module registered in sys.modules under a name unique to the path."""
    try:
        return import_user_file(path, "ketch_reward_function")
    except UserFileImportError as err:
        if err.cause is None:
            message = f"reward.function={spec!r}: {path} cannot be imported as a Python module"
            raise RewardFunctionError(message) from err
        raise RewardFunctionError(
            f"reward.function={spec!r}: importing {path} failed with {type(err.cause).__name__}: {err.cause}"
        ) from err.cause


def _check_arguments(fn: Callable, name: str, spec: str) -> None:
    """Fail now, not at the first step, when `fn` cannot take the four positional arguments."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind("data_source", "solution_str", "ground_truth", None)
    except TypeError as exc:
        raise RewardFunctionError(
            f"reward.function={spec!r}: {name}{signature} cannot be called as {SIGNATURE} ({exc})"
        ) from exc
