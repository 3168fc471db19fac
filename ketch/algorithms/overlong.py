"""DAPO's overlong shaping (Yu et al. 2025, https://arxiv.org/abs/2503.14476, sec. 3.4): the soft punishment
(eq. 13) and the filter that leaves cut-off responses out of the policy loss.

With L_max = max_response_length and a buffer of L_cache tokens, a response of |y| tokens gets

    0                                  if |y| <= L_max − L_cache
    ((L_max − L_cache) − |y|) / L_cache   if L_max − L_cache < |y| <= L_max

times `penalty_factor`, added to its score: a response that runs into the budget is pushed towards shorter
ones gradually instead of by a cliff. (The paper's −1 beyond L_max cannot happen here: the rollout stops at
L_max, so a cut-off response gets the full −penalty_factor.)

Overlong filtering masks the tokens of the responses that used every allowed token: a cut-off reasoning chain is
not a wrong answer, and its reward would teach the model that thinking longer is bad.
"""

from __future__ import annotations

import torch


def overlong_penalty(
    response_length: torch.Tensor, max_response_length: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """The penalty (≤ 0) `[batch]` of responses with `response_length` `[batch]` valid tokens."""
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(
            f"reward.overlong_buffer.len={buffer_len} must be in [1, data.max_response_length={max_response_length}]"
        )
    exceed = response_length.float() - (max_response_length - buffer_len)
    return (-exceed / buffer_len * penalty_factor).clamp(max=0)


def truncated(response_mask: torch.Tensor, attention_mask: torch.Tensor, max_response_length: int) -> torch.Tensor:
    """`[batch]` bool: the responses that used every one of `max_response_length` tokens, cut off rather than
    stopped. Their tokens are counted from `attention_mask` `[batch, prompt_len + response_len]` over the last
    `response_len` columns (`response_mask` `[batch, response_len]` gives the width), so a multi-turn trajectory's
    tool outputs, which `response_mask` leaves out, count towards its budget."""
    return attention_mask[:, -response_mask.shape[-1] :].sum(-1) >= max_response_length


def filter_overlong(response_mask: torch.Tensor, attention_mask: torch.Tensor, max_response_length: int):
    """`response_mask` `[batch, response_len]` with the rows of `truncated` responses zeroed: what the policy loss
    reads under overlong filtering."""
    keep = ~truncated(response_mask, attention_mask, max_response_length)
    return response_mask * keep[:, None].to(response_mask.dtype)
