"""A run owns its directory, and a start that fails leaves nothing that looks like a run.

A trainer's `fit` holds the run directory's lock (`ketch.trainer.run_lock`) for the whole call; a start that fails
removes the directory it created.
"""

from __future__ import annotations

import functools
import logging
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ketch.tracking import read_metrics
from ketch.trainer.run_lock import LOCK_FILE, RunDirLock

logger = logging.getLogger("ketch")


def owns_run_dir(method: Callable) -> Callable:
    """Decorate a trainer's `fit`: the run directory (`self.run_dir`) is locked for the whole call."""

    @functools.wraps(method)
    def locked(self, *args: Any, **kwargs: Any) -> Any:
        with RunDirLock(self.run_dir):
            return method(self, *args, **kwargs)

    return locked


@contextmanager
def removed_if_start_fails(run_dir: Path) -> Iterator[None]:
    """Around a run's start (run directory, config.json, trackers, workers, resume): when it raises and the run
    directory held nothing before (or only the run's lock file), the directory is removed again; an existing run's
    directory stays."""
    run_dir = Path(run_dir)
    fresh = not run_dir.exists() or {p.name for p in run_dir.iterdir()} <= {LOCK_FILE}
    try:
        yield
    except BaseException:
        if fresh:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def warn_if_steps_replaced(run_dir: Path, why: str) -> None:
    """Before a run that starts at step 1 whatever `run_dir` holds (`why` says so) writes its steps: one warning when
    `metrics.jsonl` there holds the steps of an earlier run, which this run replaces."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return
    last = max((r["step"] for r in read_metrics(path) if isinstance(r.get("step"), int)), default=0)
    if last:
        logger.warning(
            "%s holds steps up to %d of an earlier run; %s, so this run starts again at step 1 and replaces them "
            "(set another trainer.experiment_name to keep both)",
            path,
            last,
            why,
        )
