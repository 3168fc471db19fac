import pytest

from ketch.rewards import compute_score


def score(response: str, truth: str, data_source: str = "openai/gsm8k") -> float:
    return compute_score(data_source, response, truth)


def test_thousands_separator_in_response():
    assert score("She pays 1,125 dollars.\n#### 1,125", "1125") == 1.0


def test_decimal_zero_equals_integer():
    assert score("#### 25.0", "25") == 1.0


def test_currency_sign_and_separator():
    assert score("#### $1,000", "1000") == 1.0


def test_currency_sign_with_decimal():
    assert score("#### $25.0", "25") == 1.0


def test_negative_answer():
    assert score("#### -3", "-3") == 1.0


def test_sign_does_not_match_positive_truth():
    assert score("#### -3", "3") == 0.0


def test_wrong_answer_scores_zero():
    assert score("#### 1124", "1125") == 0.0


def test_last_marker_wins():
    assert score("#### 7\nwait, recount\n#### 8", "8") == 1.0
    assert score("#### 8\nwait, recount\n#### 7", "8") == 0.0


def test_missing_marker_scores_zero():
    assert score("The answer is 8.", "8") == 0.0


def test_ground_truth_with_commas():
    assert score("#### 1125", "1,125") == 1.0


def test_ground_truth_as_full_solution():
    assert score("#### 72", "48 / 2 = 24 clips in May.\n48 + 24 = 72\n#### 72") == 1.0


def test_short_data_source_name():
    assert score("#### 1,125", "1125", data_source="gsm8k") == 1.0


def test_non_numeric_ground_truth_raises():
    with pytest.raises(ValueError, match="ground_truth 'many' is not a number"):
        score("#### 3", "many")
