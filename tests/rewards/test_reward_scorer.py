import logging
import math
import pickle

import numpy as np
import pytest
import torch

from ketch.rewards import RewardScorer
from ketch.rewards.registry import UnknownDataSourceError
from ketch.rewards.scorer import RewardError

USER_FUNCTIONS = """
import math

def length(data_source, solution_str, ground_truth, extra_info):
    return float(len(solution_str))

def fails_on_boom(data_source, solution_str, ground_truth, extra_info):
    if ground_truth == "boom":
        raise ValueError("cannot score " + solution_str)
    return 1.0

def always_fails(data_source, solution_str, ground_truth, extra_info):
    raise RuntimeError("scorer is broken")

def not_a_number(data_source, solution_str, ground_truth, extra_info):
    return math.nan

def with_extras(data_source, solution_str, ground_truth, extra_info):
    if ground_truth == "1":
        return {"score": 1.0, "length": len(solution_str), "tag": "long"}
    return {"score": 0.0, "length": len(solution_str)}

def echo_extra_info(data_source, solution_str, ground_truth, extra_info):
    return {"score": 0.0, "has_extra_info": extra_info is not None}
"""


@pytest.fixture
def functions(tmp_path) -> str:
    path = tmp_path / "user_rewards.py"
    path.write_text(USER_FUNCTIONS)
    return str(path)


