"""The advice an out-of-memory failure comes with: the settings that size the failed stage's memory, with the
run's values."""

from ketch.config import load_config
from ketch.trainer.oom_advice import out_of_memory_advice


def test_an_update_names_its_token_budget_recomputation_and_the_training_state():
    config = load_config(
        overrides=[
            "actor.use_dynamic_bsz=true",
            "actor.ppo_max_token_len_per_device=16384",
            "trainer.n_gpus_per_node=1",
        ]
    )
    assert out_of_memory_advice("update_actor", config) == (
        "update_actor ran out of memory. Smaller forward passes: actor.ppo_max_token_len_per_device=16384 tokens. "
        "rollout.free_memory_while_training=true frees the rollout's weights and KV cache meanwhile. "
        "model.gradient_checkpointing=true keeps only each block's input and recomputes the rest in the backward "
        "pass. actor.optim.offload=true keeps AdamW's moments (8 bytes per parameter) in host memory. Each trained "
        "model holds 16 bytes per parameter (float32 weights and gradients, two AdamW moments) "
        "shared over its GPUs (trainer.nnodes=1 x trainer.n_gpus_per_node=1), beside the hf rollout's whole copy "
        "of the weights on each GPU: more GPUs, or actor.strategy=megatron with tensor or pipeline parallelism, "
        "make each GPU's share smaller."
    )


def test_a_forward_pass_names_its_own_micro_batch_key_and_no_recomputation():
    config = load_config(
        overrides=[
            "ref.log_prob_micro_batch_size_per_device=4",
            "model.gradient_checkpointing=true",
            "rollout.free_memory_while_training=true",
        ]
    )
    advice = out_of_memory_advice("compute_ref_log_prob", config)
    assert advice.startswith(
        "compute_ref_log_prob ran out of memory. Smaller forward passes: ref.log_prob_micro_batch_size_per_device=4 "
        "sequences, or actor.use_dynamic_bsz=true to bound the tokens instead. Each trained model"
    )
    critic = out_of_memory_advice(
        "update_critic", load_config(overrides=["actor.strategy=megatron", "rollout.placement=standalone"])
    )
    assert critic.startswith(
        "update_critic ran out of memory. Smaller forward passes: critic.ppo_micro_batch_size_per_device (unset: all "
        "of a GPU's sequences at once), or actor.use_dynamic_bsz=true to bound the tokens instead. "
        "model.gradient_checkpointing=true"
    )
    assert "larger actor.megatron.tensor_model_parallel_size or pipeline_model_parallel_size" in critic
    assert "critic.optim.offload=true keeps AdamW's moments" in critic
    offloaded = load_config(overrides=["actor.optim.offload=true"])
    assert "optim.offload" not in out_of_memory_advice("update_actor", offloaded)


def test_generation_names_the_rows_and_lengths_that_size_the_kv_cache():
    config = load_config(
        overrides=[
            "data.train_batch_size=16",
            "rollout.n=8",
            "data.max_prompt_length=128",
            "data.max_response_length=256",
        ]
    )
    assert out_of_memory_advice("generate_sequences", config) == (
        "generation ran out of memory. The hf rollout decodes a GPU's share of data.train_batch_size=16 x "
        "rollout.n=8 sequences together, each with a KV cache of up to data.max_prompt_length + "
        "data.max_response_length = 384 tokens, beside the training state: fewer prompts per step, shorter "
        "responses or more GPUs."
    )
    vllm = out_of_memory_advice("warm_up_rollout", load_config(overrides=["rollout.name=vllm"]))
    assert "rollout.gpu_memory_utilization=0.5 of the GPU" in vllm and "rollout.max_num_seqs=256" in vllm


def test_a_method_without_a_memory_setting_gets_no_advice():
    assert out_of_memory_advice("save_checkpoint", load_config()) == ""
