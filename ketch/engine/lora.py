"""LoRA adapters on a training model, through PEFT (`actor.lora`, `critic.lora`, `reward.model.lora`).

PEFT wraps each chosen linear layer in place: its weight moves to `<layer>.base_layer.weight` (frozen) beside
`<layer>.lora_A.default.weight` `[rank, in]` and `<layer>.lora_B.default.weight` `[out, rank]` (B starts at zero,
so a fresh adapter changes nothing); the layer computes W x + scaling * B A x. Every other parameter is frozen but
a value or score head, which trains whole; a vision-language model's adapters go on its language model only. The
engine shards the frozen base with FSDP2 like any weight; only the adapters (and the head) take gradients,
AdamW's moments and checkpoint space.

Out of the engine, weights go merged (`merged`): W + scaling * B A under the plain model's names, so the rollout,
vLLM, the weight bridge and the exported `model/` see an ordinary model. `model/adapter/` is the adapter in PEFT's
own format (`write_adapter`), loadable with `PeftModel.from_pretrained`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import peft
import torch
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.pytorch_utils import Conv1D

from ketch.architecture import is_vision_model
from ketch.config.errors import ConfigError
from ketch.config.schema import LoraConfig
from ketch.models.vision import VISION_MODULES

ADAPTER = "default"
"""PEFT's name of the one adapter ketch trains (it appears in parameter names, not in saved files)."""
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
ADAPTER_DIR = "adapter"
"""The adapter directory inside an exported model (`<run dir>/model/adapter`)."""
SAVED_PREFIX = "base_model.model."
"""What PEFT puts in front of a parameter's name in a saved adapter (its `PeftModel` wraps the model twice)."""

_PART = re.compile(rf"^(.*)\.(base_layer\.(?:weight|bias)|lora_[AB]\.{ADAPTER}\.weight)$")


def peft_config(settings: LoraConfig, head: str | None = None, vision: bool = False) -> peft.LoraConfig:
    """PEFT's settings for `settings` (from the adapter directory when it starts from one); `head`, a value or
    score head, never gets an adapter, nor (`vision`: a vision-language model) the vision encoder and its projector
    into the language model."""
    if settings.adapter_path is not None:
        config = _saved(settings.adapter_path)
        config.lora_dropout = settings.dropout
        if head and not isinstance(config.exclude_modules, str):  # a policy's adapter may start a critic
            config.exclude_modules = sorted(set(config.exclude_modules or ()) | {head})
        return config
    return peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=_targets(settings.target_modules),
        exclude_modules=[head] if head else (VISION_MODULES if vision else None),
    )


def _saved(directory: str | Path) -> peft.LoraConfig:
    """The settings of the adapter saved in `directory`, to train or merge it: a head saved with it (PEFT's
    `modules_to_save`) is loaded as the model's own (`_load_adapter`), not wrapped."""
    config = peft.LoraConfig.from_pretrained(str(directory))
    config.inference_mode, config.modules_to_save = False, None
    return config


def _targets(target_modules: str | list[str]) -> str | list[str]:
    """`all-linear` as PEFT spells it (a string), else a list of names."""
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    return "all-linear" if names == ["all-linear"] else names


