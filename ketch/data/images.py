"""Images of prompt rows (verl's layout): an `images` cell holds one image or a list of them, each PNG/JPEG bytes, a
file path, or a `{"bytes", "path"}` dict (as Hugging Face datasets store images); the prompt marks where each goes
with an `<image>` placeholder in its text, or a `{"type": "image"}` entry in a message's content list. A multi-turn
environment's answer (a tool's result) may hold images too (`message_content`): `{"type": "image", "image": ...}`
parts of its content list, which carry the image itself."""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from ketch.data.errors import DatasetError
from ketch.data.parquet import Rows
from ketch.data.values import to_python

IMAGE_MARKER = "<image>"
"""Where an image goes in a prompt's text; replaced by the processor's `image_placeholder` before tokenizing."""

IMAGE_INPUTS = ("pixel_values", "image_grid_thw")
"""The processor's outputs that describe a row's images (the others are per token, found again from its ids)."""

_ENTRY_FORMS = 'PNG/JPEG bytes, a path to an image file, or a {"bytes": ..., "path": ...} dict'


def row_images(cell: Any) -> list[Image.Image]:
    """The images of one `images` cell (None: none), decoded as RGB; a bad entry raises ValueError naming it."""
    if cell is None:
        return []
    entries = list(cell) if isinstance(cell, list | tuple | np.ndarray) else [cell]
    return [_open(entry, i).convert("RGB") for i, entry in enumerate(entries)]


def _open(entry: Any, i: int) -> Image.Image:
    if isinstance(entry, Mapping):
        entry = entry.get("bytes") or entry.get("path")
    if isinstance(entry, Image.Image):
        return entry
    if isinstance(entry, bytes):
        source, what = io.BytesIO(entry), f"{len(entry)} bytes"
    elif isinstance(entry, str):
        source, what = Path(entry), f"the file {entry}"
    else:
        raise ValueError(f"image {i} is a {type(entry).__name__}; give {_ENTRY_FORMS}")
    try:
        image = Image.open(source)
        image.load()
    except (OSError, UnidentifiedImageError) as err:
        raise ValueError(f"image {i} ({what}) cannot be read as an image ({err}); give {_ENTRY_FORMS}") from None
    return image


def with_image_markers(prompt: Any) -> Any:
    """`prompt` with each message's content list (`[{"type": "image"}, {"type": "text", "text": ...}]`) joined into
    one string, an `<image>` marker for each image entry; a string or string contents are returned as they are."""
    if isinstance(prompt, str) or not isinstance(prompt, list | tuple | np.ndarray):
        return prompt
    messages = to_python(list(prompt))
    return [_joined(m) if isinstance(m, Mapping) and not isinstance(m.get("content"), str) else m for m in messages]


def _joined(message: Mapping) -> dict:
    parts = message.get("content")
    if not isinstance(parts, list):
        return dict(message)
    text = "".join(IMAGE_MARKER if p.get("type") == "image" else str(p.get("text", "")) for p in parts)
    return {**message, "content": text}


def message_content(value: Any) -> str | list[dict[str, Any]]:
    """An environment's answer (a tool's result) as a message's content: a string as it is; an image (PIL, PNG/JPEG
    bytes... as `row_images` takes them, in a `{"type": "image", "image": ...}` part), or a list of strings, images
    and `{"type": "text", "text": ...}` / `{"type": "image", "image": ...}` parts, as a content list whose image parts
    hold the decoded RGB image. Raises ValueError (an unreadable image) or TypeError (anything else) naming the part."""
    if isinstance(value, str):
        return value
    parts = list(value) if isinstance(value, list | tuple) else [value]
    return [_content_part(part, i) for i, part in enumerate(parts)]


