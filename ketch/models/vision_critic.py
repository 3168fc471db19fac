"""A critic on a vision-language model: its backbone (vision encoder, projector, language model) with a scalar value
head on the language model's hidden states. transformers has no `*ForTokenClassification` class for these families;
`VisionTokenClassifier` is that class's shape (`model` the backbone, `score` the head), which
`ketch.engine.heads.ValueModel` reads."""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import TokenClassifierOutput


class VisionTokenClassifier(nn.Module):
    """The backbone `model` of an image-text-to-text model with a one-label linear head `score` `[hidden] -> [1]`
    (the language model's output projection left out), initialised as transformers initialises a token
    classifier's head: normal weights of the config's `initializer_range`, a zero bias."""

    def __init__(self, vlm: nn.Module):
        super().__init__()
        self.model, self.config = vlm.model, vlm.config
        text = vlm.config.get_text_config()
        weight = next(vlm.model.parameters())
        self.score = nn.Linear(text.hidden_size, 1, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.score.weight.normal_(0.0, getattr(text, "initializer_range", 0.02))
            self.score.bias.zero_()

    @property
    def base_model(self) -> nn.Module:
        return self.model

    @property
    def _supports_attention_backend(self) -> bool:
        """Whether the backbone's attention goes through transformers' attention interface (as HF models say)."""
        return bool(getattr(self.model, "_supports_attention_backend", False))

    def set_attn_implementation(self, name: str) -> None:
        self.model.set_attn_implementation(name)

    def get_decoder(self) -> nn.Module:
        """The language model (its transformer blocks: what FSDP shards one by one)."""
        return self.model.get_decoder()

    def forward(self, **inputs) -> TokenClassifierOutput:
        """`logits`: the per-token values `[batch, seq, 1]` of the backbone's last hidden states for HF keyword
        `inputs`, as a token classifier returns them."""
        return TokenClassifierOutput(logits=self.score(self.model(**inputs)[0]))
