import logging
import re
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from ketch.config.schema import DataConfig
from ketch.data import DatasetError, RLHFDataset
from ketch.protocol import DataProto

# character ids of the built-in tokenizer: printable ASCII c -> ord(c) - 27
ONE_PLUS_TWO = [22, 16, 23, 34]  # "1+2="
TEN_PLUS_TWENTY = [22, 21, 16, 23, 21, 34]  # "10+20="
SEVEN = [28, 34]  # "7="

GSM8K_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "What is 6*12?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 0},
    },
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "4"},
        "extra_info": {"split": "train", "index": 1},
    },
]


def _prompts(*texts):
    return [{"prompt": text} for text in texts]


def test_simple_layout_item(write_rows, tokenizer):
    path = write_rows([{"prompt": "1+2=", "answer": "3", "response": "#### 3"}])
    item = RLHFDataset(path, tokenizer, DataConfig())[0]
    assert torch.equal(item["input_ids"], torch.tensor(ONE_PLUS_TWO))
    assert item["input_ids"].dtype == torch.long
    assert torch.equal(item["attention_mask"], torch.ones(4, dtype=torch.long))
    assert {k: v for k, v in item.items() if k not in ("input_ids", "attention_mask")} == {
        "raw_prompt": "1+2=",
        "data_source": "unknown",
        "ground_truth": "3",
        "extra_info": {},
        "index": 0,
        "source_row": f"{path}, row 0",
        "answer": "3",
        "response": "#### 3",
    }


def test_gsm8k_layout_item(write_rows, tokenizer):
    item = RLHFDataset(write_rows(GSM8K_ROWS), tokenizer, DataConfig(max_prompt_length=64))[1]
    assert tokenizer.decode(item["input_ids"]) == "system: Be brief.\nuser: What is 2+2?\nassistant: "
    assert item["raw_prompt"] == GSM8K_ROWS[1]["prompt"]
    assert item["data_source"] == "openai/gsm8k"
    assert item["ground_truth"] == "4"
    assert item["extra_info"] == {"split": "train", "index": 1}
    assert item["ability"] == "math"
    assert item["reward_model"] == {"style": "rule", "ground_truth": "4"}
    assert item["index"] == 1


def test_named_chat_template_is_applied(write_rows, tokenizer):
    config = DataConfig(max_prompt_length=128, chat_template="chatml")
    item = RLHFDataset(write_rows(GSM8K_ROWS), tokenizer, config)[0]
    assert tokenizer.decode(item["input_ids"]) == "<|im_start|>user\nWhat is 6*12?<|im_end|>\n<|im_start|>assistant\n"


def test_other_columns_pass_through(write_rows, tokenizer):
    path = write_rows([{"prompt": "1+2=", "chosen": "#### 3", "rejected": "#### 4", "level": 2}])
    item = RLHFDataset(path, tokenizer, DataConfig())[0]
    assert (item["chosen"], item["rejected"], item["level"]) == ("#### 3", "#### 4", 2)


def test_prompt_key_picks_the_column(write_rows, tokenizer):
    path = write_rows([{"question": "7=", "prompt": "unused"}])
    item = RLHFDataset(path, tokenizer, DataConfig(prompt_key="question"))[0]
    assert item["input_ids"].tolist() == SEVEN
    assert (item["raw_prompt"], item["prompt"]) == ("7=", "unused")
    assert "question" not in item


def test_builtin_entry_loads_the_generated_task(tokenizer):
    dataset = RLHFDataset("builtin:arithmetic/val", tokenizer, DataConfig())
    assert len(dataset) == 256
    assert dataset[0]["data_source"] == "ketch/arithmetic"


def test_files_are_concatenated_in_order_with_running_index(write_rows, tokenizer):
    first = write_rows(_prompts("1+2=", "7="), "a.parquet")
    second = write_rows([{"prompt": "10+20=", "note": "x"}], "b.parquet")
    dataset = RLHFDataset([first, second], tokenizer, DataConfig())
    assert [item["raw_prompt"] for item in dataset] == ["1+2=", "7=", "10+20="]
    assert [item["index"] for item in dataset] == [0, 1, 2]
    assert [item["note"] for item in dataset] == [None, None, "x"]


def test_max_samples_keeps_the_first_rows(write_rows, tokenizer):
    dataset = RLHFDataset(write_rows(_prompts("1+2=", "7=", "10+20=")), tokenizer, DataConfig(max_samples=2))
    assert [item["raw_prompt"] for item in dataset] == ["1+2=", "7="]


