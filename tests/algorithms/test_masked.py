"""Masked statistics: only valid entries count, padding may hold anything."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from ketch.algorithms import masked_mean, masked_var, masked_whiten

X = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
MASK = torch.tensor([[1, 0], [1, 1]])


def test_masked_mean_over_all_valid_entries():
    # (1 + 3 + 4) / 3
    assert_close(masked_mean(X, MASK), torch.tensor(8 / 3))


def test_masked_mean_along_a_dim():
    # row 0: 1 / 1; row 1: (3 + 4) / 2
    assert_close(masked_mean(X, MASK, dim=-1), torch.tensor([1.0, 3.5]))


def test_masked_mean_ignores_nan_in_padding_and_is_zero_without_valid_entries():
    x = torch.tensor([[2.0, float("nan")], [float("inf"), 5.0]])
    mask = torch.tensor([[1, 0], [0, 0]])
    assert_close(masked_mean(x, mask, dim=-1), torch.tensor([2.0, 0.0]))


def test_masked_var_is_unbiased_by_default():
    # valid 1, 3, 4: mean 8/3, squared deviations 25/9 + 1/9 + 16/9 = 42/9; /2 = 7/3, /3 = 14/9
    assert_close(masked_var(X, MASK), torch.tensor(7 / 3))
    assert_close(masked_var(X, MASK, unbiased=False), torch.tensor(14 / 9))


def test_masked_var_of_one_valid_entry_is_zero_not_nan():
    assert masked_var(X, torch.tensor([[0, 0], [0, 1]])).item() == 0.0


def test_masked_whiten_uses_valid_entries_only_and_zeroes_padding():
    # valid 1, 2, 3, 4: mean 2.5, unbiased var 5/3, std 1.2909944
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    std = math.sqrt(5 / 3)
    expected = torch.tensor([[-1.5 / std, -0.5 / std, 0.5 / std], [1.5 / std, 0.0, 0.0]])
    assert_close(masked_whiten(x, mask), expected)


def test_masked_whiten_without_shift_keeps_the_mean():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    std = math.sqrt(5 / 3)
    expected = torch.tensor([[2.5 - 1.5 / std, 2.5 - 0.5 / std, 2.5 + 0.5 / std, 2.5 + 1.5 / std]])
    assert_close(masked_whiten(x, torch.ones(1, 4), shift_mean=False), expected)


def test_masked_whiten_of_a_single_valid_token_is_zero_not_nan():
    out = masked_whiten(torch.tensor([[7.0, 1.0]]), torch.tensor([[1, 0]]))
    assert out.tolist() == [[0.0, 0.0]]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-100, 100), min_size=6, max_size=6),
    st.lists(st.booleans(), min_size=6, max_size=6),
)
def test_whitened_valid_entries_have_mean_zero_and_unit_std(values, keep):
    x, mask = torch.tensor([values], dtype=torch.float64), torch.tensor([keep])
    valid = x[mask]
    if valid.numel() < 2 or valid.std() < 1e-3:
        return
    out = masked_whiten(x, mask)[mask]
    assert abs(out.mean().item()) < 1e-6
    assert abs(out.std().item() - 1) < 1e-4
