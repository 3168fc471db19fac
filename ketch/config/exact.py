"""Checks of `rollout.exact_log_probs`: the settings under which the rollout's log-probs equal the training
forward's bit for bit, from the config alone (`exact_log_probs_problem`, when the config loads) and against the
model's Hugging Face config (`check_exact_start`, at start-up, before any worker starts)."""

from __future__ import annotations

from typing import Any

from ketch.architecture import batch_invariant_problem
from ketch.config.errors import raise_problems
from ketch.config.schema import KetchConfig

KEY = "rollout.exact_log_probs=true"


def old_log_prob_key(config: KetchConfig) -> str:
    """The setting that makes `old_log_prob` the rollout's log-probs (`KetchConfig.old_log_prob_from_rollout`)."""
    return KEY if config.rollout.exact_log_probs else "actor.old_log_prob_from_rollout=true"


def exact_log_probs_problem(config: KetchConfig) -> str | None:
    """Why `rollout.exact_log_probs=true` cannot hold with the rest of `config`, or None: the first setting, with
    what it changes, under which the rollout and the actor's training forward would not compute the same ops."""
    c, r = config, config.rollout
    if not r.exact_log_probs:
        return None
    refused = {
        "rollout.name=vllm": (r.name == "vllm", "vLLM's kernels are its own"),
        "rollout.tensor_parallel_size > 1": (r.tensor_parallel_size > 1, "the shards' partial matmuls are summed"),
        "rollout.quantization=fp8": (r.quantization == "fp8", "the rollout decodes other weights"),
        "rollout.kv_cache_dtype=fp8": (r.kv_cache_dtype == "fp8", "the rollout attends to rounded keys and values"),
        "rollout.multi_turn.enable=true": (r.multi_turn.enable, "the turn loop is not covered"),
        "rollout.placement=standalone": (r.placement == "standalone", "the rollout runs in other processes"),
        "model.use_remove_padding=true": (c.model.use_remove_padding is True, "packed forwards are not covered"),
        "model.use_torch_compile=true": (c.model.use_torch_compile is True, "compiled blocks fuse the ops"),
        "model.use_liger=true": (c.model.use_liger, "Liger fuses the norms and the MLP"),
        "actor.strategy=megatron": (c.actor.strategy == "megatron", "Megatron's kernels are its own"),
        "actor.ulysses_sequence_parallel_size > 1": (c.actor.ulysses_sequence_parallel_size > 1, "it packs"),
        "actor.lora.rank > 0": (c.actor.lora.enabled, "the rollout decodes merged weights, the actor adds adapters"),
        "actor.router_replay": (c.actor.router_replay != "off", "the experts are the rollout's already: set it off"),
    }
    given = [(key, why) for key, (on, why) in refused.items() if on]
    if not given:
        return None
    key, why = given[0]
    return (
        f"{KEY} needs the hf rollout and the actor's padded eager forward in one process, and with "
        f"{key} {why}: drop it or set rollout.exact_log_probs=false"
    )


def check_exact_start(config: KetchConfig, model_config: Any) -> None:
    """Raise `ConfigError` when `rollout.exact_log_probs=true` does not cover the model of `model_config`."""
    if config.rollout.exact_log_probs and (problem := batch_invariant_problem(model_config)):
        raise_problems([f"{KEY} computes batch-invariantly, and {problem}: set rollout.exact_log_probs=false"])
