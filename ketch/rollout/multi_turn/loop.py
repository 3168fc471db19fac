"""`MultiTurnRollout`: the turn loop around a generation backend (`hf` or `vllm`).

Each call generates one turn for every unfinished trajectory in one batched `generate`; each trajectory's
environment then answers its turn (tool results, feedback), the answer's tokens are appended, and the
trajectory goes on until its environment is done, `max_turns` turns, or `data.max_response_length` tokens.
A turn ends at a stop token, after its environment's stop string (the end of a tool call), or after
`rollout.multi_turn.max_tokens_per_turn` tokens. Token-in, token-out: sampled tokens are kept as sampled, the
rest is tokenized once (`ChatRenderer`).

Partial rollouts (`rollout.partial`, `meta_info["round_tokens"]`): a call is one round. The rows then carry their
trajectories (`trajectory.py`): one not begun starts, one under way continues, and each samples at most
`round_tokens` tokens in this call, over as many turns as fit; the call returns the carried rows, `finished` set
where the trajectory ended. A round's budget may cut a turn: the turn goes on at the next round from its tokens so
far (`turn_tokens`), its stop strings and `max_tokens_per_turn` counted over the whole turn, so the turn is the one
an uncut call would have sampled. Rounds are cut by tokens, not at turn boundaries, because what partial rollouts
bound is the time a step waits for its longest trajectories: in reasoning tasks one turn can be most of a
trajectory, and a round that had to finish its turns would wait for the longest of them. Environments are not kept
between rounds (the next round may run in another process, or after a resume): each call rebuilds them from the
row and the conversation (`restore_environment`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate
from typing import Any

import torch

from ketch.config.schema import KetchConfig
from ketch.data.conversation import ChatRenderer
from ketch.data.images import joined_messages, message_content, row_images
from ketch.protocol import DataProto, object_array
from ketch.rollout.base import Rollout
from ketch.rollout.multi_turn.environment import Environment, restore_environment
from ketch.rollout.multi_turn.trajectory import (
    CARRIED_COLUMNS,
    ROUND_TOKENS,
    STAT_COLUMNS,
    Trajectory,
    carried_trajectory,
    left_padded,
    rollout_fields,
    trajectory_rows,
)


class MultiTurnRollout(Rollout):
    """Multi-turn generation with `backend`; `new_environment()` makes one environment per trajectory.

    `generate` takes the prompts' non-tensor columns (`raw_prompt`, and whatever the environment reads) and
    returns the `Rollout` fields with these differences: `prompts` are the opening messages re-rendered with
    the tools (left-padded to `data.max_prompt_length`); `responses` hold every turn and every environment
    answer, `attention_mask` is 1 on all of them, `response_mask` and `rollout_log_probs` only on sampled
    tokens. Non-tensor columns: `messages` (the whole conversation) and `TRAJECTORY_COLUMNS`. With
    `meta_info["round_tokens"]` (a round of partial rollouts) the rows also hold the carried columns
    (`CARRIED_TENSORS`, `CARRIED_COLUMNS`), and so does the result, instead of the `Rollout` fields.

    With a vision-language model's `processor` the prompt's images (the row's `images`, or images the opening
    messages hold) and those of the environment's answers (`{"type": "image", "image": ...}` parts, e.g. a tool that
    returns an image) are expanded into their vision tokens where they stand; the backend gets each row's images at
    every turn, and the result's `multi_modal_inputs` holds each row's image tensors in order, the prompt's first.
    `messages` holds an `<image>` marker where an image was."""

    def __init__(
        self,
        backend: Rollout,
        config: KetchConfig,
        tokenizer,
        new_environment: Callable[[], Environment],
        processor: Any | None = None,
    ):
        self.backend, self.tokenizer, self.new_environment = backend, tokenizer, new_environment
        self.max_turns = config.rollout.multi_turn.max_turns
        self.max_tokens_per_turn = config.rollout.multi_turn.max_tokens_per_turn
        self.max_prompt_length = config.data.max_prompt_length
        self.max_response_length = config.data.max_response_length
        self.renderer = ChatRenderer(tokenizer, config.data.chat_template, processor)
        self.images = processor is not None
        self.steps = ThreadPoolExecutor(max_workers=16, thread_name_prefix="ketch-env")

    @torch.no_grad()
    def generate(self, prompts: DataProto) -> DataProto:
        meta_info = dict(prompts.meta_info)
        round_tokens = meta_info.pop(ROUND_TOKENS, None)
        envs = [self.new_environment() for _ in range(len(prompts))]
        trajectories = [self._begin(i, env, prompts) for i, env in enumerate(envs)]
        active = [i for i, t in enumerate(trajectories) if not t.done]
        for i in active:
            trajectories[i].round_left = round_tokens
        while active:
            self._sample_turn([trajectories[i] for i in active], meta_info)
            for i in active:
                trajectories[i].done = len(trajectories[i].tokens) >= self.max_response_length
            ended = [i for i in active if not (trajectories[i].done or trajectories[i].turn_tokens)]
            answers = self.steps.map(lambda i: _step(i, envs[i], trajectories[i].messages, self.images), ended)
            going_on = [i for i, a in zip(ended, answers, strict=True) if self._answer(trajectories[i], envs[i], a)]
            active = [i for i in going_on if trajectories[i].round_left is None or trajectories[i].round_left > 0]
        stats = [_stats(t, env) for t, env in zip(trajectories, envs, strict=True)]
        pad = self.tokenizer.pad_token_id
        rows = trajectory_rows(trajectories, stats, self.max_prompt_length, self.max_response_length, pad, self.images)
        if round_tokens is None:
            rows = DataProto.from_dict(rollout_fields(rows.batch), rows.non_tensor_batch)
        return rows.to(next(iter(prompts.batch.values())).device)

    def _answer(self, t: Trajectory, env: Environment, answer: tuple) -> bool:
        """Append the environment's answer to `t` (cut to the token budget); whether `t` goes on (else it is done).
        `answer`: `_step`'s, the messages joined into text with their images apart."""
        messages, images, reward, done = answer
        t.reward = reward if reward is not None else t.reward
        if not done and t.num_turns >= self.max_turns:
            t.cut_by_max_turns = True
        whole = True
        if not done and not t.cut_by_max_turns:
            room = self.max_response_length - len(t.tokens)
            tools = getattr(env, "tools", None)
            glue, inputs, whole = self.renderer.glue_inputs(messages, images, tools, t.tokens[-1], room)
            t.extend(glue, None)
            t.add_images(inputs)
            t.messages += messages
        t.done = done or t.cut_by_max_turns or not whole or len(t.tokens) >= self.max_response_length
        return not t.done

    def _begin(self, index: int, env: Environment, prompts: DataProto) -> Trajectory:
        """Row `index`'s trajectory: a new one, or in a round of partial rollouts the one it carries."""
        carried = prompts.non_tensor_batch.get("messages")
        if carried is not None and len(carried[index]):
            return self._resume(index, env, prompts)
        return self._start(index, env, prompts)

    def _start(self, index: int, env: Environment, prompts: DataProto) -> Trajectory:
        row = _environment_row(prompts, index)
        try:
            messages, images = joined_messages(env.reset(row))
            images = images or row_images(row.get("images"))
            ids, image_inputs = self.renderer.prompt_inputs(messages, getattr(env, "tools", None), images)
        except Exception as exc:
            raise ValueError(f"multi-turn rollout, row {index}: the environment's reset failed: {exc}") from exc
        if len(ids) > self.max_prompt_length:
            raise ValueError(
                f"multi-turn rollout, row {index}: the prompt rendered with its tools is {len(ids)} tokens, over "
                f"data.max_prompt_length={self.max_prompt_length}; raise data.max_prompt_length"
            )
        return Trajectory(ids, messages, tuple(getattr(env, "stop", ())), multi_modal_inputs=image_inputs)

    def _resume(self, index: int, env: Environment, prompts: DataProto) -> Trajectory:
        """Row `index`'s carried trajectory, its new environment brought to where the conversation is."""
        row = prompts[index]
        t = carried_trajectory(row)
        try:
            restore_environment(env, _environment_row(prompts, index), t.answered_messages())
        except Exception as exc:
            raise ValueError(
                f"multi-turn rollout, row {index}: rebuilding the environment of a carried trajectory failed: {exc}"
            ) from exc
        t.stop = tuple(getattr(env, "stop", ()))
        rebuilt = getattr(env, "stats", {})
        t.stats_offset = {key: float(row[key]) - rebuilt.get(key, 0) for key in STAT_COLUMNS}
        return t

    def _sample_turn(self, trajectories: list[Trajectory], meta_info: dict) -> None:
        """One batched `generate` over the trajectories so far; appends each one's turn (or the rest of a turn a
        round cut), cut after its first stop string and to its token budget."""
        contexts = [t.prompt_ids + t.tokens for t in trajectories]
        limits = [self._turn_budget(t) for t in trajectories]
        budgets = [min(limit, t.round_left or limit) for t, limit in zip(trajectories, limits, strict=True)]
        stop = sorted({s for t in trajectories for s in t.stop})
        meta_info = {**meta_info, "max_new_tokens": max(budgets), "stop": stop}
        images = {"multi_modal_inputs": object_array([t.multi_modal_inputs for t in trajectories])}
        inputs = left_padded(contexts, self.tokenizer.pad_token_id)
        out = self.backend.generate(DataProto.from_dict(inputs, images if self.images else {}, meta_info=meta_info))
        mask = out.batch["response_mask"].bool().cpu()
        for t, limit, budget, row, keep, log_probs in zip(
            trajectories,
            limits,
            budgets,
            out.batch["responses"].cpu(),
            mask,
            out.batch["rollout_log_probs"].cpu(),
            strict=True,
        ):
            # a backend's response_mask covers its tokens up to and including a stop token: more than `budget` of
            # them is a cut (decoding past the budget, or padding read as a stop)
            stopped = int(keep.sum()) <= budget
            self._append_turn(t, row[keep][:budget].tolist(), log_probs[keep], stopped, budget < limit)

    def _append_turn(
        self, t: Trajectory, tokens: list[int], log_probs: torch.Tensor, stopped: bool, round_bound: bool
    ) -> None:
        """Append a call's `tokens` (and their `log_probs` `[>= len(tokens)]`) to `t`'s turn under way, or to a new
        turn; the turn stays open (`turn_tokens`) when the round's budget, not its own end, stopped it."""
        so_far = t.tokens[len(t.tokens) - t.turn_tokens :]
        end, found = _end_of_first_stop(so_far + tokens, t.stop, self.tokenizer)
        tokens = tokens[: end - len(so_far)]
        t.extend(tokens, log_probs[: len(tokens)].tolist())
        turn = so_far + tokens
        message = {"role": "assistant", "content": self.tokenizer.decode(turn, skip_special_tokens=True)}
        if t.turn_tokens:
            t.messages[-1] = message
        else:
            t.num_turns += 1
            t.messages.append(message)
        t.turn_tokens = len(turn) if round_bound and not (stopped or found) else 0
        if t.round_left is not None:
            t.round_left -= len(tokens)

    def _turn_budget(self, t: Trajectory) -> int:
        """The tokens `t`'s turn may still sample: what is left of the response and of `max_tokens_per_turn`."""
        left = self.max_response_length - len(t.tokens)
        return left if self.max_tokens_per_turn is None else min(left, self.max_tokens_per_turn - t.turn_tokens)

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


