from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from ketch.data import build_char_tokenizer
from ketch.protocol import DataProto
from ketch.rewards.scorer import decode_rows


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


def test_a_batch_decodes_as_batch_decode_does_in_one_backend_call_or_with_its_space_clean_up():
    tokenizer = build_char_tokenizer()
    rows = [[*tokenizer.encode("a , b", add_special_tokens=False), tokenizer.eos_token_id], [], [0, 0]]
    assert decode_rows(tokenizer, rows) == ["a , b", "", ""]
    # a word-level tokenizer that cleans up the spaces before punctuation: transformers' own decoding
    words = Tokenizer(WordLevel({"a": 0, ",": 1, "b": 2, "<unk>": 3}, unk_token="<unk>"))
    words.pre_tokenizer = Whitespace()
    cleaning = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", clean_up_tokenization_spaces=True)
    assert words.decode([0, 1, 2]) == "a , b"
    assert decode_rows(cleaning, [[0, 1, 2]]) == ["a, b"]
