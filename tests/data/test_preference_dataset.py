"""`PreferenceDataset`: prompt/chosen/rejected rows, chat lists, skipped pairs and clear errors; the built-in pairs."""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from ketch.config.schema import DataConfig
from ketch.data import DatasetError, PreferenceDataset, resolve_data_files
from ketch.data.builtin.arithmetic import ArithmeticTask, generate_arithmetic_task
from ketch.data.builtin.preference import PreferenceTask, generate_preference_task
from ketch.protocol import DataProto
from ketch.rewards.arithmetic import extract_answer, score_arithmetic

# character ids of the built-in tokenizer: printable ASCII c -> ord(c) - 27; <eos> is 1, <pad> 0
CHOSEN = [22, 16, 23, 34, 8, 8, 8, 8, 5, 24, 1]  # "1+2=" + "#### 3" + <eos>
REJECTED = [22, 16, 23, 34, 8, 8, 8, 8, 5, 25, 1]  # "1+2=" + "#### 4" + <eos>
PAIR = {"prompt": "1+2=", "chosen": "#### 3", "rejected": "#### 4"}


def test_string_responses_are_appended_to_the_prompt_and_end_with_eos(write_rows, tokenizer):
    item = PreferenceDataset(write_rows([PAIR]), tokenizer, DataConfig())[0]
    assert item["chosen_input_ids"].tolist() == CHOSEN
    assert item["rejected_input_ids"].tolist() == REJECTED
    assert item["index"] == 0


def test_chat_list_responses_are_the_whole_conversation(write_rows, tokenizer):
    user = {"role": "user", "content": "1+2="}
    row = {
        "prompt": None,
        "chosen": [user, {"role": "assistant", "content": "#### 3"}],
        "rejected": [user, {"role": "assistant", "content": "#### 4"}],
    }
    item = PreferenceDataset(write_rows([row]), tokenizer, DataConfig())[0]
    assert tokenizer.decode(item["chosen_input_ids"]) == "user: 1+2=\nassistant: #### 3<eos>"
    assert tokenizer.decode(item["rejected_input_ids"]) == "user: 1+2=\nassistant: #### 4<eos>"


def test_collate_right_pads_both_sides_to_one_length(write_rows, tokenizer):
    rows = [PAIR, {"prompt": "7=", "chosen": "#### 7", "rejected": "#### 70"}]
    dataset = PreferenceDataset(write_rows(rows), tokenizer, DataConfig(chosen_key="chosen"))
    batch = dataset.collate([dataset[0], dataset[1]])
    assert batch["chosen_input_ids"].tolist() == [CHOSEN, [28, 34, 8, 8, 8, 8, 5, 28, 1, 0, 0]]
    assert batch["rejected_input_ids"].tolist() == [REJECTED, [28, 34, 8, 8, 8, 8, 5, 28, 21, 1, 0]]
    assert batch["chosen_attention_mask"].tolist() == [[1] * 11, [1] * 9 + [0] * 2]
    assert batch["rejected_attention_mask"].tolist() == [[1] * 11, [1] * 10 + [0]]
    assert len(DataProto.from_single_dict(batch)) == 2


def test_equal_and_empty_pairs_are_counted_skipped_and_logged_once(write_rows, tokenizer, caplog):
    rows = [
        PAIR,
        {"prompt": "1+2=", "chosen": "#### 3", "rejected": "#### 3"},
        {"prompt": "2+2=", "chosen": "#### 4", "rejected": "#### 4"},
        {"prompt": "1+2=", "chosen": "   ", "rejected": "#### 4"},
        {"prompt": "1+2=", "chosen": "#### 3", "rejected": None},
    ]
    path = write_rows(rows)
    with caplog.at_level(logging.WARNING, logger="ketch.data"):
        dataset = PreferenceDataset(path, tokenizer, DataConfig())
    assert len(dataset) == 1 and dataset.row_ids.tolist() == [0]
    assert dataset.num_skipped == {"chosen equal to rejected": 2, "an empty response": 2}
    [record] = [r.getMessage() for r in caplog.records]
    assert record == (
        f"skipped 4 of 5 preference pairs: 2 with chosen equal to rejected (first: {path}, row 1), "
        f"2 with an empty response (first: {path}, row 3)"
    )


