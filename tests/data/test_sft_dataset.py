import re

import pytest

from ketch.config.schema import DataConfig
from ketch.data import DatasetError, SFTDataset
from ketch.protocol import DataProto

# character ids of the built-in tokenizer: printable ASCII c -> ord(c) - 27; <eos> is 1, <pad> 0
SEQUENCE = [22, 16, 23, 34, 8, 8, 8, 8, 5, 24, 1]  # "1+2=" + "#### 3" + <eos>
LOSS_MASK = [0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1]
SHORT_SEQUENCE = [28, 34, 8, 8, 8, 8, 5, 28, 1]  # "7=" + "#### 7" + <eos>
ROWS = [{"prompt": "1+2=", "response": "#### 3"}, {"prompt": "7=", "response": "#### 7"}]


def test_item_is_prompt_response_eos_with_loss_on_response(write_rows, tokenizer):
    item = SFTDataset(write_rows(ROWS), tokenizer, DataConfig())[0]
    assert item["input_ids"].tolist() == SEQUENCE
    assert item["attention_mask"].tolist() == [1] * 11
    assert item["loss_mask"].tolist() == LOSS_MASK
    assert item["index"] == 0


def test_collate_right_pads(write_rows, tokenizer):
    dataset = SFTDataset(write_rows(ROWS), tokenizer, DataConfig())
    batch = dataset.collate([dataset[0], dataset[1]])
    assert batch["input_ids"].tolist() == [SEQUENCE, [*SHORT_SEQUENCE, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1] * 11, [1] * 9 + [0, 0]]
    assert batch["position_ids"].tolist() == [list(range(11)), [*range(9), 8, 8]]
    assert batch["loss_mask"].tolist() == [LOSS_MASK, [0, 0] + [1] * 7 + [0, 0]]
    assert batch["index"].tolist() == [0, 1]


def test_collated_batch_builds_a_dataproto(write_rows, tokenizer):
    dataset = SFTDataset(write_rows(ROWS), tokenizer, DataConfig())
    data = DataProto.from_single_dict(dataset.collate([dataset[0], dataset[1]]))
    assert sorted(data.batch) == ["attention_mask", "input_ids", "loss_mask", "position_ids"]


def test_chat_prompt_is_formatted_before_the_response(write_rows, tokenizer):
    path = write_rows([{"prompt": [{"role": "user", "content": "1+2="}], "response": "#### 3"}])
    item = SFTDataset(path, tokenizer, DataConfig())[0]
    assert tokenizer.decode(item["input_ids"]) == "user: 1+2=\nassistant: #### 3<eos>"
    assert item["loss_mask"].tolist() == [0] * 22 + [1] * 7


CONVERSATION = [
    {"role": "assistant", "content": "<c>3*4</c>"},
    {"role": "tool", "content": "12"},
    {"role": "assistant", "content": "#### 12"},
]


def test_a_conversation_response_trains_the_assistant_turns_only(write_rows, tokenizer):
    path = write_rows([{"prompt": [{"role": "user", "content": "3*4="}], "response": CONVERSATION}])
    config = DataConfig(max_response_length=64)
    item = SFTDataset(path, tokenizer, config)[0]
    text = "user: 3*4=\nassistant: <c>3*4</c><eos>\ntool: 12\nassistant: #### 12<eos>"
    assert tokenizer.decode(item["input_ids"]) == text
    # prompt 22, "<c>3*4</c>" + EOS 11 (trained), glue "\ntool: 12\nassistant: " 21, "#### 12" + EOS 8 (trained)
    assert item["loss_mask"].tolist() == [0] * 22 + [1] * 11 + [0] * 21 + [1] * 8
    # A turn that ends with a stop string (the end of a tool call) ends there, as a rollout's turn does: no EOS.
    item = SFTDataset(path, tokenizer, config, turn_stop=("</c>",))[0]
    assert tokenizer.decode(item["input_ids"]) == text.replace("</c><eos>", "</c>", 1)
    assert item["loss_mask"].tolist() == [0] * 22 + [1] * 10 + [0] * 21 + [1] * 8


