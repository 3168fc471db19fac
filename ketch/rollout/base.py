"""The `Rollout` interface that every generation backend implements, and the backend registry."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

import torch

from ketch.config.schema import KetchConfig, RolloutConfig
from ketch.protocol import DataProto
from ketch.rollout.group_stop import UNFINISHED, asks_group_stop

_BACKENDS: dict[str, type[Rollout] | str] = {"vllm": "ketch.rollout.vllm:VLLMRollout"}
"""Backends by `rollout.name`; a string is imported on first use (vLLM is optional)."""


class Rollout(ABC):
    """Samples responses for left-padded prompts.

    Built as `Backend(config, model_path, tokenizer, dtype, device, seed)`. `generate` takes `input_ids`,
    `attention_mask`, `position_ids` `[batch, prompt_len]` and returns `prompts` `[batch, prompt_len]`,
    `responses` and `response_mask` `[batch, response_len]` (right-padded; the mask covers the response up
    to and including its first stop token), the concatenated `input_ids`/`attention_mask`/`position_ids`
    `[batch, prompt_len + response_len]` (a Qwen vision-language model's `position_ids`: its multimodal rotary
    positions `[batch, 3, prompt_len + response_len]`, `ketch.models.mrope`), and `rollout_log_probs` `[batch,
    response_len]` (the sampled tokens' log-probs at the sampling temperature). `meta_info` may override `do_sample` and
    `temperature` for one call (validation decodes greedily), and may give `max_new_tokens` (at most
    `data.max_response_length`) and `stop` (strings that end a response, such as the end of a tool call), as
    the multi-turn loop does for each turn: a backend stops there where it can, else decodes on, and the
    caller cuts each response after its first stop string and to its budget. Partial rollouts
    (`ketch.trainer.partial`) continue a trajectory the same way: its prompt and response so far as the prompt, a
    round's tokens as `max_new_tokens`. A vision-language model's prompts come with each row's `multi_modal_inputs`
    (non-tensor), which the result carries: the prompt's images (and a multi-turn rollout's, the environment's after
    them), for the training forwards."""

    @abstractmethod
    def generate(self, prompts: DataProto) -> DataProto:
        """Sample one response per row.

        Args:
            prompts: `input_ids`, `attention_mask`, `position_ids` `[batch, prompt_len]` (left-padded), and in
                `meta_info` the call's optional `do_sample`, `temperature`, `max_new_tokens` and `stop`.

        Returns:
            `prompts`, `responses`, `response_mask`, `input_ids`, `attention_mask`, `position_ids` and
            `rollout_log_probs`, shaped as the class describes.
        """

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights without touching disk.

        Args:
            named_tensors: (HF parameter name, full tensor) pairs. A tensor may be valid only until the next one is
                drawn (the training engine frees each gathered unit): copy it then.
        """

    def share_weights(self, named_tensors: dict[str, torch.Tensor]) -> set[str]:
        """Read some weights in place, from tensors the trainer keeps on this device and never changes (a LoRA
        run's frozen base), instead of copies of their own.

        Args:
            named_tensors: HF parameter name -> tensor, of the rollout's dtype and device.

        Returns:
            The names taken: `update_weights` need not send them again. None here (a backend with weights of its
            own elsewhere).
        """
        return set()

    @abstractmethod
    def weight_norm(self, name: str) -> float:
        """The norm of one parameter as the backend holds it (checks a weight hand-off).

        Args:
            name: The HF parameter name.

        Returns:
            Its norm.
        """

    def warm_up(self, prompts: DataProto) -> None:
        """Get ready, before the first step, for `generate` calls on batches shaped like `prompts`: load or
        compile, and capture, what their first call would. A no-op where the backend has nothing to prepare per
        shape.

        Args:
            prompts: A batch shaped like the first step's, as this process will get it.
        """
        return None

    dropped_weights = False
    """Whether `sleep` dropped the weights: the engine needs an `update_weights` before it generates again."""

    def sleep(self) -> None:
        """Free generation memory while training runs (a no-op where the backend holds none)."""
        return None

    def wake_up(self) -> None:
        """Restore what `sleep` freed."""
        return None


