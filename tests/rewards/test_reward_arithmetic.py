import pytest

from ketch.rewards import compute_score


def score(response: str, truth: str) -> float:
    return compute_score("ketch/arithmetic", response, truth)


def test_exact_answer_scores_one():
    assert score("#### 132", "132") == 1.0


def test_text_before_the_answer_is_ignored():
    assert score("12 * 11 = 132 #### 132", "132") == 1.0


def test_negative_answer_scores_one():
    assert score("#### -7", "-7") == 1.0


def test_wrong_answer_scores_zero():
    assert score("#### 131", "132") == 0.0


def test_last_marker_wins():
    assert score("#### 132 #### 5", "132") == 0.0
    assert score("#### 5 #### 132", "132") == 1.0


def test_missing_marker_scores_zero():
    assert score("132", "132") == 0.0


def test_non_integer_after_marker_scores_zero():
    assert score("#### abc", "132") == 0.0


def test_integer_ground_truth_is_accepted():
    assert compute_score("ketch/arithmetic", "#### 4", 4) == 1.0


def test_non_integer_ground_truth_raises():
    with pytest.raises(ValueError):
        score("#### 4", "four")
