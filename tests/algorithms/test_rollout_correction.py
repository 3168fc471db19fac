"""Truncated importance sampling against the rollout engine and the mismatch metrics, worked by hand."""

import pytest
import torch
from torch.testing import assert_close

from ketch.algorithms import rollout_is_weights, rollout_mismatch_metrics, turn_masks

# old_log_prob − rollout_log_probs per token: row 0 [0.5, 0, −1], row 1 [0.2, 0.1, masked (9 is ignored)]
OLD = torch.tensor([[-1.0, -0.5, -2.0], [-1.0, -1.0, 0.0]])
ROLLOUT = torch.tensor([[-1.5, -0.5, -1.0], [-1.2, -1.1, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_token_level_weights_are_the_ratio_truncated_at_the_threshold():
    # e^0.5 = 1.6487 → 1.5, e^0 = 1, e^−1 = 0.3678794; e^0.2 = 1.2214028, e^0.1 = 1.1051709, masked 0
    weights = rollout_is_weights(OLD, ROLLOUT, MASK, "token", 1.5)
    assert_close(weights, torch.tensor([[1.5, 1.0, 0.3678794], [1.2214028, 1.1051709, 0.0]]))


def test_sequence_level_weights_are_the_product_of_the_token_ratios():
    # row 0: e^(0.5 + 0 − 1) = e^−0.5 = 0.6065307; row 1: e^0.3 = 1.3498588, truncated to 1.2
    weights = rollout_is_weights(OLD, ROLLOUT, MASK, "sequence", 1.2)
    assert_close(weights, torch.tensor([[0.6065307] * 3, [1.2, 1.2, 0.0]]))


def test_bad_level_or_threshold_name_the_config_key():
    with pytest.raises(ValueError, match=r"actor.rollout_is\)"):
        rollout_is_weights(OLD, ROLLOUT, MASK, "batch", 2.0)
    with pytest.raises(ValueError, match=r"actor\.rollout_is_threshold"):
        rollout_is_weights(OLD, ROLLOUT, MASK, "token", 0.0)


def test_mismatch_metrics_compare_probabilities_and_estimate_the_kl():
    # |e^old − e^rollout| over the 5 valid tokens: 0.1447492, 0, 0.2325441, 0.0666852, 0.0350083
    # k3 = e^d − d − 1 for d = 0.5, 0, −1, 0.2, 0.1: 0.1487213, 0, 0.3678794, 0.0214028, 0.0051709
    metrics = rollout_mismatch_metrics(OLD, ROLLOUT, MASK)
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(0.2325441, abs=1e-6)
    assert metrics["training/rollout_probs_diff_mean"] == pytest.approx(0.4789868 / 5, abs=1e-6)
    assert metrics["training/rollout_kl"] == pytest.approx(0.5431744 / 5, abs=1e-6)


def test_no_valid_token_gives_no_metrics():
    assert rollout_mismatch_metrics(OLD, ROLLOUT, torch.zeros(2, 3)) == {}


# Two multi-turn responses: row 0 a tool call (2 tokens), the tool's reply (2 tokens the model did not sample), the
# answer (2 tokens); row 1 one turn of 3 tokens; then padding.
TURNS_SAMPLED = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0]])
TURNS_REAL = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
P_TRAIN = torch.tensor([[0.5, 0.4, 1.0, 1.0, 0.9, 0.8], [0.2, 0.7, 0.5, 1.0, 1.0, 1.0]])
P_ROLLOUT = torch.tensor([[0.4, 0.4, 0.1, 0.1, 0.6, 0.8], [0.2, 0.5, 0.5, 0.1, 0.1, 0.1]])


def test_turn_masks_split_the_sampled_tokens_into_answered_turns_and_last_turns():
    turns = turn_masks(TURNS_SAMPLED, TURNS_REAL)
    assert turns["tool_turns"].long().tolist() == [[1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
    assert turns["answer_turns"].long().tolist() == [[0, 0, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0]]


def test_mismatch_metrics_of_multi_turn_responses_are_also_given_per_kind_of_turn():
    # |p_train - p_rollout| on the sampled tokens: tool turn 0.1, 0; answer turns 0.3, 0 and 0, 0.2, 0
    metrics = rollout_mismatch_metrics(P_TRAIN.log(), P_ROLLOUT.log(), TURNS_SAMPLED, TURNS_REAL)
    expected = {"tool_turns": (0.1, 0.05), "answer_turns": (0.3, 0.5 / 5)}
    for kind, (maximum, mean) in expected.items():
        assert metrics[f"training/rollout_probs_diff_max/{kind}"] == pytest.approx(maximum, abs=1e-6)
        assert metrics[f"training/rollout_probs_diff_mean/{kind}"] == pytest.approx(mean, abs=1e-6)
    assert metrics["training/rollout_probs_diff_mean"] == pytest.approx(0.6 / 7, abs=1e-6)
    # no turn answered by an environment (single-turn responses): the overall metrics only
    single = rollout_mismatch_metrics(P_TRAIN.log(), P_ROLLOUT.log(), TURNS_SAMPLED, TURNS_SAMPLED)
    assert sorted(single) == [
        "training/rollout_kl",
        "training/rollout_probs_diff_max",
        "training/rollout_probs_diff_mean",
    ]
