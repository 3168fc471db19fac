"""What a run keeps on each GPU besides activations (`ketch/config/memory.py`) and `ketch doctor`'s row that
compares it with the GPU: the figures of the 7B runs on one H200 (docs/benchmarks.md), a critic, a
reference, Megatron and vLLM."""

from __future__ import annotations

from transformers import Qwen2Config

from ketch.config import load_config
from ketch.config.memory import gpu_memory_parts
from ketch.doctor_config import memory_row, parameter_count

GIB = 2**30
QWEN25_7B = Qwen2Config(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
)
P = 7_615_616_512
KV = 128 * (128 + 256) * 28 * 2 * 4 * 128 * 2  # rows x tokens x layers x (keys, values) x heads x head size x bf16
FIXED = [  # the fixed GPU workload on one GPU: GRPO, 16 prompts x 8 samples, 128 + 256 tokens
    "trainer.device=cuda",
    "trainer.n_gpus_per_node=1",
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=16",
    "actor.ppo_mini_batch_size=16",
    "rollout.n=8",
    "data.max_prompt_length=128",
    "data.max_response_length=256",
]


def test_the_7b_shape_on_one_gpu_needs_the_offload_and_the_freed_rollout_to_fit_80_gb():
    """130.3 GiB before activations is over 85% of an H200's memory (the run without the options ran out of
    memory in its second update) and over an 80 GB GPU's; with AdamW's moments offloaded and the rollout's memory
    freed while training, 56.7 GiB (that run peaked at 65.9 GiB with its activations, capped at 78.5)."""
    assert parameter_count(QWEN25_7B, trust_remote_code=False) == P
    config = load_config(overrides=FIXED)
    parts = gpu_memory_parts(config, QWEN25_7B, P, 140 * GIB)
    rollout = {"rollout weights": 2 * P, "KV cache": KV}
    assert parts == {"update": {"actor state": 16 * P, **rollout}, "generation": {"actor state": 12 * P, **rollout}}
    row = memory_row(config, QWEN25_7B, 140 * GIB)
    assert (row.name, row.status) == ("GPU memory", "warn")
    assert row.detail == (
        "7.62B parameters on 1 GPU(s), per GPU before activations: update 130.3 GiB (actor state 113.5, rollout "
        "weights 14.2, KV cache 2.6); generation 101.9 GiB (actor state 85.1, rollout weights 14.2, KV cache 2.6); "
        "the GPU has 140.0 GiB"
    )
    assert row.fix == (
        "actor.optim.offload=true or rollout.free_memory_while_training=true or more GPUs (trainer.n_gpus_per_node, "
        "trainer.nnodes) or Megatron TP/PP"
    )
    assert memory_row(config, QWEN25_7B, 80 * GIB).status == "FAIL"

    both = load_config(overrides=[*FIXED, "actor.optim.offload=true", "rollout.free_memory_while_training=true"])
    parts = gpu_memory_parts(both, QWEN25_7B, P, 80 * GIB)
    assert parts == {"update": {"actor state": 8 * P}, "generation": {"actor state": 4 * P, **rollout}}
    row = memory_row(both, QWEN25_7B, 80 * GIB)
    assert row.status == "ok" and "update 56.7 GiB (actor state 56.7)" in row.detail
    assert memory_row(both, QWEN25_7B, None).detail.endswith("; no GPU here to compare with")
    assert memory_row(load_config(overrides=[*FIXED[1:], "trainer.device=cpu"]), QWEN25_7B, None) is None


def test_a_critic_a_reference_megatron_shards_and_vllms_share():
    """PPO on 4 GPUs with Megatron TP=2 for actor and critic (state over the 2 ranks of a group, gradients kept
    between updates), KL in the reward (a bf16 reference sharded over all 4), vLLM taking half of a 100 GiB GPU
    while it generates and nothing while the actor trains (it sleeps)."""
    megatron = [
        f"{role}.{key}"
        for role in ("actor", "critic")
        for key in ("strategy=megatron", "megatron.tensor_model_parallel_size=2")
    ]
    config = load_config(
        overrides=[
            *FIXED,
            "trainer.n_gpus_per_node=4",
            "algorithm.adv_estimator=gae",
            "algorithm.use_kl_in_reward=true",
            "rollout.name=vllm",
            "rollout.gpu_memory_utilization=0.5",
            *megatron,
        ]
    )
    parts = gpu_memory_parts(config, QWEN25_7B, P, 100 * GIB)
    state = {"actor state": 16 * P // 2, "critic state": 16 * P // 2, "reference": 2 * P // 4}
    assert parts == {"update": state, "generation": {**state, "vLLM (rollout.gpu_memory_utilization)": 50 * GIB}}
    assert (
        memory_row(config, QWEN25_7B, 100 * GIB).fix
        == "more GPUs (trainer.n_gpus_per_node, trainer.nnodes) or Megatron TP/PP"
    )


def test_lora_keeps_a_frozen_bf16_base_trains_the_adapters_and_loads_no_reference():
    """Rank 64 on every linear layer of the 7B shape: 64 x 28 layers x (2 x (3584 + 3584) q/o + 2 x (3584 + 512) k/v
    + 3 x (3584 + 18944) gate/up/down) = 161,480,704 adapter numbers with 16 bytes of training state each (12 outside
    the update), beside the frozen base at 2 bytes; the KL loss's reference is the actor itself: no reference row."""
    adapters = 161_480_704
    config = load_config(overrides=[*FIXED, "actor.lora.rank=64", "actor.use_kl_loss=true"])
    parts = gpu_memory_parts(config, QWEN25_7B, P, 140 * GIB)
    rollout = {"rollout weights": 2 * P, "KV cache": KV}
    assert parts == {
        "update": {"actor state": 16 * adapters + 2 * P, **rollout},
        "generation": {"actor state": 12 * adapters + 2 * P, **rollout},
    }
    row = memory_row(config, QWEN25_7B, 140 * GIB)
    assert row.status == "ok" and "update 33.4 GiB (actor state 16.6, rollout weights 14.2, KV cache 2.6)" in row.detail
