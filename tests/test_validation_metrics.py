"""pass@k, maj@k and the validation metrics per data source, against values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ketch.trainer.metrics import majority_correct, pass_at_k, pass_k_values, validation_metrics
from ketch.trainer.validation import accuracies, extracted_answers


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 2, 1 - 3 / 6),  # 1 - C(3,2)/C(4,2)
        (4, 2, 2, 1 - 1 / 6),  # 1 - C(2,2)/C(4,2)
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (5, 1, 4, 1 - 1 / 5),  # 1 - C(4,4)/C(5,4)
        (4, 0, 4, 0.0),
        (4, 3, 2, 1.0),  # fewer wrong answers (1) than draws (2): a draw always holds a correct one
        (8, 1, 1, 1 / 8),
    ],
)
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(4, 1, 5)


@pytest.mark.parametrize(
    ("n", "ks"), [(1, []), (2, [2]), (4, [2, 4]), (5, [2, 4, 5]), (8, [2, 4, 8]), (12, [2, 4, 8, 12])]
)
def test_logged_k_are_powers_of_two_and_n(n, ks):
    assert pass_k_values(n) == ks


def test_majority_vote_ties_go_to_the_first_answer_and_none_abstains():
    assert majority_correct(["12", "13", "12", "13"], [True, False, True, False]) is True
    assert majority_correct(["13", "12", "12", "13"], [False, True, True, False]) is False
    assert majority_correct([None, None, "7", "8", "8"], [False, False, True, False, False]) is False
    assert majority_correct([None, None, None], [False, False, False]) is False
    assert majority_correct([5.0, 5, 6], [True, True, False]) is True  # 5.0 and 5 are one answer


def test_validation_metrics_per_source_with_pass_and_maj():
    sources = np.array(["a"] * 8 + ["b"] * 4, dtype=object)
    scores = np.array([1, 0, 1, 0, 0, 0, 0, 1, 0.5, 0.5, 0, 0], dtype=np.float64)
    answers = ["5", "6", "5", "6", "3", "3", "4", "7", "x", "x", "y", "z"]
    lengths = np.array([4, 4, 4, 4, 2, 2, 2, 2, 6, 6, 6, 6])
    metrics = validation_metrics(sources, scores, lengths, answers, n=4)
    # a: prompt 0 has 2 correct of 4 (pass@2 = 5/6), majority "5" (a 2-2 tie, "5" first) is correct;
    #    prompt 1 has 1 correct (pass@2 = 1/2), majority "3" is wrong.
    # b: partial credit 0.5 is not correct, so nothing passes; acc is still the mean score.
    assert metrics == pytest.approx(
        {
            "val/a/acc": 3 / 8,
            "val/a/pass@2": (5 / 6 + 1 / 2) / 2,
            "val/a/pass@4": 1.0,
            "val/a/maj@4": 0.5,
            "val/b/acc": 1 / 4,
            "val/b/pass@2": 0.0,
            "val/b/pass@4": 0.0,
            "val/b/maj@4": 0.0,
            "val/response_length/mean": 4.0,
        }
    )


def test_one_sample_per_prompt_logs_only_acc():
    metrics = validation_metrics(np.array(["a", "a"], dtype=object), np.array([1.0, 0.0]), np.array([3, 5]))
    assert metrics == {"val/a/acc": 0.5, "val/response_length/mean": 4.0}


def test_rows_must_come_in_whole_groups():
    with pytest.raises(ValueError, match="whole groups of n=4"):
        validation_metrics(np.array(["a"] * 6, dtype=object), np.zeros(6), np.zeros(6), n=4)


def test_answers_are_the_scorers_pred_else_the_stripped_response():
    texts = ["  #### 5 ", "#### 6\n", "no answer"]
    preds = np.array([5, math.nan, None], dtype=object)  # RewardScorer fills a missing field with NaN
    assert extracted_answers({"response_texts": texts, "extra": {"pred": preds}}) == [5, "#### 6", None]
    assert extracted_answers({"response_texts": texts, "extra": {}}) == ["#### 5", "#### 6", "no answer"]


def test_accuracy_is_the_scorers_acc_where_it_gives_one_else_the_score():
    scores = np.array([1 / 3, 1.0, 0.25])  # partial credit as the score, e.g. ketch/arithmetic with digit_credit
    acc = np.array([0.0, 1.0, math.nan])  # RewardScorer fills a missing field with NaN
    assert accuracies({"scores": scores, "extra": {"acc": acc}}).tolist() == [0.0, 1.0, 0.25]
    assert accuracies({"scores": scores, "extra": {}}).tolist() == [1 / 3, 1.0, 0.25]
