"""Importing a user's Python file (a reward function, a tools file) as a module of its own."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


class UserFileImportError(Exception):
    """`path` could not be imported: `cause` is what its code raised, None when it is no Python module."""

    def __init__(self, path: Path, cause: BaseException | None):
        super().__init__(f"{path}: {cause!r}" if cause else f"{path} cannot be imported as a Python module")
        self.path, self.cause = path, cause


def import_user_file(path: Path, prefix: str, reuse: bool = False) -> ModuleType:
    """Execute `path` as a module registered in sys.modules under `prefix`, its stem and a digest of the path;
    with `reuse`, a module already imported from the same path is returned as it is."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    module_name = f"{prefix}_{path.stem}_{digest}"
    if reuse and module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UserFileImportError(path, None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        del sys.modules[module_name]
        raise UserFileImportError(path, exc) from exc
    return module