def test_score_sits_on_the_last_valid_token(char_tokenizer, make_batch, functions):
    data = make_batch(["ab", "abcd", ""], ["0", "0", "0"], response_len=6)
    token_level_scores, _ = RewardScorer(char_tokenizer, f"{functions}:length")(data)
    assert token_level_scores.dtype == torch.float32
    assert token_level_scores.tolist() == [
        [0.0, 0.0, 2.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 4.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ]


def test_builtin_scores_per_data_source(char_tokenizer, make_batch):
    data = make_batch(["#### 12", "x #### 7", "#### 1"], ["12", "8", "1"], response_len=12)
    token_level_scores, info = RewardScorer(char_tokenizer)(data)
    assert token_level_scores.nonzero().tolist() == [[0, 7], [2, 6]]
    assert token_level_scores.sum().item() == 2.0
    assert info["scores"].tolist() == [1.0, 0.0, 1.0]
    assert info["response_texts"] == ["#### 12", "x #### 7", "#### 1"]
    assert info["num_errors"] == 0
    assert info["extra"] == {}


def test_mask_with_a_gap_uses_the_last_one(char_tokenizer, make_batch, functions):
    data = make_batch(["abc"], ["0"], response_len=6)
    data.batch["response_mask"] = torch.tensor([[1, 0, 1, 1, 0, 0]])
    token_level_scores, info = RewardScorer(char_tokenizer, f"{functions}:length")(data)
    assert token_level_scores.tolist() == [[0.0, 0.0, 0.0, 2.0, 0.0, 0.0]]
    assert info["response_texts"] == ["ac"]


def test_on_error_raise_names_sample_source_and_scorer(char_tokenizer, make_batch, functions):
    data = make_batch(["ok", "bad", "ok"], ["1", "boom", "1"], data_source="my/task")
    scorer = RewardScorer(char_tokenizer, f"{functions}:fails_on_boom", on_error="raise")
    with pytest.raises(RewardError) as info:
        scorer(data)
    message = str(info.value)
    assert "sample 1 (data_source='my/task')" in message
    assert "user_rewards.py:fails_on_boom" in message
    assert "ValueError: cannot score bad" in message
    assert "reward.on_error=zero" in message
    assert isinstance(info.value.__cause__, ValueError)


def test_on_error_zero_scores_the_failing_sample_zero(char_tokenizer, make_batch, functions):
    data = make_batch(["ok", "bad", "ok"], ["1", "boom", "1"], data_source="my/task")
    scorer = RewardScorer(char_tokenizer, f"{functions}:fails_on_boom", on_error="zero")
    token_level_scores, info = scorer(data)
    assert info["scores"].tolist() == [1.0, 0.0, 1.0]
    assert info["num_errors"] == 1
    assert token_level_scores.sum().item() == 2.0


def test_on_error_zero_logs_each_distinct_error_once(char_tokenizer, make_batch, functions, caplog):
    data = make_batch(["a", "b", "c"], ["0", "0", "0"])
    scorer = RewardScorer(char_tokenizer, f"{functions}:always_fails", on_error="zero")
    with caplog.at_level(logging.WARNING, logger="ketch.rewards"):
        scorer(data)
        _, info = scorer(data)
    assert info["num_errors"] == 3
    assert len(caplog.records) == 1
    assert "failed on sample 0" in caplog.records[0].getMessage()
    assert "RuntimeError: scorer is broken" in caplog.records[0].getMessage()


def test_non_finite_score_is_an_error(char_tokenizer, make_batch, functions):
    data = make_batch(["a"], ["0"])
    with pytest.raises(RewardError, match="returned the non-finite score nan"):
        RewardScorer(char_tokenizer, f"{functions}:not_a_number")(data)


def test_extra_fields_are_collected_with_nan_for_missing(char_tokenizer, make_batch, functions):
    data = make_batch(["abc", "a"], ["1", "0"])
    _, info = RewardScorer(char_tokenizer, f"{functions}:with_extras")(data)
    assert info["scores"].tolist() == [1.0, 0.0]
    assert info["extra"]["length"].dtype == np.float64
    assert info["extra"]["length"].tolist() == [3.0, 1.0]
    assert info["extra"]["tag"][0] == "long"
    assert math.isnan(info["extra"]["tag"][1])


def test_missing_extra_info_column_passes_none(char_tokenizer, make_batch, functions):
    data = make_batch(["a"], ["0"])
    _, info = RewardScorer(char_tokenizer, f"{functions}:echo_extra_info")(data)
    assert info["extra"]["has_extra_info"].tolist() == [0.0]


def test_extra_info_column_is_passed(char_tokenizer, make_batch, functions):
    data = make_batch(["a"], ["0"], extra_info=[{"index": 3}])
    _, info = RewardScorer(char_tokenizer, f"{functions}:echo_extra_info")(data)
    assert info["extra"]["has_extra_info"].tolist() == [1.0]


def test_missing_ground_truth_column(char_tokenizer, make_batch):
    data = make_batch(["#### 1"], ["1"])
    del data.non_tensor_batch["ground_truth"]
    with pytest.raises(ValueError, match=r"needs the non-tensor column 'ground_truth'; the data has \['data_source'\]"):
        RewardScorer(char_tokenizer)(data)


def test_unknown_data_source_fails_even_with_on_error_zero(char_tokenizer, make_batch):
    data = make_batch(["#### 1"], ["1"], data_source="my/task")
    with pytest.raises(UnknownDataSourceError, match="sample 0: no reward scorer for data_source 'my/task'"):
        RewardScorer(char_tokenizer, on_error="zero")(data)


def test_all_zero_response_mask_is_rejected(char_tokenizer, make_batch):
    data = make_batch(["#### 1", "#### 2"], ["1", "2"])
    data.batch["response_mask"][1] = 0
    with pytest.raises(ValueError, match=r"samples \[1\] have no response token"):
        RewardScorer(char_tokenizer)(data)


def test_invalid_on_error_is_rejected(char_tokenizer):
    with pytest.raises(ValueError, match=r"reward\.on_error must be 'raise' or 'zero', got 'skip'"):
        RewardScorer(char_tokenizer, on_error="skip")


def test_pickled_scorer_reloads_the_user_function(char_tokenizer, make_batch, functions):
    scorer = pickle.loads(pickle.dumps(RewardScorer(char_tokenizer, f"{functions}:length")))
    _, info = scorer(make_batch(["abc"], ["0"]))
    assert info["scores"].tolist() == [3.0]


def test_scorer_kwargs_reach_the_scorer_of_their_data_source_only(char_tokenizer, make_batch):
    kwargs = {"ketch/arithmetic": {"digit_credit": 0.5}}
    data = make_batch(["#### 131", "#### 132"], ["132", "132"])
    _, info = RewardScorer(char_tokenizer, scorer_kwargs=kwargs)(data)
    assert info["scores"].tolist() == [0.5 * 2 / 3, 1.0]
    assert info["extra"]["acc"].tolist() == [0.0, 1.0]
    _, info = RewardScorer(char_tokenizer, scorer_kwargs=kwargs)(make_batch(["#### 131"], ["132"], "ketch/calculator"))
    assert info["scores"].tolist() == [0.0] and info["extra"] == {}


def test_scorer_kwargs_the_scorer_cannot_take_fail_at_the_start_naming_the_key(char_tokenizer):
    with pytest.raises(ValueError, match=r"reward.scorer_kwargs\['ketch/arithmetic'\]=\{'credit': 0.5\} does not fit"):
        RewardScorer(char_tokenizer, scorer_kwargs={"ketch/arithmetic": {"credit": 0.5}})
