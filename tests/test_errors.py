"""Errors a user can act on: each failure says what, where and what to do, and a failed run stays readable
(docs/errors.md lists them). One test per pattern; every test fails on the code before issue 13."""

from __future__ import annotations

import functools
import json
import logging

import pytest

from ketch.trainer.loop import RunFailedError
from ketch.trainer.ppo import PPOTrainer
from ketch.workers import ActorRolloutRefWorker


def failure_events(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for line in lines if (r := json.loads(line)).get("event") == "failure"]


def test_a_worker_failure_carries_its_cause_everywhere_and_leaves_no_step_0_checkpoint(
    tiny_config, monkeypatch, caplog
):
    """The fault hook (as in test_faults.py): the actor's generate_sequences raises in the first step, locally."""

    @functools.wraps(ActorRolloutRefWorker.generate_sequences)
    def generate_sequences(self, prompts):
        raise ValueError("prompt 3 has no tokens (injected by a test)")

    monkeypatch.setattr(ActorRolloutRefWorker, "generate_sequences", generate_sequences)
    trainer = PPOTrainer(tiny_config())
    with caplog.at_level(logging.ERROR, logger="ketch"), pytest.raises(RunFailedError) as err:
        trainer.fit()
    cause = "generate_sequences raised ValueError: prompt 3 has no tokens (injected by a test)"
    worker_line = 'raise ValueError("prompt 3 has no tokens (injected by a test)")'  # the worker-side frame
    assert f"step 1: actor_rollout rank 0: {cause}" in str(err.value) and worker_line in str(err.value)
    (event,) = failure_events(trainer.run_dir)
    assert (event["step"], event["role"], event["rank"], event["error"]) == (1, "actor_rollout", 0, cause)
    assert worker_line in event["traceback"] and "test_errors.py" in event["traceback"]
    assert cause in caplog.text and worker_line in caplog.text
    summary = (trainer.run_dir / "summary.txt").read_text()
    assert f"failure at step 1: actor_rollout rank 0: {cause}" in summary and worker_line in summary
    assert "ValueError: prompt 3 has no tokens" in (trainer.run_dir / "report.html").read_text()
    # the untrained model is not saved as step 0, so the next plain run starts fresh instead of resuming from it
    assert trainer.checkpoints.complete() == []
