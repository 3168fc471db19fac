"""Token ids for the parts of a conversation the model does not sample: the opening prompt, and the "glue"
after each of its turns (the end of its turn as the chat template writes it, the new messages, and the next
generation prompt). Each is rendered with the tokenizer's chat template and tokenized once; the model's own
tokens are never re-tokenized."""

from __future__ import annotations

from typing import Any

from ketch.data.chat_templates import get_chat_template

_MARK = "KETCH-TURN-MARK"
"""Stands for the model's sampled turn when rendering; the glue is what the template writes after it."""


class ChatRenderer:
    """Renders with `tokenizer`'s chat template, or the built-in template named `chat_template`."""

    def __init__(self, tokenizer, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.template = get_chat_template(chat_template) if chat_template else None
        if self.template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "multi-turn rollouts render conversations with a chat template, and the tokenizer has none; "
                "set data.chat_template (e.g. chatml)"
            )

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        """The opening messages with the generation prompt, as the model is asked to continue them."""
        return self._encode(self._render(messages, tools, add_generation_prompt=True))

    def glue_ids(self, new_messages: list[dict[str, Any]], tools: list[dict] | None, last_token: int) -> list[int]:
        """What follows the model's turn (whose last sampled token is `last_token`) up to its next turn."""
        opening = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
        text = self._render([*opening, *new_messages], tools, add_generation_prompt=True)
        glue = text[text.index(_MARK) + len(_MARK) :]
        sampled_end = self.tokenizer.decode([last_token])
        if sampled_end and glue.startswith(sampled_end):  # the model already wrote the template's end of turn
            glue = glue[len(sampled_end) :]
        return self._encode(glue)

    def _render(self, messages: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]