def test_collate_left_pads_and_counts_positions(write_rows, tokenizer):
    dataset = RLHFDataset(write_rows(_prompts("1+2=", "10+20=", "7=")), tokenizer, DataConfig())
    batch = dataset.collate([dataset[0], dataset[1], dataset[2]])
    assert batch["input_ids"].tolist() == [[0, 0, *ONE_PLUS_TWO], TEN_PLUS_TWENTY, [0, 0, 0, 0, *SEVEN]]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1], [1] * 6, [0, 0, 0, 0, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 0, 1]]


def test_collate_turns_other_fields_into_object_arrays(write_rows, tokenizer):
    dataset = RLHFDataset(write_rows(GSM8K_ROWS), tokenizer, DataConfig(max_prompt_length=64))
    batch = dataset.collate([dataset[0], dataset[1]])
    for key in ("raw_prompt", "data_source", "ground_truth", "extra_info", "index", "ability", "reward_model"):
        assert batch[key].dtype == object and batch[key].shape == (2,), key
    assert batch["raw_prompt"][1] == GSM8K_ROWS[1]["prompt"]
    assert batch["index"].tolist() == [0, 1]


def test_collated_batch_builds_a_dataproto(write_rows, tokenizer):
    dataset = RLHFDataset(write_rows(GSM8K_ROWS), tokenizer, DataConfig(max_prompt_length=64))
    data = DataProto.from_single_dict(dataset.collate([dataset[0], dataset[1]]))
    assert len(data) == 2
    assert sorted(data.batch) == ["attention_mask", "input_ids", "position_ids"]
    assert data.non_tensor_batch["ground_truth"].tolist() == ["72", "4"]


def test_dataloader_uses_collate(write_rows, tokenizer):
    dataset = RLHFDataset(write_rows(_prompts("1+2=", "10+20=", "7=")), tokenizer, DataConfig())
    batches = list(DataLoader(dataset, batch_size=2, collate_fn=dataset.collate))
    assert [tuple(b["input_ids"].shape) for b in batches] == [(2, 6), (1, 2)]


def test_tokenizer_without_pad_token_pads_with_eos(write_rows, tokenizer, caplog):
    tokenizer.pad_token = None
    with caplog.at_level(logging.WARNING, logger="ketch.data"):
        dataset = RLHFDataset(write_rows(_prompts("1+2=", "7=")), tokenizer, DataConfig())
    assert dataset.collate([dataset[0], dataset[1]])["input_ids"].tolist() == [ONE_PLUS_TWO, [1, 1, *SEVEN]]
    assert "no pad token; padding with its EOS token (id 1)" in caplog.text


def test_truncation_left_keeps_the_end(write_rows, tokenizer):
    config = DataConfig(max_prompt_length=4, truncation="left")
    item = RLHFDataset(write_rows(_prompts("10+20=")), tokenizer, config)[0]
    assert item["input_ids"].tolist() == TEN_PLUS_TWENTY[-4:]
    assert item["raw_prompt"] == "10+20="


def test_truncation_right_keeps_the_start(write_rows, tokenizer):
    config = DataConfig(max_prompt_length=4, truncation="right")
    item = RLHFDataset(write_rows(_prompts("10+20=")), tokenizer, config)[0]
    assert item["input_ids"].tolist() == TEN_PLUS_TWENTY[:4]


def test_truncation_error_names_file_row_and_length(write_rows, tokenizer):
    write_rows(_prompts("7="), "a.parquet")
    path = write_rows(_prompts("1+2=", "10+20=", "100+200="), "b.parquet")
    expected = f"{path}, row 1: the prompt is 6 tokens, longer than data.max_prompt_length=4 (and 1 more)"
    with pytest.raises(DatasetError, match=re.escape(expected)):
        RLHFDataset([str(Path(path).with_name("a.parquet")), path], tokenizer, DataConfig(max_prompt_length=4))


def test_filter_overlong_prompts_drops_and_counts(write_rows, tokenizer, caplog):
    config = DataConfig(max_prompt_length=4, filter_overlong_prompts=True)
    with caplog.at_level(logging.INFO, logger="ketch.data"):
        dataset = RLHFDataset(write_rows(_prompts("10+20=", "1+2=", "100+200=")), tokenizer, config)
    assert dataset.num_filtered == 2
    assert len(dataset) == 1
    assert (dataset[0]["raw_prompt"], dataset[0]["index"]) == ("1+2=", 1)
    assert "dropped 2 of 3 prompts longer than data.max_prompt_length=4 tokens" in caplog.text


