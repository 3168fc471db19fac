"""DAPO's dynamic sampling as one stage of a PPO step (`algorithm.filter_groups`, https://arxiv.org/abs/2503.14476).

Rounds of prompts (`algorithm.filter_groups.gen_batch_size`, default `data.train_batch_size`) are generated and
scored; the groups whose samples all have the same filter metric are dropped (`informative_groups`), until
`data.train_batch_size` informative groups are collected. The first ones fill the batch; the informative groups
beyond it are discarded.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ketch.algorithms import informative_groups
from ketch.config.schema import FilterGroupsConfig
from ketch.protocol import DataProto

EXTRA_PREFIX = "reward_extra/"
"""Non-tensor batch keys under which the fields of the reward function's dict are kept, per sample."""

Round = Callable[[DataProto], tuple[DataProto, dict[str, float]]]


class DynamicSamplingError(RuntimeError):
    """`algorithm.filter_groups.max_num_gen_batches` rounds did not give a full batch of informative groups."""


def metric_values(batch: DataProto, metric: str) -> np.ndarray:
    """The filter metric per sample `[batch]`: `seq_reward` (summed `token_level_scores`) or a reward field."""
    if metric == "seq_reward":
        return batch.batch["token_level_scores"].sum(-1).double().cpu().numpy()
    if EXTRA_PREFIX + metric not in batch.non_tensor_batch:
        fields = sorted(k.removeprefix(EXTRA_PREFIX) for k in batch.non_tensor_batch if k.startswith(EXTRA_PREFIX))
        raise ValueError(
            f"algorithm.filter_groups.metric={metric!r} is not seq_reward nor a field of the reward function's "
            f"result (fields: {fields or 'none, the scorer returns a bare float'})"
        )
    return np.asarray(batch.non_tensor_batch[EXTRA_PREFIX + metric], dtype=np.float64)


def fill_with_informative_groups(
    prompts: DataProto,
    generate_and_score: Round,
    next_prompts: Callable[[], DataProto],
    settings: FilterGroupsConfig,
    num_groups: int,
    n: int,
    pad_token_id: int,
) -> tuple[DataProto, dict[str, float]]:
    """A batch of `num_groups` informative groups of `n` samples, and metrics.

    `generate_and_score(prompts)` expands, generates and scores one round of prompts; `next_prompts()` gives
    the next round's prompts. Metrics: the round metrics averaged over rounds, `dynamic_sampling/gen_rounds`,
    `dynamic_sampling/groups_generated` and `dynamic_sampling/groups_informative`.
    """
    kept, round_metrics, generated, informative = [], [], 0, 0
    while True:
        batch, metrics = generate_and_score(prompts)
        round_metrics.append(metrics)
        keep = informative_groups(batch.non_tensor_batch["uid"], metric_values(batch, settings.metric))
        kept.append(batch[keep])
        generated, informative = generated + len(batch) // n, informative + int(keep.sum()) // n
        if informative >= num_groups:
            break
        if settings.max_num_gen_batches and len(round_metrics) >= settings.max_num_gen_batches:
            raise DynamicSamplingError(_not_filled(settings, informative, generated, num_groups))
        prompts = next_prompts()
    metrics = {k: float(np.mean([m[k] for m in round_metrics if k in m])) for k in round_metrics[-1]}
    metrics["dynamic_sampling/gen_rounds"] = float(len(round_metrics))
    metrics["dynamic_sampling/groups_generated"] = float(generated)
    metrics["dynamic_sampling/groups_informative"] = float(informative)
    return DataProto.concat(same_prompt_width(kept, pad_token_id))[: num_groups * n], metrics


PROMPT_SIDE = {"prompts": None, "input_ids": None, "attention_mask": 0, "position_ids": 0}
"""Tensors that start with the left-padded prompt, and their padding value (None: the pad token)."""


def same_prompt_width(parts: list[DataProto], pad_token_id: int) -> list[DataProto]:
    """Each round padded on the left to the widest round's prompts: a round pads its prompts to its own longest.
    The prompts are `prompts` after generation, `input_ids` before it (partial rollouts' buffer)."""
    prompt = "prompts" if "prompts" in parts[0].batch else "input_ids"
    width = max(part.batch[prompt].shape[1] for part in parts)
    for part in parts:
        extra = width - part.batch[prompt].shape[1]
        for key, value in PROMPT_SIDE.items():
            if extra and key in part.batch:
                padding = pad_token_id if value is None else value
                part.batch[key] = torch.nn.functional.pad(part.batch[key], (extra, 0), value=padding)
    return parts


def _not_filled(settings: FilterGroupsConfig, informative: int, generated: int, num_groups: int) -> str:
    return (
        f"dynamic sampling (algorithm.filter_groups) found {informative} of the data.train_batch_size={num_groups} "
        f"informative groups it needs in max_num_gen_batches={settings.max_num_gen_batches} rounds of generation "
        f"({generated} groups): in the others every sample had the same {settings.metric}. Raise "
        "algorithm.filter_groups.max_num_gen_batches (0 = no limit), sample more or more diverse responses "
        "(rollout.n, rollout.temperature), or use prompts the model solves only sometimes"
    )
