"""`RayWorkerGroup`: one Ray actor per rank, each hosting one or more roles (colocation), and group
methods that dispatch a call over the ranks and collect the results.

A rank's process is a `WorkerHost` that builds every role given to the group. Colocated roles (actor,
rollout, reference and critic in one process per device) are one group with several roles; split
placement is one group per role on its own resource pool. Either way the trainer sees role groups with
the same methods as `LocalWorkerGroup`.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, OutOfMemoryError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ketch.controller.decorator import Registration, registered_methods
from ketch.controller.dispatch import DataParallelLayout
from ketch.controller.errors import WorkerDiedError, WorkerError, WorkerTimeoutError, describe, host_out_of_memory
from ketch.controller.resource_pool import RayResourcePool

STARTUP_TIMEOUT = 600.0
"""Seconds the worker processes of a group may take to start (a new node may have to pull packages)."""
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


DEAD_PEER_GRACE_S = 5.0
"""How long a failed call waits for its peers, so that a rank's death is reported rather than the errors it caused."""


class RayClassWithInitArgs:
    """A worker class and the arguments to build it with, on every rank."""

    def __init__(self, cls: type, *args: Any, **kwargs: Any):
        self.cls, self.args, self.kwargs = cls, args, kwargs


class WorkerHost:
    """The process of one rank: builds its roles and runs their methods by name."""

    def __init__(self, roles: dict[str, RayClassWithInitArgs]):
        self.workers = {role: spec.cls(*spec.args, **spec.kwargs) for role, spec in roles.items()}

    def execute(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.workers[role], method)(*args, **kwargs)

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port on it, for torch.distributed's rank 0."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            return ray.util.get_node_ip_address(), sock.getsockname()[1]

    def set_env(self, env: dict[str, str]) -> None:
        os.environ.update(env)

    def where(self) -> dict[str, Any]:
        return {
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
        }


class RoleGroup:
    """The methods of one role on a group: `group.method(...)` blocks and collects; `group.async_method(...)`
    returns a `GroupCall` to collect later."""

    def __init__(self, group: RayWorkerGroup, role: str, cls: type):
        self.group, self.role = group, role
        refs = {r: actor.execute.remote(role, "dispatch_rank") for r, actor in enumerate(group.actors)}
        ranks = group.wait(role, "dispatch_rank", refs)
        self.layout = DataParallelLayout.from_ranks([ranks[r] for r in sorted(ranks)], role)
        for name, registration in registered_methods(cls).items():
            setattr(self, name, functools.partial(self._call, name, registration))
            setattr(self, f"async_{name}", functools.partial(self._call_async, name, registration))

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's node address and a free port there, for a process group that rank 0 hosts."""
        return ray.get(self.group.actors[0].rendezvous.remote())

    def _call(self, method: str, registration: Registration, *args: Any, **kwargs: Any) -> Any:
        return self._call_async(method, registration, *args, **kwargs).get()

    def _call_async(self, method: str, registration: Registration, *args: Any, **kwargs: Any) -> GroupCall:
        calls, context = self.layout.plan(registration.dispatch, args, kwargs)
        ranks = [0] if registration.execute == "rank_zero" else range(self.world_size)
        refs = {r: self.group.actors[r].execute.remote(self.role, method, *calls[r][0], **calls[r][1]) for r in ranks}
        return GroupCall(self, method, refs, registration, context)


class GroupCall:
    """A call in flight on some ranks; `get()` waits (up to the group's timeout) and collects."""

    def __init__(self, role_group: RoleGroup, method: str, refs: dict[int, Any], registration: Registration, context):
        self.group, self.role, self.method, self.refs = role_group.group, role_group.role, method, refs
        self.layout, self.registration, self.context = role_group.layout, registration, context

    def get(self) -> Any:
        results = self.group.wait(self.role, self.method, self.refs)
        return self.layout.gather(self.registration.dispatch, [results[r] for r in sorted(results)], self.context)

    def started_to_end(self) -> bool:
        """Whether some rank has returned, raised or died, so that `get` will not wait on another group."""
        done, _ = ray.wait(list(self.refs.values()), num_returns=1, timeout=0)
        return bool(done)


def get_together(calls: list[GroupCall], poll: float = 0.005) -> list[Any]:
    """The results of calls on groups whose ranks wait on each other (a process group across the groups): each call
    is collected once one of its ranks ends, so that a failure in either group surfaces at once rather than as the
    other group's hang. Past the groups' timeout the first unfinished call's `get` reports it."""
    results: dict[int, Any] = {}
    deadline = min((c.group.timeout for c in calls if c.group.timeout is not None), default=None)
    deadline = None if deadline is None else time.monotonic() + deadline
    while len(results) < len(calls):
        ended = [i for i, call in enumerate(calls) if i not in results and call.started_to_end()]
        if not ended and deadline is not None and time.monotonic() > deadline:
            ended = [next(i for i in range(len(calls)) if i not in results)]
        for i in ended:
            results[i] = calls[i].get()
        if not ended:
            time.sleep(poll)
    return [results[i] for i in range(len(calls))]


