"""Re-encoding rollout samples for a reward model with another tokenizer or chat template."""

from __future__ import annotations

import numpy as np
import torch

from ketch.data import build_char_tokenizer, format_prompt
from ketch.data.batching import pad
from ketch.data.retokenize import needs_retokenize, retokenize
from ketch.protocol import DataProto
from ketch.rollout.base import assemble_sequences, response_mask_from_stops


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def rollout_batch(actor) -> DataProto:
    """Two samples as the rollout returns them: a chat prompt with a finished reply (EOS, then padding) and
    a string prompt with a reply cut off at the length limit (no EOS)."""
    raw_prompts = [[{"role": "user", "content": "1+2="}], "7="]
    prompt_ids = [torch.tensor(encode(actor, format_prompt(p, actor))) for p in raw_prompts]
    prompts = pad(prompt_ids, actor.pad_token_id, "left")
    replies = [[*encode(actor, "####3"), actor.eos_token_id], encode(actor, "####701")]
    responses = pad([torch.tensor(r) for r in replies], actor.pad_token_id, "right")
    mask = response_mask_from_stops(responses, [actor.eos_token_id])
    prompt_data = DataProto.from_dict({"input_ids": prompts, "attention_mask": (prompts != actor.pad_token_id).long()})
    data = assemble_sequences(prompt_data, responses.masked_fill(mask == 0, actor.pad_token_id), mask)
    data.non_tensor_batch["raw_prompt"] = np.array(raw_prompts, dtype=object)
    return data


def test_retokenize_when_the_vocabulary_or_the_template_differs(shifted_tokenizer):
    actor = build_char_tokenizer()
    assert not needs_retokenize(actor, build_char_tokenizer(), None, None)
    assert needs_retokenize(actor, shifted_tokenizer, None, None)
    assert needs_retokenize(actor, build_char_tokenizer(), None, "chatml")
    assert not needs_retokenize(actor, build_char_tokenizer(), "plain", None)  # the tokenizer's own is `plain`


def test_samples_are_decoded_re_templated_and_encoded_for_the_reward_model(shifted_tokenizer):
    actor, rm = build_char_tokenizer(), shifted_tokenizer
    input_ids, attention_mask = retokenize(rollout_batch(actor), actor, rm, None, [actor.eos_token_id])
    chat = "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    first = encode(rm, chat) + encode(rm, "####3") + [rm.eos_token_id]  # finished: the reward model's EOS
    second = encode(rm, "7=") + encode(rm, "####701")  # cut off: no EOS
    assert input_ids.tolist() == [first, second + [rm.pad_token_id] * (len(first) - len(second))]
    assert attention_mask.tolist() == [[1] * len(first), [1] * len(second) + [0] * (len(first) - len(second))]
    assert rm.decode(input_ids[0]) == chat + "####3<eos>"
    assert rm.eos_token_id == actor.eos_token_id + 2


def test_a_named_template_replaces_the_reward_models_own(shifted_tokenizer):
    actor, rm = build_char_tokenizer(), shifted_tokenizer
    input_ids, _ = retokenize(rollout_batch(actor), actor, rm, "zephyr", [actor.eos_token_id])
    assert rm.decode(input_ids[0]).startswith("<|user|>\n1+2=<eos>\n<|assistant|>\n####3<eos>")
