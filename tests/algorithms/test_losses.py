"""Loss reduction, PPO policy and value losses, entropy, and the policy-loss registry."""

import math
import uuid

import pytest
import torch
from torch.testing import assert_close

from ketch.algorithms import (
    AGG_MODES,
    agg_loss,
    entropy_from_logits,
    get_policy_loss,
    policy_loss,
    register_policy_loss,
    value_loss,
)

# ----------------------------------------------------------------------------- agg_loss
# row 0 valid 1, 2 (sum 3, mean 1.5); row 1 valid 4, 5, 6 (sum 15, mean 5); row 2 has no valid token (NaN padding)
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [float("nan"), 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 18 / 5),  # (1 + 2 + 4 + 5 + 6) / 5 valid tokens
        ("seq-mean-token-sum", 9.0),  # (3 + 15) / 2 rows with a valid token: the third has none
        ("seq-mean-token-mean", 6.5 / 2),  # (1.5 + 5) / 2
        ("seq-mean-token-sum-norm", 3.0),  # (3/3 + 15/3) / 2, normalised by the padded length 3
    ],
)
def test_each_agg_mode_ignores_padding_and_rows_without_a_valid_token(mode, expected):
    assert_close(agg_loss(LOSS, MASK, mode), torch.tensor(expected))


def test_seq_modes_divide_by_the_given_count_of_sequences():
    # a global count of sequences from the engine: (3 + 15) / 3
    assert_close(agg_loss(LOSS, MASK, "seq-mean-token-sum", num_seqs=3), torch.tensor(6.0))


def test_seq_mean_token_sum_norm_takes_a_norm_constant():
    # (3/2 + 15/2) / 2
    assert_close(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_constant=2), torch.tensor(4.5))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_no_valid_token_gives_zero_loss_not_nan(mode):
    loss_mat = torch.ones(2, 3, requires_grad=True)
    loss = agg_loss(loss_mat, torch.zeros(2, 3), mode)
    loss.backward()
    assert loss.item() == 0.0 and (loss_mat.grad == 0).all()


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_with_global_counts_sum_to_the_full_batch_loss(mode):
    generator = torch.Generator().manual_seed(0)
    loss_mat = torch.randn(5, 4, generator=generator)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]])
    counts = {"num_tokens": mask.sum(), "num_seqs": (mask.sum(-1) > 0).sum()}
    parts = [slice(0, 1), slice(1, 3), slice(3, 5)]  # uneven split, one micro-batch holds the empty row
    summed = sum(agg_loss(loss_mat[p], mask[p], mode, **counts) for p in parts)
    assert_close(summed, agg_loss(loss_mat, mask, mode, **counts))


def test_unknown_agg_mode_lists_the_modes():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'sum'; choose one of token-mean, seq-mean-token-sum"):
        agg_loss(LOSS, MASK, "sum")


# ----------------------------------------------------------------------------- policy loss
def ratios(*values):
    """old_log_prob 0 and log_prob log(r): the ratio is r."""
    log_prob = torch.tensor([[math.log(v) for v in values]])
    return torch.zeros_like(log_prob), log_prob


def test_ppo_clipped_surrogate_and_clipfrac():
    # A=+1 r=1.5: max(−1.5, −1.2) = −1.2 clipped; A=+1 r=0.5: max(−0.5, −0.8) = −0.5
    # A=−1 r=0.5: max(0.5, 0.8) = 0.8 clipped;  A=−1 r=1.1: max(1.1, 1.1) = 1.1 (tie: not clipped)
    old, new = ratios(1.5, 0.5, 0.5, 1.1)
    loss, metrics = policy_loss(old, new, torch.tensor([[1.0, 1.0, -1.0, -1.0]]), torch.ones(1, 4))
    assert_close(loss, torch.tensor((-1.2 - 0.5 + 0.8 + 1.1) / 4))
    assert_close(metrics["pg_clipfrac"], torch.tensor(0.5))
    assert_close(metrics["pg_clipfrac_lower"], torch.tensor(0.0))
    # ppo_kl = mean(old − new) = −log(1.5·0.5·0.5·1.1) / 4 = −log(0.4125) / 4
    assert_close(metrics["ppo_kl"], torch.tensor(-math.log(0.4125) / 4))


def test_asymmetric_clip_range_bounds_each_side_separately():
    # low 0.2, high 0.28: A=+1 r=1.5 → −1.28; A=−1 r=0.75 → max(0.75, 0.8) = 0.8; both clipped
    old, new = ratios(1.5, 0.75)
    loss, metrics = policy_loss(old, new, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), 0.2, 0.28)
    assert_close(loss, torch.tensor((-1.28 + 0.8) / 2))
    assert_close(metrics["pg_clipfrac"], torch.tensor(1.0))


def test_dual_clip_caps_the_loss_of_negative_advantages():
    # c = 3: A=−1 r=5: max(5, 1.2) = 5 → capped at 3; A=−1 r=2: 2 < 3 kept; A=+1 r=5: max(−5, −1.2) = −1.2
    old, new = ratios(5.0, 2.0, 5.0)
    loss, metrics = policy_loss(old, new, torch.tensor([[-1.0, -1.0, 1.0]]), torch.ones(1, 3), clip_ratio_c=3.0)
    assert_close(loss, torch.tensor((3.0 + 2.0 - 1.2) / 3))
    assert_close(metrics["pg_clipfrac"], torch.tensor(1 / 3))
    assert_close(metrics["pg_clipfrac_lower"], torch.tensor(1 / 3))


