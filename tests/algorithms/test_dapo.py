"""DAPO's group filter and overlong shaping (https://arxiv.org/abs/2503.14476) against hand-worked numbers."""

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from ketch.algorithms import filter_overlong, informative_groups, overlong_penalty, truncated


def test_only_groups_whose_values_differ_are_kept():
    # a: 1 vs 0 differ → kept; b: 1, 1 all equal → dropped; c: a group of one → dropped;
    # d: 0.5, 0.5, 0.2 differ → kept, all three samples
    uids = np.array(["a", "a", "b", "b", "c", "d", "d", "d"], dtype=object)
    keep = informative_groups(uids, [1.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.2])
    assert keep.tolist() == [True, True, False, False, False, True, True, True]


def test_groups_need_not_be_adjacent_and_ids_may_be_ints():
    # group 7 = samples 0 and 2 (1 vs 0, kept); group 3 = sample 1 alone (dropped)
    assert informative_groups([7, 3, 7], [1.0, 0.0, 0.0]).tolist() == [True, False, True]


def test_every_group_all_equal_keeps_nothing():
    assert not informative_groups(["a", "a", "b", "b"], [0.0, 0.0, 1.0, 1.0]).any()


def test_a_missing_metric_value_is_an_error_naming_the_sample():
    with pytest.raises(ValueError, match=r"NaN \(missing\) for samples \[1\]"):
        informative_groups(["a", "a"], [1.0, float("nan")])


def test_overlong_penalty_is_the_papers_linear_ramp_over_the_buffer():
    # L_max = 16, L_cache = 4: no penalty up to 12 tokens, then (12 − |y|) / 4 · factor
    lengths = torch.tensor([10, 12, 13, 15, 16])
    assert_close(overlong_penalty(lengths, 16, 4, 1.0), torch.tensor([0.0, 0.0, -0.25, -0.75, -1.0]))
    assert_close(overlong_penalty(lengths, 16, 4, 0.5), torch.tensor([0.0, 0.0, -0.125, -0.375, -0.5]))


def test_overlong_buffer_longer_than_the_budget_is_an_error_naming_the_keys():
    with pytest.raises(ValueError, match=r"reward.overlong_buffer.len=20 .*data.max_response_length=16"):
        overlong_penalty(torch.tensor([3]), 16, 20, 1.0)


def test_overlong_filtering_masks_the_responses_that_used_every_allowed_token():
    # 2 prompt columns, 4 response columns, a budget of 4 tokens: row 0 stopped after 2, row 1 used all 4, row 2 is
    # a trajectory of 2 model tokens around 2 tool tokens (out of response_mask, in its budget), row 3 stopped after 3.
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 1], [1, 1, 1, 0]])
    prompt_mask = torch.tensor([[0, 1], [1, 1], [1, 1], [0, 1]])
    attention_mask = torch.cat([prompt_mask, torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]])], 1)
    assert truncated(response_mask, attention_mask, 4).tolist() == [False, True, True, False]
    assert truncated(response_mask, attention_mask, 5).tolist() == [False] * 4  # a budget wider than the batch
    expected = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]])
    assert torch.equal(filter_overlong(response_mask, attention_mask, 4), expected)
