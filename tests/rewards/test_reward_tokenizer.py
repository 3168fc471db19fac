from ketch.protocol import DataProto


def test_char_tokenizer_round_trips_text_with_spaces(char_tokenizer):
    ids = char_tokenizer.encode("#### 12", add_special_tokens=False)
    assert len(ids) == 7
    assert char_tokenizer.decode(ids) == "#### 12"


def test_char_tokenizer_skips_eos_and_pad_when_decoding(char_tokenizer):
    ids = [*char_tokenizer.encode("a  b", add_special_tokens=False), char_tokenizer.eos_token_id, 0, 0]
    assert char_tokenizer.decode(ids, skip_special_tokens=True) == "a  b"


def test_make_batch_masks_text_and_eos(make_batch):
    data: DataProto = make_batch(["#### 1"], ["1"], response_len=9)
    assert data.batch["response_mask"].tolist() == [[1, 1, 1, 1, 1, 1, 1, 0, 0]]
