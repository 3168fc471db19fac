"""DAPO's soft overlong punishment (Yu et al. 2025, https://arxiv.org/abs/2503.14476, eq. 13).

With L_max = max_response_length and a buffer of L_cache tokens, a response of |y| tokens gets

    0                                  if |y| <= L_max − L_cache
    ((L_max − L_cache) − |y|) / L_cache   if L_max − L_cache < |y| <= L_max

times `penalty_factor`, added to its score: a response that runs into the budget is pushed towards shorter
ones gradually instead of by a cliff. (The paper's −1 beyond L_max cannot happen here: the rollout stops at
L_max, so a cut-off response gets the full −penalty_factor.)
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
