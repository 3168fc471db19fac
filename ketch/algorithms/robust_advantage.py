"""`robust_compute_advantage`: run an advantage estimator on a batch with checks for non-finite numbers.

Steps: check `token_level_rewards` and `values` are finite at valid tokens → estimator → check its outputs
are finite → whiten over valid tokens (estimators registered whiten=True, when `normalize_advantage`) → clip.
The output check comes before whitening so that one bad sequence cannot spread NaN over the whole batch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Literal

import torch

from ketch.algorithms._checks import check_same_shape, format_rows, require
from ketch.algorithms.estimators import get_adv_estimator
from ketch.algorithms.masked import masked_whiten

if TYPE_CHECKING:
    from ketch.protocol import DataProto

_HINTS = {
    "token_level_rewards": "check the reward function (and the KL penalty) that produced them",
    "values": "check the critic (a diverged value head gives inf/NaN values)",
}
_WHO = "robust_compute_advantage"
_OR_ZERO = "or set algorithm.non_finite=zero to zero these entries and continue"


class NonFiniteError(ValueError):
    """A NaN or inf in the rewards, values or advantages of a batch; the message names where and what to do."""


def robust_compute_advantage(
    batch: DataProto,
    gamma: float = 1.0,
    lam: float = 1.0,
    clip_advantage: float | None = None,
    normalize_advantage: bool = True,
    estimator: str = "gae",
    norm_adv_by_std_in_grpo: bool = True,
    non_finite: Literal["raise", "zero"] = "raise",
) -> DataProto:
    """A new batch of the same class with `advantages` and `returns` `[batch, response_len]` added.

    Reads `batch.batch["token_level_rewards"]`, `["response_mask"]`, and when present `["values"]`,
    `["reward_baselines"]` and `batch.non_tensor_batch["uid"]` (the group ids). With `non_finite="raise"` a
    NaN/inf at a valid token raises `NonFiniteError`; with `"zero"` those entries are zeroed (the returned batch
    holds the zeroed rewards/values) and counted in `meta_info["non_finite_zeroed"]`.
    """
    adv_estimator = get_adv_estimator(estimator)
    _check_options(non_finite, clip_advantage)
    mask = require(batch.batch, "response_mask", _WHO, "1 for response tokens, 0 for padding")
    valid = mask.bool()
    cleaned, zeroed = _finite_inputs(batch.batch, valid, non_finite)
    group_ids = batch.non_tensor_batch.get("uid")
    advantages, returns = adv_estimator(
        cleaned["token_level_rewards"],
        mask,
        values=cleaned.get("values"),
        group_ids=group_ids,
        reward_baselines=batch.batch.get("reward_baselines"),
        gamma=gamma,
        lam=lam,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
    )
    bad = valid & ~(advantages.isfinite() & returns.isfinite())
    if non_finite == "raise" and bad.any():
        raise _bad_output_error(bad, estimator, group_ids)
    zeroed += int(bad.sum())
    advantages, returns = torch.where(valid & ~bad, advantages, 0), torch.where(valid & ~bad, returns, 0)
    if normalize_advantage and adv_estimator.whiten:
        advantages = masked_whiten(advantages, valid)
    if clip_advantage is not None:
        advantages = advantages.clamp(-clip_advantage, clip_advantage)
    return type(batch)(
        batch={**batch.batch, **cleaned, "advantages": advantages, "returns": returns},
        non_tensor_batch=dict(batch.non_tensor_batch),
        meta_info={**batch.meta_info, "non_finite_zeroed": zeroed},
    )


def _check_options(non_finite: str, clip_advantage: float | None) -> None:
    if non_finite not in ("raise", "zero"):
        raise ValueError(f"non_finite must be 'raise' or 'zero', got {non_finite!r}")
    if clip_advantage is not None and clip_advantage <= 0:
        raise ValueError(f"clip_advantage must be > 0 (or None to disable clipping), got {clip_advantage}")


def _finite_inputs(
    tensors: dict[str, torch.Tensor], valid: torch.Tensor, non_finite: str
) -> tuple[dict[str, torch.Tensor], int]:
    """`token_level_rewards` (and `values` when present) with non-finite valid entries zeroed, and their count.

    With `non_finite="raise"` a non-finite valid entry raises NonFiniteError instead.
    """
    rewards = require(tensors, "token_level_rewards", _WHO, "the reward of each response token")
    inputs = {"token_level_rewards": rewards} | ({"values": tensors["values"]} if "values" in tensors else {})
    check_same_shape(_WHO, **inputs, response_mask=valid)
    cleaned, zeroed = {}, 0
    for name, x in inputs.items():
        bad = valid & ~x.isfinite()
        count = int(bad.sum())
        if count and non_finite == "raise":
            raise NonFiniteError(
                f"{name} has {count} non-finite (NaN/inf) value(s) at valid response tokens in row(s) "
                f"{format_rows(bad.any(-1))}; {_HINTS[name]}, {_OR_ZERO}"
            )
        cleaned[name], zeroed = (torch.where(bad, 0, x) if count else x), zeroed + count
    return cleaned, zeroed


def _bad_output_error(bad: torch.Tensor, estimator: str, group_ids: Sequence[Hashable] | None) -> NonFiniteError:
    """The error for non-finite estimator outputs at the `[batch, response_len]` bool mask `bad`."""
    rows = bad.any(-1)
    groups = ""
    if group_ids is not None:
        uids = list(dict.fromkeys(group_ids[i] for i in rows.nonzero().flatten().tolist()))
        groups = f" (uid group(s) {uids[:8]})"
    return NonFiniteError(
        f"advantage estimator {estimator!r} produced {int(bad.sum())} non-finite advantage/return value(s) in "
        f"row(s) {format_rows(rows)}{groups} although token_level_rewards and values are finite. A zero-variance "
        "group (all scores equal) divided by a group std + eps of 0 does this in GRPO: keep eps > 0; otherwise "
        f"check the estimator's other inputs (e.g. reward_baselines for remax), {_OR_ZERO}"
    )