def _step(index: int, env: Environment, messages: list[dict[str, Any]], images: bool) -> tuple:
    """`env.step(messages)` as (the answer's messages with their content lists joined into text, the images those
    held, reward, done): the images decoded (`message_content`) and taken out once (`joined_messages`); `images`:
    whether the model takes them."""
    try:
        answer, reward, done = env.step(messages)
        answer = [
            m if isinstance(m.get("content"), str) else {**m, "content": message_content(m["content"])} for m in answer
        ]
        answer, found = joined_messages(answer)
        if found and not images:
            raise ValueError("it answered with an image, and the model is text-only")
        return answer, found, reward, done
    except Exception as exc:
        raise RuntimeError(f"multi-turn rollout, row {index}: the environment's step failed: {exc!r}") from exc


def _environment_row(prompts: DataProto, index: int) -> dict[str, Any]:
    """Row `index`'s columns by name as its environment's `reset` gets them: the data set's, not the carried ones."""
    return {key: values[index] for key, values in prompts.non_tensor_batch.items() if key not in CARRIED_COLUMNS}


def _stats(t: Trajectory, env: Environment) -> dict[str, float]:
    """`t`'s counts: its environment's `stats` and those of earlier rounds."""
    stats = getattr(env, "stats", {})
    return {key: stats.get(key, 0) + t.stats_offset.get(key, 0) for key in STAT_COLUMNS}


def _end_of_first_stop(tokens: list[int], stop: tuple[str, ...], tokenizer) -> tuple[int, bool]:
    """How many of `tokens` to keep: up to the token that completes the first of the `stop` strings, else all; and
    whether one was found."""
    pieces = tokenizer.batch_decode([[token] for token in tokens]) if stop else []
    text = "".join(pieces)
    ends = [text.find(s) + len(s) for s in stop if s in text]
    if not ends:
        return len(tokens), False
    return bisect_left(list(accumulate(map(len, pieces))), min(ends)) + 1, True
