"""Images of prompt rows (verl's layout): an `images` cell holds one image or a list of them, each PNG/JPEG bytes, a
file path, or a `{"bytes", "path"}` dict (as Hugging Face datasets store images); the prompt marks where each goes
with an `<image>` placeholder in its text, or a `{"type": "image"}` entry in a message's content list."""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from ketch.data.values import to_python

IMAGE_MARKER = "<image>"
"""Where an image goes in a prompt's text; replaced by the processor's `image_placeholder` before tokenizing."""

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


def check_image_count(text: str, images: list) -> None:
    """Raise ValueError unless `text` has one `<image>` marker per image."""
    markers = text.count(IMAGE_MARKER)
    if markers != len(images):
        raise ValueError(
            f"the row has {len(images)} image(s) but its prompt has {markers} {IMAGE_MARKER} placeholder(s); put "
            f'one {IMAGE_MARKER} in the prompt text (or a {{"type": "image"}} entry in a message) per image'
        )