def test_no_usable_pair_is_an_error(write_rows, tokenizer):
    with pytest.raises(DatasetError, match=r"no usable preference pair is left in .*1 with chosen equal to rejected"):
        PreferenceDataset(write_rows([{"prompt": "1=", "chosen": "a", "rejected": "a"}]), tokenizer, DataConfig())


def test_a_missing_column_names_the_file_and_the_setting(write_rows, tokenizer):
    path = write_rows([{"prompt": "1+2=", "chosen": "#### 3", "worse": "#### 4"}])
    with pytest.raises(DatasetError, match=f"data file {path} has no column 'rejected' \\(data.rejected_key\\)"):
        PreferenceDataset(path, tokenizer, DataConfig())
    assert len(PreferenceDataset(path, tokenizer, DataConfig(rejected_key="worse"))) == 1


def test_string_responses_without_a_prompt_column_name_the_prompt_key(write_rows, tokenizer):
    path = write_rows([{"question": "1+2=", "chosen": "#### 3", "rejected": "#### 4"}])
    with pytest.raises(
        DatasetError, match=r"row 0, column 'chosen' .*no prompt in column 'prompt' \(data.prompt_key\)"
    ):
        PreferenceDataset(path, tokenizer, DataConfig())
    assert len(PreferenceDataset(path, tokenizer, DataConfig(prompt_key="question"))) == 1


def test_a_chat_list_must_end_with_the_assistant_reply(write_rows, tokenizer):
    row = {"prompt": "x", "chosen": [{"role": "user", "content": "1+2="}], "rejected": "#### 4"}
    path = write_rows([row])
    with pytest.raises(
        DatasetError, match=rf"{path}, row 0, column 'chosen' \(data.chosen_key\): .*got roles \['user'\]"
    ):
        PreferenceDataset(path, tokenizer, DataConfig())


def test_builtin_pairs_prefer_the_right_answer_over_each_kind_of_rejected_reply():
    task = PreferenceTask(task=ArithmeticTask(num_train=40, num_val=8, seed=3), pairs_per_problem=2, max_offset=12)
    splits = generate_preference_task(task)
    assert (len(splits["sft"]), len(splits["train"]), len(splits["val"])) == (40, 80, 16)
    kinds = Counter(row["kind"] for row in splits["train"] + splits["val"])
    assert kinds == {"format": 61, "near_miss": 17, "far_miss": 18}  # 96 pairs drawn at shares 0.6, 0.2, 0.2
    for row in splits["train"] + splits["val"]:
        assert row["chosen"] == f"#### {row['answer']}"
        wrong = extract_answer(row["rejected"])
        if row["kind"] == "format":
            assert score_arithmetic("", row["rejected"], row["answer"]) == 0.0
        else:
            offset = abs(wrong - int(row["answer"]))
            assert 0 < offset <= 12 if row["kind"] == "near_miss" else 12 < offset <= 120
    problems = generate_arithmetic_task(task.task)["val"]
    assert [row["prompt"] for row in splits["val"]] == [p["prompt"] for p in problems for _ in range(2)]


def test_builtin_demonstrations_give_the_bare_number_at_the_sloppy_share():
    task = PreferenceTask(task=ArithmeticTask(num_train=200, num_val=8, seed=3), sloppy=0.5)
    demos = generate_preference_task(task)["sft"]
    bare = [d for d in demos if not d["response"].startswith("#### ")]
    assert len(bare) == 93 and all(d["response"] == d["answer"] for d in bare)
    assert all(d["response"] == f"#### {d['answer']}" for d in demos if d not in bare)


def test_builtin_preference_files_resolve_by_name():
    train, val = resolve_data_files(["builtin:arithmetic-preference/train", "builtin:arithmetic-preference/val"])
    assert train.endswith("train.parquet") and val.endswith("val.parquet") and "arithmetic-preference-" in train
    with pytest.raises(ValueError, match="builtin:arithmetic-preference/val"):
        resolve_data_files(["builtin:arithmetic-preference/test"])
