"""The rollout–training mismatch metrics in a PPO step, with and without the separate old-log-prob pass."""

from __future__ import annotations

import math

import pytest

from ketch.trainer.ppo import PPOTrainer

MISMATCH = ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean", "training/rollout_kl")


def first_step(config) -> dict[str, float]:
    trainer = PPOTrainer(config)
    trainer._open()
    try:
        return trainer._train_step(trainer.loader.next_batch(), 1)
    finally:
        trainer.groups.shutdown()


def test_the_mismatch_is_logged_from_the_updates_own_forward_when_the_old_log_prob_pass_is_skipped(tiny_config):
    # one mini-batch, one epoch, no KL, no rollout_is: old_log_prob is the update forward's own log-prob
    grpo = ("algorithm.adv_estimator=grpo", "rollout.n=2", "trainer.total_steps=1")
    skipped = first_step(tiny_config(*grpo, "trainer.experiment_name=skipped"))
    forced = first_step(tiny_config(*grpo, "trainer.experiment_name=forced", "actor.recompute_old_log_prob=true"))
    assert "timing_s/old_log_prob" not in skipped and "timing_s/old_log_prob" in forced
    for key in MISMATCH:
        assert math.isfinite(skipped[key]) and skipped[key] >= 0, key
        # the same seed gives the same samples: both passes see the same π_old and the same rollout log-probs
        assert skipped[key] == pytest.approx(forced[key], rel=1e-4, abs=1e-15), key
    # KV-cached decoding and the full forward round differently even in fp32: a small mismatch, not none
    assert skipped["training/rollout_probs_diff_max"] >= skipped["training/rollout_probs_diff_mean"] > 0
