import pytest

from ketch.rewards import load_reward_function
from ketch.rewards.custom import RewardFunctionError


def write(tmp_path, source: str, name: str = "my_reward.py") -> str:
    path = tmp_path / name
    path.write_text(source)
    return str(path)


def test_loads_the_named_function(tmp_path):
    path = write(tmp_path, "def score(data_source, solution_str, ground_truth, extra_info):\n    return 0.5\n")
    fn = load_reward_function(f"{path}:score")
    assert fn("d", "text", "truth", None) == 0.5


def test_dict_returning_function_is_returned_unchanged(tmp_path):
    source = (
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 1.0, 'length': len(solution_str)}\n"
    )
    fn = load_reward_function(f"{write(tmp_path, source)}:score")
    assert fn("d", "abcd", "x", None) == {"score": 1.0, "length": 4}


def test_missing_file(tmp_path):
    with pytest.raises(RewardFunctionError, match=r"file .*nowhere\.py does not exist"):
        load_reward_function(f"{tmp_path}/nowhere.py:score")


def test_missing_function_part(tmp_path):
    path = write(tmp_path, "def score(a, b, c, d):\n    return 0.0\n")
    with pytest.raises(RewardFunctionError, match=r"is not of the form path/to/file\.py:function_name"):
        load_reward_function(path)


def test_missing_function_lists_defined_functions(tmp_path):
    path = write(tmp_path, "def helper(x):\n    return x\n\ndef other(a, b, c, d):\n    return 0.0\n")
    with pytest.raises(RewardFunctionError, match=r"has no 'score'; functions defined there: helper, other"):
        load_reward_function(f"{path}:score")


def test_syntax_error_shows_file_and_error(tmp_path):
    path = write(tmp_path, "def score(a, b, c, d)\n    return 0.0\n", name="broken.py")
    with pytest.raises(RewardFunctionError, match=r"importing .*broken\.py failed with SyntaxError") as info:
        load_reward_function(f"{path}:score")
    assert isinstance(info.value.__cause__, SyntaxError)


def test_import_time_exception_is_shown(tmp_path):
    path = write(tmp_path, "import no_such_module_for_ketch_tests\n")
    with pytest.raises(RewardFunctionError, match="ModuleNotFoundError: No module named 'no_such_module_for_ketch"):
        load_reward_function(f"{path}:score")


def test_non_callable_attribute(tmp_path):
    path = write(tmp_path, "score = 3\n")
    with pytest.raises(RewardFunctionError, match=r"'score' in .* is a int, not a function"):
        load_reward_function(f"{path}:score")


def test_function_with_wrong_arguments(tmp_path):
    path = write(tmp_path, "def score(solution_str):\n    return 0.0\n")
    with pytest.raises(RewardFunctionError, match=r"score\(solution_str\) cannot be called as fn\(data_source"):
        load_reward_function(f"{path}:score")


def test_error_is_a_value_error():
    assert issubclass(RewardFunctionError, ValueError)
