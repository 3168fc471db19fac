"""Running `ketch` in tests: in a fresh process (optionally with a file size limit), or in this one expecting a
user error."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

from ketch.cli import main

ROOT = Path(__file__).resolve().parents[1]


def ketch_env(**extra: str) -> dict[str, str]:
    """The environment of a `python -m ketch` process: this one's, with ketch on the path, one thread per process and
    no rendezvous variables (this process's runs set them), plus `extra`."""
    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}
    return env | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"} | extra


def run_cli(*args: str, file_size_limit: int | None = None) -> subprocess.CompletedProcess:
    """`python -m ketch *args` in a fresh process; `file_size_limit` caps every file it writes (RLIMIT_FSIZE, with
    SIGXFSZ ignored so that a write past it fails with EFBIG, as a full disk fails with ENOSPC)."""

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, resource.RLIM_INFINITY))

    command = [sys.executable, "-m", "ketch", *args]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        env=ketch_env(),
        timeout=300,
        preexec_fn=limit if file_size_limit else None,
    )


def cli_error(capsys, *args: str) -> str:
    """Run `ketch *args` in this process: it must exit 2 (a user error) with no traceback through ketch's own
    code (a user's reward function shows its own); returns the message."""
    assert main(list(args)) == 2
    err = capsys.readouterr().err
    assert f'File "{ROOT / "ketch"}' not in err
    return err.split(f"ketch {args[0]}: error: ", 1)[1]
