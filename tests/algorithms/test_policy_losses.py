"""GSPO, GSPO-token and CISPO against numbers worked by hand from the papers' formulas."""

import math

import pytest
import torch
from torch.testing import assert_close

from ketch.algorithms import cispo_loss, get_policy_loss, gspo_loss, gspo_token_loss, policy_loss

NAN = float("nan")


def leaf(rows):
    return torch.tensor(rows, requires_grad=True)


# ----------------------------------------------------------------------------- GSPO (sequence level)
# log_prob − old_log_prob per token; row 0's third token is masked (its 5.0 and NaN advantage are ignored)
# row 0: [0.2, −0.1] → log s = 0.05, s = 1.0512711, A = 1: inside [0.8, 1.2] → loss −1.0512711
# row 1: [0.6, 0.6, 0.6] → s = e^0.6 = 1.8221188, A = 1: clipped to 1.2 → loss max(−1.822, −1.2) = −1.2
# row 2: [−1.0] → s = e^−1 = 0.3678794, A = −1: clipped to 0.8 → loss max(0.3679, 0.8) = 0.8
LOG_RATIO = [[0.2, -0.1, 5.0], [0.6, 0.6, 0.6], [-1.0, 0.0, 0.0]]
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
SEQ_ADV = torch.tensor([[1.0, 1.0, NAN], [1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]])
WIDE = {"gspo_clip_ratio_low": 0.2, "gspo_clip_ratio_high": 0.2}


def test_gspo_clips_the_length_normalised_sequence_ratio():
    log_prob = leaf(LOG_RATIO)
    loss, metrics = gspo_loss(torch.zeros(3, 3), log_prob, SEQ_ADV, MASK, loss_agg_mode="seq-mean-token-mean", **WIDE)
    assert_close(loss, torch.tensor((-1.0512711 - 1.2 + 0.8) / 3))
    # the 4 valid tokens of the two clipped sequences out of 6 valid tokens
    assert_close(metrics["pg_clipfrac"], torch.tensor(4 / 6))
    assert_close(metrics["ppo_kl"], torch.tensor(-(0.2 - 0.1 + 1.8 - 1.0) / 6))
    loss.backward()
    # only row 0 is unclipped: d(−A·s)/d log_prob_t = −s / |y| per token, over 3 sequences: −1.0512711 / 6
    expected = [[-1.0512711 / 6, -1.0512711 / 6, 0], [0, 0, 0], [0, 0, 0]]
    assert_close(log_prob.grad, torch.tensor(expected))


def test_gspo_default_range_is_the_papers_3e_4_and_4e_4():
    # row 0 alone: s = 1.0512711 is clipped to 1 + 4e-4
    loss, metrics = gspo_loss(torch.zeros(1, 3), torch.tensor(LOG_RATIO[:1]), SEQ_ADV[:1], MASK[:1])
    assert_close(loss, torch.tensor(-1.0004))
    assert_close(metrics["pg_clipfrac"], torch.tensor(1.0))


def test_gspo_token_equals_gspo_in_value_and_gradient_for_one_advantage_per_sequence():
    generator = torch.Generator().manual_seed(3)
    old = torch.randn(4, 5, generator=generator) * 0.05 - 1
    new_a = (old + torch.randn(4, 5, generator=generator) * 0.05).requires_grad_()
    new_b = new_a.detach().clone().requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    advantages = torch.tensor([1.0, -0.5, 2.0, 0.3])[:, None].expand(4, 5)
    settings = {"loss_agg_mode": "seq-mean-token-mean", "gspo_clip_ratio_low": 0.02, "gspo_clip_ratio_high": 0.03}
    loss_a, _ = gspo_loss(old, new_a, advantages, mask, **settings)
    loss_b, _ = gspo_token_loss(old, new_b, advantages, mask, **settings)
    (loss_a + loss_b).backward()
    assert_close(loss_a, loss_b)
    assert_close(new_a.grad, new_b.grad)


def test_gspo_token_takes_each_tokens_own_advantage():
    # log-ratios [0.1, −0.1] → s = 1 for both tokens; A = [2, −1] → per-token loss [−2, 1], mean −0.5;
    # the gradient of token t is −A_t·s/|y| = [−1, 0.5]; sequence-level GSPO uses mean(A) = 0.5 for both: −0.25
    token, seq = leaf([[0.1, -0.1]]), leaf([[0.1, -0.1]])
    advantages, mask = torch.tensor([[2.0, -1.0]]), torch.ones(1, 2)
    loss_token, _ = gspo_token_loss(torch.zeros(1, 2), token, advantages, mask, **WIDE)
    loss_seq, _ = gspo_loss(torch.zeros(1, 2), seq, advantages, mask, **WIDE)
    (loss_token + loss_seq).backward()
    assert_close(loss_token, torch.tensor(-0.5))
    assert_close(token.grad, torch.tensor([[-1.0, 0.5]]))
    assert_close(loss_seq, torch.tensor(-0.5))
    assert_close(seq.grad, torch.tensor([[-0.25, -0.25]]))


