import pytest

from ketch.rewards import compute_score
from ketch.rewards.arithmetic import score_arithmetic


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


def partial(response: str, truth: str) -> dict:
    return score_arithmetic("ketch/arithmetic", response, truth, None, digit_credit=0.5)


def test_digit_credit_scores_the_matching_places_from_the_units_and_keeps_acc_exact():
    assert partial("#### 132", "132") == {"score": 1.0, "acc": 1.0}
    assert partial("#### 131", "132") == {"score": 0.5 * 2 / 3, "acc": 0.0}  # hundreds and tens right
    assert partial("#### 32", "132") == {"score": 0.5 * 2 / 3, "acc": 0.0}  # the missing hundreds count as wrong
    assert partial("#### 1132", "132") == {"score": 0.5 * 3 / 4, "acc": 0.0}
    assert partial("#### 7", "-7") == {"score": 0.5 * 1 / 2, "acc": 0.0}  # the sign is a place
    assert partial("#### 45", "132") == {"score": 0.0, "acc": 0.0}
    assert partial("no answer", "132") == {"score": 0.0, "acc": 0.0}


def test_partial_credit_must_stay_below_a_right_answer():
    with pytest.raises(ValueError, match=r"digit_credit=1.0 and call_credit=0.0 must be >= 0 and sum to less than 1"):
        score_arithmetic("ketch/arithmetic", "#### 1", "2", None, digit_credit=1.0)
    with pytest.raises(ValueError, match=r"digit_credit=0.5 and call_credit=0.5 must"):
        score_arithmetic("ketch/arithmetic", "#### 1", "2", None, digit_credit=0.5, call_credit=0.5)


def test_call_credit_pays_a_wrong_answer_whose_tool_calls_all_ran():
    def scored(answer: str, calls: int, errors: int, **credit) -> dict:
        info = {"messages": [], "tool_calls": calls, "tool_errors": errors}
        return score_arithmetic("ketch/calculator", f"#### {answer}", "2301", info, **credit)

    assert scored("2301", 1, 0, call_credit=0.1) == {"score": 1.0, "acc": 1.0}
    assert scored("2310", 1, 0, call_credit=0.1) == {"score": 0.1, "acc": 0.0}
    assert scored("2310", 2, 1, call_credit=0.1) == {"score": 0.0, "acc": 0.0}  # one call failed
    assert scored("2310", 0, 0, call_credit=0.1) == {"score": 0.0, "acc": 0.0}  # answered without the tool
    assert scored("2300", 1, 0, call_credit=0.1, digit_credit=0.5) == {"score": 0.1 + 0.5 * 3 / 4, "acc": 0.0}
    assert score_arithmetic("ketch/arithmetic", "#### 7", "8", None, call_credit=0.1) == {"score": 0.0, "acc": 0.0}
