"""Failures of worker calls, each naming the role and rank that failed and carrying the worker's own cause."""

from __future__ import annotations

import re


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


_RAY_MEMORY = {
    "in_use": re.compile(r"was ([\d.]+)GB(?: used)? / ([\d.]+)GB"),
    "threshold": re.compile(r"threshold of (?:[\d.]+B \(([\d.]+)% of|([\d.]+))"),
    "worker": re.compile(r"memory used=([\d.]+)GB"),
    "place": re.compile(r"\(IP: ([^,]+),.*?pid=(\d+)", re.DOTALL),
}
"""The figures of Ray's memory monitor report (Ray 2.4x and 2.5x+ layouts)."""
HOST_MEMORY_FIX = (
    "each worker process holds its models in host memory while they load: start fewer (trainer.n_cpu_workers, "
    "trainer.n_gpus_per_node), load smaller weights (model.dtype=bfloat16), free the host's memory, or raise Ray's "
    "kill threshold (RAY_memory_usage_threshold, when nothing else needs the memory)"
)
"""What lowers the host memory that the workers need."""


def host_out_of_memory(method: str, where: str, ray_message: str) -> str:
    """One line for a worker that Ray's memory monitor killed during `method` (`ray_message`, Ray's own report; its
    node and pid replace `where` when it names them): the host's memory in use and free, Ray's kill threshold, what
    the killed worker used, and `HOST_MEMORY_FIX`."""
    found = {name: pattern.search(ray_message) for name, pattern in _RAY_MEMORY.items()}
    if found["place"]:
        where = f"node {found['place'][1]}, pid {found['place'][2]}"
    figures = "the host ran out of memory"
    if found["in_use"]:
        used, total = float(found["in_use"][1]), float(found["in_use"][2])
        figures = f"{used:.2f} GB of the host's {total:.2f} GB were in use ({total - used:.2f} GB free)"
    if found["threshold"]:
        share = float(found["threshold"][1]) / 100 if found["threshold"][1] else float(found["threshold"][2])
        figures += f", above Ray's kill threshold of {share:.0%} (RAY_memory_usage_threshold)"
    if found["worker"]:
        figures += f"; the killed worker used {float(found['worker'][1]):.2f} GB"
    return f"worker process killed by Ray's memory monitor during {method} ({where}): {figures}; {HOST_MEMORY_FIX}"