class RayWorkerGroup:
    """Starts one `WorkerHost` per slot of `pool` with the environment torch.distributed needs.

    `workers` is one `RayClassWithInitArgs` (its methods are bound on the group) or a dict role -> spec
    (colocated roles; use `group.role(name)`). Calls that do not return within `timeout` seconds raise
    `WorkerTimeoutError`; a remote exception raises `WorkerError` with the remote traceback; a dead process
    raises `WorkerDiedError`, each naming role, rank and node."""

    def __init__(
        self,
        pool: RayResourcePool,
        workers: RayClassWithInitArgs | dict[str, RayClassWithInitArgs],
        timeout: float | None = None,
        env: dict[str, str] | None = None,
    ):
        """Start the worker processes and give them rank 0's rendezvous address.

        Args:
            pool: Where the processes run, one per slot.
            workers: One worker spec (its methods are bound on the group), or role name -> spec for roles that
                share each process.
            timeout: Seconds a call may take before `WorkerTimeoutError` (None: no limit).
            env: More environment variables for every process.

        Raises:
            WorkerError: If a process fails, dies (`WorkerDiedError`) or overruns (`WorkerTimeoutError`) while
                starting.
        """
        roles = workers if isinstance(workers, dict) else {workers.cls.__name__: workers}
        self.pool, self.timeout = pool, timeout
        self.world_size = pool.world_size
        self.actors = [self._start(rank, slot, roles, env or {}) for rank, slot in enumerate(pool.slots())]
        names = "+".join(roles)
        refs = {r: a.where.remote() for r, a in enumerate(self.actors)}
        self.places = self.wait(names, "start-up", refs, timeout=STARTUP_TIMEOUT)
        address, port = self.wait(names, "start-up", {0: self.actors[0].rendezvous.remote()})[0]
        master = {"MASTER_ADDR": address, "MASTER_PORT": str(port)}
        self.wait(names, "start-up", {r: a.set_env.remote(master) for r, a in enumerate(self.actors)})
        self.roles = {role: RoleGroup(self, role, spec.cls) for role, spec in roles.items()}
        if len(self.roles) == 1:
            self.__dict__.update({k: v for k, v in vars(next(iter(self.roles.values()))).items() if callable(v)})

    def _start(self, rank: int, slot, roles: dict[str, RayClassWithInitArgs], env: dict[str, str]):
        share = 1.0 / self.pool.max_colocate_count
        env = env | {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(slot.local_rank),
            "LOCAL_WORLD_SIZE": str(self.pool.process_on_nodes[slot.node_index]),
        }
        return (
            ray.remote(WorkerHost)
            .options(
                num_cpus=share,
                num_gpus=share if self.pool.use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(slot.placement_group, slot.bundle_index),
                runtime_env={"env_vars": env},
            )
            .remote(roles)
        )

    def role(self, name: str) -> RoleGroup:
        """The methods of one role hosted by this group.

        Args:
            name: The role's name, a key of `workers`.

        Returns:
            Its `RoleGroup`: `group.role(name).method(...)` blocks and collects, `async_method(...)` returns a
            `GroupCall`.

        Raises:
            KeyError: If the group does not host `name`.
        """
        if name not in self.roles:
            raise KeyError(f"this worker group hosts roles {sorted(self.roles)}, not {name!r}")
        return self.roles[name]

    def wait(self, role: str, method: str, refs: dict[int, Any], timeout: float | None = None) -> dict[int, Any]:
        """Wait for remote calls, raising at the first failure rather than waiting for the slowest rank.

        Args:
            role: The role, for error messages.
            method: The method, for error messages.
            refs: Rank -> the Ray object reference of its call.
            timeout: Seconds to wait in all (None: the group's timeout).

        Returns:
            Rank -> result.

        Raises:
            WorkerError: A rank's call raised (with the remote traceback).
            WorkerDiedError: A rank's process died.
            WorkerTimeoutError: Not every rank returned within the timeout.
        """
        pending = {ref: rank for rank, ref in refs.items()}
        results: dict[int, Any] = {}
        timeout = timeout or self.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not ready:
                ranks = sorted(pending.values())
                raise WorkerTimeoutError(
                    role,
                    ranks[0],
                    f"{method} did not return within {timeout}s (trainer.worker_timeout; ranks still running: {ranks})",
                    method=method,
                )
            rank = pending.pop(ready[0])
            try:
                results[rank] = self._result(ready[0], role, rank, method)
            except WorkerDiedError:
                raise
            except WorkerError:
                died = self._dead_peer(role, method, pending)
                if died is None:
                    raise
                raise died from died.__cause__
        return results

    def _dead_peer(self, role: str, method: str, pending: dict[Any, int]) -> WorkerDiedError | None:
        """The death of a rank still `pending`, if one died: a peer killed mid-collective makes the others raise
        first (a reset connection), but the death is the cause to report and recover from."""
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=DEAD_PEER_GRACE_S) if pending else ([], [])
        for ref in ready:
            try:
                self._result(ref, role, pending[ref], method)
            except WorkerDiedError as died:
                return died
            except WorkerError:
                continue
        return None

    def _result(self, ref, role: str, rank: int, method: str) -> Any:
        try:
            return ray.get(ref)
        except RayTaskError as err:
            cause = err.cause if isinstance(err.cause, BaseException) else err
            remote = _ANSI.sub("", str(err))  # Ray's header (process, node) and the worker-side traceback
            raise WorkerError(role, rank, f"{method} raised {describe(cause)}", cause, remote, method) from err
        except (RayActorError, OutOfMemoryError) as err:
            place = self.places.get(rank, {}) if hasattr(self, "places") else {}
            where = f"node {place.get('node_ip', '?')}, pid {place.get('pid', '?')}"
            died = f"worker process died during {method} ({where}): {err}"
            if isinstance(err, OutOfMemoryError) or "low on memory" in str(err):  # Ray's memory monitor killed it
                died = host_out_of_memory(method, where, str(err))
            raise WorkerDiedError(role, rank, died, err, method=method) from err
        except GetTimeoutError as err:
            raise WorkerTimeoutError(role, rank, f"{method} timed out", method=method) from err

    def shutdown(self) -> None:
        """Kill every worker process and free the pool's placement groups."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.pool.release()
