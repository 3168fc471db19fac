"""Write an engine's model as a Hugging Face directory (weights gathered from the FSDP shards)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from ketch.engine.engine import TrainEngine


def save_hf_model(engine: TrainEngine, prefix: str, hf_config, out_dir: Path, rank: int, tokenizer=None) -> None:
    """Gather the full weights (every rank takes part) and, on rank 0, save them with `hf_config` as a
    `save_pretrained` directory (safetensors), plus the tokenizer when given."""
    state = {name: tensor.cpu() for name, tensor in engine.full_parameters(prefix=prefix)}
    if rank != 0:
        return
    auto_cls = AutoModelForTokenClassification if hf_config.num_labels == 1 and _is_critic(state) else None
    model = (auto_cls or AutoModelForCausalLM).from_config(hf_config, dtype=next(iter(state.values())).dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(hf_config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"export: weights do not match the model (missing {missing}, unexpected {unexpected})")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def _is_critic(state: dict[str, torch.Tensor]) -> bool:
    return any(name.startswith("score.") for name in state)
