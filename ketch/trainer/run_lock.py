"""A run directory's lock: a run holds an exclusive OS lock (`fcntl.flock`) on `<run dir>/run.lock` from before it
writes anything there until its last write.

The lock belongs to the driver's open file, so the OS releases it when the process ends in any way, `kill -9`
included: no stale lock survives. The file says which process holds it (host, pid, command), for the message a second
run on the same directory stops with. Readers (resume, `ketch export`, `ketch report`) take no lock. The trainers hold
it (`ketch.trainer.run_dir`); a starting run's checks and `ketch doctor` ask who holds it (`holder`).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

LOCK_FILE = "run.lock"
"""The file in a run directory that the run holding it locks."""
PROBE_GRACE_S = 0.5
"""How long `acquire` tries again before it calls the directory busy: `holder` (a starting run's check, `ketch
doctor`) takes the lock for an instant, which must not stop a run that starts at that moment."""


class RunDirBusyError(RuntimeError):
    """Another process holds the run directory's lock: the message names the directory, that process and the way
    out."""


def holder(run_dir: Path) -> dict[str, Any] | None:
    """Who holds the lock of `run_dir` (`host`, `pid`, `command`, `since`; `{}` before the holder wrote them), or
    None when no process does. It takes the lock for an instant to find out, which a run starting at that moment
    waits out (`PROBE_GRACE_S`)."""
    path = Path(run_dir) / LOCK_FILE
    if not path.is_file():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_holder(fd) or {}
    finally:
        os.close(fd)
    return None


def busy_message(run_dir: Path, owner: dict[str, Any]) -> str:
    """One line: the directory, the process that holds it, and what to do."""
    who = f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}"
    command = f" ({owner['command']})" if owner.get("command") else ""
    return (
        f"the run directory {run_dir} is in use by another run, {who}{command}; set another "
        "trainer.experiment_name (or trainer.default_local_dir), or wait until that run ends"
    )


class RunDirLock:
    """The exclusive lock of one run directory, held by this process between `acquire` and `release`."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.fd: int | None = None

    def acquire(self) -> None:
        """Create the run directory if needed and lock it; raise `RunDirBusyError` when another process holds
        it."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / LOCK_FILE
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            if not _locked(fd, PROBE_GRACE_S):
                owner = _read_holder(fd) or {}
                os.close(fd)
                raise RunDirBusyError(busy_message(self.run_dir, owner))
            if _same_file(fd, path):  # else a failed start removed the directory after we opened the file
                break
            os.close(fd)
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.fd = fd
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "command": _command(), "since": time.time()}
        text = json.dumps(owner).encode()
        os.pwrite(fd, text, 0)  # then cut what a longer earlier record left: the file never reads empty
        os.ftruncate(fd, len(text))

    def release(self) -> None:
        """Give the lock up (closing the file releases it); the lock file stays, naming its last holder."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _locked(fd: int, grace: float) -> bool:
    """Whether this process got the exclusive lock of `fd`, trying for up to `grace` seconds."""
    deadline = time.monotonic() + grace
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def _read_holder(fd: int) -> dict[str, Any] | None:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        return None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _command() -> str:
    """`ketch train` (`sft`, `rm`) for the command line, `python -m ketch` included; else the program's name."""
    program = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path("python")
    if program.name == "ketch" or (program.name == "__main__.py" and program.parent.name == "ketch"):
        return " ".join(["ketch", *sys.argv[1:2]])
    return "python -c" if program.name == "-c" else program.name
