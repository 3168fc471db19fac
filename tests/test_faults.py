"""Runs that survive faults: an injected out-of-memory error (local) and a killed worker process (Ray)."""

from __future__ import annotations

import functools
import json
import linecache
import os
import re
import signal
import sys
import threading
import time

import pytest
import ray
import torch

from ketch.tracking import read_metrics
from ketch.trainer.loop import RunFailedError
from ketch.trainer.ppo import PPOTrainer
from ketch.workers import ActorRolloutRefWorker


def events(trainer: PPOTrainer) -> list[dict]:
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    return [record for line in lines if "event" in (record := json.loads(line))]


def oom_once_at(monkeypatch, call: int) -> None:
    """The test hook: update_actor raises torch.OutOfMemoryError on its `call`-th call, once."""
    calls = {"n": 0}
    original = ActorRolloutRefWorker.update_actor

    @functools.wraps(original)
    def update_actor(self, data):
        calls["n"] += 1
        if calls["n"] == call:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected by a test)")
        return original(self, data)

    monkeypatch.setattr(ActorRolloutRefWorker, "update_actor", update_actor)


def test_an_injected_oom_is_survived_with_a_checkpoint_at_the_failing_step(tiny_config, monkeypatch):
    oom_once_at(monkeypatch, call=3)
    config = tiny_config("trainer.total_steps=4", "trainer.max_retries=1", "trainer.oom_retry_delay=0")
    trainer = PPOTrainer(config)
    trainer.fit()
    assert [r["step"] for r in read_metrics(trainer.run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    kinds = [(e["event"], e.get("step")) for e in events(trainer)]
    assert kinds[:4] == [("failure", 3), ("checkpoint", 2), ("resume", 2), ("recovery", 2)]
    failure = events(trainer)[0]
    assert failure["role"] == "actor_rollout" and failure["rank"] == 0 and failure["out_of_memory"] is True


def test_without_retries_a_failure_ends_the_run_with_a_summary(tiny_config, monkeypatch):
    oom_once_at(monkeypatch, call=2)
    trainer = PPOTrainer(tiny_config("trainer.total_steps=3"))
    with pytest.raises(RunFailedError) as err:
        trainer.fit()
    assert "the run failed 1 time(s), more than trainer.max_retries=0 allows" in str(err.value)
    assert "step 2: actor_rollout rank 0: update_actor raised OutOfMemoryError: CUDA out of memory." in str(err.value)
    # what to change comes with it, indented under the failure, with the run's own values
    assert "\n    update_actor ran out of memory. Smaller forward passes: actor.ppo_micro_batch_size_per_device" in str(
        err.value
    )
    assert events(trainer)[0]["advice"].startswith("update_actor ran out of memory.")
    assert (trainer.run_dir / "checkpoints" / "global_step_1").is_dir(), "checkpoint_on_failure saved step 1"


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    yield
    ray.shutdown()


def kill_rank_when(trainer: PPOTrainer, rank: int, step: int) -> threading.Thread:
    """SIGKILL a worker process of `rank` once the run has completed `step` steps (a real kill, no hook)."""

    def watch() -> None:
        while trainer.step < step:
            time.sleep(0.05)
        os.kill(trainer.groups.owned[0].places[rank]["pid"], signal.SIGKILL)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_a_killed_worker_without_retries_names_the_dead_worker(tiny_config, ray_session):
    trainer = PPOTrainer(tiny_config("trainer.n_cpu_workers=2", "trainer.total_steps=4"))
    kill_rank_when(trainer, rank=1, step=1)
    with pytest.raises(RunFailedError, match=r"(actor_rollout|critic) rank 1: WorkerDiedError: .*worker process died"):
        trainer.fit()


def driver_stage(thread_id: int) -> str | None:
    """What the driver thread is waiting on, read from its stack: `generate`, `update` or `checkpoint`."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        name = frame.f_code.co_name
        if name == "_save_checkpoint":
            return "checkpoint"
        if name == "_generate":
            return "generate"
        if name == "_train_step" and "update_actor(" in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
            return "update"
        frame = frame.f_back
    return None


def kill_rank_during(trainer: PPOTrainer, rank: int, plan: list[tuple[int, str]]) -> threading.Thread:
    """SIGKILL the worker process of `rank` at each (step, stage) of `plan`, in order, while the driver waits on that
    stage (a real kill, no hook). A checkpoint belongs to the step it saves; the others to the step under way."""
    driver = threading.get_ident()

    def watch() -> None:
        for step, stage in plan:
            while (trainer.step if stage == "checkpoint" else trainer.step + 1) != step or driver_stage(
                driver
            ) != stage:
                time.sleep(0.002)
            failures = len(trainer.failures)
            os.kill(trainer.groups.owned[0].places[rank]["pid"], signal.SIGKILL)
            while len(trainer.failures) == failures:
                time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_three_kills_in_generation_update_and_checkpointing_change_nothing(tiny_config, ray_session):
    """Every step is logged once, and the run ends where an undisturbed one does: resume is exact."""
    steps = ("trainer.total_steps=6", "trainer.save_freq=2", "trainer.test_freq=6", "trainer.max_retries=5")
    undisturbed = PPOTrainer(tiny_config("trainer.n_cpu_workers=2", *steps, "trainer.experiment_name=calm"))
    expected = undisturbed.fit()
    trainer = PPOTrainer(tiny_config("trainer.n_cpu_workers=2", *steps, "trainer.experiment_name=killed"))
    watcher = kill_rank_during(trainer, rank=1, plan=[(2, "generate"), (3, "update"), (4, "checkpoint")])
    metrics = trainer.fit()
    watcher.join(timeout=1)
    assert [r["step"] for r in read_metrics(trainer.run_dir / "metrics.jsonl")] == list(range(1, 7))
    failures = [e for e in events(trainer) if e["event"] == "failure"]
    assert [(f["step"], f["rank"]) for f in failures] == [(2, 1), (3, 1), (4, 1)]
    died = [re.search(r"WorkerDiedError: .* died during (\w+)", f["error"]).group(1) for f in failures]
    assert died == ["generate_sequences", "update_actor", "save_checkpoint"]
    assert [e["step"] for e in events(trainer) if e["event"] == "resume"] == [2, 2]  # the first kill: from scratch
    assert [e["step"] for e in events(trainer) if e["event"] == "recovery"] == [0, 2, 2]
    for key in ("val/ketch/arithmetic/acc", "critic/score/mean", "actor/pg_loss"):
        assert metrics[key] == pytest.approx(expected[key], abs=1e-4), key
