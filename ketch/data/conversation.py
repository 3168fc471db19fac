"""Token ids of a conversation the way a multi-turn rollout builds them: the opening prompt, then each of the
model's turns (its own tokens and the stop token) followed by the "glue" (the end of its turn as the chat
template writes it, the tool or user messages, and the next generation prompt). Prompt and glue are rendered
with the chat template and tokenized once; the model's own tokens are never re-tokenized.

`ChatRenderer` serves the turn loop (`ketch.rollout.multi_turn`); `conversation_tokens` builds a multi-turn SFT
demonstration from the same pieces, so SFT trains on exactly the tokens a rollout would hold, with the loss on
the model's turns only. With a vision-language model's processor, the prompt and the glue may hold images (an
`<image>` marker in the text, or an image part of a content list): the processor expands each into the image's
vision tokens and gives the image tensors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ketch.data.chat_templates import get_chat_template, to_messages
from ketch.data.images import IMAGE_MARKER, check_image_count, image_tensors, with_image_markers

_MARK = "KETCH-TURN-MARK"
"""Stands for the model's sampled turn when rendering; the glue is what the template writes after it."""


def prompt_messages(prompt: Any) -> list[dict[str, Any]]:
    """A prompt cell as chat messages (a plain string becomes one user message; content lists are joined into text,
    an `<image>` marker for each image entry)."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else to_messages(with_image_markers(prompt))


def row_tool_names(row: Mapping[str, Any]) -> list[str] | None:
    """The names of the tools a row allows: its `tools` column, else `extra_info["tools"]`; None if it names none."""
    names = row.get("tools")
    extra = row.get("extra_info")
    if names is None and isinstance(extra, Mapping):
        names = extra.get("tools")
    return None if names is None else list(names)


class ChatRenderer:
    """Renders with `tokenizer`'s chat template, or the built-in template named `chat_template`; `processor` (a
    vision-language model's, `ketch.models.vision.load_image_processor`) expands images into vision tokens."""

    def __init__(self, tokenizer, chat_template: str | None = None, processor: Any | None = None):
        self.tokenizer, self.processor = tokenizer, processor
        self.template = get_chat_template(chat_template) if chat_template else None
        if self.template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "multi-turn conversations are rendered with a chat template, and the tokenizer has none; "
                "set data.chat_template (e.g. chatml)"
            )

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        """The opening messages with the generation prompt, as the model is asked to continue them."""
        return self.encode(self._render(messages, tools, add_generation_prompt=True))

    def prompt_inputs(
        self, messages: list[dict[str, Any]], tools: list[dict] | None, images: list
    ) -> tuple[list[int], dict[str, Any]]:
        """`prompt_ids` of `messages` whose `<image>` markers stand for `images` (in order): the ids with each image's
        vision tokens, and the images' tensors (`ketch.data.images.image_tensors`; empty without images)."""
        return self._with_images(self._render(messages, tools, add_generation_prompt=True), images)

    def glue_ids(self, new_messages: list[dict[str, Any]], tools: list[dict] | None, last_token: int) -> list[int]:
        """What follows the model's turn (whose last sampled token is `last_token`) up to its next turn."""
        return self.encode(self._glue_text(new_messages, tools, last_token))

    def glue_inputs(
        self, messages: list[dict[str, Any]], images: list, tools: list[dict] | None, last_token: int, room: int
    ) -> tuple[list[int], dict[str, Any], bool]:
        """`glue_ids` of messages whose `<image>` markers stand for `images` (in order; `joined_messages` of
        `ketch.data.images` gives both from messages with image parts), cut to `room` tokens: the ids with each
        image's vision tokens, the images' tensors (empty without images), and whether the glue fits whole. A glue
        with images that does not fit is cut before its first image, which it drops: an image's vision tokens are
        never cut."""
        text = self._glue_text(messages, tools, last_token)
        ids, inputs = self._with_images(text, images)
        whole = len(ids) <= room
        if not whole and images:
            ids, inputs = self.encode(text[: text.index(IMAGE_MARKER)]), {}
        return ids[:room], inputs, whole

    def _glue_text(self, new_messages: list[dict[str, Any]], tools: list[dict] | None, last_token: int) -> str:
        opening = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
        text = self._render([*opening, *new_messages], tools, add_generation_prompt=True)
        glue = text[text.index(_MARK) + len(_MARK) :]
        sampled_end = self.tokenizer.decode([last_token])
        if sampled_end and glue.startswith(sampled_end):  # the model already wrote the template's end of turn
            glue = glue[len(sampled_end) :]
        return glue

    def _with_images(self, text: str, images: list) -> tuple[list[int], dict[str, Any]]:
        """`text`'s ids with the vision tokens of `images`, one for each `<image>` marker, and their tensors."""
        if self.processor is None:
            if images:
                raise ValueError("the conversation holds images, and the model is text-only (it has no processor)")
            return self.encode(text), {}
        check_image_count(text, images)
        if not images:
            return self.encode(text), {}
        text = text.replace(IMAGE_MARKER, self.processor.image_placeholder)
        out = self.processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
        return out["input_ids"][0].tolist(), image_tensors(out)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _render(self, messages: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )


def conversation_tokens(
    renderer: ChatRenderer,
    messages: list[dict[str, Any]],
    stop_token: int,
    stop: tuple[str, ...] = (),
    tools: list[dict] | None = None,
) -> tuple[list[int], list[int]]:
    """(ids, loss_mask) of the response part of a conversation, `messages` being what follows the prompt: each
    assistant message is its content's tokens and `stop_token` (loss 1; no stop token where the content ends
    with one of the `stop` strings, as a rollout's turn ends there), each run of other messages (tool results,
    user replies) the glue before the next assistant turn (loss 0), rendered with the JSON schemas `tools` as
    the rollout renders it. `messages` must begin and end with an assistant message."""
    roles = [m.get("role") for m in messages]
    if not messages or roles[0] != "assistant" or roles[-1] != "assistant":
        raise ValueError(f"the response must begin and end with an assistant message; its roles: {roles}")
    ids: list[int] = []
    loss_mask: list[int] = []
    pending: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] != "assistant":
            pending.append(message)
            continue
        if pending:
            glue = renderer.glue_ids(pending, tools, ids[-1])
            ids, loss_mask, pending = ids + glue, loss_mask + [0] * len(glue), []
        content = message["content"]
        turn = renderer.encode(content) + ([] if content.endswith(tuple(stop)) else [stop_token])
        ids, loss_mask = ids + turn, loss_mask + [1] * len(turn)
    return ids, loss_mask
