"""What a run keeps on each GPU (`ketch/config/memory.py`) and `ketch doctor`'s row that compares it with the GPU:
the figures of the 7B runs on one H200 (docs/benchmarks.md), activations for the configured lengths, a critic, a
reference, Megatron and vLLM."""

from __future__ import annotations

from transformers import Gemma2Config, Qwen2Config

from ketch.config import load_config
from ketch.config.memory import gpu_memory_parts
from ketch.doctor.config_checks import memory_row, meta_model

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
BLOCK = (8 * 3584 + 4 * 18944) * 2  # a block's activations per token in bf16: 8 x hidden + 4 x intermediate numbers
LM_HEAD = 3 * 4 * 2**26  # the lm-head pass's chunk: 2^26 logits in three float32 tensors
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

LONG = [  # GRPO with long responses on one GPU: 16 prompts x 4 samples, state offloaded, micro-batches by tokens
    "trainer.device=cuda",
    "data.train_batch_size=16",
    "actor.ppo_mini_batch_size=16",
    "rollout.n=4",
    "data.max_prompt_length=512",
    "actor.optim.offload=true",
    "rollout.free_memory_while_training=true",
    "actor.use_dynamic_bsz=true",
]


def test_the_7b_shape_on_one_gpu_needs_the_offload_the_freed_rollout_and_recomputation_to_fit_80_gb():
    """One micro-batch of all 128 sequences (49,152 tokens) keeps 268.5 GiB of activations, and a world of one
    process its gathered bf16 weights: far over an H200 (the run without options ran out of memory). With AdamW's
    moments offloaded, the rollout's memory freed while training, recomputation and micro-batches of 4,096 tokens,
    63.0 GiB (that run peaked at 65.9 GiB, capped at 78.5, with the lm-head chunks of 4,096 tokens then)."""
    assert sum(p.numel() for p in meta_model(QWEN25_7B, trust_remote_code=False).parameters()) == P
    config = load_config(overrides=FIXED)
    parts = gpu_memory_parts(config, QWEN25_7B, P, 140 * GIB)
    rollout = {"rollout weights": 2 * P, "KV cache": KV}
    activations = 128 * 384 * 28 * BLOCK + LM_HEAD
    assert parts == {
        "update": {"actor state": 16 * P, "activations": activations, "gathered weights": 2 * P, **rollout},
        "generation": {"actor state": 12 * P, **rollout},
    }
    row = memory_row(config, QWEN25_7B, 140 * GIB)
    assert (row.name, row.status) == ("GPU memory", "FAIL")
    assert row.detail == (
        "7.62B parameters on 1 GPU(s), per GPU: update 413.0 GiB (actor state 113.5, activations 268.5, gathered "
        "weights 14.2, rollout weights 14.2, KV cache 2.6); generation 101.9 GiB (actor state 85.1, rollout weights "
        "14.2, KV cache 2.6); the GPU has 140.0 GiB"
    )
    assert row.fix == (
        "actor.optim.offload=true or rollout.free_memory_while_training=true or rollout.max_num_batched_tokens (the KV "
        "cache's tokens) or model.gradient_checkpointing=true or model.activation_offload=true or "
        "actor.use_dynamic_bsz=true with actor.ppo_max_token_len_per_device or more GPUs (trainer.n_gpus_per_node, "
        "trainer.nnodes) or Megatron TP/PP"
    )

    fitted = [
        *FIXED,
        "actor.optim.offload=true",
        "rollout.free_memory_while_training=true",
        "model.gradient_checkpointing=true",
        "actor.use_dynamic_bsz=true",
        "actor.ppo_max_token_len_per_device=4096",
    ]
    both = load_config(overrides=fitted)
    parts = gpu_memory_parts(both, QWEN25_7B, P, 80 * GIB)
    recomputed = 4096 * (6 * BLOCK + 28 * 3584 * 2) + LM_HEAD  # six blocks' worth and every block's input
    assert parts == {
        "update": {"actor state": 8 * P, "activations": recomputed},
        "generation": {"actor state": 4 * P, **rollout},
    }
    row = memory_row(both, QWEN25_7B, 80 * GIB)
    assert row.status == "ok" and "update 63.0 GiB (actor state 56.7, activations 6.3)" in row.detail
    assert memory_row(both, QWEN25_7B, None).detail.endswith("; no GPU here to compare with")


