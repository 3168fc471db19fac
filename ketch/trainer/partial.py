"""Partial rollouts as one stage of a PPO step (`rollout.partial`): trajectories that outlive a step.

The buffer holds groups of `rollout.n` samples of one prompt each, oldest first: prompts not begun yet, trajectories
under way (their tokens and rollout log-probs so far) and finished ones. A step tops it up with fresh prompts to
`in_flight_prompts` groups in flight, drops the trajectories begun more than `max_staleness` steps ago (they begin
again from their prompt), then generates in rounds: every unfinished trajectory in flight continues for
`round_tokens` tokens, its prompt and response so far as the backend's prompt, until `data.train_batch_size`
groups have every sample finished (the rollout stops a round there, cutting the other rows where they are:
`ketch.rollout.group_stop`; a trajectory that the staleness bound would drop at the next step is never cut, and
goes on past `round_tokens` to its end). Those groups, oldest first, are the step's batch; the rest stays for the
next step, whose weights are newer. A group is used only when all its samples are finished, so group estimators (GRPO)
see whole groups. The tokens a trajectory sampled in earlier steps keep the log-probs of the weights that sampled
them (`rollout_log_probs`), which truncated importance sampling (`actor.rollout_is`) corrects against.

Multi-turn rollouts (`rollout.multi_turn`) carry more than tokens: a row then holds the trajectory as the turn loop
left it (`ketch/rollout/multi_turn/trajectory.py`: the rendered prompt, tokens with their sampled mask and log-probs,
the conversation, the counts, a turn a round cut), and a round hands the rows to the rollout with `round_tokens`,
which continues each one (its environment rebuilt from the row) and returns the rows as they are after the round.

Every prompt the loader gives enters the buffer once and leaves it once, trained; the buffer is saved with the
checkpoint (`PARTIAL_FILE`), so a resumed run continues the same trajectories.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ketch.config.partial import in_flight_prompts, round_tokens
from ketch.config.schema import KetchConfig
from ketch.protocol import DataProto
from ketch.rollout.base import assemble_sequences
from ketch.rollout.group_stop import FINISH_FRACTION, GROUP_INDEX, MUST_FINISH, UNFINISHED
from ketch.rollout.multi_turn.trajectory import (
    CARRIED_COLUMNS,
    CARRIED_TENSORS,
    ROUND_TOKENS,
    not_begun,
    rollout_fields,
)
from ketch.trainer.dynamic_sampling import same_prompt_width

logger = logging.getLogger("ketch")

PARTIAL_FILE = "partial_rollouts.pt"
"""The buffer in a checkpoint directory (`DataProto.save_to_disk`)."""

PROMPT_KEYS = ("input_ids", "attention_mask")
"""The left-padded prompt of each row of the buffer."""

Generate = Callable[[DataProto], DataProto]


class PartialRollouts:
    """The trajectories in flight between steps (see the module docstring). Rows are samples, the `rollout.n`
    samples of a prompt adjacent; besides the prompt (`input_ids`, `attention_mask` `[rows, prompt_len]`) and its
    non-tensor columns (`uid` among them) a row holds `responses` and `rollout_log_probs` `[rows,
    max_response_length]` (pad token and 0 after the tokens so far), `response_length`, `finished` and `first_step`
    (the step of its first token; 0 before it begins) `[rows]`. With multi-turn rollouts a row holds the carried
    trajectory's columns instead of the prompt and those tensors (`CARRIED_TENSORS`, `CARRIED_COLUMNS`), besides
    `first_step`. The rows are never changed in place: every stage makes new tensors, so the buffer of the last
    completed step stays whole while a step runs."""

    def __init__(self, config: KetchConfig, pad_token_id: int):
        self.n, self.batch_size = config.rollout.n, config.data.train_batch_size
        self.in_flight, self.round_tokens = in_flight_prompts(config), round_tokens(config)
        self.max_staleness = config.rollout.partial.max_staleness
        self.max_length, self.pad_token_id = config.data.max_response_length, pad_token_id
        self.multi_turn, self.prompt_width = config.rollout.multi_turn.enable, config.data.max_prompt_length
        self.rows: DataProto | None = None
        self.before: tuple[int, DataProto | None] = (0, None)

    def next_batch(
        self, prompts: DataProto, step: int, generate: Generate, more_prompts: Callable[[], DataProto]
    ) -> tuple[DataProto, dict[str, float]]:
        """This step's batch of `data.train_batch_size` finished groups, as `Rollout.generate` gives a batch (with
        the prompts' columns, and `first_step` `[batch]`: the step of each trajectory's first token), and metrics.
        `prompts`: the step's prompts, expanded (`uid`, `rollout.n` rows each); `more_prompts()` gives more when the
        buffer holds too few to fill the prompts in flight; `generate(prompts)` samples responses."""
        self.before = (step - 1, self.rows)
        rows = self._add(self.rows, prompts)
        while len(rows) < self.in_flight * self.n:
            rows = self._add(rows, more_prompts())
        rows, dropped = self._drop_stale(rows, step)
        rows, rounds = self._generate(rows, step, generate)
        batch, self.rows = self._take(rows)
        metrics = dropped | self._metrics(batch, step) | {"partial/rounds": float(rounds)}
        out = self._as_rollout(batch)
        out.meta_info["epoch"] = prompts.meta_info["epoch"]
        return out, metrics

    # ----------------------------------------------------------------- stages
    def _add(self, rows: DataProto | None, prompts: DataProto) -> DataProto:
        """`rows` with the expanded `prompts` appended as samples not begun yet (multi-turn: without the prompt's
        tensors, which the rollout renders again from the row)."""
        fresh = prompts.select(batch_keys=[] if self.multi_turn else PROMPT_KEYS, meta_keys=[])
        fresh = fresh.union(self._not_begun(len(prompts), prompts.batch["input_ids"].dtype))
        if rows is None or len(rows) == 0:
            return fresh
        return DataProto.concat(same_prompt_width([rows.select(), fresh], self.pad_token_id))

    def _drop_stale(self, rows: DataProto, step: int) -> tuple[DataProto, dict[str, float]]:
        """Trajectories begun more than `max_staleness` steps before `step` begin again: their tokens are dropped."""
        b = rows.batch
        stale = (b["first_step"] > 0) & (step - b["first_step"] > self.max_staleness)
        metrics = {
            "partial/trajectories_dropped": float(stale.sum()),
            "partial/tokens_dropped": float(b["response_length"][stale].sum()),
        }
        if not stale.any():
            return rows, metrics
        return _where(stale, self._not_begun(len(rows), b["responses"].dtype), rows), metrics

    def _not_begun(self, count: int, dtype: torch.dtype) -> DataProto:
        """The trajectory columns of `count` rows not begun (`responses` of `dtype`, the prompts' token type)."""
        if self.multi_turn:
            state = not_begun(count, self.prompt_width, self.max_length, self.pad_token_id)
        else:
            state = DataProto.from_dict(
                {
                    "responses": torch.full((count, self.max_length), self.pad_token_id, dtype=dtype),
                    "rollout_log_probs": torch.zeros(count, self.max_length),
                    "response_length": torch.zeros(count, dtype=torch.long),
                    "finished": torch.zeros(count, dtype=torch.bool),
                }
            )
        state.batch["first_step"] = torch.zeros(count, dtype=torch.long)
        return state

    def _generate(self, rows: DataProto, step: int, generate: Generate) -> tuple[DataProto, int]:
        """Rounds of `round_tokens` tokens for the unfinished samples of the groups in flight, until
        `data.train_batch_size` groups are finished (a backend that can stops a round there); returns the rows
        and the number of rounds."""
        rounds = 0
        in_flight = torch.arange(len(rows)) < self.in_flight * self.n
        while (finished := int(self._finished_groups(rows).sum())) < self.batch_size:
            index = (in_flight & ~rows.batch["finished"]).nonzero().squeeze(-1)
            part = self._continue(rows[index], step, generate, index // self.n, self.batch_size - finished)
            rows = _replace_rows(rows, index, part)
            rounds += 1
        return rows, rounds

    def _continue(self, part: DataProto, step: int, generate: Generate, groups: torch.Tensor, needed: int) -> DataProto:
        """`part`'s trajectories, each continued for up to `round_tokens` tokens (fewer where it stops or reaches
        `data.max_response_length`, or where the backend stops once `needed` of the rows' `groups` `[rows]` are
        finished; to its end in its last step before the staleness bound): the backend's prompt is a row's prompt
        and response so far (`continuation`)."""
        if self.multi_turn:
            return self._continue_turns(part, step, generate)
        b = part.batch
        begun = torch.where(b["first_step"] > 0, b["first_step"], step)
        last = step - begun >= self.max_staleness  # dropped if not finished in this step
        rest = self.max_length - b["response_length"]
        allowed = torch.where(last, rest, rest.clamp(max=self.round_tokens))
        inputs = continuation(
            b["input_ids"], b["attention_mask"], b["responses"], b["response_length"], self.pad_token_id
        )
        inputs.meta_info["max_new_tokens"] = int(allowed.max())
        inputs.batch[GROUP_INDEX] = groups
        inputs.meta_info[FINISH_FRACTION] = needed / len(groups.unique())
        inputs.batch[MUST_FINISH] = last
        out = generate(inputs).batch
        # a backend's response_mask covers its tokens up to and including a stop token: at most `allowed` of them
        # is a stop; more (decoding past the budget, or padding read as a stop) is a cut, and so is a row the
        # backend stopped early (`unfinished`)
        produced = out["response_mask"].sum(-1)
        taken = torch.minimum(produced, allowed)
        length = b["response_length"] + taken
        stopped = (produced <= allowed) & ~out.get(UNFINISHED, torch.zeros_like(produced, dtype=torch.bool))
        part = part.select()
        part.batch |= {
            "responses": _append(b["responses"], out["responses"], b["response_length"], taken),
            "rollout_log_probs": _append(b["rollout_log_probs"], out["rollout_log_probs"], b["response_length"], taken),
            "response_length": length,
            "finished": stopped | (length >= self.max_length),
            "first_step": begun,
        }
        return part

    def _continue_turns(self, part: DataProto, step: int, generate: Generate) -> DataProto:
        """`part`'s multi-turn trajectories, each continued by the rollout for up to `round_tokens` sampled tokens
        (over as many turns as fit; `MultiTurnRollout`), which returns their carried columns."""
        inputs = part.select(batch_keys=CARRIED_TENSORS, meta_keys=[])
        inputs.meta_info[ROUND_TOKENS] = self.round_tokens
        out = generate(inputs)
        first_step = part.batch["first_step"]
        part = part.select()
        part.batch |= {key: out.batch[key] for key in CARRIED_TENSORS}
        part.batch["first_step"] = torch.where(first_step > 0, first_step, step)
        part.non_tensor_batch |= {key: out.non_tensor_batch[key] for key in CARRIED_COLUMNS}
        return part

    def _take(self, rows: DataProto) -> tuple[DataProto, DataProto]:
        """The first `data.train_batch_size` finished groups, and the rows that stay."""
        chosen = self._finished_groups(rows).nonzero().squeeze(-1)[: self.batch_size]
        taken = torch.zeros(len(rows) // self.n, dtype=torch.bool)
        taken[chosen] = True
        taken = taken.repeat_interleave(self.n)
        return rows[taken], rows[~taken]

    def _finished_groups(self, rows: DataProto) -> torch.Tensor:
        """`[groups]` bool: every sample of the group is finished."""
        return rows.batch["finished"].view(-1, self.n).all(-1)

    def _metrics(self, batch: DataProto, step: int) -> dict[str, float]:
        """Staleness of the trained trajectories (steps since their first token) and what is carried over."""
        staleness = (step - batch.batch["first_step"]).float()
        left = self.rows.batch
        carried = left["first_step"] > 0
        return {
            "partial/staleness/mean": staleness.mean().item(),
            "partial/staleness/max": staleness.max().item(),
            "partial/carried": float(carried.sum()),
            "partial/carried_unfinished": float((carried & ~left["finished"]).sum()),
            "partial/carried_fraction": float(carried.sum()) / (float(carried.sum()) + len(batch)),
        }

    def _as_rollout(self, batch: DataProto) -> DataProto:
        """The finished groups as `Rollout.generate` returns a batch, with the prompts' non-tensor columns and
        `first_step`."""
        b = batch.batch
        if self.multi_turn:
            fields = rollout_fields(b) | {"first_step": b["first_step"]}
            return DataProto.from_dict(fields, batch.non_tensor_batch)
        prompts = _left_padded(DataProto.from_dict({k: b[k] for k in PROMPT_KEYS}), self.pad_token_id)
        response_mask = (torch.arange(self.max_length) < b["response_length"].unsqueeze(-1)).long()
        out = assemble_sequences(prompts, b["responses"], response_mask)
        out.batch |= {"rollout_log_probs": b["rollout_log_probs"], "first_step": b["first_step"]}
        return out.union(batch.select(batch_keys=[], meta_keys=[]))

    # ----------------------------------------------------------------- checkpoints
    def save(self, path: Path, step: int) -> None:
        """Write the buffer as it was after `step` (the last completed step: a step that failed may have changed it)."""
        rows = self.before[1] if self.before[0] == step else self.rows
        if rows is not None:
            rows.save_to_disk(path)

    def load(self, path: Path | None) -> None:
        """The buffer of a checkpoint (`path`), or an empty one where there is none (a fresh start, or a checkpoint
        of a run without partial rollouts)."""
        self.rows = DataProto.load_from_disk(path) if path is not None and path.is_file() else None
        self.before = (0, None)
        if self.rows is None:
            return
        if ("turn_tokens" in self.rows.batch) != self.multi_turn:
            kind = "multi-turn" if self.multi_turn else "single-turn"
            raise ValueError(
                f"{path} holds the trajectories of a run with rollout.multi_turn.enable={not self.multi_turn}, which "
                f"this run's {kind} rollouts cannot continue: resume with the checkpoint's value"
            )
        if not self._fits(self.rows):
            raise ValueError(
                f"{path} holds trajectories of another rollout.n or data.max_response_length than this run's "
                f"({self.n}, {self.max_length}): resume with the checkpoint's values"
            )
        if self.multi_turn and self.rows.batch["prompts"].shape[-1] != self.prompt_width:
            raise ValueError(
                f"{path} holds multi-turn trajectories whose prompts are padded to "
                f"{self.rows.batch['prompts'].shape[-1]} tokens, not this run's data.max_prompt_length="
                f"{self.prompt_width}: resume with the checkpoint's value"
            )

    def _fits(self, rows: DataProto) -> bool:
        """Whether `rows` are groups of `rollout.n` samples with responses of `data.max_response_length` tokens."""
        uid = rows.non_tensor_batch["uid"]
        groups = len(uid) % self.n == 0 and (uid.reshape(-1, self.n) == uid[:: self.n, None]).all()
        return bool(groups) and rows.batch["responses"].shape[-1] == self.max_length


def continuation(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_length: torch.Tensor,
    pad_token_id: int,
) -> DataProto:
    """What a backend continues a trajectory from: the left-padded prompt `[rows, prompt_len]` followed by the first
    `response_length` `[rows]` tokens of `responses` `[rows, response_len]`, as one left-padded prompt
    (`input_ids`, `attention_mask`, `position_ids` `[rows, width]`, width the longest row's tokens)."""
    tokens = torch.cat([prompt_ids, responses], dim=-1)
    so_far = (torch.arange(responses.shape[-1]) < response_length.unsqueeze(-1)).to(prompt_mask.dtype)
    mask = torch.cat([prompt_mask, so_far], dim=-1)
    order = torch.sort(mask, dim=-1, stable=True).indices  # padding first, the real tokens after it in their order
    joined = DataProto.from_dict({"input_ids": tokens.gather(-1, order), "attention_mask": mask.gather(-1, order)})
    return _left_padded(joined, pad_token_id)


def _left_padded(prompts: DataProto, pad_token_id: int) -> DataProto:
    """Left-padded prompts without the columns that are padding in every row; padding tokens set to `pad_token_id`;
    `position_ids` from the attention mask."""
    mask = prompts.batch["attention_mask"]
    width = max(int(mask.sum(-1).max()), 1)
    mask = mask[:, -width:]
    return DataProto.from_dict(
        {
            "input_ids": prompts.batch["input_ids"][:, -width:].masked_fill(mask == 0, pad_token_id),
            "attention_mask": mask,
            "position_ids": (mask.long().cumsum(-1) - 1).clamp(min=0),
        }
    )


def _append(so_far: torch.Tensor, new: torch.Tensor, length: torch.Tensor, taken: torch.Tensor) -> torch.Tensor:
    """`so_far` `[rows, response_len]` with the first `taken` `[rows]` entries of `new` `[rows, response_len]`
    written after each row's first `length` `[rows]` entries."""
    position = torch.arange(so_far.shape[-1]) - length.unsqueeze(-1)  # where in `new` each entry comes from
    placed = (position >= 0) & (position < taken.unsqueeze(-1))
    return torch.where(placed, new.gather(-1, position.clamp(0, new.shape[-1] - 1)).to(so_far.dtype), so_far)


def _replace_rows(rows: DataProto, index: torch.Tensor, part: DataProto) -> DataProto:
    """A copy of `rows` whose rows `index` are `part`'s (same keys and widths)."""
    out = rows.select()
    out.batch = {k: v.index_copy(0, index, part.batch[k]) for k, v in rows.batch.items()}
    out.non_tensor_batch = {k: v.copy() for k, v in rows.non_tensor_batch.items()}
    for key, values in out.non_tensor_batch.items():
        values[index.numpy()] = part.non_tensor_batch[key]
    return out


def _where(rows_chosen: torch.Tensor, chosen: DataProto, others: DataProto) -> DataProto:
    """A copy of `others` whose `chosen`'s columns are `chosen`'s in the rows `rows_chosen` `[rows]` (bool)."""
    out = others.select()
    for key, value in chosen.batch.items():
        where = rows_chosen.view(-1, *[1] * (value.dim() - 1))
        out.batch[key] = torch.where(where, value, others.batch[key])
    for key, value in chosen.non_tensor_batch.items():
        out.non_tensor_batch[key] = np.where(rows_chosen.numpy(), value, others.non_tensor_batch[key])
    return out
