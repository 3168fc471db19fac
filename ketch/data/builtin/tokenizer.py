"""A character-level tokenizer for the built-in arithmetic task: one token per character.

Ids: `<pad>` 0, `<eos>` 1, `<bos>` 2, `<unk>` 3, then newline 4 and the printable ASCII characters
space (5) to `~` (99) in code-point order; 100 tokens in all. Any other character encodes as `<unk>`.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from ketch.data.chat_templates import get_chat_template

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")
CHARACTERS = ("\n", *(chr(code) for code in range(32, 127)))


def build_char_tokenizer(extra_specials: tuple[str, ...] = (), chat_template: str = "plain") -> PreTrainedTokenizerFast:
    """A fast tokenizer mapping every character to its own token; padding on the left, nothing added on encode.

    Its chat template (`plain`) writes each message as `role: content` on its own line and ends with
    `assistant: ` as the generation prompt. `extra_specials` go in front of the ids above, moving every
    other id up (the same text under other ids, as a second model's tokenizer may have it).
    """
    specials = (*extra_specials, *SPECIAL_TOKENS)
    vocab = {token: i for i, token in enumerate((*specials, *CHARACTERS))}
    # A BPE model without merges splits text into single characters, each looked up in the vocabulary.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
        chat_template=get_chat_template(chat_template),
    )