def test_gspo_token_ignores_a_masked_token_in_the_sequence_ratio():
    # valid log-ratios [0.3, −0.1] (the masked 4.0 is ignored): log s = 0.1, s = 1.1051709 for both tokens;
    # A = [1, 2] inside [0.8, 1.2] → per-token loss [−1.1051709, −2.2103418], seq-mean-token-mean: −1.6577564;
    # gradient −A_t·s / 2 = [−0.5525855, −1.1051709], 0 at the masked token
    log_prob = leaf([[0.3, -0.1, 4.0]])
    loss, _ = gspo_token_loss(torch.zeros(1, 3), log_prob, torch.tensor([[1.0, 2.0, NAN]]), MASK[:1], **WIDE)
    loss.backward()
    assert_close(loss, torch.tensor(-1.6577564))
    assert_close(log_prob.grad, torch.tensor([[-0.5525855, -1.1051709, 0.0]]))


@pytest.mark.parametrize("name", ["vanilla", "gspo", "gspo_token", "cispo"])
def test_an_all_equal_group_adds_no_loss_and_no_gradient(name):
    # an all-equal group (or a group of one under dynamic sampling's filter) has advantages 0 on every token;
    # the second sequence's masked token holds garbage (NaN advantage, huge log-ratio) that must not leak
    log_prob = leaf([[-0.5, -1.5], [-2.0, 30.0]])
    advantages, mask = torch.tensor([[0.0, 0.0], [0.0, NAN]]), torch.tensor([[1, 1], [1, 0]])
    loss, _ = get_policy_loss(name)(torch.full((2, 2), -1.0), log_prob, advantages, mask, loss_agg_mode="token-mean")
    loss.backward()
    assert loss.item() == 0.0
    assert (log_prob.grad == 0).all()


def test_gspo_with_no_valid_token_gives_zero_not_nan():
    log_prob = leaf([[0.3, 0.3]])
    loss, metrics = gspo_loss(torch.zeros(1, 2), log_prob, torch.ones(1, 2), torch.zeros(1, 2))
    loss.backward()
    assert loss.item() == 0.0 and (log_prob.grad == 0).all() and metrics["ppo_kl"].item() == 0.0


# ----------------------------------------------------------------------------- CISPO
# old_log_prob −1, ratios [1.5, 0.5, 1.1], A = [1, −1, 1], range [0.8, 1.28]: weights r̂ = [1.28, 0.8, 1.1];
# log_prob = −1 + ln r = [−0.5945349, −1.6931472, −0.9046898]; the fourth token is masked
CISPO_LOG_PROB = [[-1 + math.log(1.5), -1 + math.log(0.5), -1 + math.log(1.1), 7.0]]
CISPO_ADV = torch.tensor([[1.0, -1.0, 1.0, NAN]])
CISPO_MASK = torch.tensor([[1, 1, 1, 0]])


def test_cispo_weights_log_prob_by_the_clipped_detached_ratio():
    log_prob = leaf(CISPO_LOG_PROB)
    old = torch.full((1, 4), -1.0)
    loss, metrics = cispo_loss(old, log_prob, CISPO_ADV, CISPO_MASK, clip_ratio_low=0.2, clip_ratio_high=0.28)
    # −r̂·A·log_prob per token: 1.28·0.5945349 = 0.7610047, −0.8·1.6931472 = −1.3545177, 1.1·0.9046898 = 0.9951588
    assert_close(loss, torch.tensor((0.7610047 - 1.3545177 + 0.9951588) / 3))
    assert_close(metrics["pg_clipfrac"], torch.tensor(2 / 3))
    loss.backward()
    # every token keeps a gradient −r̂·A / 3, also the two whose ratio was clipped
    assert_close(log_prob.grad, torch.tensor([[-1.28 / 3, 0.8 / 3, -1.1 / 3, 0.0]]))


def test_cispo_keeps_the_gradient_that_ppo_clipping_drops():
    old = torch.full((1, 4), -1.0)
    ppo_log_prob = leaf(CISPO_LOG_PROB)
    ppo_adv = torch.where(CISPO_MASK.bool(), CISPO_ADV, 0)
    policy_loss(old, ppo_log_prob, ppo_adv, CISPO_MASK, 0.2, 0.28)[0].backward()
    # PPO: the tokens with r = 1.5 (A > 0) and r = 0.5 (A < 0) are clipped and get no gradient; r = 1.1 gets −r·A/3
    assert_close(ppo_log_prob.grad, torch.tensor([[0.0, 0.0, -1.1 / 3, 0.0]]))


@pytest.mark.parametrize("name", ["vanilla", "gspo", "gspo_token", "cispo"])
def test_every_registered_loss_applies_rollout_is_weights_to_each_token(name):
    # ratio 1 everywhere (nothing clipped), A = 1, log_prob −1: the per-token loss is −r·A = −1 (CISPO:
    # −r̂·A·log_prob = 1); weighted by [2, 0.5], token-mean: (2 + 0.5)·per_token / 2
    fn = get_policy_loss(name)
    old = torch.full((1, 2), -1.0)
    settings = {"loss_agg_mode": "token-mean", "rollout_is_weights": torch.tensor([[2.0, 0.5]])}
    loss, _ = fn(old, old.clone(), torch.ones(1, 2), torch.ones(1, 2), **settings)
    per_token = 1.0 if name == "cispo" else -1.0
    assert_close(loss, torch.tensor(2.5 * per_token / 2))
