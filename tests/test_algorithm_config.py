"""Config keys of the algorithms (policy loss, rollout correction, DAPO): bad values stop at load with the keys."""

import pytest

from ketch.config import ConfigError, load_config


def test_an_unknown_policy_loss_lists_the_registered_ones_at_load():
    with pytest.raises(ConfigError, match=r"actor.policy_loss=ppo2: unknown .*registered: cispo, gspo, gspo_token"):
        load_config(overrides=["actor.policy_loss=ppo2"])


def test_an_unknown_estimator_lists_the_registered_ones_at_load():
    with pytest.raises(ConfigError, match=r"algorithm.adv_estimator=grpoo: .*reinforce_plus_plus_baseline"):
        load_config(overrides=["algorithm.adv_estimator=grpoo"])


def test_rollout_is_cannot_skip_the_old_log_prob_pass():
    with pytest.raises(ConfigError, match=r"actor.rollout_is needs .* set actor.recompute_old_log_prob=null"):
        load_config(overrides=["actor.rollout_is=token", "actor.recompute_old_log_prob=false"])


def test_old_log_probs_from_the_rollout_exclude_what_needs_the_training_engines():
    with pytest.raises(ConfigError, match=r"old_log_prob_from_rollout=true skips .* which actor.rollout_is needs"):
        load_config(overrides=["actor.rollout_is=token", "actor.old_log_prob_from_rollout=true"])
    with pytest.raises(ConfigError, match=r"which actor.recompute_old_log_prob=true needs"):
        load_config(overrides=["actor.recompute_old_log_prob=true", "actor.old_log_prob_from_rollout=true"])


def test_the_registries_declare_the_built_ins_that_ketch_algorithms_registers():
    import ketch.algorithms  # noqa: F401  (registers the built-ins)
    from ketch.registry import ADV_ESTIMATORS, POLICY_LOSSES

    estimators = {n for n in ADV_ESTIMATORS.names() if ADV_ESTIMATORS.get(n).fn.__module__.startswith("ketch.")}
    losses = {n for n in POLICY_LOSSES.names() if POLICY_LOSSES.get(n).__module__.startswith("ketch.")}
    assert (estimators, losses) == (ADV_ESTIMATORS.builtins, POLICY_LOSSES.builtins)
