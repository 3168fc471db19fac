"""The run's checkpoints on disk: atomic writes, a `latest` pointer, rotation, resume lookup, remote copy.

Layout of `<run dir>/checkpoints/`:

    global_step_12/
        actor/            sharded model + optimizer (DCP), extra_rank{r}.pt, manifest.json, hf/ (config, tokenizer)
        critic/           the same for the critic (when there is one)
        trainer_state.json  global step, data position, KL controller, validation history
        partial_rollouts.pt the trajectories in flight of partial rollouts (rollout.partial), when on
        config.json       the config that made it
    latest              "global_step_12"

A checkpoint is written under a temporary name and renamed into place only when complete, then the
pointer is replaced; `trainer_state.json` is what marks a directory as complete.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import fsspec

from ketch.disk import directory_size, free_space, size_text, write_error_cause

logger = logging.getLogger("ketch")

STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (disk full, I/O error); the message names the path, the free space
    and what to do. The previous checkpoint stays the one to resume from."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class CheckpointManager:
    def __init__(self, root: Path, keep: int | None = None, remote_dir: str | None = None):
        self.root, self.keep, self.remote_dir = Path(root), keep, remote_dir

    def staging_dir(self, step: int) -> Path:
        """A fresh temporary directory for the checkpoint of `step` (workers write their parts into it)."""
        path = self.root / f".tmp-global_step_{step}-{uuid.uuid4().hex[:8]}"
        path.mkdir(parents=True)
        return path.resolve()

    def commit(self, staging: Path, step: int, trainer_state: dict[str, Any], config: dict[str, Any]) -> Path:
        """Complete `staging` with the driver's state, move it into place, update `latest`, rotate, copy."""
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / STATE_FILE).write_text(json.dumps(trainer_state))
        final = self.root / f"global_step_{step}"
        if final.exists():
            stale = self.root / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            final.rename(stale)
            shutil.rmtree(stale)
        staging.rename(final)
        pointer = self.root / f".latest-{uuid.uuid4().hex[:8]}"
        pointer.write_text(final.name)
        pointer.replace(self.root / "latest")
        self._rotate()
        if self.remote_dir:
            self._copy_to_remote(final)
        return final

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def io_failure(self, step: int, err: BaseException) -> CheckpointError:
        """What to tell the user when writing the checkpoint of `step` failed with `err` (a failed write)."""
        latest = self.latest()
        if latest is None:
            kept, again = "there is no earlier checkpoint", "it starts again from step 1"
        else:
            kept = f"{latest} stays the latest checkpoint (it takes {size_text(directory_size(latest))})"
            again = f"it resumes from {latest.name}"
        return CheckpointError(
            f"could not write the checkpoint of step {step} to {self.root / f'global_step_{step}'} "
            f"({write_error_cause(err)}); {free_space(self.root)}. {kept}. Free space (or set "
            f"trainer.default_local_dir to a larger disk, or trainer.max_checkpoints_to_keep), then run the same "
            f"command again: {again}",
            step,
        )

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name))]
        return [p for _, p in sorted(found) if (p / STATE_FILE).is_file()]

    def latest(self) -> Path | None:
        """The newest complete checkpoint (by step, whatever the pointer says), or None."""
        complete = self.complete()
        return complete[-1] if complete else None

    def to_resume(self, mode: str) -> Path | None:
        """The checkpoint `trainer.resume_mode` names: None for `disable`, the newest for `auto`, else the path."""
        if mode == "disable":
            return None
        return self.latest() if mode == "auto" else Path(mode)

    def _rotate(self) -> None:
        if self.keep:
            for old in self.complete()[: -self.keep]:
                shutil.rmtree(old)
                logger.info("deleted old checkpoint %s (trainer.max_checkpoints_to_keep=%d)", old, self.keep)

    def _copy_to_remote(self, checkpoint: Path) -> None:
        target = f"{self.remote_dir.rstrip('/')}/{checkpoint.name}"
        fs, path = fsspec.core.url_to_fs(target)
        fs.put(str(checkpoint), path, recursive=True)
        logger.info("copied checkpoint to %s", target)


def due(freq: int, step: int, total_steps: int) -> bool:
    """Whether an event every `freq` steps (`trainer.test_freq`, `trainer.save_freq`; 0 = never) falls on
    `step`; the last step always has it."""
    return freq > 0 and (step % freq == 0 or step == total_steps)


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    path = Path(checkpoint) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{checkpoint} is not a complete ketch checkpoint (no {STATE_FILE}); point trainer.resume_mode at a "
            "directory like <run dir>/checkpoints/global_step_N"
        )
    return json.loads(path.read_text())
