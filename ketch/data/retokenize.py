"""Re-encode rollout samples for a reward model whose tokenizer or chat template differs from the actor's.

The sequence is built as `PreferenceDataset` builds it for `ketch rm`: prompt text + reply + EOS, so a
reward model trained by ketch sees in PPO what it saw in training.
"""

from __future__ import annotations

from typing import Any

import torch

from ketch.data.batching import encode, pad, pad_token_id
from ketch.data.chat_templates import format_prompt, get_chat_template
from ketch.protocol import DataProto


def needs_retokenize(
    actor_tokenizer: Any, rm_tokenizer: Any, actor_template: str | None, rm_template: str | None
) -> bool:
    """Whether the reward model reads token ids differently from the actor: another vocabulary or EOS, or
    another chat template (`*_template` name built-in templates; None = the tokenizer's own)."""
    if actor_tokenizer.get_vocab() != rm_tokenizer.get_vocab():
        return True
    if actor_tokenizer.eos_token_id != rm_tokenizer.eos_token_id:
        return True
    return _template(actor_tokenizer, actor_template) != _template(rm_tokenizer, rm_template)


def retokenize(
    data: DataProto, actor_tokenizer: Any, rm_tokenizer: Any, chat_template: str | None, stop_token_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`input_ids` and `attention_mask` `[batch, seq]` (right-padded) of each sample for the reward model.

    `data` holds `prompts` `[batch, prompt_len]` (left-padded), `responses`, `response_mask`
    `[batch, response_len]`, `attention_mask` `[batch, prompt_len + response_len]` and, optionally, the
    non-tensor `raw_prompt`. A chat-list raw prompt is rendered with `chat_template` (a built-in name) or the
    reward model's own template; any other prompt is decoded from the actor's tokens. The reply is decoded
    with the actor's tokenizer (special tokens dropped) and followed by the reward model's EOS when the
    response ended with one of `stop_token_ids`."""
    b = data.batch
    prompt_mask = b["attention_mask"][:, : b["prompts"].shape[1]].bool()
    raw_prompts = data.non_tensor_batch.get("raw_prompt")
    prompt_texts, reply_texts, finished = [], [], []
    for i in range(len(data)):
        raw = raw_prompts[i] if raw_prompts is not None else None
        if raw is not None and not isinstance(raw, str):
            prompt_texts.append(format_prompt(raw, rm_tokenizer, chat_template))
        else:
            prompt_texts.append(actor_tokenizer.decode(b["prompts"][i][prompt_mask[i]], skip_special_tokens=True))
        reply = b["responses"][i][b["response_mask"][i].bool()]
        reply_texts.append(actor_tokenizer.decode(reply, skip_special_tokens=True))
        finished.append(len(reply) > 0 and int(reply[-1]) in stop_token_ids)
    eos = rm_tokenizer.eos_token_id
    sequences = [
        torch.tensor(p + r + ([eos] if done and eos is not None else []), dtype=torch.long)
        for p, r, done in zip(
            encode(rm_tokenizer, prompt_texts), encode(rm_tokenizer, reply_texts), finished, strict=True
        )
    ]
    input_ids = pad(sequences, pad_token_id(rm_tokenizer), "right")
    attention_mask = pad([torch.ones_like(s) for s in sequences], 0, "right")
    return input_ids, attention_mask


def _template(tokenizer: Any, name: str | None) -> str | None:
    return get_chat_template(name) if name else getattr(tokenizer, "chat_template", None)
