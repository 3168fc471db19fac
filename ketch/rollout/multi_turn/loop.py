"""`MultiTurnRollout`: the turn loop around a generation backend (`hf` or `vllm`).

Each call generates one turn for every unfinished trajectory in one batched `generate`; each trajectory's
environment then answers its turn (tool results, feedback), the answer's tokens are appended, and the
trajectory goes on until its environment is done, `max_turns` turns, or `data.max_response_length` tokens.
A turn ends at a stop token, after its environment's stop string (the end of a tool call), or after
`rollout.multi_turn.max_tokens_per_turn` tokens. Token-in, token-out: sampled tokens are kept as sampled, the
rest is tokenized once (`ChatRenderer`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import numpy as np
import torch
from torch import nn

from ketch.config.schema import KetchConfig
from ketch.data.conversation import ChatRenderer
from ketch.protocol import DataProto, object_array
from ketch.rollout.base import Rollout
from ketch.rollout.multi_turn.environment import Environment

TRAJECTORY_COLUMNS = ("num_turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_time", "cut_by_max_turns")
"""Per-trajectory numbers the rollout returns as non-tensor columns (float64 `[batch]`), besides `messages`,
`cut_by_length` and `env_reward` (NaN where the environment gave none)."""


@dataclass
class Trajectory:
    """One row's conversation and its response tokens: `sampled` marks the model's own tokens."""

    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    stop: tuple[str, ...] = ()
    tokens: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    num_turns: int = 0
    reward: float | None = None
    cut_by_max_turns: bool = False

    def extend(self, tokens: Iterable[int], log_probs: Iterable[float] | None) -> None:
        tokens = list(tokens)
        self.tokens += tokens
        self.sampled += [1 if log_probs is not None else 0] * len(tokens)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(tokens)


class MultiTurnRollout(Rollout):
    """Multi-turn generation with `backend`; `new_environment()` makes one environment per trajectory.

    `generate` takes the prompts' non-tensor columns (`raw_prompt`, and whatever the environment reads) and
    returns the `Rollout` fields with these differences: `prompts` are the opening messages re-rendered with
    the tools (left-padded to `data.max_prompt_length`); `responses` hold every turn and every environment
    answer, `attention_mask` is 1 on all of them, `response_mask` and `rollout_log_probs` only on sampled
    tokens. Non-tensor columns: `messages` (the whole conversation) and `TRAJECTORY_COLUMNS`."""

    def __init__(self, backend: Rollout, config: KetchConfig, tokenizer, new_environment: Callable[[], Environment]):
        self.backend, self.tokenizer, self.new_environment = backend, tokenizer, new_environment
        self.max_turns = config.rollout.multi_turn.max_turns
        self.max_tokens_per_turn = config.rollout.multi_turn.max_tokens_per_turn
        self.max_prompt_length = config.data.max_prompt_length
        self.max_response_length = config.data.max_response_length
        self.renderer = ChatRenderer(tokenizer, config.data.chat_template)
        self.steps = ThreadPoolExecutor(max_workers=16, thread_name_prefix="ketch-env")

    @torch.no_grad()
    def generate(self, prompts: DataProto) -> DataProto:
        envs = [self.new_environment() for _ in range(len(prompts))]
        trajectories = [self._start(i, env, prompts) for i, env in enumerate(envs)]
        active = list(range(len(trajectories)))
        for turn in range(self.max_turns):
            self._sample_turn([trajectories[i] for i in active], prompts.meta_info)
            active = [i for i in active if len(trajectories[i].tokens) < self.max_response_length]
            answers = self.steps.map(lambda i: _step(i, envs[i], trajectories[i].messages), active)
            last = turn == self.max_turns - 1
            going_on = [self._answer(trajectories[i], envs[i], a, last) for i, a in zip(active, answers, strict=True)]
            active = [i for i, keep in zip(active, going_on, strict=True) if keep]
            if not active:
                break
        return self._output(trajectories, envs, prompts.batch["input_ids"].device)

    def _answer(self, t: Trajectory, env: Environment, answer: tuple, last_turn: bool) -> bool:
        """Append the environment's answer to `t` (cut to the token budget); whether `t` goes on."""
        messages, reward, done = answer
        t.reward = reward if reward is not None else t.reward
        if done:
            return False
        if last_turn:
            t.cut_by_max_turns = True
            return False
        glue = self.renderer.glue_ids(messages, getattr(env, "tools", None), t.tokens[-1])
        t.extend(glue[: self.max_response_length - len(t.tokens)], None)
        t.messages += messages
        return len(t.tokens) < self.max_response_length

    def _start(self, index: int, env: Environment, prompts: DataProto) -> Trajectory:
        row = {key: values[index] for key, values in prompts.non_tensor_batch.items()}
        try:
            messages = env.reset(row)
        except Exception as exc:
            raise ValueError(f"multi-turn rollout, row {index}: the environment's reset failed: {exc}") from exc
        ids = self.renderer.prompt_ids(messages, getattr(env, "tools", None))
        if len(ids) > self.max_prompt_length:
            raise ValueError(
                f"multi-turn rollout, row {index}: the prompt rendered with its tools is {len(ids)} tokens, over "
                f"data.max_prompt_length={self.max_prompt_length}; raise data.max_prompt_length"
            )
        return Trajectory(ids, list(messages), tuple(getattr(env, "stop", ())))

    def _sample_turn(self, trajectories: list[Trajectory], meta_info: dict) -> None:
        """One batched `generate` over the trajectories so far; appends each one's turn, cut after its first
        stop string and to its token budget."""
        contexts = [t.prompt_ids + t.tokens for t in trajectories]
        budgets = [self._turn_budget(t) for t in trajectories]
        stop = sorted({s for t in trajectories for s in t.stop})
        meta_info = {**meta_info, "max_new_tokens": max(budgets), "stop": stop}
        out = self.backend.generate(
            DataProto.from_dict(_left_padded(contexts, self.tokenizer.pad_token_id), meta_info=meta_info)
        )
        mask = out.batch["response_mask"].bool().cpu()
        for t, budget, row, keep, log_probs in zip(
            trajectories, budgets, out.batch["responses"].cpu(), mask, out.batch["rollout_log_probs"].cpu(), strict=True
        ):
            tokens = row[keep][:budget].tolist()
            tokens = tokens[: _end_of_first_stop(tokens, t.stop, self.tokenizer)]
            t.extend(tokens, log_probs[keep][: len(tokens)].tolist())
            t.num_turns += 1
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            t.messages.append({"role": "assistant", "content": text})

    def _turn_budget(self, t: Trajectory) -> int:
        left = self.max_response_length - len(t.tokens)
        return left if self.max_tokens_per_turn is None else min(left, self.max_tokens_per_turn)

    def _output(self, trajectories: list[Trajectory], envs: list[Environment], device: torch.device) -> DataProto:
        pad, width = self.tokenizer.pad_token_id, self.max_response_length
        prompt = _left_padded([t.prompt_ids for t in trajectories], pad, self.max_prompt_length)
        responses = _right_padded([t.tokens for t in trajectories], pad, width, torch.long)
        response_mask = _right_padded([t.sampled for t in trajectories], 0, width, torch.long)
        real = _right_padded([[1] * len(t.tokens) for t in trajectories], 0, width, torch.long)
        attention_mask = torch.cat([prompt["attention_mask"], real], dim=-1)
        out = DataProto.from_dict(
            {
                "prompts": prompt["input_ids"],
                "responses": responses,
                "response_mask": response_mask,
                "input_ids": torch.cat([prompt["input_ids"], responses], dim=-1),
                "attention_mask": attention_mask,
                "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
                "rollout_log_probs": _right_padded([t.log_probs for t in trajectories], 0.0, width, torch.float32),
            },
            non_tensors={"messages": object_array([t.messages for t in trajectories])}
            | _trajectory_columns(trajectories, envs, width),
        )
        return out.to(device)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.backend.update_weights(named_tensors)

    @property
    def dropped_weights(self) -> bool:
        return self.backend.dropped_weights

    def share_weights(self, named_tensors: dict[str, torch.Tensor]) -> set[str]:
        return self.backend.share_weights(named_tensors)

    def weight_norm(self, name: str) -> float:
        return self.backend.weight_norm(name)

    def warm_up(self, prompts: DataProto) -> None:
        self.backend.warm_up(prompts)

    def sleep(self) -> None:
        self.backend.sleep()

    def wake_up(self) -> None:
        self.backend.wake_up()


