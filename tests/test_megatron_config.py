"""`actor.strategy=megatron` and `actor.megatron.*`: sizes that cannot run are stopped at start-up, naming the key."""

from __future__ import annotations

import sys

import pytest
from transformers import Qwen2Config

from ketch.cli import main
from ketch.config import ConfigError, load_config
from ketch.config.parallel import check_megatron_start

GPU_RUN = ["trainer.device=cuda", "trainer.n_gpus_per_node=4", "algorithm.adv_estimator=grpo", "rollout.n=2"]


def model_config(**sizes: int) -> Qwen2Config:
    base = {"num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 64}
    return Qwen2Config(hidden_size=64, intermediate_size=128, **(base | sizes))


def megatron(*overrides: str):
    return load_config(overrides=[*GPU_RUN, "actor.strategy=megatron", *overrides])


def test_megatron_sizes_divide_the_data_parallel_world():
    config = megatron("actor.megatron.tensor_model_parallel_size=2")
    # 4 GPUs / (TP 2 x PP 1) = 2 data-parallel ranks: 16 prompts x 2 samples = 32 sequences -> 16 per rank
    assert (config.num_processes(gpu_visible=True), config.world_size(gpu_visible=True)) == (4, 2)
    check_megatron_start(config, model_config(), gpu_visible=True)


def test_tensor_size_not_dividing_the_gpus_names_both_keys():
    with pytest.raises(
        ConfigError,
        match=r"actor\.megatron\.tensor_model_parallel_size x pipeline_model_parallel_"
        r"size = 3 x 1 does not divide the 4 GPUs",
    ):
        megatron("actor.megatron.tensor_model_parallel_size=3")


def test_tensor_size_not_dividing_the_heads_names_the_key_and_the_count():
    config = megatron("actor.megatron.tensor_model_parallel_size=4")
    with pytest.raises(ConfigError) as err:
        check_megatron_start(config, model_config(num_attention_heads=6, num_key_value_heads=2), gpu_visible=True)
    message = str(err.value)
    assert "actor.megatron.tensor_model_parallel_size=4 does not divide the model's num_attention_heads=6" in message
    assert "num_key_value_heads=2" in message


def test_pipeline_larger_than_the_layers_is_named():
    config = megatron("actor.megatron.pipeline_model_parallel_size=4")
    with pytest.raises(ConfigError, match=r"pipeline_model_parallel_size=4 is larger than the model's 2 layers"):
        check_megatron_start(config, model_config(num_hidden_layers=2), gpu_visible=True)


def test_virtual_pipeline_must_divide_the_layers_per_stage():
    config = megatron(
        "actor.megatron.pipeline_model_parallel_size=2", "actor.megatron.virtual_pipeline_model_parallel_size=3"
    )
    with pytest.raises(ConfigError, match=r"2 x 3 does not divide the model's 4 layers"):
        check_megatron_start(config, model_config(), gpu_visible=True)


def test_sequence_parallel_without_tensor_parallelism_is_a_conflict():
    with pytest.raises(ConfigError, match=r"actor\.megatron\.sequence_parallel=true .*\.tensor_model_parallel_size=1"):
        megatron("actor.megatron.sequence_parallel=true")


def test_optimizer_offload_is_refused_with_megatron_by_key():
    with pytest.raises(
        ConfigError, match=r"critic\.optim\.offload keeps FSDP's AdamW moments in host memory and is not"
    ):
        megatron("algorithm.adv_estimator=gae", "critic.strategy=megatron", "critic.optim.offload=true")
    megatron("actor.strategy=fsdp", "actor.optim.offload=true")  # FSDP's optimizer offloads


def test_megatron_on_a_cpu_is_refused_by_key():
    with pytest.raises(ConfigError, match=r"actor\.strategy=megatron trains on GPUs only, but trainer\.device=cpu"):
        load_config(overrides=["actor.strategy=megatron", "trainer.device=cpu"])
    auto = load_config(overrides=["actor.strategy=megatron"])
    with pytest.raises(ConfigError, match=r"actor\.strategy=megatron trains on GPUs only, and this machine shows none"):
        check_megatron_start(auto, model_config(), gpu_visible=False)


def test_megatron_without_megatron_core_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron", None)  # find_spec then reports the package missing
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    missing = r"needs megatron-core, which is not installed: pip install 'ketch\[megatron\]'"
    with pytest.raises(ConfigError, match=missing):
        check_megatron_start(megatron(), model_config(), gpu_visible=True)


def test_critic_must_share_the_actors_data_parallel_size():
    with pytest.raises(ConfigError, match=r"tensor x pipeline sizes are \{'actor': 2, 'critic': 1\}"):
        load_config(
            overrides=[
                *GPU_RUN[:2],
                "algorithm.adv_estimator=gae",  # a critic is trained (the default estimator, grpo, has none)
                "actor.strategy=megatron",
                "actor.megatron.tensor_model_parallel_size=2",
            ]
        )


def test_actor_and_critic_with_the_same_grid_share_the_data_parallel_ranks():
    both = ("actor", "critic")
    config = load_config(
        overrides=[
            *GPU_RUN[:2],
            *(f"{role}.strategy=megatron" for role in both),
            *(f"{role}.megatron.tensor_model_parallel_size=2" for role in both),
        ]
    )
    assert (config.model_parallel_size, config.world_size(gpu_visible=True)) == (2, 2)


def test_ketch_train_with_megatron_on_cpu_exits_2_naming_the_key(capsys):
    assert main(["train", "actor.strategy=megatron", "trainer.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "\nketch train: error: invalid configuration" in "\n" + err  # after the log lines, if any
    assert "actor.strategy=megatron trains on GPUs only, but trainer.device=cpu" in err
