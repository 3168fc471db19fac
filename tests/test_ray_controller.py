"""The Ray single controller: dispatch modes, colocation, and failures that name role, rank and node."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
import torch

from ketch.controller import (
    ALL_TO_ALL,
    DP_COMPUTE_PROTO,
    ONE_TO_ALL,
    RANK_ZERO,
    DispatchMode,
    Worker,
    register,
    register_dispatch_mode,
)
from ketch.controller.errors import WorkerDiedError, WorkerError, WorkerTimeoutError
from ketch.controller.ray_group import RayClassWithInitArgs, RayWorkerGroup, get_together
from ketch.controller.resource_pool import RayResourcePool
from ketch.protocol import DataProto

LAST_RANK_ONLY = register_dispatch_mode(
    DispatchMode("LAST_RANK_ONLY", lambda world, args, kwargs: ([(args, kwargs)] * world, {}), lambda r, _: r[-1])
)


class Probe(Worker):
    def __init__(self, label: str = "probe"):
        self.label = label

    @register(ONE_TO_ALL)
    def whoami(self) -> tuple[int, int, int, str]:
        return self.rank, self.world_size, os.getpid(), self.label

    @register(DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        rows = len(data)
        return DataProto.from_dict({"x": data.batch["x"] * 2, "rank": torch.full((rows,), self.rank)})

    @register(RANK_ZERO)
    def rank_zero_view(self) -> int:
        return self.rank

    @register(ALL_TO_ALL)
    def take(self, value: int) -> int:
        return value * 10 + self.rank

    @register(ONE_TO_ALL, execute="rank_zero")
    def only_on_rank_zero(self) -> int:
        return self.rank

    @register(LAST_RANK_ONLY)
    def last(self) -> int:
        return self.rank

    @register(ONE_TO_ALL)
    def fail_on_rank_one(self) -> None:
        if self.rank == 1:
            raise ValueError("boom on purpose")

    @register(ONE_TO_ALL)
    def nap(self, seconds: float) -> None:
        time.sleep(seconds)


@pytest.fixture(scope="module")
def ray_session():
    # Worker processes import this module's classes: let them find the tests directory.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
        ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
        yield
        ray.shutdown()


@pytest.fixture(scope="module")
def probes(ray_session):
    group = RayWorkerGroup(RayResourcePool([2]), RayClassWithInitArgs(Probe), timeout=60)
    yield group
    group.shutdown()


def test_one_to_all_runs_on_every_rank_with_its_rank(probes):
    assert [(rank, world) for rank, world, _, _ in probes.whoami()] == [(0, 2), (1, 2)]


def test_dp_compute_proto_pads_an_uneven_batch_and_removes_the_padding(probes):
    out = probes.double(DataProto.from_dict({"x": torch.arange(5)}))
    assert out.batch["x"].tolist() == [0, 2, 4, 6, 8]
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1]  # 5 rows padded to 6: 3 per rank


def test_rank_zero_collects_rank_zeros_result(probes):
    assert probes.rank_zero_view() == 0


def test_all_to_all_gives_each_rank_its_own_argument(probes):
    assert probes.take([1, 2]) == [10, 21]


def test_execute_rank_zero_runs_on_rank_zero_only(probes):
    assert probes.only_on_rank_zero() == [0]


def test_a_registered_dispatch_mode_is_used(probes):
    assert probes.last() == 1


def test_async_calls_return_futures(probes):
    first, second = probes.async_take([1, 2]), probes.async_take([3, 4])
    assert (second.get(), first.get()) == ([30, 41], [10, 21])


def test_a_remote_exception_names_role_rank_and_carries_the_traceback(probes):
    with pytest.raises(WorkerError) as err:
        probes.fail_on_rank_one()
    assert err.value.role == "Probe" and err.value.rank == 1
    assert "Probe rank 1: fail_on_rank_one raised" in str(err.value)
    assert "ValueError: boom on purpose" in str(err.value)
    assert "test_ray_controller.py" in str(err.value), "the remote traceback is included"
    assert err.value.error == "fail_on_rank_one raised ValueError: boom on purpose"
    assert "test_ray_controller.py" in err.value.traceback and "raise ValueError" in err.value.traceback


def test_colocated_roles_share_one_process_per_rank(ray_session):
    roles = {"actor": RayClassWithInitArgs(Probe, "a"), "critic": RayClassWithInitArgs(Probe, "c")}
    group = RayWorkerGroup(RayResourcePool([2]), roles, timeout=60)
    actor, critic = group.role("actor").whoami(), group.role("critic").whoami()
    group.shutdown()
    assert [pid for _, _, pid, _ in actor] == [pid for _, _, pid, _ in critic]
    assert [label for *_, label in actor] == ["a", "a"] and [label for *_, label in critic] == ["c", "c"]


def test_a_call_that_overruns_the_timeout_names_the_ranks(ray_session):
    group = RayWorkerGroup(RayResourcePool([2]), RayClassWithInitArgs(Probe), timeout=1.0)
    start = time.monotonic()
    with pytest.raises(
        WorkerTimeoutError,
        match=r"Probe rank 0: nap did not return within 1.0s \(trainer.worker_timeout; ranks still running: \[0, 1\]\)",
    ):
        group.nap(30)
    assert time.monotonic() - start < 10
    group.shutdown()


def test_a_killed_worker_is_reported_as_dead_with_its_node(ray_session):
    group = RayWorkerGroup(RayResourcePool([2]), RayClassWithInitArgs(Probe), timeout=30)
    pid = group.places[1]["pid"]
    call = group.async_nap(20)
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError) as err:
        call.get()
    assert time.monotonic() - start < 15, "reported well within the timeout"
    assert err.value.rank == 1
    assert f"Probe rank 1: worker process died during nap (node {group.places[1]['node_ip']}, pid {pid})" in str(
        err.value
    )
    group.shutdown()


def test_get_together_raises_one_groups_failure_while_the_other_group_still_waits(probes):
    napping = RayWorkerGroup(RayResourcePool([1]), RayClassWithInitArgs(Probe), timeout=60)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="Probe rank 1: fail_on_rank_one raised ValueError"):
        get_together([napping.async_nap(30), probes.async_fail_on_rank_one()])  # the napper is listed first
    assert time.monotonic() - start < 10, "not after the nap"
    napping.shutdown()
    assert get_together([probes.async_take([1, 2]), probes.async_whoami()])[0] == [10, 21]
