import re

import numpy as np
import pytest

from ketch.config.schema import DataConfig
from ketch.data import DatasetError, RLHFDataset, build_char_tokenizer, format_prompt, get_chat_template

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2="}]

RENDERED = {
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n",
    "zephyr": "<|system|>\nBe brief.<eos>\n<|user|>\n1+2=<eos>\n<|assistant|>\n",
    "llama-3": (
        "<bos><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n1+2=<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "plain": "system: Be brief.\nuser: 1+2=\nassistant: ",
}
GENERATION_PROMPTS = {
    "chatml": "<|im_start|>assistant\n",
    "zephyr": "<|assistant|>\n",
    "llama-3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "plain": "assistant: ",
}


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_named_template_renders_a_conversation(name, tokenizer):
    assert format_prompt(MESSAGES, tokenizer, chat_template=name) == RENDERED[name]


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_named_template_leaves_out_the_generation_prompt_when_not_asked(name, tokenizer):
    text = tokenizer.apply_chat_template(MESSAGES, chat_template=get_chat_template(name), tokenize=False)
    assert text == RENDERED[name].removesuffix(GENERATION_PROMPTS[name])


def test_assistant_turns_render_like_other_turns(tokenizer):
    messages = [*MESSAGES, {"role": "assistant", "content": "3"}, {"role": "user", "content": "2+2="}]
    assert format_prompt(messages, tokenizer, chat_template="chatml") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n"
        "<|im_start|>assistant\n3<|im_end|>\n<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    )


def test_unknown_template_name_lists_the_names():
    with pytest.raises(ValueError, match="unknown chat template 'vicuna'; the built-in ones are: chatml, zephyr"):
        get_chat_template("vicuna")


def test_string_prompt_is_returned_unchanged(tokenizer):
    assert format_prompt("347+58=", tokenizer, chat_template="chatml") == "347+58="


def test_without_a_name_the_tokenizers_own_template_is_used(tokenizer):
    assert format_prompt(MESSAGES, tokenizer) == "system: Be brief.\nuser: 1+2=\nassistant: "


def test_numpy_array_of_messages_renders_like_a_list(tokenizer):
    array = np.empty(2, dtype=object)
    array[:] = MESSAGES
    assert format_prompt(array, tokenizer, chat_template="chatml") == RENDERED["chatml"]


def test_apply_chat_template_false_joins_the_contents(tokenizer):
    assert format_prompt(MESSAGES, tokenizer, apply_chat_template=False) == "Be brief.\n1+2="


def test_tokenizer_without_template_asks_for_data_chat_template(tokenizer):
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match=r"tokenizer has no chat template; set data\.chat_template=chatml"):
        format_prompt(MESSAGES, tokenizer)


def test_message_without_content_is_named(tokenizer):
    expected = r"message 1 .* 'content' missing or not a string \(message keys: \['role'\]\)"
    with pytest.raises(ValueError, match=expected):
        format_prompt([MESSAGES[0], {"role": "user"}], tokenizer)


def test_message_that_is_not_a_dict_is_named(tokenizer):
    with pytest.raises(ValueError, match="message 0 of the prompt is a str, not a"):
        format_prompt(["hello"], tokenizer)


def test_empty_message_list_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="empty message list"):
        format_prompt([], tokenizer)


def test_prompt_of_another_type_is_rejected(tokenizer):
    with pytest.raises(ValueError, match=re.escape("string or a list of {role, content} messages, got int")):
        format_prompt(5, tokenizer)


def test_an_unknown_role_names_the_file_row_and_role(write_rows, tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "1+2="}]}, {"prompt": [{"role": "bot", "content": "3"}]}]
    path = write_rows(rows)
    expected = f"{path}, row 1, column 'prompt': message 0 of the prompt has the unknown role 'bot'; use one of: system"
    with pytest.raises(DatasetError, match=re.escape(expected)):
        RLHFDataset(path, tokenizer, DataConfig())


def test_a_template_that_fails_on_the_prompt_names_the_file_row_and_fix(write_rows, tokenizer):
    tokenizer.chat_template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}x"
    path = write_rows([{"prompt": MESSAGES}])
    expected = f"{path}, row 0, column 'prompt': chat template the tokenizer's"
    with pytest.raises(DatasetError, match=re.escape(expected) + ".*no system.*set data.chat_template to one of"):
        RLHFDataset(path, tokenizer, DataConfig())


LONG_CHAT = [*MESSAGES, {"role": "assistant", "content": "3"}, {"role": "user", "content": "2+2="}]


@pytest.mark.parametrize("name", ["chatml", "llama-3"])
def test_dataset_prompts_are_the_tokenizers_chat_template_token_for_token(name, write_rows):
    # The tokenizer's own template (no data.chat_template): its specials stay single tokens and the
    # llama-3 template's <bos> is not doubled by the encoding.
    specials = ("<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    tokenizer = build_char_tokenizer(extra_specials=specials, chat_template=name)
    path = write_rows([{"prompt": MESSAGES}, {"prompt": LONG_CHAT}])
    dataset = RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=256))
    for row, messages in enumerate([MESSAGES, LONG_CHAT]):
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        assert dataset[row]["input_ids"].tolist() == expected
    first = dataset[0]["input_ids"].tolist()
    if name == "chatml":  # <|im_start|> is id 0: system turn first, then the user's
        assert first[:8] == [0, *tokenizer.encode("system\n", add_special_tokens=False)]
    else:  # one <bos>, then the system header
        assert first[:2] == [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids("<|start_header_id|>")]
        assert first.count(tokenizer.bos_token_id) == 1
