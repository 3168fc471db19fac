"""A model's training-mode forward made to compute what its eval-mode forward computes (`disable_dropout`): the
update must differentiate the distribution the rollout sampled from, so dropout and noise, under whatever name a
family keeps them, are found by what the model computes and turned off."""

from __future__ import annotations

import inspect
import re
from functools import cache

import torch
from torch import nn

NOISE_FIELD = re.compile(r"dropout|pdrop|layerdrop|drop_path|jitter_noise")
"""The names of module attributes that hold a rate of randomness in training forwards: dropout (`attention_dropout`,
GPT-2's `attn_pdrop`, Seed-OSS's `residual_dropout`, OPT's `dropout` and `layerdrop`), stochastic depth, a router's
jitter noise."""


class RandomForwardError(ValueError):
    """A model whose training-mode forward is random after ketch turned its dropout and noise off."""


def disable_dropout(model: nn.Module) -> list[nn.Module]:
    """Make `model`'s training-mode forward compute what its eval-mode forward computes, which the rollout samples
    from: the update must differentiate the distribution the tokens came from.

    Names alone miss some (GPT-BigCode's `attn_pdrop`, Seed-OSS's residual dropout kept as a number, PhiMoE's router,
    which samples its experts while training), so what the model computes decides, not a list of names:
    1. the modules whose own forward reads their training flag (attention modules for their dropout, routers with
       jitter, PhiMoE's sampling router) stay in eval mode (`eval_only_modules`; returned, for the caller to pass to
       `keep_in_eval` after each `train()`), but for the decoder blocks, whose flag
       transformers' gradient checkpointing reads: eval mode for the whole model would turn it off;
    2. in the blocks, the float attributes whose names say dropout or noise (`NOISE_FIELD`: OPT's `dropout`, BLOOM's
       `hidden_dropout`) are set to 0, as are all `nn.Dropout` rates; where the eval-mode logits then change, such a
       rate was part of the model's computation and the attributes get their values back. The config is left as it
       is: PhiMoE's jitter also decides, in eval mode, which experts share a token, and the export writes it;
    3. two training-mode forwards and the eval-mode forward of the same 8 tokens (no gradients: on the CPU where the
       model is loaded, about the cost of decoding 24 tokens) must give the eval-mode logits from before; a model
       still random raises `RandomForwardError`."""
    reference = _logits(model, training=False)
    pinned = eval_only_modules(model)
    changed = _zero_block_noise(model)
    if (_logits(model, training=False) - reference).abs().max().item() > _same_logits_tolerance(model):
        for target, name, value in changed:
            setattr(target, name, value)
    gap = max((_logits(model, mode, pinned) - reference).abs().max().item() for mode in (True, True, False))
    if gap > _same_logits_tolerance(model):
        raise RandomForwardError(
            f"{type(model).__name__} (model_type={model.config.model_type!r}) computes other logits in each "
            f"training-mode forward of the same tokens (largest gap {gap:.3g}) after ketch kept its modules that read "
            "their training flag in eval mode and set its blocks' dropout and noise rates to 0: ketch would train "
            "another distribution than the rollout samples; turn the model's randomness off in its config "
            "(model.override_config)"
        )
    return pinned


def _zero_block_noise(model: nn.Module) -> list[tuple[nn.Module, str, float]]:
    """Step 2 of `disable_dropout`: the dropout and noise rates of `model`'s decoder blocks set to 0, and every
    `nn.Dropout`'s; returns the (module, attribute, value before) of the blocks' rates."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    changed = []
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        if not isinstance(module, GradientCheckpointingLayer):
            continue
        for name, value in list(vars(module).items()):
            if isinstance(value, float) and value > 0 and NOISE_FIELD.search(name):
                setattr(module, name, 0.0)
                changed.append((module, name, value))
    return changed


def _logits(model: nn.Module, training: bool, eval_only: list[nn.Module] = ()) -> torch.Tensor:
    """`model`'s logits `[1, 8, vocab]` (float32) of 8 fixed tokens in training mode (`eval_only` kept in eval mode)
    or in eval mode, without gradients; the model's mode is left as it was."""
    was_training, device = model.training, next(model.parameters()).device
    tokens = torch.arange(1, 9, device=device)[None] % model.config.get_text_config().vocab_size
    model.train(training)
    keep_in_eval(eval_only)
    with torch.no_grad():
        logits = model(input_ids=tokens, use_cache=False).logits.float()  # the probe needs no cache
    model.train(was_training)
    return logits


def _same_logits_tolerance(model: nn.Module) -> float:
    """How far the logits of the same tokens may differ between training and eval mode through rounding alone
    (kernels may differ between the modes): 1e-4 in float32, 1e-2 in 16 bits; dropout moves them by far more."""
    return 1e-4 if next(model.parameters()).dtype == torch.float32 else 1e-2


def eval_only_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` whose own `forward` reads their training flag, but for the decoder blocks (transformers'
    gradient checkpointing reads theirs): the ones to keep in eval mode while the model trains (`keep_in_eval`)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [
        module
        for module in model.modules()
        if _reads_training_flag(type(module)) and not isinstance(module, GradientCheckpointingLayer)
    ]


def keep_in_eval(modules: list[nn.Module]) -> None:
    """Put `modules` back in eval mode (after a `train()` of a model that holds them; their children keep theirs). The
    flag is set on each module, not by a method of its own, so that compiled blocks save their guards."""
    for module in modules:
        module.training = False


@cache
def _reads_training_flag(module_class: type) -> bool:
    """Whether `module_class.forward`'s own source reads `self.training` (other than for gradient checkpointing)."""
    try:
        source = inspect.getsource(module_class.forward)
    except (OSError, TypeError):
        return False
    return "self.training" in source.replace("self.gradient_checkpointing and self.training", "")