def register_rollout(name: str) -> Callable[[type[Rollout]], type[Rollout]]:
    """Decorator registering a `Rollout` subclass as the backend `rollout.name=name`.

    A registered name is replaced. The class is built as `cls(config, model_path, tokenizer, dtype, device, seed)`.

    Args:
        name: The backend's name.

    Returns:
        A decorator that registers the class and returns it.
    """

    def wrap(cls):
        _BACKENDS[name] = cls
        return cls

    return wrap


def get_rollout_class(name: str) -> type[Rollout]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown rollout backend {name!r} (rollout.name); available: {sorted(_BACKENDS)}")
    backend = _BACKENDS[name]
    if isinstance(backend, str):
        module, attr = backend.split(":")
        backend = _BACKENDS[name] = getattr(importlib.import_module(module), attr)
    return backend


def build_rollout(
    config: KetchConfig, model_path: str, tokenizer, dtype: torch.dtype, device: torch.device, seed: int
) -> Rollout:
    """The backend named by `rollout.name`, loaded from `model_path`."""
    return get_rollout_class(config.rollout.name)(config, model_path, tokenizer, dtype, device, seed)


def call_sampling(prompts: DataProto, config: RolloutConfig) -> tuple[bool, float]:
    """(do_sample, temperature) of one `generate` call: `meta_info` overrides the config; greedy gets 1.0."""
    do_sample = prompts.meta_info.get("do_sample", config.do_sample)
    return do_sample, prompts.meta_info.get("temperature", config.temperature) if do_sample else 1.0


def call_limits(prompts: DataProto, max_response_length: int) -> tuple[int, list[str]]:
    """(max_new_tokens, stop strings) of one `generate` call: `meta_info` may lower the first and give the second."""
    return min(prompts.meta_info.get("max_new_tokens", max_response_length), max_response_length), list(
        prompts.meta_info.get("stop", ())
    )


def rollout_output(
    prompts: DataProto,
    responses: torch.Tensor,
    log_probs: torch.Tensor,
    stop_token_ids: list[int] | None,
    pad_token_id: int,
    cut_at: torch.Tensor | None = None,
) -> DataProto:
    """A backend's sampled `responses` and their `log_probs` `[batch, response_len]` as the `Rollout` fields:
    tokens after each row's first stop token become padding; `stop_token_ids=None` (`rollout.ignore_eos`)
    keeps every token; `cut_at` `[batch]`: a row's tokens end there at the latest (a backend stopped it early), and
    where the prompts ask for a group stop, `unfinished` `[batch]` marks the rows cut before `response_len`."""
    if stop_token_ids is None:
        response_mask = torch.ones_like(responses)
    else:
        response_mask = response_mask_from_stops(responses, stop_token_ids)
    if cut_at is not None:
        response_mask = response_mask * (torch.arange(responses.shape[1], device=responses.device) < cut_at[:, None])
    result = assemble_sequences(prompts, responses.masked_fill(response_mask == 0, pad_token_id), response_mask)
    result.batch["rollout_log_probs"] = log_probs * response_mask
    if cut_at is not None and asks_group_stop(prompts):
        result.batch[UNFINISHED] = cut_at < responses.shape[1]
    return result


def response_mask_from_stops(responses: torch.Tensor, stop_token_ids: list[int]) -> torch.Tensor:
    """1 on every token up to and including the first stop token of each row, 0 after; `[batch, response_len]`.
    A row without a stop token (truncated) is all ones."""
    is_stop = torch.isin(responses, torch.tensor(stop_token_ids, device=responses.device))
    stops_before = is_stop.long().cumsum(-1) - is_stop.long()
    return (stops_before == 0).long()


def assemble_sequences(prompts: DataProto, responses: torch.Tensor, response_mask: torch.Tensor) -> DataProto:
    """The rollout output fields shared by all backends (see `Rollout`), with the prompts' `multi_modal_inputs`."""
    prompt_ids, prompt_mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    images = {k: v for k, v in prompts.non_tensor_batch.items() if k == "multi_modal_inputs"}
    attention_mask = torch.cat([prompt_mask, response_mask.to(prompt_mask.dtype)], dim=-1)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(
        {
            "prompts": prompt_ids,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompt_ids, responses], dim=-1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
        },
        images,
    )
