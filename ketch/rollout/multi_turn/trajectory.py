"""A multi-turn trajectory and its rows: what the turn loop returns, and what partial rollouts carry between rounds.

With `rollout.partial` a trajectory outlives one `generate` call: the driver's buffer (`ketch/trainer/partial.py`)
holds it as one row of `CARRIED_TENSORS` and `CARRIED_COLUMNS` and hands it back at the next round, maybe to another
process, maybe after a resume. Everything the turn loop needs to go on is in that row: the rendered prompt, the
tokens with their sampled mask and rollout log-probs, the conversation, the counts, and `turn_tokens`, the tokens of
a model turn that a round's budget cut (0 between turns). The environment is rebuilt from the row and the
conversation (`restore_environment`), so no worker keeps state between rounds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ketch.protocol import DataProto, object_array

TRAJECTORY_COLUMNS = ("num_turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_time", "cut_by_max_turns")
"""Per-trajectory numbers the rollout returns as non-tensor columns (float64 `[batch]`), besides `messages`,
`cut_by_length` and `env_reward` (NaN where the environment gave none)."""

STAT_COLUMNS = ("tool_calls", "tool_errors", "tool_timeouts", "tool_time")
"""The columns an environment counts in its `stats`."""

CARRIED_TENSORS = (
    "prompts",
    "prompt_length",
    "responses",
    "response_mask",
    "rollout_log_probs",
    "response_length",
    "turn_tokens",
    "finished",
)
"""A carried trajectory's tensors: `prompts` `[rows, max_prompt_length]` (the rendered prompt, left-padded) and its
`prompt_length` `[rows]`; `responses`, `response_mask`, `rollout_log_probs` `[rows, max_response_length]` (pad, 0
and 0 after the first `response_length` `[rows]`); `turn_tokens` `[rows]` (the tokens of a turn a round cut, the last
of the response; 0 between turns); `finished` `[rows]` bool."""

CARRIED_COLUMNS = ("messages", *TRAJECTORY_COLUMNS, "cut_by_length", "env_reward")
"""A carried trajectory's non-tensor columns: the conversation (empty: not begun; with a cut turn, its text so far
is the last message) and the numbers the rollout returns."""

ROUND_TOKENS = "round_tokens"
"""The `meta_info` key of a partial rollout's round: the tokens each trajectory may sample in this call; the rows
then hold the carried columns, and the rollout returns them."""


@dataclass
class Trajectory:
    """One row's conversation and its response tokens: `sampled` marks the model's own tokens. `turn_tokens`: the
    tokens of a turn that a round's budget cut (0 between turns); `round_left`: the tokens this call may still
    sample (None: no bound); `stats_offset`: what to add to the environment's `stats` (the counts of earlier
    rounds, less what rebuilding the environment counted); `multi_modal_inputs`: the tensors of the images in the
    prompt and the tokens, in order (a vision-language model's; `ketch.models.vision.image_model_inputs` reads
    them)."""

    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    stop: tuple[str, ...] = ()
    tokens: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    num_turns: int = 0
    reward: float | None = None
    cut_by_max_turns: bool = False
    turn_tokens: int = 0
    done: bool = False
    round_left: int | None = None
    stats_offset: dict[str, float] = field(default_factory=dict)
    multi_modal_inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    def extend(self, tokens: Iterable[int], log_probs: Iterable[float] | None) -> None:
        tokens = list(tokens)
        self.tokens += tokens
        self.sampled += [1 if log_probs is not None else 0] * len(tokens)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(tokens)

    def add_images(self, inputs: dict[str, torch.Tensor]) -> None:
        """Append the tensors of images that come after the trajectory's (`pixel_values` `[patches or images, ...]`,
        Qwen's `image_grid_thw` `[images, 3]`), each concatenated after the trajectory's on its first dimension (in a
        new dict: the rows of earlier backend calls keep theirs)."""
        held = self.multi_modal_inputs
        self.multi_modal_inputs = held | {k: torch.cat([held[k], v]) if k in held else v for k, v in inputs.items()}

    def answered_messages(self) -> list[dict[str, Any]]:
        """The conversation up to the environment's last answer: without the text of a turn a round cut."""
        return self.messages[:-1] if self.turn_tokens else self.messages