def add_lora(model: nn.Module, settings: LoraConfig, head: str | None = None, seed: int = 0) -> nn.Module:
    """Give the HF `model` LoRA adapters in place (fresh ones drawn with `seed`, or those at
    `settings.adapter_path`) and freeze every other parameter except the submodule `head` (a value or score head,
    trained whole). The adapters and the head are float32 (the training master weights) whatever the base's dtype.
    Returns `model`. Every rank draws the same adapters, so that they do not depend on the number of ranks."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = peft_config(settings, head, is_vision_model(model.config))
        peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    if settings.adapter_path is not None:
        _load_adapter(model, Path(settings.adapter_path))
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    if head is not None:
        getattr(model, head).float().requires_grad_(True)
    return model


def _load_adapter(model: nn.Module, directory: Path) -> None:
    """Load the adapter weights saved in `directory` (PEFT's format) into `model`'s fresh adapters; a head saved
    with them (PEFT's `modules_to_save`) is loaded too."""
    state = {}
    for key, tensor in peft.load_peft_weights(str(directory), device="cpu").items():
        name = re.sub(r"\.(lora_[AB])\.weight$", rf".\1.{ADAPTER}.weight", key.removeprefix(SAVED_PREFIX))
        state[name] = tensor
    params = dict(model.named_parameters())
    unknown = sorted(set(state) - set(params))
    missing = sorted(n for n in params if ".lora_" in n and n not in state)
    wrong = sorted(n for n in set(state) & set(params) if state[n].shape != params[n].shape)
    if unknown or missing or wrong:
        raise ValueError(
            f"the adapter at {directory} does not fit the model: weights the model lacks {unknown[:3]}, adapter "
            f"weights the file lacks {missing[:3]}, of other shapes {wrong[:3]}; was it trained on this base model?"
        )
    model.load_state_dict(state, strict=False)


@contextmanager
def adapters_disabled(module: nn.Module) -> Iterator[None]:
    """Within the block, `module`'s LoRA layers compute their base layer alone: the model before training (the
    reference policy). Nothing is copied. Only PEFT's flag is set: its `enable_adapters` also sets `requires_grad`,
    on whichever of FSDP2's sharded or gathered parameters the layer holds at that moment, and the sharded ones
    then stay frozen."""
    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


def lora_layers(module: nn.Module) -> dict[str, tuple[float, bool]]:
    """Each LoRA layer of `module` by name: (scaling, fan_in_fan_out: its base weight is stored transposed, as in
    GPT-2's Conv1D). Empty without adapters."""
    return {
        name: (layer.scaling[ADAPTER], getattr(layer, "fan_in_fan_out", False))
        for name, layer in module.named_modules()
        if isinstance(layer, LoraLayer)
    }


def merged(
    named_tensors: Iterable[tuple[str, torch.Tensor]], layers: dict[str, tuple[float, bool]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs with the adapters of `layers` (see `lora_layers`) merged into their weights, under the
    plain model's names: `<layer>.weight` = W + scaling * B A, computed in float32 and cast to W's dtype (exactly W
    while B is zero), `<layer>.bias` = the base bias. A layer's three tensors arrive from one FSDP unit, so each is
    still valid when the last of them comes; other tensors pass unchanged."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        match = _PART.match(name)
        if match is None or match[1] not in layers:
            yield name, tensor
            continue
        layer, part = match[1], match[2]
        if part == "base_layer.bias":
            yield f"{layer}.bias", tensor
            continue
        got = parts.setdefault(layer, {})
        got[part.split(".")[0]] = tensor
        if len(got) == 3:
            del parts[layer]
            yield f"{layer}.weight", merge_weight(got["base_layer"], got["lora_A"], got["lora_B"], *layers[layer])


def merge_weight(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, fan_in_fan_out: bool
) -> torch.Tensor:
    """W + scaling * B A (`weight` `[out, in]`, or `[in, out]` with `fan_in_fan_out`; A `[rank, in]`; B
    `[out, rank]`) in float32, returned in W's dtype."""
    delta = (lora_b.float() @ lora_a.float()) * scaling
    return (weight.float() + (delta.T if fan_in_fan_out else delta)).to(weight.dtype)


def write_adapter(
    state: dict[str, torch.Tensor], config: peft.LoraConfig, out_dir: str | Path, base_model: str, head: str | None
) -> Path:
    """Write the adapter weights `state` (the HF model's parameter names: `...lora_A.default.weight`, and the
    `head`'s, when trained with them) as a PEFT adapter directory for the model at `base_model`:
    `adapter_config.json` and `adapter_model.safetensors`, loadable with `PeftModel.from_pretrained`."""
    out = write_adapter_config(config, out_dir, base_model, head)
    tensors = {SAVED_PREFIX + name.replace(f".{ADAPTER}.", "."): t.contiguous() for name, t in state.items()}
    save_file(tensors, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    return out


def write_adapter_config(config: peft.LoraConfig, out_dir: str | Path, base_model: str, head: str | None) -> Path:
    """`adapter_config.json` of `config` for the model at `base_model`, the `head` saved whole with the adapter
    (PEFT's `modules_to_save`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(config)
    config.base_model_name_or_path, config.inference_mode = base_model, True
    config.modules_to_save = [head] if head else None
    config.save_pretrained(str(out))
    return out


def merged_state(model: nn.Module, directory: str | Path, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF `model` with the adapter weights `state` (names as in `write_adapter`) of the adapter configured in
    `directory/adapter_config.json` merged in: its state by the plain model's names (how `ketch export` merges a
    checkpoint that holds adapters)."""
    peft.inject_adapter_in_model(_saved(directory), model, adapter_name=ADAPTER)
    model.load_state_dict(state, strict=False)
    return {name: t.detach() for name, t in merged(model.named_parameters(remove_duplicate=False), lora_layers(model))}


# ----------------------------------------------------------------- start-up checks
def check_lora(key: str, settings: LoraConfig, hf_config, trust_remote_code: bool = False) -> None:
    """`ConfigError` in one line when the config section `key` (e.g. `actor.lora`) cannot apply to the model of
    `hf_config`: a target module that names none of its linear layers (the message lists them), or an adapter
    directory that is missing, not LoRA, DoRA, or of another rank than `key.rank`. Builds the model on the meta
    device only (no weights)."""
    targets = _targets(settings.target_modules)
    if settings.adapter_path is not None:
        saved = _checked_adapter_config(key, Path(settings.adapter_path))
        if settings.rank and settings.rank != saved.r:
            raise ConfigError(
                f"{key}.rank={settings.rank} but the adapter at {key}.adapter_path has rank {saved.r}; set "
                f"{key}.rank={saved.r} or 0 (the adapter's own)"
            )
        targets = saved.target_modules
        if isinstance(targets, str) and targets != "all-linear":  # PEFT's regular expression over module paths
            return
        targets = _targets(sorted(targets) if isinstance(targets, set | tuple) else targets)
    if targets == "all-linear":
        return
    names = linear_layers(hf_config, trust_remote_code)
    leaves = sorted({name.rpartition(".")[2] for name in names})
    for target in targets:
        if not any(name == target or name.endswith(f".{target}") for name in names):
            raise ConfigError(
                f"{key}.target_modules names {target!r}, which is no linear layer of {_model_name(hf_config)}; its "
                f"linear layers are {', '.join(leaves)} (or use all-linear)"
            )


def _checked_adapter_config(key: str, directory: Path) -> peft.LoraConfig:
    if not (directory / ADAPTER_CONFIG).is_file():
        raise ConfigError(
            f"{key}.adapter_path={directory} has no {ADAPTER_CONFIG}; give a PEFT adapter directory (a run's "
            "model/adapter)"
        )
    config = peft.PeftConfig.from_pretrained(str(directory))
    if config.peft_type != peft.PeftType.LORA or getattr(config, "use_dora", False):
        kind = "DoRA" if getattr(config, "use_dora", False) else str(config.peft_type)
        raise ConfigError(f"{key}.adapter_path={directory} holds a {kind} adapter; ketch trains LoRA adapters only")
    return config


def linear_layers(hf_config, trust_remote_code: bool = False) -> list[str]:
    """The names of the linear layers of the causal LM of `hf_config` that can take an adapter (every one but the
    output layer, and a vision-language model's vision encoder and projector), from a skeleton on the meta device."""
    vision = is_vision_model(hf_config)
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(hf_config, trust_remote_code=trust_remote_code)
    output = model.get_output_embeddings()
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear | Conv1D)
        and module is not output
        and not (vision and re.fullmatch(VISION_MODULES, name))
    ]


def _model_name(hf_config) -> str:
    return (hf_config.architectures or [hf_config.model_type])[0]