def _step(index: int, env: Environment, messages: list[dict[str, Any]]) -> tuple:
    try:
        return env.step(messages)
    except Exception as exc:
        raise RuntimeError(f"multi-turn rollout, row {index}: the environment's step failed: {exc!r}") from exc


def _end_of_first_stop(tokens: list[int], stop: tuple[str, ...], tokenizer) -> int:
    """How many of `tokens` to keep: up to the token that completes the first of the `stop` strings, else all."""
    pieces = tokenizer.batch_decode([[token] for token in tokens]) if stop else []
    text = "".join(pieces)
    ends = [text.find(s) + len(s) for s in stop if s in text]
    if not ends:
        return len(tokens)
    return bisect_left(list(accumulate(map(len, pieces))), min(ends)) + 1


def _trajectory_columns(trajectories: list[Trajectory], envs: list[Environment], width: int) -> dict[str, np.ndarray]:
    stats = [getattr(env, "stats", {}) for env in envs]
    columns = {
        "num_turns": [t.num_turns for t in trajectories],
        "cut_by_max_turns": [float(t.cut_by_max_turns) for t in trajectories],
        "cut_by_length": [float(len(t.tokens) >= width) for t in trajectories],
        "env_reward": [np.nan if t.reward is None else t.reward for t in trajectories],
    }
    for key in ("tool_calls", "tool_errors", "tool_timeouts", "tool_time"):
        columns[key] = [s.get(key, 0) for s in stats]
    return {k: np.asarray(v, dtype=np.float64) for k, v in columns.items()}


def _left_padded(rows: list[list[int]], pad: int, width: int | None = None) -> dict[str, torch.Tensor]:
    """`input_ids`, `attention_mask`, `position_ids` `[batch, width]` (default: the longest row)."""
    width = width or max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


def _right_padded(rows: list[list], value: float, width: int, dtype: torch.dtype) -> torch.Tensor:
    """`[batch, width]`: each row followed by `value`."""
    padded = [nn.functional.pad(torch.tensor(row, dtype=dtype), (0, width - len(row)), value=value) for row in rows]
    return torch.stack(padded)