def test_a_conversation_response_must_end_with_the_assistant(write_rows, tokenizer):
    path = write_rows([{"prompt": "3*4=", "response": CONVERSATION[:2]}])
    expected = "the response must begin and end with an assistant message; its roles: ['assistant', 'tool']"
    with pytest.raises(DatasetError, match=re.escape(f"{path}, row 0, column 'response' (data.response_key): ")):
        SFTDataset(path, tokenizer, DataConfig())
    with pytest.raises(DatasetError, match=re.escape(expected)):
        SFTDataset(path, tokenizer, DataConfig())


def test_response_key_picks_the_column(write_rows, tokenizer):
    path = write_rows([{"prompt": "1+2=", "target": "#### 3"}])
    item = SFTDataset(path, tokenizer, DataConfig(response_key="target"))[0]
    assert item["input_ids"].tolist() == SEQUENCE


def test_truncation_left_drops_from_the_prompt_side(write_rows, tokenizer):
    config = DataConfig(max_prompt_length=2, max_response_length=8, truncation="left")
    item = SFTDataset(write_rows(ROWS[:1]), tokenizer, config)[0]
    assert item["input_ids"].tolist() == SEQUENCE[1:]
    assert item["loss_mask"].tolist() == LOSS_MASK[1:]


def test_truncation_left_past_the_prompt_cuts_into_the_response(write_rows, tokenizer):
    config = DataConfig(max_prompt_length=1, max_response_length=4, truncation="left")
    item = SFTDataset(write_rows(ROWS[:1]), tokenizer, config)[0]
    assert item["input_ids"].tolist() == SEQUENCE[6:]
    assert item["loss_mask"].tolist() == [1] * 5


def test_truncation_right_drops_the_response_end(write_rows, tokenizer):
    config = DataConfig(max_prompt_length=2, max_response_length=8, truncation="right")
    item = SFTDataset(write_rows(ROWS[:1]), tokenizer, config)[0]
    assert item["input_ids"].tolist() == SEQUENCE[:10]
    assert item["loss_mask"].tolist() == LOSS_MASK[:10]


def test_truncation_error_names_file_row_and_length(write_rows, tokenizer):
    path = write_rows(ROWS)
    expected = (
        f"{path}, row 0: the sequence is 11 tokens, longer than data.max_prompt_length + data.max_response_length=10"
    )
    with pytest.raises(DatasetError, match=re.escape(expected)):
        SFTDataset(path, tokenizer, DataConfig(max_prompt_length=2, max_response_length=8))


def test_filter_overlong_drops_and_counts(write_rows, tokenizer):
    config = DataConfig(max_prompt_length=2, max_response_length=8, filter_overlong_prompts=True)
    dataset = SFTDataset(write_rows(ROWS), tokenizer, config)
    assert dataset.num_filtered == 1
    assert [item["index"] for item in dataset] == [1]


def test_missing_response_column_is_named(write_rows, tokenizer):
    path = write_rows([{"prompt": "1+2=", "answer": "3"}])
    expected = f"data file {path} has no column 'response' (data.response_key); its columns are: prompt, answer"
    with pytest.raises(DatasetError, match=re.escape(expected)):
        SFTDataset(path, tokenizer, DataConfig())


def test_response_that_is_not_a_string_names_file_and_row(write_rows, tokenizer):
    path = write_rows([{"prompt": "1+2=", "response": "#### 3"}, {"prompt": "7=", "response": None}])
    expected = (
        f"{path}, row 1, column 'response' (data.response_key): "
        "the response must be a string or a list of messages, got NoneType"
    )
    with pytest.raises(DatasetError, match=re.escape(expected)):
        SFTDataset(path, tokenizer, DataConfig())


def test_tokenizer_without_eos_is_rejected(write_rows, tokenizer):
    tokenizer.eos_token = None
    with pytest.raises(DatasetError, match="the tokenizer has no EOS token"):
        SFTDataset(write_rows(ROWS), tokenizer, DataConfig())
