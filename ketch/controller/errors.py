"""Failures of worker calls, each naming the role and rank that failed and carrying the worker's own cause."""

from __future__ import annotations


class WorkerError(RuntimeError):
    """A worker method raised. `error` says what failed on one line (for a raising method: `<method> raised
    <Type>: <message>` of the worker's own exception) and `traceback` is the worker-side traceback; the
    message holds both, after the role and rank. `method` is the worker method that was called."""

    def __init__(
        self,
        role: str,
        rank: int,
        error: str,
        cause: BaseException | None = None,
        traceback: str = "",
        method: str = "",
    ):
        self.role, self.rank, self.error, self.cause, self.traceback = role, rank, error, cause, traceback.rstrip()
        self.method = method
        super().__init__(f"{role} rank {rank}: {error}" + (f"\n{self.traceback}" if self.traceback else ""))


class WorkerDiedError(WorkerError):
    """A worker process is gone (killed, crashed, out of memory, node lost)."""


class WorkerTimeoutError(WorkerError):
    """A worker call did not return within trainer.worker_timeout seconds."""


def describe(error: BaseException) -> str:
    """`Type: first line of the message` (`Type` alone when the message is empty)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` (or what it wraps) is a device or host out-of-memory error."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if "OutOfMemoryError" in type(error).__name__ or "out of memory" in str(error).lower():
            return True
        error = getattr(error, "cause", None) or error.__cause__
    return False
