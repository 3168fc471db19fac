"""A start that fails leaves nothing that looks like a run."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def removed_if_start_fails(run_dir: Path) -> Iterator[None]:
    """Around a run's start (run directory, config.json, trackers, workers, resume): when it raises and the run
    directory did not exist before, the directory is removed again; an existing run's directory stays."""
    fresh = not Path(run_dir).exists()
    try:
        yield
    except BaseException:
        if fresh:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
