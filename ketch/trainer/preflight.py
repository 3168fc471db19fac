"""What a run checks before any model is built or warmed up, shared with `ketch doctor`: no other run holds the run
directory, the output directory and the ketch cache directory can be written, the checkpoint that
`trainer.resume_mode` names exists, vLLM is installed in a supported version and imports when `rollout.name=vllm`,
and the attention kernel that `model.attn_implementation` names is installed; then the data files, the data sources
that the registered scorers score, and the tools of a multi-turn rollout.

Each directory, resume, vLLM and attention check is a `Check` row (the rows of the `ketch doctor` table);
`preflight` turns the failed ones into one `StartupError`, another run's lock into `RunDirBusyError`, and the data
and tools raise their own errors. The trainers call it first thing, so a run that cannot work stops in seconds
(before the built-in model's warm-up, minutes on a first run) and leaves nothing behind.
"""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ketch.cache import CACHE_FIX, cache_root
from ketch.config import KetchConfig
from ketch.data import resolve_data_files
from ketch.data.dataset import DEFAULT_DATA_SOURCE
from ketch.data.parquet import Rows, read_parquet_files
from ketch.rewards import UnknownDataSourceError, known_data_sources
from ketch.rewards.registry import scorer_for
from ketch.rollout import vllm_adapter
from ketch.rollout.multi_turn import ToolError, environment_factory
from ketch.trainer.run_lock import RunDirBusyError, busy_message, holder

GIB = 2**30
"""Bytes per GiB, for the rows' figures."""

ATTENTION_PACKAGES = {
    "flash_attention_2": ("flash_attn", "flash-attn"),
    "flash_attention_3": ("flash_attn_interface", ""),
}
"""The module that transformers imports for an attention kernel, and the package that installs it."""


@dataclass(frozen=True)
class Check:
    name: str
    status: Literal["ok", "warn", "FAIL"]
    detail: str
    fix: str = ""


class StartupError(RuntimeError):
    """A run cannot start here (an unwritable output or cache directory, a resume path that does not exist, a
    missing or broken vLLM, a missing attention kernel); the message says what to do."""


def preflight(config: KetchConfig, required: Mapping[str, str], scored: bool = False) -> None:
    """Every check a run of `config` can make before any model is built: raise `RunDirBusyError` when another run
    holds the run directory, `StartupError` listing each failed row; then `DatasetError` for a data file that is
    missing, unreadable, empty or without a `required` column (column -> the `data.` key that names it), with
    `scored` (PPO) `UnknownDataSourceError` for a data source that no registered scorer scores, and an error for a
    tools or environment file that does not load."""
    run_dir = Path(config.trainer.default_local_dir) / config.trainer.experiment_name
    if (owner := holder(run_dir)) is not None:
        raise RunDirBusyError(busy_message(run_dir, owner))
    rows = (output_dir_row(run_dir), resume_row(config), cache_row(), vllm_row(config), attention_row(config))
    failed = [f"{r.detail}: {r.fix}" for r in rows if r.status == "FAIL"]
    if failed:
        raise StartupError("cannot start the run:\n  - " + "\n  - ".join(failed))
    d = config.data
    train = _data_sources(d.train_files, required)
    val = _data_sources(d.val_files, required) if d.val_files else None
    if scored and config.reward.function is None:  # a user's function scores every data source
        if config.reward.source_weights["rule"]:
            check_data_sources(train, d.max_samples)
        if val is not None:  # validation always scores with the rules
            check_data_sources(val, d.max_samples)
    if config.rollout.multi_turn.enable:
        environment_factory(config, tokenizer=None)


def _data_sources(files: list[str], required: Mapping[str, str]) -> Rows:
    """The `data_source` column of `files` (the data files checked on the way, see `read_parquet_files`)."""
    return read_parquet_files(resolve_data_files(files), required, columns=["data_source"])


def check_data_sources(rows: Rows, max_samples: int | None) -> None:
    """Raise `UnknownDataSourceError`, naming the file and row, at the first of the rows in use (the first
    `data.max_samples`) whose data source has no registered scorer."""
    known = set(known_data_sources())
    sources = rows.columns.get("data_source", [None] * len(rows))[:max_samples]
    for row, source in enumerate(sources):
        name = DEFAULT_DATA_SOURCE if source is None else str(source)
        if name not in known:
            try:
                scorer_for(name)
            except UnknownDataSourceError as err:
                raise UnknownDataSourceError(f"data file {rows.locate(row)}: {err}") from None


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


