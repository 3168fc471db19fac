"""What a run checks before anything loads, shared with `ketch doctor`: the output directory and the ketch cache
directory can be written, and vLLM is installed in a supported version when `rollout.name=vllm`.

Each check is a `Check` row (the rows of the `ketch doctor` table); `preflight` turns the failed ones into one
`StartupError` that the trainers raise first thing, so a run that cannot work stops before any model loads and
leaves nothing behind.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ketch.cache import CACHE_FIX, cache_root
from ketch.config import KetchConfig
from ketch.rollout import vllm_adapter

GIB = 2**30
"""Bytes per GiB, for the rows' figures."""


@dataclass(frozen=True)
class Check:
    name: str
    status: Literal["ok", "warn", "FAIL"]
    detail: str
    fix: str = ""


class StartupError(RuntimeError):
    """A run cannot start here (an unwritable output or cache directory, a missing vLLM); the message says what
    to do."""


def preflight(config: KetchConfig) -> None:
    """Raise `StartupError` listing every check a run of `config` cannot start without that fails here."""
    run_dir = Path(config.trainer.default_local_dir) / config.trainer.experiment_name
    rows = (output_dir_row(run_dir), cache_row(), vllm_row(config))
    failed = [f"{r.detail}: {r.fix}" for r in rows if r.status == "FAIL"]
    if failed:
        raise StartupError("cannot start the run:\n  - " + "\n  - ".join(failed))


def existing_parent(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (absolute)."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _write_error(path: Path) -> str | None:
    """Why no file can be created in `path` (or, before it exists, in its nearest existing ancestor); None when
    one can."""
    try:
        with tempfile.TemporaryFile(dir=existing_parent(path)):
            pass
    except OSError as err:
        return err.strerror or str(err)
    return None


def output_dir_row(out_dir: Path) -> Check:
    """Whether a file can be created in `out_dir` (or, before it exists, in its nearest existing ancestor)."""
    where = existing_parent(out_dir)
    if error := _write_error(out_dir):
        fix = "set trainer.default_local_dir to a directory you can write"
        return Check("output dir", "FAIL", f"cannot write in {where} ({error})", fix)
    state = "exists" if out_dir.exists() else f"will be created in {where}"
    return Check("output dir", "ok", f"{out_dir} ({state}), writable")


def cache_row() -> Check:
    """Whether files can be created in the ketch cache directory (or, before it exists, where it would be)."""
    root = cache_root()
    if error := _write_error(root):
        return Check("cache", "FAIL", f"cannot write the ketch cache directory {root} ({error})", CACHE_FIX)
    return Check("cache", "ok", f"{root}, writable")


def vllm_row(config: KetchConfig) -> Check:
    """vLLM's version against the supported range; a FAIL only when `rollout.name=vllm` needs it."""
    needed = config.rollout.name == "vllm"
    spec = vllm_adapter.supported_range()
    fix = f"pip install 'vllm{spec}'"
    version = vllm_adapter.installed_version()
    if version is None:
        if needed:
            return Check("vllm", "FAIL", "not installed, and rollout.name=vllm", f"{fix}, or set rollout.name=hf")
        return Check("vllm", "ok", "not installed (needed only for rollout.name=vllm)")
    if vllm_adapter.is_supported(version):
        return Check("vllm", "ok", f"{version} (supported: {spec})")
    detail = f"vLLM {version}, outside the supported {spec}" + (", and rollout.name=vllm" if needed else "")
    return Check("vllm", "FAIL" if needed else "warn", detail, f"{fix}, or set rollout.name=hf" if needed else fix)
