"""Load Hugging Face causal LMs, critics, reward models and tokenizers with the config fix-ups ketch needs.

Every loader takes a local directory or a hub id. Failures name the path and what to check; hub ids
are only fetched when the user asked for one (tests and the built-in run never touch the network).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import huggingface_hub
import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)

from ketch.architecture import (
    attention_implementation,
    attention_implementation_problem,
    causal_lm_problem,
    is_vision_model,
    value_head_problem,
)
from ketch.models.special_tokens import ensure_eos_token, ensure_pad_token, say_once
from ketch.models.vision_critic import VisionTokenClassifier

logger = logging.getLogger("ketch.models")

_PIPELINE = ("normalizer", "pre_tokenizer", "model", "decoder")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""The parts of a saved `tokenizer.json` that decide token ids and decoded text."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(OSError):
    """A model or tokenizer that cannot be loaded: the message names the path and what to check."""


def quiet_transformers() -> None:
    """Silence transformers' per-load progress bars and load reports (ketch logs what matters)."""
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """`auto` is bfloat16 on GPU and float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return DTYPES[name]


def load_model_config(path: str, trust_remote_code: bool = False, override: dict[str, Any] | None = None):
    """The model's `PretrainedConfig` with `override` applied and rope settings made readable by this
    transformers version (newer configs nest `rope_theta` in `rope_parameters`; older ones use
    `rope_scaling` with `type` instead of `rope_type`; a config with neither loads with the defaults)."""
    _check_path(path, "model")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read the model config at {path!r} (model.path): {err}") from err
    for key, value in (override or {}).items():
        setattr(config, key, value)
    _fix_rope(config)
    return config


def check_causal_lm(config, path: str) -> None:
    """`ModelLoadError` in one line when the model at `path` is not a decoder-only causal LM (an encoder, an
    encoder-decoder model, or one without a causal-LM class)."""
    problem = causal_lm_problem(config)
    if problem:
        raise ModelLoadError(
            f"model.path={path}: {problem}; ketch trains decoder-only causal LMs (AutoModelForCausalLM: Llama, "
            "Qwen, Mistral, Gemma, Phi, OLMo, GPT-2, their mixtures of experts, ...)"
        )


def check_value_head(config, key: str) -> None:
    """`ModelLoadError` in one line when no critic can be built on the model of `config` (at `key`)."""
    problem = value_head_problem(config)
    if problem:
        raise ModelLoadError(
            f"{key}: a critic needs the backbone with a scalar value head (AutoModelForTokenClassification), and "
            f"{problem}; use a critic-free estimator (algorithm.adv_estimator=grpo, rloo, reinforce_plus_plus, "
            "remax), or critic.model_path of an architecture that has one"
        )


def _fix_rope(config) -> None:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params and not hasattr(type(config), "rope_parameters"):
        config.rope_theta = params["rope_theta"]
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict) and "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling["type"]


def load_causal_lm(
    path: str,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "auto",
    trust_remote_code: bool = False,
    override_config: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """An `AutoModelForCausalLM` (a vision-language model: `AutoModelForImageTextToText`) from `path` on the CPU
    (callers move it), in `dtype`."""
    quiet_transformers()
    config = load_model_config(path, trust_remote_code, override_config)
    kwargs = {"dtype": dtype, "attn_implementation": attn_implementation, "trust_remote_code": trust_remote_code}
    if is_vision_model(config):
        return _from_pretrained(AutoModelForImageTextToText, path, config, kwargs, "a vision-language model")
    return _from_pretrained(AutoModelForCausalLM, path, config, kwargs, "a causal LM")


def load_critic(
    path: str,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "auto",
    trust_remote_code: bool = False,
    override_config: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """The backbone at `path` with a scalar value head (`AutoModelForTokenClassification`, one label; a
    vision-language model's backbone, vision encoder included, with a fresh head: `VisionTokenClassifier`).

    A causal-LM checkpoint gives the backbone's weights and a freshly initialised head; a critic
    checkpoint saved by ketch gives both."""
    args = (path, dtype, attn_implementation, trust_remote_code, override_config)
    if is_vision_model(load_model_config(path, trust_remote_code, override_config)):
        return VisionTokenClassifier(load_causal_lm(*args))
    what = "a critic (needs a *ForTokenClassification class for this architecture)"
    return _load_with_scalar_head(AutoModelForTokenClassification, *args, what=what)


def load_reward_model(
    path: str,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "auto",
    trust_remote_code: bool = False,
    override_config: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """The backbone at `path` with a scalar score head (`AutoModelForSequenceClassification`, one label).

    A causal-LM checkpoint gives the backbone's weights and a freshly initialised head; a reward model
    saved by ketch (or any one-label sequence classifier) gives both. `config.architectures` names the
    loaded class, so that exports are written as a reward model."""
    what = "a reward model (needs a *ForSequenceClassification class for this architecture)"
    args = (path, dtype, attn_implementation, trust_remote_code, override_config)
    model = _load_with_scalar_head(AutoModelForSequenceClassification, *args, what=what)
    model.config.architectures = [type(model).__name__]
    return model


def _load_with_scalar_head(
    auto_cls, path: str, dtype, attn_implementation: str, trust_remote_code: bool, override_config, what: str
) -> torch.nn.Module:
    """`auto_cls` with one label and no dropout in the head, loaded from `path`."""
    quiet_transformers()
    override = {"classifier_dropout": 0.0, "hidden_dropout": 0.0, **(override_config or {})}
    config = load_model_config(path, trust_remote_code, override)
    config.num_labels = 1
    kwargs = {"dtype": dtype, "attn_implementation": attn_implementation, "trust_remote_code": trust_remote_code}
    return _from_pretrained(auto_cls, path, config, kwargs, what)


def _from_pretrained(auto_cls, path: str, config, kwargs: dict[str, Any], what: str):
    """`auto_cls` from `path` with `kwargs`, its `attn_implementation` resolved for the model
    (`ketch.architecture.attention_implementation`; a kernel that would change its logits is warned of once)."""
    problem = attention_implementation_problem(config, kwargs["attn_implementation"])
    if problem:
        say_once(problem, logging.WARNING)
    kwargs = {**kwargs, "attn_implementation": attention_implementation(config, kwargs["attn_implementation"])}
    try:
        return auto_cls.from_pretrained(path, config=config, **kwargs)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load {what} from {path!r}: {err}") from err


def load_tokenizer(path: str, trust_remote_code: bool = False, model_path: str | None = None):
    """The tokenizer at `path`, with left padding and EOS and pad tokens that never open a turn (see
    `ensure_eos_token` and `ensure_pad_token`; chosen with the generation config of `model_path`, default `path`)."""
    quiet_transformers()
    _check_path(path, "tokenizer")
    _check_tokenizer_files(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        where = "model.tokenizer_path or model.path"
        raise ModelLoadError(f"cannot load a tokenizer from {path!r} ({where}): {err}") from err
    tokenizer = _as_saved(tokenizer, path)
    try:
        ensure_eos_token(tokenizer, model_path or path)
        ensure_pad_token(tokenizer, model_path or path)
    except ValueError as err:
        raise ModelLoadError(str(err)) from err
    tokenizer.padding_side = "left"
    return tokenizer


def check_tokenizer_fits(tokenizer, model_config, model_path: str, tokenizer_path: str | None) -> None:
    """Raise `ModelLoadError` when `tokenizer` can produce a token id that the model has no embedding for: every id
    of its vocabulary, added and special tokens must be below the model's `vocab_size` (`tokenizer_path`:
    `model.tokenizer_path`, None when the tokenizer is the model's own)."""
    vocab_size = getattr(model_config.get_text_config(), "vocab_size", None)
    largest = max([*tokenizer.get_vocab().values(), *tokenizer.all_special_ids])
    if vocab_size is None or largest < vocab_size:
        return
    source = f"{tokenizer_path} (model.tokenizer_path)" if tokenizer_path else model_path
    own = "use the model's own tokenizer (unset model.tokenizer_path)"
    other = own if tokenizer_path else "set model.tokenizer_path to a tokenizer that fits it"
    raise ModelLoadError(
        f"the tokenizer of {source} produces token ids up to {largest}, but the model {model_path} has {vocab_size} "
        f"token embeddings (ids 0 to {vocab_size - 1}); resize the model's embeddings to {largest + 1} "
        f"(model.resize_token_embeddings({largest + 1}), then save the model) or {other}"
    )


def _check_tokenizer_files(path: str) -> None:
    """A local directory without any tokenizer file fails with the fix, not transformers' conversion error."""
    local = Path(path).expanduser()
    if local.is_dir() and not any((local / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelLoadError(
            f"the directory {path!r} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); save the model's "
            "tokenizer there (tokenizer.save_pretrained), or set model.tokenizer_path to a directory that has one"
        )


def _as_saved(tokenizer, path: str):
    """`tokenizer`, or the one in `path/tokenizer.json` loaded as it is when they differ.

    transformers 5 picks the tokenizer class from the model type and may rebuild the text pipeline from the
    vocabulary (e.g. a `Qwen2Tokenizer` for a Qwen2 model whose saved tokenizer splits characters), which
    silently changes the token ids. The saved file is what the model was trained with, so it wins."""
    file = Path(path).expanduser() / "tokenizer.json"
    if not file.is_file() or not hasattr(tokenizer, "backend_tokenizer"):
        return tokenizer
    saved, loaded = json.loads(file.read_text()), json.loads(tokenizer.backend_tokenizer.to_str())
    if all(saved.get(k) == loaded.get(k) for k in _PIPELINE):
        return tokenizer
    logger.debug(
        "%s rebuilds the tokenizer at %s differently; using its tokenizer.json as saved", type(tokenizer).__name__, path
    )
    return PreTrainedTokenizerFast.from_pretrained(path)


def _check_path(path: str, what: str) -> None:
    looks_local = path.startswith((".", "/", "~")) or Path(path).exists()
    if looks_local and not Path(path).expanduser().is_dir():
        raise ModelLoadError(f"{what} path {path!r} is not a directory; check model.path (or model.tokenizer_path)")


def local_or_hub(path: str) -> str:
    """An existing local path made absolute (worker processes may run elsewhere), else the hub id as given."""
    local = Path(path).expanduser()
    return str(local.resolve()) if local.exists() else path