def carried_trajectory(row: dict[str, Any]) -> Trajectory:
    """The trajectory of a carried row (its `CARRIED_TENSORS` and `CARRIED_COLUMNS` by name, tensors `[width]`);
    its `stop` and `stats_offset` come from its rebuilt environment."""
    length, prompt_length = int(row["response_length"]), int(row["prompt_length"])
    reward = float(row["env_reward"])
    return Trajectory(
        prompt_ids=row["prompts"][row["prompts"].shape[-1] - prompt_length :].tolist(),
        messages=[dict(message) for message in row["messages"]],
        tokens=row["responses"][:length].tolist(),
        sampled=row["response_mask"][:length].tolist(),
        log_probs=row["rollout_log_probs"][:length].tolist(),
        num_turns=int(row["num_turns"]),
        reward=None if math.isnan(reward) else reward,
        cut_by_max_turns=bool(row["cut_by_max_turns"]),
        turn_tokens=int(row["turn_tokens"]),
        done=bool(row["finished"]),
    )


def trajectory_rows(
    trajectories: list[Trajectory],
    stats: list[dict[str, float]],
    prompt_width: int,
    response_width: int,
    pad: int,
    images: bool = False,
) -> DataProto:
    """The trajectories as carried rows (`CARRIED_TENSORS`, `CARRIED_COLUMNS`); `stats`: each one's counts; with
    `images` (a vision-language model's rollout) also `multi_modal_inputs`, each row's image tensors."""
    prompt = left_padded([t.prompt_ids for t in trajectories], pad, prompt_width)
    tensors = {
        "prompts": prompt["input_ids"],
        "prompt_length": torch.tensor([len(t.prompt_ids) for t in trajectories]),
        "responses": right_padded([t.tokens for t in trajectories], pad, response_width, torch.long),
        "response_mask": right_padded([t.sampled for t in trajectories], 0, response_width, torch.long),
        "rollout_log_probs": right_padded([t.log_probs for t in trajectories], 0.0, response_width, torch.float32),
        "response_length": torch.tensor([len(t.tokens) for t in trajectories]),
        "turn_tokens": torch.tensor([t.turn_tokens for t in trajectories]),
        "finished": torch.tensor([t.done for t in trajectories]),
    }
    columns = {
        "num_turns": [t.num_turns for t in trajectories],
        "cut_by_max_turns": [float(t.cut_by_max_turns) for t in trajectories],
        "cut_by_length": [float(len(t.tokens) >= response_width) for t in trajectories],
        "env_reward": [np.nan if t.reward is None else t.reward for t in trajectories],
    }
    for key in STAT_COLUMNS:
        columns[key] = [s.get(key, 0) for s in stats]
    non_tensors = {k: np.asarray(v, dtype=np.float64) for k, v in columns.items()}
    non_tensors["messages"] = object_array([t.messages for t in trajectories])
    if images:
        non_tensors["multi_modal_inputs"] = object_array([t.multi_modal_inputs for t in trajectories])
    return DataProto.from_dict(tensors, non_tensors)


def not_begun(count: int, prompt_width: int, response_width: int, pad: int) -> DataProto:
    """`count` carried rows of trajectories not begun: no messages, no tokens, every count 0."""
    empty = [Trajectory([], []) for _ in range(count)]
    return trajectory_rows(empty, [{}] * count, prompt_width, response_width, pad)


def rollout_fields(carried: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The `Rollout.generate` tensors of carried rows (`CARRIED_TENSORS`): `prompts` `[rows, prompt_len]`;
    `responses`, `response_mask`, `rollout_log_probs` `[rows, response_len]`; `input_ids`, `attention_mask` (1 on
    the prompt's and the response's tokens, environment answers included), `position_ids` `[rows, prompt_len +
    response_len]`."""
    prompts, responses = carried["prompts"], carried["responses"]
    width = prompts.shape[-1]
    prompt_mask = torch.arange(width, device=prompts.device) >= width - carried["prompt_length"].unsqueeze(-1)
    real = torch.arange(responses.shape[-1], device=prompts.device) < carried["response_length"].unsqueeze(-1)
    attention_mask = torch.cat([prompt_mask, real], dim=-1).long()
    return {
        "prompts": prompts,
        "responses": responses,
        "response_mask": carried["response_mask"],
        "input_ids": torch.cat([prompts, responses], dim=-1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "rollout_log_probs": carried["rollout_log_probs"],
    }


def left_padded(rows: list[list[int]], pad: int, width: int | None = None) -> dict[str, torch.Tensor]:
    """`input_ids`, `attention_mask`, `position_ids` `[batch, width]` (default: the longest row)."""
    width = width or max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


def right_padded(rows: list[list], value: float, width: int, dtype: torch.dtype) -> torch.Tensor:
    """`[batch, width]`: each row followed by `value`."""
    padded = [nn.functional.pad(torch.tensor(row, dtype=dtype), (0, width - len(row)), value=value) for row in rows]
    return torch.stack(padded)
