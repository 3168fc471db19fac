"""The config loader: precedence, both override spellings, and a clear error for each kind of bad input."""

import pytest

from ketch.config import BatchError, ConfigError, derive_batch_plan, load_config, parse_overrides, to_yaml
from ketch.config.schema import KetchConfig


def test_defaults_load_and_validate(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty) == KetchConfig()


def test_both_override_spellings_and_lists():
    pairs = parse_overrides(["--data.train_files", "x.parquet", "rollout.n=4", "--actor.optim.betas=[0.9,0.95]"])
    assert pairs == [("data.train_files", "x.parquet"), ("rollout.n", 4), ("actor.optim.betas", [0.9, 0.95])]


def test_yaml_then_overrides_take_precedence(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  n: 2\n  temperature: 0.7\ntrainer:\n  seed: 5\n")
    config = load_config(path, ["rollout.n=8"])
    assert (config.rollout.n, config.rollout.temperature, config.trainer.seed) == (8, 0.7, 5)


def test_ketch_rm_defaults_to_the_builtin_preference_pairs_below_yaml_and_overrides(tmp_path):
    config = load_config(command="rm")
    assert config.data.train_files == ["builtin:arithmetic-preference/train"]
    assert (config.trainer.experiment_name, config.trainer.total_steps) == ("arithmetic-rm", 1000)
    assert load_config(command="train").data.train_files == ["builtin:arithmetic/train"]
    path = tmp_path / "rm.yaml"
    path.write_text("data:\n  train_files: [pairs.parquet]\n")
    config = load_config(path, ["trainer.total_steps=7"], command="rm")
    assert (config.data.train_files, config.trainer.total_steps) == (["pairs.parquet"], 7)


def test_single_string_becomes_a_list_and_float_strings_parse():
    config = load_config(overrides=["data.train_files=a.parquet", "actor.optim.lr=1e-6"])
    assert config.data.train_files == ["a.parquet"]
    assert config.actor.optim.lr == 1e-6


def test_unknown_key_suggests_the_closest_keys():
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.total_step'.*did you mean trainer.total_steps"):
        load_config(overrides=["trainer.total_step=3"])


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  optim:\n    lrr: 1.0\n")
    with pytest.raises(ConfigError, match=r"'actor.optim.lrr' \(.*c.yaml\); did you mean actor.optim.lr"):
        load_config(path)


def test_wrong_type_names_key_value_and_expected_type():
    with pytest.raises(ConfigError, match=r"data.train_batch_size='abc' has type str, expected int"):
        load_config(overrides=["data.train_batch_size=abc"])


def test_bool_is_not_accepted_as_int():
    with pytest.raises(ConfigError, match=r"rollout.n=True has type bool, expected int"):
        load_config(overrides=["rollout.n=true"])


def test_literal_lists_the_choices():
    with pytest.raises(ConfigError, match=r"rollout.name='foo' is not one of 'hf', 'vllm'"):
        load_config(overrides=["rollout.name=foo"])


def test_section_given_a_scalar_lists_its_keys():
    with pytest.raises(ConfigError, match=r"trainer is a section of keys \(project_name, "):
        load_config(overrides=["trainer=3"])


def test_missing_yaml_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*nope.yaml does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_mini_batch_that_does_not_divide_names_both_keys():
    with pytest.raises(ConfigError, match=r"actor.ppo_mini_batch_size=7 must divide data.train_batch_size=32"):
        load_config(overrides=["actor.ppo_mini_batch_size=7"])


def test_gae_without_critic_is_a_conflict():
    with pytest.raises(ConfigError, match=r"adv_estimator=gae needs values, but critic.enable=false"):
        load_config(overrides=["algorithm.adv_estimator=gae", "critic.enable=false"])


def test_kl_in_reward_and_loss_together_is_a_conflict():
    with pytest.raises(ConfigError, match=r"would penalise KL twice"):
        load_config(overrides=["algorithm.use_kl_in_reward=true", "actor.use_kl_loss=true"])


@pytest.mark.parametrize("where", ["rollout.name=vllm", "rollout.placement=standalone"])
def test_freeing_the_rollouts_memory_is_for_the_hf_rollout_beside_the_actor(where):
    with pytest.raises(ConfigError, match=r"rollout.free_memory_while_training frees the memory of an hf rollout"):
        load_config(overrides=["rollout.free_memory_while_training=true", where, "trainer.backend=ray"])


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["rollout.temperature=0", "data.max_prompt_length=0"])
    assert "rollout.temperature=0.0 must be > 0" in str(err.value)
    assert "data.max_prompt_length=0 must be >= 1" in str(err.value)


def test_batch_plan_for_grpo_on_two_ranks():
    config = load_config(
        overrides=[
            "algorithm.adv_estimator=grpo",
            "data.train_batch_size=16",
            "rollout.n=4",
            "actor.ppo_mini_batch_size=8",
            "actor.ppo_micro_batch_size_per_device=4",
        ]
    )
    plan = derive_batch_plan(config, world_size=2)
    assert (plan.sequences_per_step, plan.sequences_per_device) == (64, 32)
    assert plan.actor.mini_batch_size == 32
    assert plan.actor.num_mini_batches == 2
    assert plan.actor.mini_batch_per_device == 16
    assert plan.actor.grad_accum_steps == 4
    assert plan.critic is None


def test_batch_plan_rejects_a_micro_batch_that_does_not_divide_the_rank_share():
    config = load_config(
        overrides=[
            "data.train_batch_size=12",
            "rollout.n=1",
            "actor.ppo_mini_batch_size=12",
            "actor.ppo_micro_batch_size_per_device=4",
        ]
    )
    with pytest.raises(BatchError, match=r"ppo_micro_batch_size_per_device=4 must divide the 6 sequences"):
        derive_batch_plan(config, world_size=2)


def test_config_show_yaml_round_trips(tmp_path):
    config = load_config(overrides=["rollout.n=3", "model.override_config={rope_theta: 10000}"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(config))
    assert load_config(path) == config


def test_the_builtin_run_gets_its_own_defaults_only_without_a_yaml_file_on_the_builtin_task(tmp_path):
    demo = load_config()
    assert (demo.rollout.n, demo.trainer.total_steps, demo.actor.old_log_prob_from_rollout) == (16, 190, True)
    optim = demo.actor.optim
    assert (optim.lr, optim.lr_scheduler, optim.min_lr_ratio) == (1.5e-4, "cosine", 0.1)
    assert load_config(overrides=["rollout.n=4"]).rollout.n == 4
    assert load_config(overrides=["trainer.seed=3"]).rollout.n == 16
    assert load_config(overrides=["data.train_files=[a.parquet]"]).rollout.n == 8
    assert load_config(overrides=["model.path=my-model"]).trainer.total_steps == 100
    assert load_config(command="sft").rollout.n == 8
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  seed: 5\n")
    assert load_config(path).rollout.n == 8
