import pytest

from ketch.rewards import compute_score
from ketch.rewards.math import last_boxed, normalize


def score(response: str, truth: str) -> float:
    return compute_score("math", response, truth)


def test_last_boxed_keeps_nested_braces():
    assert last_boxed(r"so \boxed{\frac{\sqrt{3}}{2}} done") == r"\frac{\sqrt{3}}{2}"


def test_last_boxed_takes_the_last_one():
    assert last_boxed(r"\boxed{1} then \boxed{2}") == "2"


def test_last_boxed_reads_fbox():
    assert last_boxed(r"\fbox{7}") == "7"


def test_last_boxed_unbalanced_is_none():
    assert last_boxed(r"\boxed{\frac{1}{2}") is None


def test_nested_braces_match():
    assert score(r"Thus $\boxed{\frac{\sqrt{3}}{2}}$.", r"\frac{\sqrt{3}}{2}") == 1.0


def test_fraction_equals_decimal():
    assert score(r"\boxed{\frac{1}{2}}", "0.5") == 1.0


def test_dfrac_equals_frac():
    assert score(r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}") == 1.0


def test_unbraced_frac_equals_braced():
    assert score(r"\boxed{\frac12}", r"\frac{1}{2}") == 1.0


def test_missing_boxed_scores_zero():
    assert score("The answer is 5.", "5") == 0.0


def test_wrong_answer_scores_zero():
    assert score(r"\boxed{6}", "5") == 0.0


def test_earlier_boxed_is_ignored():
    assert score(r"\boxed{5} no, \boxed{6}", "5") == 0.0


def test_ground_truth_as_solution_with_boxed():
    assert score(r"\boxed{10}", r"So the total is $\boxed{10}$.") == 1.0


def test_list_is_not_a_thousands_number():
    assert score(r"\boxed{1,2}", "12") == 0.0


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"30^\circ", "30"),
        (r"30^{\circ}", "30"),
        (r"50\%", "50"),
        (r"\$5.", "5"),
        (r"10\text{ cm}^2", "10"),
        (r"\text{(A)}", "(A)"),
        (r"3\!\sqrt2", r"3\sqrt{2}"),
        (r"\tfrac{a}{b}", r"\frac{a}{b}"),
        ("x = 4", "4"),
    ],
)
def test_normalize(raw, expected):
    assert normalize(raw) == expected


def test_numbers_within_tolerance_match():
    assert score(r"\boxed{0.3333333}", r"\frac{1}{3}") == 1.0


def test_numbers_outside_tolerance_differ():
    assert score(r"\boxed{0.333}", r"\frac{1}{3}") == 0.0


@pytest.mark.parametrize("source", ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"])
def test_math_data_sources(source):
    assert compute_score(source, r"\boxed{2}", "2") == 1.0
