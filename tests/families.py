"""The architecture matrix's families and their tiny random models (2 blocks, 64 wide), for the tests: ketch itself
knows only the facts of `ketch.architecture.FAMILIES`, which lists the families that need one."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

FAMILY_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
"""The sizes of every family's tiny model: 2 blocks 64 wide, 4 query heads of 16 (2 key/value heads where the
family has grouped-query attention)."""
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
SLIDING = 8
"""A sliding window shorter than the tests' sequences, so that packing and decoding must honour it."""
FAMILY_SETTINGS: dict[str, dict] = {
    "llama": {},
    "mistral": {"sliding_window": SLIDING},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2": {},
    "qwen2_moe": {**MOE, "shared_expert_intermediate_size": 64},
    "qwen3": {"head_dim": 16},
    "qwen3_moe": {**MOE, "head_dim": 16},
    "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16, "sliding_window": SLIDING},
    "gemma3_text": {"head_dim": 16, "sliding_window": SLIDING, "sliding_window_pattern": 2},
    "phi": {"num_key_value_heads": 4},
    "phi3": {},
    "olmo2": {},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "granite": {"logits_scaling": 4.0},
    "cohere": {"logit_scale": 0.5},
    "stablelm": {},
    "starcoder2": {},
    "gpt_neox": {"num_key_value_heads": None},
    "gpt2": {"num_key_value_heads": None, "intermediate_size": None},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": SLIDING},
    "deepseek_v3": {  # multi-head latent attention: keys of 16 + 8 (rotary), values of 16
        **MOE,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_group": 1,
        "topk_group": 1,
    },
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "llama4_text": {  # chunked attention in every layer
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "head_dim": 16,
        "intermediate_size_mlp": 128,
        "attention_chunk_size": SLIDING,
    },
    "apertus": {},
    "arcee": {},
    "bloom": {},
    "cohere2": {},
    "exaone4": {},
    "glm": {},
    "glm4": {},
    "gpt_bigcode": {"num_key_value_heads": None, "intermediate_size": None},  # dropout as attn_pdrop (0.1)
    "granitemoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "jamba": {  # Mamba layers, then attention; experts in every second layer
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "mamba_d_state": 8,
        "mamba_dt_rank": 8,
    },
    "nemotron": {},
    "olmo": {},
    "olmo3": {},
    "opt": {"num_key_value_heads": None, "intermediate_size": None, "ffn_dim": 128, "word_embed_proj_dim": 64},
    "persimmon": {"num_key_value_heads": None},
    "phimoe": {"num_local_experts": 4, "num_experts_per_tok": 2},  # router jitter noise 0.01
    "recurrent_gemma": {},
    "seed_oss": {},  # attention and residual dropout 0.1
    "smollm3": {},
    "xglm": {"num_key_value_heads": None, "intermediate_size": None, "ffn_dim": 128},
}
"""The architecture matrix, one entry per family (keyed by `config.model_type`): what its tiny config sets beside
`FAMILY_SIZES` and 2 key/value heads (None: left to the family's own default)."""

MATRIX = sorted(FAMILY_SETTINGS)
"""The families of the architecture matrix (`tests/test_architectures.py` on the CPU, `tests/gpu/` on a GPU)."""


def tiny_family_config(model_type: str, tokenizer):
    """A tiny random config of the family `model_type` with `tokenizer`'s vocabulary and special tokens."""
    settings = {**FAMILY_SIZES, "num_key_value_heads": 2, **FAMILY_SETTINGS[model_type]}
    config = AutoConfig.for_model(model_type, **{k: v for k, v in settings.items() if v is not None})
    config.vocab_size = len(tokenizer)
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    return config


def save_tiny_family_model(path: str | Path, model_type: str, tokenizer, seed: int = 0) -> Path:
    """A randomly initialised tiny model of the family `model_type` and `tokenizer`, saved together."""
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(tiny_family_config(model_type, tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)