def resume_row(config: KetchConfig) -> Check:
    """Whether the checkpoint that `trainer.resume_mode` names exists (when it names one)."""
    mode = config.trainer.resume_mode
    if mode in ("auto", "disable"):
        return Check("resume", "ok", f"trainer.resume_mode={mode}")
    if not Path(mode).is_dir():
        detail = f"trainer.resume_mode={mode}: no such checkpoint directory"
        fix = "give a checkpoint directory (<run dir>/checkpoints/global_step_N), or trainer.resume_mode=auto"
        return Check("resume", "FAIL", detail, fix)
    return Check("resume", "ok", f"trainer.resume_mode={mode}")


def run_dir_row(run_dir: Path) -> Check:
    """Whether another run holds `run_dir` (its lock, `ketch/trainer/run_lock.py`)."""
    if (owner := holder(run_dir)) is not None:
        detail, fix = busy_message(run_dir, owner).split("; ", 1)
        return Check("run dir", "FAIL", detail, fix)
    state = "an earlier run's, not in use" if (run_dir / "config.json").is_file() else "no run there yet"
    return Check("run dir", "ok", f"{run_dir} ({state})")


def cache_row() -> Check:
    """Whether files can be created in the ketch cache directory (or, before it exists, where it would be)."""
    root = cache_root()
    if error := _write_error(root):
        return Check("cache", "FAIL", f"cannot write the ketch cache directory {root} ({error})", CACHE_FIX)
    return Check("cache", "ok", f"{root}, writable")


def vllm_row(config: KetchConfig) -> Check:
    """vLLM's version against the supported range, and (when `rollout.name=vllm` needs it) whether it imports; a
    FAIL only when it is needed."""
    needed = config.rollout.name == "vllm"
    spec = vllm_adapter.supported_range()
    fix = f"pip install 'vllm{spec}'"
    version = vllm_adapter.installed_version()
    if version is None:
        if needed:
            return Check("vllm", "FAIL", "not installed, and rollout.name=vllm", f"{fix}, or set rollout.name=hf")
        return Check("vllm", "ok", "not installed (needed only for rollout.name=vllm)")
    if not vllm_adapter.is_supported(version):
        detail = f"vLLM {version}, outside the supported {spec}" + (", and rollout.name=vllm" if needed else "")
        return Check("vllm", "FAIL" if needed else "warn", detail, f"{fix}, or set rollout.name=hf" if needed else fix)
    if needed and (error := vllm_adapter.import_error()):
        detail = f"vLLM {version} is installed, but `import vllm` fails with {error}"
        return Check("vllm", "FAIL", detail, f"pip install --force-reinstall 'vllm{spec}', or set rollout.name=hf")
    return Check("vllm", "ok", f"{version} (supported: {spec})")


def attention_row(config: KetchConfig) -> Check:
    """Whether the attention kernel of `model.attn_implementation` is installed (transformers imports it only when
    a worker loads the model, minutes later)."""
    requested = config.model.attn_implementation
    if requested not in ATTENTION_PACKAGES:
        return Check("attention", "ok", f"model.attn_implementation={requested}")
    module, package = ATTENTION_PACKAGES[requested]
    if importlib.util.find_spec(module) is not None:
        return Check("attention", "ok", f"model.attn_implementation={requested} ({module} installed)")
    install = f"pip install {package}" if package else f"install the module {module} (FlashAttention 3)"
    detail = f"model.attn_implementation={requested}, but {module} is not installed"
    return Check("attention", "FAIL", detail, f"{install}, or set model.attn_implementation=sdpa")


def tools_row(config: KetchConfig) -> Check | None:
    """Whether the tools or the environment of a multi-turn rollout load; None without one."""
    mt = config.rollout.multi_turn
    if not mt.enable:
        return None
    try:
        environment_factory(config, tokenizer=None)
    except ToolError as err:
        return Check("tools", "FAIL", str(err), "correct rollout.multi_turn.tools or rollout.multi_turn.environment")
    loaded = f"environment {mt.environment}" if mt.environment else f"tools {', '.join(mt.tools)}"
    return Check("tools", "ok", f"{loaded}: loaded")
