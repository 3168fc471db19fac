"""What to change after a worker ran out of memory: the settings that bound the memory of the stage that failed,
with their values in the run, and how much of a GPU the training state takes.

A run that ran out of memory once will again at the same step with the same settings, so the advice is part of
the failure's log line and of the summary the run ends with.
"""

from __future__ import annotations

from functools import reduce

from ketch.config import KetchConfig

GENERATION = ("generate_sequences", "warm_up_rollout")
UPDATES = ("update_actor", "update_critic", "sft_step")
TOKEN_BUDGETED = ("update_actor", "compute_log_prob", "compute_ref_log_prob", "update_critic", "compute_values")
"""The stages that `actor.use_dynamic_bsz` sizes by tokens."""
MICRO_BATCH_KEYS = {
    "update_actor": "actor.ppo_micro_batch_size_per_device",
    "sft_step": "actor.ppo_micro_batch_size_per_device",
    "compute_log_prob": "rollout.log_prob_micro_batch_size_per_device",
    "compute_ref_log_prob": "ref.log_prob_micro_batch_size_per_device",
    "update_critic": "critic.ppo_micro_batch_size_per_device",
    "compute_values": "critic.ppo_micro_batch_size_per_device",
    "compute_rm_score": "reward.model.micro_batch_size_per_device",
}
"""Worker method -> the key that sets the sequences of its forward passes."""


def out_of_memory_advice(method: str, config: KetchConfig) -> str:
    """What to change after worker method `method` ran out of memory ('' for a method this does not know)."""
    if method in GENERATION:
        return _generation_advice(config)
    micro = _micro_batch_setting(method, config)
    if micro is None:
        return ""
    lines = [f"{method} ran out of memory. Smaller forward passes: {micro}."]
    r = config.rollout
    if r.name == "hf" and r.placement == "hybrid" and not r.free_memory_while_training and method != "sft_step":
        lines.append("rollout.free_memory_while_training=true frees the rollout's weights and KV cache meanwhile.")
    if method in UPDATES and not config.model.gradient_checkpointing:
        lines.append(
            "model.gradient_checkpointing=true keeps only each block's input and recomputes the rest in the backward "
            "pass."
        )
    role = "critic" if method == "update_critic" else "actor"
    trained = getattr(config, role)
    if method in UPDATES and trained.strategy == "fsdp" and not trained.optim.offload:
        lines.append(f"{role}.optim.offload=true keeps AdamW's moments (8 bytes per parameter) in host memory.")
    t = config.trainer
    split = (
        "larger actor.megatron.tensor_model_parallel_size or pipeline_model_parallel_size"
        if config.actor.strategy == "megatron"
        else "actor.strategy=megatron with tensor or pipeline parallelism"
    )
    lines.append(
        "Each trained model holds 16 bytes per parameter (float32 weights and gradients, two AdamW moments) shared "
        f"over its GPUs (trainer.nnodes={t.nnodes} x trainer.n_gpus_per_node={t.n_gpus_per_node}), beside the hf "
        f"rollout's whole copy of the weights on each GPU: more GPUs, or {split}, make each GPU's share smaller."
    )
    return " ".join(lines)


def _micro_batch_setting(method: str, config: KetchConfig) -> str | None:
    """The setting (and its value) that sizes one forward pass of `method`'s stage; None for other methods."""
    a = config.actor
    if a.use_dynamic_bsz and method in TOKEN_BUDGETED:
        return f"actor.ppo_max_token_len_per_device={a.ppo_max_token_len_per_device} tokens"
    key = MICRO_BATCH_KEYS.get(method)
    if key is None:
        return None
    value = reduce(getattr, key.split("."), config)
    setting = f"{key}={value} sequences" if value else f"{key} (unset: all of a GPU's sequences at once)"
    if method in TOKEN_BUDGETED:
        setting += ", or actor.use_dynamic_bsz=true to bound the tokens instead"
    return setting


def _generation_advice(config: KetchConfig) -> str:
    d, r = config.data, config.rollout
    if r.name == "vllm":
        return (
            f"generation ran out of memory. vLLM takes rollout.gpu_memory_utilization={r.gpu_memory_utilization} "
            "of the GPU for its weights and KV cache and training uses the rest; "
            f"rollout.max_num_seqs={r.max_num_seqs} sequences decode together."
        )
    return (
        f"generation ran out of memory. The hf rollout decodes a GPU's share of data.train_batch_size="
        f"{d.train_batch_size} x rollout.n={r.n} sequences together, each with a KV cache of up to "
        f"data.max_prompt_length + data.max_response_length = {d.max_prompt_length + d.max_response_length} "
        "tokens, beside the training state: fewer prompts per step, shorter responses or more GPUs."
    )
