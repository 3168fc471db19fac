"""The local backend: every role in the driver's own process, behind the same group calls as Ray.

For one device and for debugging with a plain debugger. The group has one rank, so dispatch modes
reduce to calling the method and collecting its one result."""

from __future__ import annotations

import functools
import traceback
from typing import Any

from ketch.controller.decorator import registered_methods
from ketch.controller.dispatch import DataParallelLayout
from ketch.controller.errors import WorkerError, describe


class LocalWorkerGroup:
    """Builds `worker_cls(*args, **kwargs)` in this process and exposes its registered methods.

    A registered method is called on the group as on the worker; an exception it raises becomes a `WorkerError`
    naming the role, rank 0 and the method, with the traceback."""

    world_size = 1

    def __init__(self, worker_cls: type, *args: Any, role: str = "worker", **kwargs: Any):
        """Build the worker.

        Args:
            worker_cls: A `Worker` subclass.
            *args: Positional arguments of `worker_cls`.
            role: The role's name in error messages.
            **kwargs: Keyword arguments of `worker_cls`.
        """
        self.role = role
        self.worker = worker_cls(*args, **kwargs)
        self.layout = DataParallelLayout.flat(1)
        for name, registration in registered_methods(worker_cls).items():
            setattr(self, name, functools.partial(self._call, name, registration))

    def _call(self, name: str, registration, *args: Any, **kwargs: Any) -> Any:
        ((rank_args, rank_kwargs),), context = self.layout.plan(registration.dispatch, args, kwargs)
        try:
            result = getattr(self.worker, name)(*rank_args, **rank_kwargs)
        except Exception as err:
            raise WorkerError(
                self.role, 0, f"{name} raised {describe(err)}", err, traceback.format_exc(), method=name
            ) from err
        return self.layout.gather(registration.dispatch, [result], context)

    def shutdown(self) -> None:
        """Drop the worker (its models are freed with it)."""
        self.worker = None
