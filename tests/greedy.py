"""transformers' greedy `generate`, the reference the static decoder's tests compare with."""

from __future__ import annotations

import torch


def generate_greedy(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`model.generate`'s greedy tokens `[batch, max_new_tokens]` after left-padded prompts `[batch, prompt_len]`
    (no stop token) and their log-probs under the model's logits."""
    out = model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=pad_token_id,
        eos_token_id=None,
    )
    tokens = out.sequences[:, input_ids.shape[1] :]
    return tokens, torch.stack(out.logits, 1).log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
