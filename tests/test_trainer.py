"""PPOTrainer end to end on a tiny random model: every estimator runs a step; logs and metrics files."""

from __future__ import annotations

import gc
import json
import logging

import pytest
import torch

from ketch.protocol import DataProto
from ketch.tracking import format_step_line, read_metrics
from ketch.trainer.ppo import PPOTrainer


def run(config) -> tuple[PPOTrainer, dict[str, float]]:
    trainer = PPOTrainer(config)
    metrics = trainer.fit()
    return trainer, metrics


def actor_weights(trainer: PPOTrainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in trainer.actor_rollout.worker.actor.full_parameters(prefix="lm.")}


def first_step(config) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """The metrics of one training step of a fresh trainer on `config`, and the actor's weights after it."""
    trainer = PPOTrainer(config)
    trainer._open()
    metrics = trainer._train_step(trainer.loader.next_batch(), 1)
    weights = actor_weights(trainer)
    trainer.groups.shutdown()
    return metrics, weights


def test_one_ppo_step_with_critic_and_kl_in_the_reward_updates_both_models(tiny_config):
    config = tiny_config("trainer.total_steps=1", "algorithm.use_kl_in_reward=true", "actor.optim.lr=0.01")
    trainer = PPOTrainer(config)
    trainer._open()
    before = actor_weights(trainer)
    critic_before = {n: p.full_tensor().clone() for n, p in trainer.critic.worker.critic.module.named_parameters()}
    metrics = trainer._train_step(trainer.loader.next_batch(), 1)
    after = actor_weights(trainer)
    assert all(not torch.equal(before[n], after[n]) for n in before if "layers.0" in n)
    critic_after = dict(trainer.critic.worker.critic.module.named_parameters())
    assert not torch.equal(critic_before["critic.score.weight"], critic_after["critic.score.weight"].full_tensor())
    expected = {"critic/vf_loss", "critic/vf_clipfrac", "critic/values/mean", "critic/vf_explained_var"}
    expected |= {"actor/pg_loss", "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff", "timing_s/ref"}
    assert expected <= set(metrics)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.001)


@pytest.mark.parametrize(
    "overrides",
    [
        ("algorithm.adv_estimator=grpo", "rollout.n=4", "actor.use_kl_loss=true"),
        ("algorithm.adv_estimator=rloo", "rollout.n=2"),
        ("algorithm.adv_estimator=reinforce_plus_plus",),
        ("algorithm.adv_estimator=remax",),
    ],
    ids=["grpo", "rloo", "reinforce_plus_plus", "remax"],
)
def test_one_step_of_each_critic_free_estimator(tiny_config, overrides):
    trainer, metrics = run(tiny_config("trainer.total_steps=1", *overrides))
    assert trainer.critic is None
    assert "critic/vf_loss" not in metrics and "timing_s/values" not in metrics
    assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
    if "actor.use_kl_loss=true" in overrides:
        assert "actor/kl_loss" in metrics and "timing_s/ref" in metrics


def test_grpo_groups_share_a_uid_and_have_n_samples(tiny_config):
    trainer = PPOTrainer(tiny_config("algorithm.adv_estimator=grpo", "rollout.n=3"))
    batch = trainer._expand(trainer.loader.next_batch())
    uids = batch.non_tensor_batch["uid"].tolist()
    assert len(uids) == 24 and len(set(uids)) == 8
    assert all(uids[i] == uids[i - i % 3] for i in range(24))