def test_long_responses_count_their_activations_and_the_settings_that_shrink_them_are_named():
    """GRPO on the 7B shape with 32k-token responses on one 140 GiB GPU, state offloaded: a micro-batch of one
    sequence (512 + 32,768 tokens, over the 16,384-token budget, alone) with recomputation keeps 45.8 GiB; the
    checkpoints in host memory take 0.2 MB a token off; the hf rollout's KV cache for 64 rows of 33,280 tokens
    (113.8 GiB) shrinks to one sub-batch of rollout.max_num_batched_tokens=133120 (4 rows); partial rollouts with
    twice the prompts in flight double it."""
    long = [*LONG, "data.max_response_length=32768", "model.gradient_checkpointing=true"]
    config = load_config(overrides=long)
    tokens = 512 + 32768
    parts = gpu_memory_parts(config, QWEN25_7B, P, 140 * GIB)
    assert parts["update"]["activations"] == tokens * (6 * BLOCK + 28 * 3584 * 2) + LM_HEAD
    assert parts["generation"]["KV cache"] == 64 * tokens * 28 * 2 * 4 * 128 * 2
    row = memory_row(config, QWEN25_7B, 140 * GIB)
    assert row.status == "FAIL" and "activations 45.8" in row.detail and "KV cache 113.8" in row.detail
    assert row.fix == (
        "rollout.max_num_batched_tokens (the KV cache's tokens) or model.activation_offload=true or a smaller "
        "actor.ppo_max_token_len_per_device (now 16384) or more GPUs (trainer.n_gpus_per_node, trainer.nnodes) or "
        "Megatron TP/PP"
    )
    fitted = load_config(overrides=[*long, "model.activation_offload=true", "rollout.max_num_batched_tokens=133120"])
    parts = gpu_memory_parts(fitted, QWEN25_7B, P, 140 * GIB)
    assert parts["update"]["activations"] == tokens * 6 * BLOCK + LM_HEAD
    assert parts["generation"]["KV cache"] == 4 * tokens * 28 * 2 * 4 * 128 * 2
    assert memory_row(fitted, QWEN25_7B, 140 * GIB).status == "ok"
    assert memory_row(load_config(overrides=[*FIXED[1:], "trainer.device=cpu"]), QWEN25_7B, None) is None
    partial = ["rollout.partial.enable=true", "rollout.partial.over_sample=2", "actor.rollout_is=token"]
    parts = gpu_memory_parts(load_config(overrides=[*long, *partial]), QWEN25_7B, P, 140 * GIB)
    assert parts["generation"]["KV cache"] == 128 * tokens * 28 * 2 * 4 * 128 * 2  # 32 prompts in flight x 4


def test_a_critic_a_reference_megatron_shards_and_vllms_share():
    """PPO on 4 GPUs with Megatron TP=2 for actor and critic (state over the 2 ranks of a group, gradients kept
        between updates), KL in the reward (a bf16 reference sharded over all 4), vLLM taking half of a 100 GiB GPU
        while it generates and nothing while the actor trains (it sleeps), when the update's activations count: the 64
    sequences of each of the 2 data-parallel ranks in one micro-batch, split over the tensor-parallel pair."""
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
    activations = 32 * 384 * 28 * BLOCK + LM_HEAD  # 64 sequences a data-parallel rank, split over TP=2
    assert parts == {
        "update": {**state, "activations": activations},
        "generation": {**state, "vLLM (rollout.gpu_memory_utilization)": 50 * GIB},
    }
    assert (
        memory_row(config, QWEN25_7B, 100 * GIB).fix
        == "more GPUs (trainer.n_gpus_per_node, trainer.nnodes) or Megatron TP/PP"
    )


