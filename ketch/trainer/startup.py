"""`check_start`: the start-up checks of `ketch train`, `ketch sft` and `ketch rm`, in one order.

The cheap checks come first, so that a run that cannot work stops in seconds and leaves nothing behind: the
run directory, output and cache directories, vLLM, the attention kernel and the data (`preflight`), then the
command's own settings; only then is the model resolved (a built-in model is warmed up there, minutes on a
first run) and its config and tokenizer checked against what the run asks of them. No worker has started yet.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ketch.config import KetchConfig
from ketch.config.exact import check_exact_start
from ketch.config.parallel import check_megatron_start, check_rollout_start, check_vision_start, megatron_roles
from ketch.engine.lora import check_lora
from ketch.engine.megatron.weights import check_supported
from ketch.models import check_causal_lm, check_tokenizer_fits, load_model_config, load_tokenizer
from ketch.trainer.preflight import preflight


@dataclass(frozen=True)
class StartingModel:
    """The model a run trains, resolved and checked."""

    path: str
    """`model.path` as a local directory or hub id (a built-in model warmed up, a GGUF file converted)."""
    config: Any
    """Its Hugging Face config."""
    tokenizer: Any
    """`model.tokenizer_path`'s tokenizer, or the model's own; every id below the model's vocabulary size."""


def check_start(
    config: KetchConfig,
    required: Mapping[str, str],
    resolve: Callable[[KetchConfig], str],
    *,
    scored: bool = False,
    trains: Literal["actor", "reward_model"] = "actor",
    settings: Callable[[], None] | None = None,
) -> StartingModel:
    """Every check a training command makes before any worker starts; raises the first failure's error.

    Args:
        config: The run's config.
        required: The data columns the command reads (column -> the `data.` key that names it), for `preflight`.
        resolve: `model.path` -> the model's directory or hub id; it may build the model (a built-in warm-up).
        scored: The data sources must have a scorer (PPO's rewards).
        trains: `actor`: `model.path` becomes a policy (a causal LM that Megatron and the rollout can split, with
            `actor.lora`); `reward_model`: it becomes a reward model (with `reward.model.lora`).
        settings: The command's own checks of `config`, run after `preflight` and before the model is resolved.

    Returns:
        The resolved model, its config and its tokenizer.
    """
    c = config
    preflight(c, required, scored)
    if settings is not None:
        settings()
    path = resolve(c)
    model_config = load_model_config(path, c.model.trust_remote_code)  # a bad path fails here
    if trains == "actor":
        _check_policy(c, model_config)
    lora_key, lora = ("actor.lora", c.actor.lora) if trains == "actor" else ("reward.model.lora", c.reward.model.lora)
    if lora.enabled:
        check_lora(lora_key, lora, model_config, c.model.trust_remote_code)
    tokenizer = load_tokenizer(c.model.tokenizer_path or path, c.model.trust_remote_code, path)
    check_tokenizer_fits(tokenizer, model_config, path, c.model.tokenizer_path)
    return StartingModel(path, model_config, tokenizer)


def _check_policy(c: KetchConfig, model_config: Any) -> None:
    """A policy is a causal LM that the Megatron roles (when any) and a tensor-parallel rollout can split."""
    check_causal_lm(model_config, c.model.path)
    check_vision_start(c, model_config)
    check_megatron_start(c, model_config, torch.cuda.is_available())
    check_rollout_start(c, model_config)
    check_exact_start(c, model_config)
    if megatron_roles(c):
        check_supported(model_config)
