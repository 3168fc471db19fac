"""`ketch sft` and `ketch rm` on the `TrainingLoop` of `ketch train`: a run killed after its checkpoint of step 2
resumes to the losses of an uninterrupted run, and a failed step is recovered from (`trainer.max_retries`)."""

from __future__ import annotations

import functools
import json
import shutil

import pytest

from ketch.tracking import read_metrics
from ketch.trainer.loop import RunFailedError
from ketch.trainer.rm import RMTrainer
from ketch.trainer.sft import SFTTrainer
from ketch.workers import ActorRolloutRefWorker, RewardModelWorker

SFT_LOSSES = [4.399270, 4.074493, 3.502600, 3.194340]
"""`sft/loss` of steps 1-4 of `sft_config`, uninterrupted (CPU, float32, seed 1)."""
RM_LOSSES = [0.6964974, 0.7046000, 0.6991024, 0.5381061]
"""`rm/bt_loss` of steps 1-4 of `rm_config`, uninterrupted."""


def trainer(kind: str, tiny_config, preference_files) -> SFTTrainer | RMTrainer:
    """4 steps of 8 rows (SFT) or 8 pairs (RM), a checkpoint every 2."""
    steps = ("trainer.total_steps=4", "trainer.save_freq=2")
    if kind == "sft":
        config = tiny_config(*steps, "actor.optim.lr=1e-2")
        return SFTTrainer(config, model_path=config.model.path)
    files = [f"data.train_files=[{preference_files['train']}]", f"data.val_files=[{preference_files['val']}]"]
    return RMTrainer(tiny_config(*files, *steps, "reward.model.optim.lr=0.01"))


CASES = {
    "sft": (ActorRolloutRefWorker, "sft_step", "sft/loss", SFT_LOSSES),
    "rm": (RewardModelWorker, "rm_step", "rm/bt_loss", RM_LOSSES),
}
"""What each kind of run trains with, the loss it reports, the loss's values."""


def fail_after(monkeypatch, worker, method: str, calls: int, times: int = 1) -> None:
    """Make `worker.method` raise on the `times` calls after its first `calls` ones."""
    count = {"n": 0}
    original = getattr(worker, method)

    @functools.wraps(original)  # keeps the @register dispatch of the method
    def failing(self, data):
        count["n"] += 1
        if calls < count["n"] <= calls + times:
            raise RuntimeError("simulated crash")
        return original(self, data)

    monkeypatch.setattr(worker, method, failing)


def losses(trainer, key: str) -> list[float]:
    return [r[key] for r in read_metrics(trainer.run_dir / "metrics.jsonl")]


@pytest.mark.parametrize("kind", CASES)
def test_a_run_killed_after_step_2_resumes_to_the_losses_of_an_unbroken_one(
    tiny_config, preference_files, monkeypatch, kind
):
    worker, method, key, expected = CASES[kind]
    unbroken = trainer(kind, tiny_config, preference_files)
    unbroken.fit()
    assert losses(unbroken, key) == pytest.approx(expected, rel=1e-4)
    shutil.rmtree(unbroken.run_dir)

    with monkeypatch.context() as patch:
        fail_after(patch, worker, method, calls=2)
        with pytest.raises(RunFailedError):
            trainer(kind, tiny_config, preference_files).fit()
    resumed = trainer(kind, tiny_config, preference_files)
    resumed.fit()
    records = read_metrics(resumed.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert losses(resumed, key) == pytest.approx(expected, rel=1e-4)
    state = json.loads((resumed.run_dir / "checkpoints" / "global_step_4" / "trainer_state.json").read_text())
    assert state["loader"] == {"epoch": 0, "batch_index": 4, "seed": 1}
    assert (resumed.run_dir / "report.html").is_file() and (resumed.run_dir / "model" / "config.json").is_file()


def test_sft_with_one_retry_survives_a_failed_step(tiny_config, monkeypatch):
    fail_after(monkeypatch, ActorRolloutRefWorker, "sft_step", calls=2)
    config = tiny_config("trainer.total_steps=4", "trainer.max_retries=1", "actor.optim.lr=1e-2")
    sft = SFTTrainer(config, model_path=config.model.path)
    sft.fit()
    lines = (sft.run_dir / "metrics.jsonl").read_text().splitlines()
    events = [(r["event"], r.get("step")) for r in map(json.loads, lines) if "event" in r]
    assert events[:4] == [("failure", 3), ("checkpoint", 2), ("resume", 2), ("recovery", 2)]
    assert losses(sft, "sft/loss") == pytest.approx(SFT_LOSSES, rel=1e-4)