def test_nothing_filtered_counts_zero(write_rows, tokenizer):
    dataset = RLHFDataset(write_rows(_prompts("1+2=")), tokenizer, DataConfig(filter_overlong_prompts=True))
    assert dataset.num_filtered == 0


def test_fsspec_memory_url(tokenizer):
    url = f"memory://ketch-tests/{uuid.uuid4().hex}/train.parquet"
    with fsspec.open(url, "wb") as f:
        pq.write_table(pa.Table.from_pylist(_prompts("7=")), f)
    try:
        assert RLHFDataset(url, tokenizer, DataConfig())[0]["input_ids"].tolist() == SEVEN
    finally:
        fsspec.filesystem("memory").rm(url)


def test_missing_file_is_named(tmp_path, tokenizer):
    path = tmp_path / "missing.parquet"
    with pytest.raises(DatasetError, match=f"data file not found: {re.escape(str(path))}"):
        RLHFDataset(str(path), tokenizer, DataConfig())


def test_empty_file_is_rejected(tmp_path, tokenizer):
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    with pytest.raises(DatasetError, match=f"data file {re.escape(str(path))} has no rows"):
        RLHFDataset(str(path), tokenizer, DataConfig())


def test_corrupt_file_is_rejected(tmp_path, tokenizer):
    path = tmp_path / "corrupt.parquet"
    path.write_bytes(b"this is not parquet")
    with pytest.raises(DatasetError, match=f"cannot read {re.escape(str(path))} as a Parquet file"):
        RLHFDataset(str(path), tokenizer, DataConfig())


def test_missing_prompt_column_lists_the_columns(write_rows, tokenizer):
    path = write_rows([{"question": "1+2=", "answer": "3"}])
    expected = (
        f"data file {path} has no column 'prompt' (data.prompt_key); its columns are: question, answer; "
        "set data.prompt_key=<one of them>"
    )
    with pytest.raises(DatasetError, match=re.escape(expected)):
        RLHFDataset(path, tokenizer, DataConfig())


def test_prompt_cell_of_wrong_type_names_file_and_row(write_rows, tokenizer):
    path = write_rows([{"prompt": 5}, {"prompt": 6}])
    with pytest.raises(DatasetError, match=re.escape(f"{path}, row 0, column 'prompt': a prompt must be a string")):
        RLHFDataset(path, tokenizer, DataConfig())


def test_bad_message_names_file_and_row(write_rows, tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "hi"}]}, {"prompt": [{"role": "user", "content": None}]}]
    path = write_rows(rows)
    with pytest.raises(DatasetError, match=re.escape(f"{path}, row 1, column 'prompt': message 0 of the prompt")):
        RLHFDataset(path, tokenizer, DataConfig())


def test_column_named_like_an_added_field_is_rejected(write_rows, tokenizer):
    with pytest.raises(DatasetError, match=re.escape("column(s) ['index'], which the dataset fills itself")):
        RLHFDataset(write_rows([{"prompt": "7=", "index": 3}]), tokenizer, DataConfig())


def test_pandas_index_column_is_dropped(tmp_path, tokenizer):
    path = tmp_path / "pandas.parquet"
    table = pa.table({"prompt": ["7="], "__index_level_0__": np.array([5])})
    pq.write_table(table, path)
    assert "__index_level_0__" not in RLHFDataset(str(path), tokenizer, DataConfig())[0]


def test_filtering_every_prompt_is_an_error(write_rows, tokenizer):
    config = DataConfig(max_prompt_length=3, filter_overlong_prompts=True)
    with pytest.raises(DatasetError, match=re.escape("every prompt is longer than data.max_prompt_length=3 tokens")):
        RLHFDataset(write_rows(_prompts("1+2=", "7=12")), tokenizer, config)


def test_unknown_chat_template_names_the_setting(write_rows, tokenizer):
    with pytest.raises(DatasetError, match=re.escape("data.chat_template: unknown chat template 'vicuna'")):
        RLHFDataset(write_rows(GSM8K_ROWS), tokenizer, DataConfig(chat_template="vicuna"))


def test_empty_file_list_is_rejected(tokenizer):
    with pytest.raises(DatasetError, match="no data files given"):
        RLHFDataset([], tokenizer, DataConfig())


def test_negative_index_counts_from_the_end(write_rows, tokenizer):
    dataset = RLHFDataset(write_rows(_prompts("1+2=", "7=")), tokenizer, DataConfig())
    assert dataset[-1]["raw_prompt"] == "7="