def test_dual_clip_bound_must_exceed_one():
    old, new = ratios(1.0)
    with pytest.raises(ValueError, match=r"clip_ratio_c .* must be > 1 for dual clip, or None; got 0.5"):
        policy_loss(old, new, torch.ones(1, 1), torch.ones(1, 1), clip_ratio_c=0.5)


def test_policy_loss_ignores_masked_tokens_and_stays_finite_for_huge_log_ratios():
    # the log-ratio 50 is clamped to 20 before exp; the masked token's NaN advantage is ignored
    old, new = torch.zeros(1, 2), torch.tensor([[50.0, 0.0]], requires_grad=True)
    loss, _ = policy_loss(old, new, torch.tensor([[-1.0, float("nan")]]), torch.tensor([[1, 0]]))
    loss.backward()
    assert_close(loss, torch.tensor(math.exp(20)))
    assert new.grad.isfinite().all()


def test_policy_loss_gradients_do_not_depend_on_the_micro_batch_split():
    generator = torch.Generator().manual_seed(1)
    old = torch.randn(4, 3, generator=generator)
    adv = torch.randn(4, 3, generator=generator)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 1, 1]])
    full = (old + 0.3 * torch.randn(4, 3, generator=generator)).requires_grad_()
    policy_loss(old, full, adv, mask)[0].backward()
    split = full.detach().clone().requires_grad_()
    for rows in (slice(0, 1), slice(1, 4)):
        policy_loss(old[rows], split[rows], adv[rows], mask[rows], num_tokens=int(mask.sum()))[0].backward()
    assert_close(split.grad, full.grad)


# ----------------------------------------------------------------------------- value loss
def test_clipped_value_loss_and_clipfrac():
    # R = 1, old = 0.5, c = 0.2:
    #   v=1.0: (0)², clip → 0.7: (0.3)² = 0.09 → 0.5·0.09 = 0.045 (clipped)
    #   v=0.6: (0.4)² = 0.16 both → 0.08;  v=0.0: 1 vs clip → 0.3: 0.49 → 0.5·1 = 0.5
    vpreds = torch.tensor([[1.0, 0.6, 0.0, 9.0]])
    returns, old_values, mask = torch.ones(1, 4), torch.full((1, 4), 0.5), torch.tensor([[1, 1, 1, 0]])
    loss, metrics = value_loss(vpreds, returns, old_values, mask, cliprange_value=0.2)
    assert_close(loss, torch.tensor((0.045 + 0.08 + 0.5) / 3))
    assert_close(metrics["vf_clipfrac"], torch.tensor(1 / 3))


def test_value_loss_gradient_ignores_nan_returns_in_padding():
    vpreds = torch.tensor([[0.5, 0.0]], requires_grad=True)
    returns = torch.tensor([[1.0, float("nan")]])
    loss, _ = value_loss(vpreds, returns, torch.zeros(1, 2), torch.tensor([[1, 0]]), cliprange_value=10.0)
    loss.backward()
    # 0.5·(0.5 − 1)² = 0.125; d/dv = v − R = −0.5
    assert_close(loss, torch.tensor(0.125))
    assert_close(vpreds.grad, torch.tensor([[-0.5, 0.0]]))


# ----------------------------------------------------------------------------- entropy
def test_entropy_of_uniform_and_skewed_distributions():
    # uniform over 4: log 4; p = [1/4, 3/4] from logits [0, log 3]: −(¼ log ¼ + ¾ log ¾) = 0.5623351
    skewed = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert_close(entropy_from_logits(torch.zeros(1, 4)), torch.tensor([math.log(4)]))
    assert_close(entropy_from_logits(torch.tensor([[0.0, math.log(3)]])), torch.tensor([skewed]))


def test_entropy_is_stable_for_huge_logits():
    assert_close(entropy_from_logits(torch.tensor([[1000.0, 1000.0], [1e4, -1e4]])), torch.tensor([math.log(2), 0.0]))


# ----------------------------------------------------------------------------- registry
def test_vanilla_policy_loss_is_policy_loss_called_with_keyword_settings():
    old, new = ratios(1.5, 0.5)
    advantages, mask = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    settings = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "gspo_clip_ratio_low": 3e-4, "num_seqs": None}
    loss, _ = get_policy_loss("vanilla")(old, new, advantages, mask, **settings)
    assert_close(loss, policy_loss(old, new, advantages, mask, 0.2, 0.28)[0])
    assert_close(loss, torch.tensor((-1.28 + 0.8) / 2))


def test_a_user_policy_loss_can_be_registered_and_unknown_names_are_listed():
    name = f"reinforce-{uuid.uuid4().hex}"

    @register_policy_loss(name)
    def reinforce(old_log_prob, log_prob, advantages, response_mask, **kwargs):
        return -(advantages * log_prob).mean(), {}

    assert get_policy_loss(name) is reinforce
    listing = r"unknown policy loss \(actor.policy_loss\) 'clipped'; registered: .*cispo, gspo, gspo_token, .*vanilla"
    with pytest.raises(ValueError, match=listing):
        get_policy_loss("clipped")