def _content_part(part: Any, i: int) -> dict[str, Any]:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if isinstance(part, Mapping) and part.get("type") == "text":
        return {"type": "text", "text": str(part.get("text", ""))}
    image = part.get("image") if isinstance(part, Mapping) and part.get("type") == "image" else part
    if not isinstance(image, Image.Image | bytes | str | Mapping):
        raise TypeError(
            f"part {i} is a {type(part).__name__}; give text, an image ({_ENTRY_FORMS} or a PIL image), or a "
            '{"type": "text", "text": ...} or {"type": "image", "image": ...} part'
        )
    return {"type": "image", "image": _open(image, i).convert("RGB")}


def joined_messages(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """`messages` with each content list joined into text (an `<image>` marker for each image part,
    `with_image_markers`), and the images its image parts hold (`{"type": "image", "image": ...}`), in order."""
    images = [
        _open(part["image"], i).convert("RGB")
        for message in messages
        if isinstance(message.get("content"), list | tuple)
        for i, part in enumerate(message["content"])
        if isinstance(part, Mapping) and part.get("type") == "image" and part.get("image") is not None
    ]
    return with_image_markers(messages), images


def check_image_count(text: str, images: list) -> None:
    """Raise ValueError unless `text` has one `<image>` marker per image."""
    markers = text.count(IMAGE_MARKER)
    if markers != len(images):
        raise ValueError(
            f"the row has {len(images)} image(s) but its prompt has {markers} {IMAGE_MARKER} placeholder(s); put "
            f'one {IMAGE_MARKER} in the prompt text (or a {{"type": "image"}} entry in a message) per image'
        )


def prompt_images(rows: Rows, row_ids: np.ndarray, texts: list[str], image_key: str, vision: bool) -> dict[int, list]:
    """The images of each row of `row_ids` (by row number; none without an `image_key` column), each row's checked
    against the `<image>` placeholders of its prompt text in `texts`; `vision`: the model takes images. A bad image,
    a count that does not match, or images for a text-only model raise DatasetError naming the file, row and column.
    """
    column = rows.columns.get(image_key)
    if column is None:
        return {}
    images = {}
    for row, text in zip(row_ids, texts, strict=True):
        try:
            images[int(row)] = row_images(column[row])
            if images[int(row)] and not vision:
                raise ValueError(
                    "the row has images but the model is text-only; train a vision-language model (model.path) "
                    "or set data.image_key to a column without images"
                )
            check_image_count(text, images[int(row)])
        except ValueError as err:
            raise DatasetError(f"{rows.locate(row)}, column {image_key!r}: {err}") from None
    return images


def process_prompt(processor: Any, text: str, images: list) -> dict[str, Any]:
    """A vision-language `processor`'s outputs for one prompt `text` with its `images` (empty: none): `input_ids`
    `[1, prompt_len]` with each `<image>` expanded into the image's vision tokens, and the image tensors."""
    text = text.replace(IMAGE_MARKER, processor.image_placeholder)
    return processor(text=[text], images=images or None, return_tensors="pt")


def image_tensors(processed: Mapping[str, Any]) -> dict[str, Any]:
    """A row's `multi_modal_inputs`: the image tensors of `process_prompt`'s outputs (`pixel_values`, Qwen's
    `image_grid_thw` `[images, 3]`)."""
    return {k: v for k, v in processed.items() if k in IMAGE_INPUTS}


def check_untruncated(
    truncated: np.ndarray, images: dict[int, list], rows: Rows, row_ids: np.ndarray, limit: str
) -> None:
    """Raise DatasetError for the first row with images that `data.truncation` would cut (`truncated` `[n]`, by
    position in `row_ids`) to `limit` (the setting, e.g. `data.max_prompt_length=64`): its vision tokens must stay
    whole."""
    for k in np.flatnonzero(truncated):
        if images.get(int(row_ids[k])):
            raise DatasetError(
                f"{rows.locate(row_ids[k])}: the prompt with its images' vision tokens is longer than {limit}, and a "
                "prompt with images cannot be truncated; raise the limit, set data.filter_overlong_prompts=true, "
                "or give smaller images"
            )
