"""Model loading (causal LMs, critics with a value head, reward models with a score head, tokenizers) and the
built-in tiny model."""

from ketch.models.pretrained import (
    ModelLoadError,
    check_causal_lm,
    check_tokenizer_fits,
    check_value_head,
    load_causal_lm,
    load_critic,
    load_model_config,
    load_reward_model,
    load_tokenizer,
    local_or_hub,
    quiet_transformers,
    resolve_dtype,
)
from ketch.models.special_tokens import (
    ensure_eos_token,
    ensure_pad_token,
    generation_token_ids,
    stop_token_ids,
    turn_start_ids,
)
from ketch.models.tiny import build_tiny_model, save_tiny_model, tiny_qwen2_config

__all__ = [
    "ModelLoadError",
    "build_tiny_model",
    "check_causal_lm",
    "check_tokenizer_fits",
    "check_value_head",
    "ensure_eos_token",
    "ensure_pad_token",
    "generation_token_ids",
    "load_causal_lm",
    "load_critic",
    "load_model_config",
    "load_reward_model",
    "load_tokenizer",
    "local_or_hub",
    "quiet_transformers",
    "resolve_dtype",
    "save_tiny_model",
    "stop_token_ids",
    "tiny_qwen2_config",
    "turn_start_ids",
]
