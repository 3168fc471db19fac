"""PPO over Ray: several CPU ranks with FSDP over gloo, placements from config, and the same numbers as
the local backend."""

from __future__ import annotations

import json

import pytest
import ray

from ketch.tracking import read_metrics
from ketch.trainer.ppo import PPOTrainer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    yield
    ray.shutdown()


def fit(config) -> tuple[PPOTrainer, dict[str, float]]:
    trainer = PPOTrainer(config)
    return trainer, trainer.fit()


def test_two_cpu_ranks_train_with_fsdp_over_gloo_and_a_tensor_parallel_rollout(tiny_config):
    # the two ranks decode as one TP=2 hf rollout; the hand-off is checked after each update
    overrides = ("rollout.tensor_parallel_size=2", "rollout.check_weight_sync=true")
    trainer, metrics = fit(tiny_config("trainer.n_cpu_workers=2", "trainer.test_freq=2", *overrides))
    assert trainer.plan.world_size == 2 and trainer.plan.sequences_per_device == 4
    assert {"actor/pg_loss", "critic/vf_loss", "val/ketch/arithmetic/acc"} <= set(metrics)
    assert metrics["response_length/mean"] > 0
    assert trainer.groups.owned == [], "groups are shut down at the end"


def test_ray_with_one_worker_gives_the_local_backends_metrics(tiny_config):
    keys = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/entropy", "critic/vf_loss")
    _, local = fit(tiny_config("trainer.backend=local", "trainer.total_steps=2", "trainer.experiment_name=local"))
    _, remote = fit(tiny_config("trainer.backend=ray", "trainer.total_steps=2", "trainer.experiment_name=ray"))
    for key in keys:
        assert remote[key] == pytest.approx(local[key], rel=1e-4, abs=1e-5), key


@pytest.mark.parametrize("placement", ["colocate", "split"])
def test_placement_comes_from_config_alone(tiny_config, placement):
    trainer = PPOTrainer(
        tiny_config("trainer.n_cpu_workers=2", "trainer.total_steps=1", f"trainer.placement={placement}")
    )
    trainer._open()
    actor_pids = [p["pid"] for p in trainer.groups.owned[0].places.values()]
    critic_pids = [p["pid"] for p in trainer.groups.owned[-1].places.values()]
    metrics = trainer._train_step(trainer.loader.next_batch(), 1)
    trainer.groups.shutdown()
    assert "critic/vf_loss" in metrics
    if placement == "colocate":
        assert len(trainer.groups.owned) == 0 and actor_pids == critic_pids
    else:
        assert set(actor_pids).isdisjoint(critic_pids)


def test_a_checkpoint_of_one_rank_resumes_on_two(tiny_config):
    PPOTrainer(tiny_config("trainer.backend=local", "trainer.total_steps=2")).fit()
    trainer, _ = fit(tiny_config("trainer.n_cpu_workers=2", "trainer.total_steps=3"))
    records = read_metrics(trainer.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert (
        json.loads((trainer.run_dir / "checkpoints" / "global_step_3" / "trainer_state.json").read_text())["world_size"]
        == 2
    )


def test_a_split_reward_model_has_processes_of_its_own_and_scores_like_a_local_one(tiny_config, reward_model_dir):
    rm = (f"reward.model.path={reward_model_dir}", "trainer.total_steps=1")
    trainer = PPOTrainer(tiny_config(*rm, "trainer.n_cpu_workers=2", "reward.model.placement=split"))
    trainer._open()
    batch, _ = trainer._score(trainer._generate(trainer._expand(trainer.loader.next_batch()), 1))
    actor_pids = {p["pid"] for p in trainer.groups.owned[0].places.values()}
    rm_pids = {p["pid"] for p in trainer.groups.owned[-1].places.values()}
    trainer.groups.shutdown()
    assert len(rm_pids) == 2 and rm_pids.isdisjoint(actor_pids)
    local = PPOTrainer(tiny_config(*rm, "trainer.backend=local", "trainer.experiment_name=local"))
    local._open()
    keys = ["input_ids", "attention_mask", "position_ids", "prompts", "responses", "response_mask"]
    expected = local.reward_model.compute_rm_score(batch.select(keys, [], [])).batch["rm_scores"]
    local.groups.shutdown()
    assert batch.batch["rm_scores"].sum(-1).tolist() == pytest.approx(expected.sum(-1).tolist(), rel=1e-5, abs=1e-6)
