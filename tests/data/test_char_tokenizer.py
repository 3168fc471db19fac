from pathlib import Path

from transformers import AutoTokenizer

from ketch.data import build_char_tokenizer


def test_special_token_ids():
    tok = build_char_tokenizer()
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert (tok.pad_token, tok.eos_token, tok.bos_token, tok.unk_token) == ("<pad>", "<eos>", "<bos>", "<unk>")


def test_vocabulary_is_newline_then_printable_ascii():
    tok = build_char_tokenizer()
    assert len(tok) == 100
    assert tok.convert_tokens_to_ids(["\n", " ", "0", "~"]) == [4, 5, 21, 99]


def test_encode_gives_one_token_per_character_and_adds_nothing():
    assert build_char_tokenizer().encode("#### 12") == [8, 8, 8, 8, 5, 22, 23]


def test_decode_round_trips_exactly():
    tok = build_char_tokenizer()
    text = "#### 12\n a , b . -3"
    assert tok.decode(tok.encode(text)) == text


def test_decode_skips_eos_and_pad_on_request():
    tok = build_char_tokenizer()
    assert tok.decode([0, 0, 22, 1]) == "<pad><pad>1<eos>"
    assert tok.decode([0, 0, 22, 1], skip_special_tokens=True) == "1"


def test_special_token_text_encodes_as_the_special_token():
    assert build_char_tokenizer().encode("1<eos>") == [22, 1]


def test_unknown_character_encodes_as_unk():
    assert build_char_tokenizer().encode("é1") == [3, 22]


def test_pads_on_the_left():
    batch = build_char_tokenizer()(["1", "123"], padding=True)
    assert batch["input_ids"] == [[0, 0, 22], [22, 23, 24]]
    assert batch["attention_mask"] == [[0, 0, 1], [1, 1, 1]]


def test_chat_template_writes_role_lines_and_generation_prompt():
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2="}]
    text = build_char_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "system: Add.\nuser: 1+2=\nassistant: "


def test_save_writes_tokenizer_json_and_config(tmp_path: Path):
    build_char_tokenizer().save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    assert (tmp_path / "tokenizer_config.json").is_file()


def test_loads_back_identically_with_auto_tokenizer(tmp_path: Path):
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "user: 347+58=\nassistant: #### 405<eos>"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.decode(tok.encode(text)) == text
    assert loaded.get_vocab() == tok.get_vocab()
    assert loaded.all_special_ids == tok.all_special_ids
    assert loaded.padding_side == "left"
    assert loaded.chat_template == tok.chat_template
