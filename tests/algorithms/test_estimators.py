"""Advantage estimators against hand-computed numbers, and the estimator registry."""

import math
import uuid

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from ketch.algorithms import (
    compute_gae,
    compute_grpo_advantage,
    compute_reinforce_pp_advantage,
    compute_remax_advantage,
    compute_rloo_advantage,
    get_adv_estimator,
    register_adv_estimator,
)

# GAE, gamma = 0.9, lam = 0.8, rewards [0, 0, 1], values [0.5, 0.6, 0.7]; the value after the end is 0:
#   t=2: delta = 1 + 0.9*0 - 0.7 = 0.3                 A = 0.3
#   t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03              A = 0.03 + 0.72*0.3 = 0.246
#   t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04              A = 0.04 + 0.72*0.246 = 0.21712
#   returns = A + V = [0.71712, 0.846, 1.0]
GAE_ADV = [0.21712, 0.246, 0.3]
GAE_RET = [0.71712, 0.846, 1.0]


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


# ----------------------------------------------------------------------------- GAE
def test_gae_matches_hand_computation():
    adv, ret = compute_gae(t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]]), torch.ones(1, 3), gamma=0.9, lam=0.8)
    assert_close(adv, t([GAE_ADV]))
    assert_close(ret, t([GAE_RET]))


def test_gae_skips_a_masked_token_in_the_middle_as_if_it_did_not_exist():
    # the masked token's reward 9 and value 99 are ignored; the numbers equal the unmasked 3-token case
    mask = torch.tensor([[1, 0, 1, 1]])
    adv, ret = compute_gae(t([[0, 9, 0, 1]]), t([[0.5, 99, 0.6, 0.7]]), mask, gamma=0.9, lam=0.8)
    assert_close(adv, t([[0.21712, 0, 0.246, 0.3]]))
    assert_close(ret, t([[0.71712, 0, 0.846, 1.0]]))


def test_gae_ends_the_episode_at_the_last_valid_token():
    # padding at the end: its reward 5 and value 9 do not bootstrap the last valid token
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = compute_gae(t([[0, 0, 1, 5]]), t([[0.5, 0.6, 0.7, 9]]), mask, gamma=0.9, lam=0.8)
    assert_close(adv, t([[*GAE_ADV, 0]]))
    assert_close(ret, t([[*GAE_RET, 0]]))


def test_gae_rows_are_independent():
    # row 1: one token, delta = 2 - 0.5 = 1.5
    rewards, values = t([[0, 0, 1], [2, 0, 0]]), t([[0.5, 0.6, 0.7], [0.5, 3, 3]])
    adv, _ = compute_gae(rewards, values, torch.tensor([[1, 1, 1], [1, 0, 0]]), gamma=0.9, lam=0.8)
    assert_close(adv, t([GAE_ADV, [1.5, 0, 0]]))


def test_gae_rejects_mismatched_shapes_naming_them():
    with pytest.raises(ValueError, match=r"compute_gae: got token_level_rewards \(1, 3\), values \(1, 2\)"):
        compute_gae(torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1, 3), 1.0, 1.0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.floats(-5, 5), st.floats(-5, 5)), min_size=1, max_size=5),
    st.lists(st.integers(0, 2), min_size=6, max_size=6),
    st.floats(0, 1),
    st.floats(0, 1),
)
def test_gae_is_unchanged_by_masked_tokens_inserted_anywhere(tokens, gaps, gamma, lam):
    compact = torch.tensor([tokens], dtype=torch.float64)  # [1, n, (reward, value)]
    expected, _ = compute_gae(compact[..., 0], compact[..., 1], torch.ones(1, len(tokens)), gamma, lam)
    garbage = (1e3, -1e3)
    padded, mask = [], []
    for gap, token in zip(gaps, [*tokens, None], strict=False):
        padded += [garbage] * gap + ([token] if token else [])
        mask += [False] * gap + ([True] if token else [])
    padded, mask = torch.tensor([padded], dtype=torch.float64), torch.tensor([mask])
    adv, _ = compute_gae(padded[..., 0], padded[..., 1], mask, gamma, lam)
    assert_close(adv[mask], expected[0])
    assert (adv[~mask] == 0).all()


# ----------------------------------------------------------------------------- REINFORCE++ and ReMax
def test_reinforce_pp_whitens_the_discounted_return_to_go():
    # gamma 0.9, rewards [0, 0, 1]: returns [0.81, 0.9, 1]; mean 0.903333, deviations −0.093333, −0.003333,
    # 0.096667; unbiased variance (0.0087111 + 0.0000111 + 0.0093444) / 2 = 0.0090333, std 0.0950438
    adv, ret = compute_reinforce_pp_advantage(t([[0, 0, 1]]), torch.ones(1, 3), gamma=0.9)
    assert_close(ret, t([[0.81, 0.9, 1.0]]))
    assert_close(adv, t([[-0.98200, -0.03507, 1.01707]]), atol=1e-4, rtol=0)


