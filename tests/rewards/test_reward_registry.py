import pytest

from ketch.rewards import compute_score, known_data_sources, register_scorer, registry
from ketch.rewards.registry import UnknownDataSourceError


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made in a test are dropped afterwards."""
    monkeypatch.setattr(registry, "_SCORERS", dict(registry._SCORERS))


def test_builtin_data_sources_are_known():
    assert known_data_sources() == [
        "DigitalLearningGmbH/MATH-lighteval",
        "HuggingFaceH4/MATH-500",
        "gsm8k",
        "ketch/arithmetic",
        "ketch/calculator",
        "ketch/dots",
        "lighteval/MATH",
        "math",
        "openai/gsm8k",
    ]


def test_unknown_data_source_lists_known_sources_and_reward_function():
    with pytest.raises(UnknownDataSourceError) as info:
        compute_score("my/task", "#### 1", "1")
    message = str(info.value)
    assert "'my/task'" in message
    assert "gsm8k, ketch/arithmetic" in message
    assert "reward.function=path/to/file.py:fn" in message


def test_unknown_data_source_error_is_a_value_error():
    assert issubclass(UnknownDataSourceError, ValueError)


def test_compute_score_dispatches_on_data_source():
    assert compute_score("ketch/arithmetic", "#### 5", "5") == 1.0
    assert compute_score("gsm8k", "#### 5", "6") == 0.0


def test_registered_scorer_receives_all_arguments(scratch_registry):
    calls = []

    @register_scorer("my/task", "my/task-v2")
    def score(data_source, solution_str, ground_truth, extra_info):
        calls.append((data_source, solution_str, ground_truth, extra_info))
        return {"score": 0.25, "length": len(solution_str)}

    assert compute_score("my/task-v2", "abc", "x", {"k": 1}) == {"score": 0.25, "length": 3}
    assert calls == [("my/task-v2", "abc", "x", {"k": 1})]
    assert "my/task" in known_data_sources()


def test_registering_a_second_scorer_for_a_source_fails(scratch_registry):
    with pytest.raises(ValueError, match=r"'gsm8k' already has the scorer ketch\.rewards\.gsm8k\.score_gsm8k"):

        @register_scorer("gsm8k")
        def other(data_source, solution_str, ground_truth, extra_info):
            return 0.0


def test_register_scorer_needs_a_data_source():
    with pytest.raises(ValueError, match="at least one data source"):
        register_scorer()
