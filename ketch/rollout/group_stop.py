"""Stopping a generation once enough groups of rows have finished: partial rollouts (`ketch.trainer.partial`) need
`data.train_batch_size` prompts with every sample finished, not every row of the prompts in flight.

The caller gives each row its group (`GROUP_INDEX` `[batch]` in the prompts, e.g. its prompt's) and the share of the
groups present that must finish (`FINISH_FRACTION` in `meta_info`). A backend that looks at its rows between tokens (the
static decoder, every 16 tokens; vLLM, every engine step) stops once that share of its groups, rounded up, have every
row finished, and returns `UNFINISHED` `[batch]` bool: the rows it stopped before their stop token and their token
budget, whose tokens so far are their response (the response mask ends there). vLLM runs its engine one step at a time
and aborts the requests still running (`vllm_adapter.generate_until`). Rows marked `MUST_FINISH` `[batch]` (bool,
optional) are never cut: the call goes on until they are finished too. A share rather than a count, so that each rank of
a worker group judges its own rows: their groups' shares add up to the caller's count. The hf backend's `generate`
path looks after every token (`GroupStopCriteria`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import StoppingCriteria

from ketch.protocol import DataProto

GROUP_INDEX = "group_index"
FINISH_FRACTION = "finish_fraction"
MUST_FINISH = "must_finish"
UNFINISHED = "unfinished"


def asks_group_stop(prompts: DataProto) -> bool:
    """Whether `prompts` ask for a group stop: then the result marks the rows the call cut (`UNFINISHED`)."""
    return GROUP_INDEX in prompts.batch and FINISH_FRACTION in prompts.meta_info


@dataclass
class GroupStop:
    """`groups` `[batch]`: each row's group; the call may stop once `needed` of its `count` groups are finished and
    no row of `must_finish` `[batch]` is left."""

    groups: torch.Tensor
    needed: int
    count: int
    must_finish: torch.Tensor

    @classmethod
    def of(cls, prompts: DataProto) -> GroupStop | None:
        """The stop `prompts` ask for (see the module docstring), or None."""
        if not asks_group_stop(prompts):
            return None
        groups = prompts.batch[GROUP_INDEX]
        count = len(groups.unique())
        needed = math.ceil(prompts.meta_info[FINISH_FRACTION] * count - 1e-6)
        return cls(groups, needed, count, prompts.batch.get(MUST_FINISH, torch.zeros_like(groups, dtype=torch.bool)))

    def reached(self, unfinished_rows: torch.Tensor) -> bool:
        """Whether the call may stop when every row but `unfinished_rows` `[k]` (row indices) is finished."""
        if self.must_finish[unfinished_rows].any():
            return False
        return self.count - len(self.groups[unfinished_rows].unique()) >= self.needed

    def to(self, device: torch.device) -> GroupStop:
        return GroupStop(self.groups.to(device), self.needed, self.count, self.must_finish.to(device))


class GroupStopCriteria(StoppingCriteria):
    """`group_stop` for transformers' `generate` on prompts of `prompt_len` tokens: a row counts as finished once it
    has sampled one of `stop_token_ids`; when enough are, every row stops. `cut_at` `[batch]`: each row's tokens where
    the stop cut it, `length` (the call's response length) for the rows it did not."""

    def __init__(self, group_stop: GroupStop, prompt_len: int, stop_token_ids: list[int], length: int):
        self.group_stop, self.prompt_len = group_stop, prompt_len
        self.stops = torch.tensor(stop_token_ids, device=group_stop.groups.device)
        self.cut_at = torch.full_like(group_stop.groups, length)
        self.finished = torch.zeros_like(group_stop.groups, dtype=torch.bool)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        """Called after each new token (the last of `input_ids` `[batch, seq]`)."""
        self.finished |= torch.isin(input_ids[:, -1], self.stops)
        unfinished = (~self.finished).nonzero().squeeze(1)
        stop = len(unfinished) > 0 and self.group_stop.reached(unfinished)
        if stop:
            self.cut_at[unfinished] = input_ids.shape[1] - self.prompt_len
        return torch.full((len(input_ids),), stop, dtype=torch.bool, device=input_ids.device)
