"""Built-in chat templates and `format_prompt`, which turns a dataset prompt cell into prompt text.

A prompt cell is either a plain string (used as it is) or a chat message list
`[{"role": ..., "content": ...}, ...]` (rendered with a chat template, ending with the generation prompt).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from jinja2 import TemplateError

from ketch.data.values import to_python

ROLES = ("system", "developer", "user", "assistant", "tool")
"""The roles a chat message may have (a template renders each as its model expects)."""

CHAT_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for message in messages %}"
        "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "zephyr": (
        "{% for message in messages %}"
        "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
    "llama-3": (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    "plain": (
        "{% for message in messages %}"
        "{{ message['role'] }}: {{ message['content'] }}\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    ),
}
"""Jinja chat templates by name: ChatML, Zephyr, Llama 3, and `plain` (`role: content` lines)."""


def get_chat_template(name: str) -> str:
    """The Jinja source of the built-in chat template `name`."""
    if name not in CHAT_TEMPLATES:
        raise ValueError(f"unknown chat template {name!r}; the built-in ones are: {', '.join(CHAT_TEMPLATES)}")
    return CHAT_TEMPLATES[name]


def to_messages(prompt: Any) -> list[dict[str, str]]:
    """Check a chat message list (a list or numpy array of {role, content} dicts) and return it as plain Python."""
    if not isinstance(prompt, list | tuple | np.ndarray):
        raise ValueError(
            f"a prompt must be a string or a list of {{role, content}} messages, got {type(prompt).__name__}"
        )
    messages = to_python(list(prompt))
    if not messages:
        raise ValueError("the prompt is an empty message list; give at least one {role, content} message")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {i} of the prompt is a {type(message).__name__}, not a {{role, content}} dict")
        missing = [key for key in ("role", "content") if not isinstance(message.get(key), str)]
        if missing:
            raise ValueError(
                f"message {i} of the prompt needs string fields 'role' and 'content'; "
                f"{' and '.join(repr(k) for k in missing)} missing or not a string (message keys: {sorted(message)})"
            )
        if message["role"] not in ROLES:
            raise ValueError(
                f"message {i} of the prompt has the unknown role {message['role']!r}; use one of: {', '.join(ROLES)}"
            )
    return messages


def format_prompt(
    prompt: str | list[dict[str, str]] | np.ndarray,
    tokenizer: Any,
    chat_template: str | None = None,
    apply_chat_template: bool = True,
) -> str:
    """The prompt text to tokenize.

    A string is returned unchanged. A message list is rendered with the built-in template named
    `chat_template`, else the tokenizer's own, with the generation prompt appended; with
    `apply_chat_template=False` its contents are joined with newlines instead (no roles, no template).
    """
    if isinstance(prompt, str):
        return prompt
    messages = to_messages(prompt)
    if not apply_chat_template:
        return "\n".join(message["content"] for message in messages)
    template = get_chat_template(chat_template) if chat_template else None
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the prompt is a chat message list but the tokenizer has no chat template; set "
            f"data.chat_template=chatml (or one of: {', '.join(CHAT_TEMPLATES)}), "
            "or data.apply_chat_template=false to join the message contents"
        )
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=True, tokenize=False
        )
    except TemplateError as err:
        source = f"the built-in {chat_template!r}" if template else f"the tokenizer's ({tokenizer.name_or_path})"
        raise ValueError(
            f"chat template {source} fails on the prompt: {err}; change the messages to the form the template "
            "expects, or set data.chat_template to one of: " + ", ".join(CHAT_TEMPLATES)
        ) from None