def test_metrics_jsonl_has_every_step_and_an_end_event(tiny_config):
    trainer, _ = run(tiny_config("trainer.total_steps=2", "trainer.test_freq=2", "trainer.val_before_train=true"))
    records = read_metrics(trainer.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    expected = {
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/grad_norm",
        "critic/vf_loss",
        "critic/vf_explained_var",
        "critic/score/mean",
        "response_length/mean",
        "response_length/clip_ratio",
        "timing_s/gen",
        "timing_s/update_actor",
        "perf/throughput",
        "val/ketch/arithmetic/acc",
    }
    assert expected <= set(records[2])
    assert set(records[0]) == {"step", "val/ketch/arithmetic/acc", "val/response_length/mean", "timing_s/testing"}
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["event"] == "end"
    assert json.loads((trainer.run_dir / "config.json").read_text())["trainer"]["total_steps"] == 2


def test_console_line_has_the_documented_shape():
    metrics = {
        "timing_s/gen": 0.821,
        "timing_s/values": 0.31,
        "timing_s/adv": 0.149,
        "timing_s/step": 2.0,
        "actor/pg_loss": 0.4213,
        "critic/vf_loss": 0.8761,
        "actor/reward_kl_penalty": 0.0121,
        "critic/score/mean": 2.181,
        "critic/score/std": 0.43,
        "response_length/mean": 42.71,
    }
    assert format_step_line(10, metrics) == (
        "Step 10: timing/gen=0.82s, timing/values=0.31s, timing/adv=0.15s, loss/actor=0.421, loss/critic=0.876, "
        "kl_divergence=0.012, reward_mean=2.18, reward_std=0.43, response_len_mean=42.7"
    )


def test_console_logs_every_log_interval(tiny_config, caplog):
    with caplog.at_level(logging.INFO, logger="ketch"):
        run(tiny_config("trainer.total_steps=2", "trainer.logger=[console,jsonl]", "trainer.log_interval=2"))
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Step ")]
    assert len(steps) == 1 and steps[0].startswith("Step 2: timing/gen=")


def test_all_truncated_responses_get_a_clear_warning_once(tiny_config, caplog):
    trainer = PPOTrainer(tiny_config("data.max_response_length=3"))
    responses = {"responses": torch.full((2, 3), 9), "response_mask": torch.ones(2, 3)}
    cut_off = DataProto.from_dict({**responses, "attention_mask": torch.ones(2, 5)})  # 2 prompt tokens, 3 response
    with caplog.at_level(logging.WARNING, logger="ketch"):
        trainer._warn_if_all_truncated(cut_off, 1)
        trainer._warn_if_all_truncated(cut_off, 1)
    assert caplog.text.count("reached data.max_response_length=3 without a stop token") == 1
    assert "rollout.stop_token_ids" in caplog.text


def grpo_first_steps(tiny_config, settings: tuple[str, ...], *common: str) -> tuple[list[dict], list[dict]]:
    """`first_step` of a GRPO run (2 samples per prompt, lr 0.01, `common` overrides) under each of `settings`
    (one override each): their metrics and their weights, in that order."""
    steps = [
        first_step(
            tiny_config(
                "algorithm.adv_estimator=grpo",
                "rollout.n=2",
                "actor.optim.lr=0.01",
                *common,
                setting,
                f"trainer.experiment_name=run-{i}",
            )
        )
        for i, setting in enumerate(settings)
    ]
    return [m for m, _ in steps], [w for _, w in steps]


def test_skipping_the_old_log_prob_pass_gives_the_same_update_on_policy(tiny_config):
    settings = ("actor.recompute_old_log_prob=true", "actor.recompute_old_log_prob=null")
    metrics, weights = (dict(zip(("true", "null"), x, strict=True)) for x in grpo_first_steps(tiny_config, settings))
    assert "timing_s/old_log_prob" in metrics["true"] and "timing_s/old_log_prob" not in metrics["null"]
    # the old-log-prob pass also measures the rollout engine against the training engine: the same fp32
    # weights on the CPU, so the sampled tokens' probabilities agree to rounding (KV-cached decoding and the
    # full forward round differently: a small mismatch, not none)
    mismatch = {k.removeprefix("training/rollout_"): v for k, v in metrics["true"].items()}
    assert 0 < mismatch["probs_diff_mean"] <= mismatch["probs_diff_max"] < 1e-4
    assert abs(mismatch["kl"]) < 1e-6
    # without the pass, the update's own forward is π_old: the same samples give the same mismatch
    for key in ("probs_diff_max", "probs_diff_mean", "kl"):
        assert metrics["null"][f"training/rollout_{key}"] == pytest.approx(mismatch[key], rel=1e-4, abs=1e-15), key
    assert metrics["null"]["actor/entropy"] == pytest.approx(metrics["true"]["actor/entropy"], rel=1e-5)
    for name, tensor in weights["true"].items():
        torch.testing.assert_close(weights["null"][name], tensor, atol=1e-6, rtol=0)


def test_old_log_probs_from_the_rollout_save_the_pass_and_give_the_recomputed_update(tiny_config):
    settings = ("actor.recompute_old_log_prob=true", "actor.old_log_prob_from_rollout=true")
    # two mini-batches: the second one's ratio needs π_old
    (recomputed, from_rollout), (recomputed_weights, rollout_weights) = grpo_first_steps(
        tiny_config, settings, "actor.ppo_mini_batch_size=4"
    )
    assert "timing_s/old_log_prob" in recomputed and "timing_s/old_log_prob" not in from_rollout
    # the rollout's log-probs of the sampled tokens are the training engine's to rounding (fp32 on the CPU), so
    # the ratios, and with them the update, are the same
    assert from_rollout["actor/ppo_kl"] == pytest.approx(recomputed["actor/ppo_kl"], abs=1e-6)
    for name, tensor in recomputed_weights.items():
        torch.testing.assert_close(rollout_weights[name], tensor, atol=1e-5, rtol=0)


def test_what_the_first_step_built_is_frozen_for_the_run_and_thawed_after_it(tiny_config, monkeypatch):
    """After the first step, Python's collector no longer scans the run's long-lived objects (a full collection of
    them took 0.35 s of a GPU step); after the run, they are collectable again."""
    trainer = PPOTrainer(tiny_config("trainer.total_steps=3"))
    frozen_at_start = []
    train_step = trainer._train_step

    def counted(batch, step):
        frozen_at_start.append(gc.get_freeze_count())
        return train_step(batch, step)

    monkeypatch.setattr(trainer, "_train_step", counted)
    trainer.fit()
    assert frozen_at_start[0] == 0
    assert min(frozen_at_start[1:]) > 10_000  # ~455,000 objects here
    assert gc.get_freeze_count() == 0


def test_the_rollout_warms_up_on_the_first_steps_prompts_before_it(tiny_config, monkeypatch):
    """`Rollout.warm_up` gets the first step's prompts, as the generating worker gets them, before any generation:
    for ReMax once sampled and once greedy (its baseline); a resumed run warms up again, on its next step's."""
    from ketch.rollout.hf import HFRollout

    calls = []
    generate, warm_up = HFRollout.generate, HFRollout.warm_up

    def record(name, original):
        def recorded(self, prompts):
            calls.append((name, prompts.batch["input_ids"].clone(), prompts.meta_info.get("do_sample")))
            return original(self, prompts)

        return recorded

    monkeypatch.setattr(HFRollout, "generate", record("generate", generate))
    monkeypatch.setattr(HFRollout, "warm_up", record("warm_up", warm_up))
    config = tiny_config("algorithm.adv_estimator=remax", "trainer.total_steps=1", "trainer.save_freq=1")
    PPOTrainer(config).fit()
    assert [(name, sample) for name, _, sample in calls] == [
        ("warm_up", None),
        ("warm_up", False),
        ("generate", None),
        ("generate", False),
    ]
    assert calls[0][1].shape[0] == 8 and all(torch.equal(c[1], calls[0][1]) for c in calls)
    calls.clear()
    trainer = PPOTrainer(tiny_config("algorithm.adv_estimator=remax", "trainer.total_steps=2"))
    trainer.fit()
    assert trainer.step == 2 and [name for name, _, _ in calls] == ["warm_up", "warm_up", "generate", "generate"]
    assert all(torch.equal(c[1], calls[2][1]) for c in calls)