def test_lora_keeps_a_frozen_bf16_base_trains_the_adapters_and_loads_no_reference():
    """Rank 64 on every linear layer of the 7B shape: 64 x 28 layers x (2 x (3584 + 3584) q/o + 2 x (3584 + 512) k/v
    + 3 x (3584 + 18944) gate/up/down) = 161,480,704 adapter numbers with 16 bytes of training state each (12 outside
    the update), beside the frozen base at 2 bytes; the KL loss's reference is the actor itself: no reference row.
    With recomputation, the activations of the one micro-batch of 128 x 384 tokens are six blocks' worth and every
    block's input, as without LoRA. In one process the rollout reads the frozen weights the adapters leave alone in
    place (`ketch doctor` counts them on the model's skeleton): here the embeddings, the output layer and the norms,
    2 x 152,064 x 3,584 + 57 x 3,584 = 1,090,199,040 numbers (2.0 GiB) fewer of the rollout's own."""
    adapters = 161_480_704
    lora = ["actor.lora.rank=64", "actor.use_kl_loss=true", "model.gradient_checkpointing=true"]
    config = load_config(overrides=[*FIXED, *lora])
    parts = gpu_memory_parts(config, QWEN25_7B, P, 140 * GIB)
    rollout = {"rollout weights": 2 * P, "KV cache": KV}
    activations = 128 * 384 * (6 * BLOCK + 28 * 3584 * 2) + LM_HEAD
    assert parts == {
        "update": {"actor state": 16 * adapters + 2 * P, "activations": activations, **rollout},
        "generation": {"actor state": 12 * adapters + 2 * P, **rollout},
    }
    row = memory_row(config, QWEN25_7B, 140 * GIB)
    assert row.status == "ok"
    assert "update 98.7 GiB (actor state 16.6, activations 67.3, rollout weights 12.2, KV cache 2.6)" in row.detail
    shared = 1_090_199_040
    assert gpu_memory_parts(config, QWEN25_7B, P, 140 * GIB, shared=shared)["generation"]["rollout weights"] == 2 * (
        P - shared
    )


def test_eager_attention_counts_its_scores_quadratic_in_the_sequence():
    """Gemma 2 2B (its soft cap keeps it on eager attention and padded forwards) with 8k-token responses: one
    sequence of 512 + 8,192 tokens a micro-batch keeps [8 heads, 8704, 8704] scores in each layer at 8 bytes a score
    (softmax's float32 output, its bf16 copy, the cap's tanh): 2 layers' worth with recomputation (9.0 GiB), all 26
    without (117.4 GiB, over the GPU: the fix names a kernel that keeps none). Flash attention keeps none."""
    gemma2 = Gemma2Config(
        hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, vocab_size=256000, attn_logit_softcapping=50.0,
    )  # fmt: skip
    long = [*LONG, "data.max_response_length=8192"]
    scores = 8 * 8704**2 * 8
    row = memory_row(load_config(overrides=[*long, "model.gradient_checkpointing=true"]), gemma2, 140 * GIB)
    assert row.status == "ok" and "eager attention scores 9.0" in row.detail and 2 * scores == 9_697_230_848
    row = memory_row(load_config(overrides=long), gemma2, 140 * GIB)
    assert row.status == "FAIL" and "eager attention scores 117.4" in row.detail
    assert row.fix == (
        "rollout.max_num_batched_tokens (the KV cache's tokens) or model.attn_implementation=flash_attention_2 (where "
        "installed and the model takes it) or model.gradient_checkpointing=true or model.activation_offload=true or "
        "a smaller actor.ppo_max_token_len_per_device (now 16384) or more GPUs (trainer.n_gpus_per_node, "
        "trainer.nnodes) or Megatron TP/PP"
    )
    flash = memory_row(load_config(overrides=[*long, "model.attn_implementation=flash_attention_2"]), gemma2, None)
    assert "eager" not in flash.detail and "activations" in flash.detail
    llama = memory_row(load_config(overrides=[*long, "model.gradient_checkpointing=true"]), QWEN25_7B, None)
    assert "eager" not in llama.detail
