"""Failures of worker calls, each naming the role and rank that failed."""

from __future__ import annotations


class WorkerError(RuntimeError):
    """A worker method raised; the message carries the remote traceback."""

    def __init__(self, role: str, rank: int, message: str, cause: BaseException | None = None):
        super().__init__(f"{role} rank {rank}: {message}")
        self.role, self.rank, self.cause = role, rank, cause


class WorkerDiedError(WorkerError):
    """A worker process is gone (killed, crashed, out of memory, node lost)."""


class WorkerTimeoutError(WorkerError):
    """A worker call did not return within trainer.worker_timeout seconds."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` (or what it wraps) is a device or host out-of-memory error."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if "OutOfMemoryError" in type(error).__name__ or "out of memory" in str(error).lower():
            return True
        error = getattr(error, "cause", None) or error.__cause__
    return False