def test_reinforce_pp_skips_masked_tokens_in_the_middle_and_at_the_end():
    # gamma 0.5 over valid rewards [1, 0, 2]: [1 + 0.5*1, 0 + 0.5*2, 2] = [1.5, 1, 2]; whitened: mean 1.5,
    # unbiased std sqrt((0 + 0.25 + 0.25) / 2) = 0.5 → [0, −1, 1]; masked tokens 0
    mask = torch.tensor([[1, 0, 1, 1, 0]])
    adv, ret = compute_reinforce_pp_advantage(t([[1, 7, 0, 2, 7]]), mask, gamma=0.5)
    assert_close(ret, t([[1.5, 0, 1, 2, 0]]))
    assert_close(adv, t([[0, 0, -1, 1, 0]]), atol=1e-6, rtol=0)


def test_remax_subtracts_the_greedy_baseline_from_the_return_to_go():
    # row 0: return-to-go [1, 1, 1] − 0.5; row 1: [1, 1, (masked 3 ignored)] − 0.25
    rewards, mask = t([[0, 0, 1], [0, 1, 3]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_remax_advantage(rewards, t([0.5, 0.25]), mask)
    assert_close(adv, t([[0.5, 0.5, 0.5], [0.75, 0.75, 0]]))
    assert_close(ret, t([[1, 1, 1], [1, 1, 0]]))


def test_remax_rejects_a_baseline_per_token():
    with pytest.raises(ValueError, match=r"reward_baselines has shape \(2, 3\), expected \[batch\] = \(2,\)"):
        compute_remax_advantage(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3))


# ----------------------------------------------------------------------------- GRPO and RLOO
# one-token responses; groups a: [1, 2, 3], b: [0, 4], c: [0.7] (interleaved rows)
IDS = np.array(["a", "b", "a", "b", "a", "c"], dtype=object)
SCORES = t([[1], [0], [2], [4], [3], [0.7]])
ONE = torch.ones(6, 1)


def test_grpo_normalises_by_group_mean_and_unbiased_std():
    # a: mean 2, std sqrt((1 + 0 + 1) / 2) = 1; b: mean 2, std sqrt((4 + 4) / 1) = sqrt(8); c alone: mean 0, std 1
    adv, ret = compute_grpo_advantage(SCORES, ONE, IDS)
    b = 2 / (math.sqrt(8) + 1e-6)
    assert_close(adv, t([[-1 / (1 + 1e-6)], [-b], [0], [b], [1 / (1 + 1e-6)], [0.7 / (1 + 1e-6)]]))
    assert_close(ret, adv)


def test_dr_grpo_only_subtracts_the_group_mean():
    adv, _ = compute_grpo_advantage(SCORES, ONE, IDS, norm_by_std=False)
    assert_close(adv, t([[-1], [-2], [0], [2], [1], [0.7]]))


def test_grpo_scores_sum_valid_tokens_and_broadcast_over_them():
    # scores 0 + 1 = 1 (masked 5 ignored) and 3; mean 2, std sqrt(2): ±1/sqrt(2) on valid tokens only
    adv, _ = compute_grpo_advantage(t([[0, 1, 5], [0, 0, 3]]), torch.tensor([[1, 1, 0], [1, 1, 1]]), ["g", "g"])
    a = 1 / (math.sqrt(2) + 1e-6)
    assert_close(adv, t([[-a, -a, 0], [a, a, a]]))


def test_grpo_group_of_one_uses_mean_0_and_std_1():
    adv, _ = compute_grpo_advantage(t([[0, 0.3], [0.4, 0]]), torch.ones(2, 2), ["x", "y"], eps=0.5)
    assert_close(adv, t([[0.2, 0.2], [0.4 / 1.5, 0.4 / 1.5]]))  # score / (1 + eps)
    adv, _ = compute_grpo_advantage(t([[0, 0.3], [0.4, 0]]), torch.ones(2, 2), ["x", "y"], norm_by_std=False)
    assert_close(adv, t([[0.3, 0.3], [0.4, 0.4]]))  # Dr. GRPO: score − 0


def test_grpo_and_rloo_give_exactly_zero_when_a_group_scores_all_equal():
    # 0.1 + 0.2 is not exactly 0.3 in float; the deviation from the group mean must still be exactly 0
    rewards = t([[0.1, 0.2]] * 3)
    for compute in (compute_grpo_advantage, compute_rloo_advantage):
        adv, _ = compute(rewards, torch.ones(3, 2), ["u", "u", "u"])
        assert (adv == 0).all(), compute.__name__


def test_dr_grpo_gives_exactly_zero_for_an_all_equal_group_and_ignores_masked_tokens():
    # group u scores 0.1 + 0.2 three times (all equal → exactly 0, no division by a zero std to guard);
    # group v: 1 (the masked 9 is ignored) and 0 → mean 0.5, advantages ±0.5 on the valid tokens only
    rewards = t([[0.1, 0.2]] * 3 + [[1, 9], [0, 0]])
    mask = torch.tensor([[1, 1]] * 3 + [[1, 0], [1, 1]])
    adv, _ = compute_grpo_advantage(rewards, mask, ["u", "u", "u", "v", "v"], norm_by_std=False)
    assert_close(adv, t([[0, 0]] * 3 + [[0.5, 0], [-0.5, -0.5]]))
    assert (adv[:3] == 0).all()


def test_rloo_scores_sum_valid_tokens_and_broadcast_over_them():
    # scores 1 (masked 5 ignored), 2, 6: leave-one-out baselines 4, 3.5, 1.5 → −3, −1.5, 4.5 on valid tokens
    rewards, mask = t([[1, 5], [0, 2], [6, 0]]), torch.tensor([[1, 0], [1, 1], [1, 1]])
    adv, _ = compute_rloo_advantage(rewards, mask, ["g", "g", "g"])
    assert_close(adv, t([[-3, 0], [-1.5, -1.5], [4.5, 4.5]]))


def test_group_ids_may_be_a_list_an_object_array_or_a_tensor():
    expected, _ = compute_grpo_advantage(SCORES, ONE, IDS)
    assert_close(compute_grpo_advantage(SCORES, ONE, IDS.tolist())[0], expected)
    assert_close(compute_grpo_advantage(SCORES, ONE, torch.tensor([0, 1, 0, 1, 0, 2]))[0], expected)


def test_group_ids_of_the_wrong_length_are_refused():
    with pytest.raises(ValueError, match="group_ids has 2 entries but the batch has 6 sequences"):
        compute_grpo_advantage(SCORES, ONE, ["a", "b"])


def test_rloo_subtracts_the_mean_of_the_other_group_members():
    # a: 1 − (2+3)/2 = −1.5, 2 − (1+3)/2 = 0, 3 − (1+2)/2 = 1.5; b: 0 − 4, 4 − 0; c alone: raw 0.7
    adv, ret = compute_rloo_advantage(SCORES, ONE, IDS)
    assert_close(adv, t([[-1.5], [-4], [0], [4], [1.5], [0.7]]))
    assert_close(ret, adv)


group_batches = st.lists(st.tuples(st.integers(0, 3), st.floats(-10, 10)), min_size=1, max_size=12)


def _group_sums(adv, ids):
    return {g: adv[ids == g, 0].sum().item() for g in set(ids.tolist()) if (ids == g).sum() > 1}


@settings(max_examples=60, deadline=None)
@given(group_batches)
def test_grpo_advantages_of_each_group_sum_to_zero(rows):
    ids, scores = torch.tensor([g for g, _ in rows]), torch.tensor([[s] for _, s in rows], dtype=torch.float64)
    adv, _ = compute_grpo_advantage(scores, torch.ones_like(scores), ids)
    for total in _group_sums(adv, ids).values():
        assert abs(total) < 1e-6


@settings(max_examples=60, deadline=None)
@given(group_batches)
def test_rloo_advantages_of_each_group_sum_to_zero(rows):
    ids, scores = torch.tensor([g for g, _ in rows]), torch.tensor([[s] for _, s in rows], dtype=torch.float64)
    adv, _ = compute_rloo_advantage(scores, torch.ones_like(scores), ids)
    for total in _group_sums(adv, ids).values():
        assert abs(total) < 1e-9


# ----------------------------------------------------------------------------- registry
def test_builtin_estimators_are_registered_with_their_whitening():
    whiten = {name: get_adv_estimator(name).whiten for name in ("gae", "grpo", "rloo", "reinforce_plus_plus", "remax")}
    assert whiten == {"gae": True, "grpo": False, "rloo": False, "reinforce_plus_plus": True, "remax": False}


def test_registered_estimators_share_one_calling_convention():
    adv, _ = get_adv_estimator("gae")(t([[0, 0, 1]]), torch.ones(1, 3), values=t([[0.5, 0.6, 0.7]]), gamma=0.9, lam=0.8)
    assert_close(adv, t([GAE_ADV]))
    adv, _ = get_adv_estimator("rloo")(SCORES, ONE, group_ids=IDS, values=None, gamma=1.0)
    assert_close(adv[:2], t([[-1.5], [-4]]))


@pytest.mark.parametrize(
    ("name", "needed"),
    [("gae", "values from the critic"), ("grpo", "group_ids"), ("rloo", "group_ids"), ("remax", "reward_baselines")],
)
def test_an_estimator_names_the_context_it_is_missing(name, needed):
    with pytest.raises(ValueError, match=f"{name!r} needs {needed}"):
        get_adv_estimator(name)(torch.zeros(1, 2), torch.ones(1, 2))


def test_unknown_estimator_lists_the_registered_names():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'; registered: gae, grpo, .*remax"):
        get_adv_estimator("ppo")


def test_registering_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="'gae' is already registered"):
        register_adv_estimator("gae")(lambda token_level_rewards, response_mask, **context: (None, None))


def test_a_user_estimator_is_registered_with_its_whitening_flag():
    name = f"zeros-{uuid.uuid4().hex}"

    @register_adv_estimator(name, whiten=True)
    def zeros(token_level_rewards, response_mask, **context):
        return torch.zeros_like(token_level_rewards), torch.zeros_like(token_level_rewards)

    assert get_adv_estimator(name).fn is zeros and get_adv_estimator(name).whiten
