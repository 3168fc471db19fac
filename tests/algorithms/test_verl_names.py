"""Functions named after verl's return what verl's namesakes return for the same inputs (numbers worked by hand
from verl's definitions; at masked tokens ketch gives 0)."""

import math

import numpy as np
import torch
from torch.testing import assert_close

from ketch.algorithms import (
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_policy_loss,
    compute_reinforce_pp_advantage,
    compute_reinforce_pp_baseline_advantage,
    get_adv_estimator,
    kl_penalty,
    policy_loss,
    robust_compute_advantage,
)
from ketch.protocol import DataProto


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def whiten(xs):
    """(x − mean) / sqrt(unbiased var + 1e-8), written out for the hand computations below."""
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


def test_compute_gae_advantage_return_whitens_advantages_and_keeps_raw_returns():
    # GAE (gamma 0.9, lam 0.8) of rewards [0, 0, 1], values [0.5, 0.6, 0.7] is [0.21712, 0.246, 0.3]
    # (tests/algorithms/test_estimators.py); returns = GAE + values; advantages whitened over valid tokens:
    # mean 0.254373, unbiased var 0.00176986 → [−0.88551, −0.19903, 1.08455]
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = compute_gae_advantage_return(t([[0, 0, 1, 0]]), t([[0.5, 0.6, 0.7, 9]]), mask, 0.9, 0.8)
    assert_close(adv, t([[-0.88551, -0.19903, 1.08455, 0]]), atol=1e-4, rtol=0)
    assert_close(ret, t([[0.71712, 0.846, 1.0, 0]]))


def test_compute_grpo_outcome_advantage_uses_verls_argument_names_and_group_of_one_rule():
    # groups a: [1, 3] → mean 2, std sqrt(2); lone b: 5 → (5 − 0) / (1 + eps)
    index = np.array(["a", "b", "a"], dtype=object)
    adv, ret = compute_grpo_outcome_advantage(t([[1.0], [5.0], [3.0]]), torch.ones(3, 1), index, epsilon=1e-6)
    a = 1 / (math.sqrt(2) + 1e-6)
    assert_close(adv, t([[-a], [5 / (1 + 1e-6)], [a]]))
    assert_close(ret, adv)
    adv, _ = compute_grpo_outcome_advantage(t([[1.0], [5.0], [3.0]]), torch.ones(3, 1), index, 1e-6, False)
    assert_close(adv, t([[-1.0], [5.0], [1.0]]))


def test_compute_reinforce_pp_advantage_equals_the_registered_estimator_after_whitening():
    rewards, mask = t([[0, 0, 1, 0], [0, 2, 0, 0]]), torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    batch = DataProto.from_dict({"token_level_rewards": rewards, "response_mask": mask})
    robust = robust_compute_advantage(batch, gamma=0.9, estimator="reinforce_plus_plus")
    adv, ret = compute_reinforce_pp_advantage(rewards, mask, gamma=0.9)
    # returns row 0 [0.81, 0.9, 1], row 1 [1.8, 2]; whitened over the five valid tokens
    expected = whiten([0.81, 0.9, 1.0, 1.8, 2.0])
    assert_close(adv, t([[*expected[:3], 0], [*expected[3:], 0, 0]]), atol=1e-5, rtol=0)
    assert_close(robust.batch["advantages"], adv)
    assert_close(ret, t([[0.81, 0.9, 1.0, 0], [1.8, 2.0, 0, 0]]))


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_whitens_over_the_batch():
    # groups a: [1, 2, 3] → [−1, 0, 1]; b: [0, 4] → [−2, 2]; lone c: 0.7 stays 0.7 (mean 0)
    # two-token responses, the score on the last valid token; row 3 has one valid token
    ids = np.array(["a", "b", "a", "b", "a", "c"], dtype=object)
    rewards = t([[0, 1], [0, 0], [0, 2], [4, 0], [0, 3], [0, 0.7]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0], [1, 1], [1, 1]])
    centered = [-1, -2, 0, 2, 1, 0.7]
    tokens = [c for c, n in zip(centered, [2, 2, 2, 1, 2, 2], strict=True) for _ in range(n)]
    w = iter(whiten(tokens))
    expected = [[next(w) if m else 0.0 for m in row] for row in mask.tolist()]
    adv, ret = compute_reinforce_pp_baseline_advantage(rewards, mask, ids)
    assert_close(adv, t(expected), atol=1e-5, rtol=0)
    assert_close(ret, adv)
    batch = DataProto.from_dict({"token_level_rewards": rewards, "response_mask": mask}, non_tensors={"uid": ids})
    robust = robust_compute_advantage(batch, estimator="reinforce_plus_plus_baseline")
    assert_close(robust.batch["advantages"], adv)
    assert get_adv_estimator("reinforce_plus_plus_baseline").whiten


def test_reinforce_pp_baseline_gives_no_nan_for_all_equal_groups_and_zero_for_an_all_equal_batch():
    ids = ["a", "a", "b", "b"]
    adv, _ = compute_reinforce_pp_baseline_advantage(t([[1.0], [1.0], [0.0], [2.0]]), torch.ones(4, 1), ids)
    expected = whiten([0.0, 0.0, -1.0, 1.0])  # group a centres to 0, b to ±1; whitened over the batch
    assert_close(adv, t([[x] for x in expected]), atol=1e-5, rtol=0)
    adv, _ = compute_reinforce_pp_baseline_advantage(t([[1.0], [1.0]]), torch.ones(2, 1), ["a", "a"])
    assert (adv == 0).all()


def test_ppo_kl_uses_the_log_ratio_clamped_to_20():
    # one token with log-ratio 50: verl clamps it to 20 before the metric, so ppo_kl = −20, not −50
    _, metrics = policy_loss(torch.zeros(1, 2), t([[50.0, 1.0]]), torch.ones(1, 2), torch.tensor([[1, 0]]))
    assert_close(metrics["ppo_kl"], torch.tensor(-20.0))


def test_compute_policy_loss_returns_verls_tuple_with_dual_clip_on_by_default():
    # A=−1 r=5 → max(5, 1.2) = 5 capped at c = 3; A=−1 r=2 → 2; A=+1 r=5 → max(−5, −1.2) = −1.2 (clipped)
    old, new = torch.zeros(1, 3), t([[math.log(5), math.log(2), math.log(5)]])
    loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(old, new, t([[-1, -1, 1]]), torch.ones(1, 3), 0.2)
    assert_close(loss, torch.tensor((3.0 + 2.0 - 1.2) / 3))
    assert_close(clipfrac, torch.tensor(1 / 3))
    assert_close(clipfrac_lower, torch.tensor(1 / 3))
    assert_close(ppo_kl, torch.tensor(-(2 * math.log(5) + math.log(2)) / 3))


def test_kl_penalty_plus_kinds_have_the_estimators_value_and_the_k2_gradient():
    log_prob, ref = torch.tensor([[0.5]], requires_grad=True), torch.zeros(1, 1)
    value = kl_penalty(log_prob, ref, "k3+")
    value.sum().backward()
    assert_close(value, torch.tensor([[math.exp(-0.5) + 0.5 - 1]]))  # k3 = exp(−d) + d − 1, d = 0.5
    assert_close(log_prob.grad, torch.tensor([[0.5]]))  # d/dd of d²/2
