"""The built-in visual task: small images of coloured dots and the question `How many red dots?` -> `3`.

Each image is `size` x `size` pixels on a white background, cut into `cells` x `cells` square cells; a dot is a disc
drawn inside one cell (at most one per cell, jittered within it), red or a distractor colour (green, blue). The count
of red dots is uniform in 0..`max_count`, the count of distractors uniform in 0..`max_distractors`. With the
defaults (56 pixels, 4 x 4 cells of 14 pixels) each dot lies within one 14-pixel patch of a Qwen2-VL vision tower.

`builtin:dots/{train,val}` resolve to Parquet files (verl's image layout: a `prompt` with an `<image>` placeholder, an
`images` column of PNG bytes) generated once into the user cache.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from ketch.data.parquet import cached_splits

BUILTIN_DOTS_TASK = "builtin:dots"
DATA_SOURCE = "ketch/dots"
SPLITS = ("train", "val")
QUESTION = "<image>How many red dots?"
BACKGROUND = (255, 255, 255)
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 40), "blue": (40, 70, 220)}
"""The dots' colours (RGB); red is counted, the others are distractors."""
_FORMAT_VERSION = 1  # bump when the rows written for the same settings change, to regenerate cached files

Dot = tuple[int, str, int, int]
"""A dot: its cell (row-major index), its colour's name, and its centre's offset (x, y) from the cell's centre."""


@dataclass(frozen=True)
class DotsTask:
    """Settings of the generated images: `size` pixels a side, `cells` x `cells` cells, dots of `radius` pixels,
    0..`max_count` red dots and 0..`max_distractors` green or blue ones."""

    size: int = 56
    cells: int = 4
    radius: int = 4
    max_count: int = 4
    max_distractors: int = 2
    num_train: int = 4000
    num_val: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        if self.cells < 1 or self.size % self.cells or 2 * self.radius + 2 > self.size // self.cells:
            raise ValueError(
                f"DotsTask needs cells that divide size and hold a dot of radius {self.radius} with a pixel to spare "
                f"(2 * radius + 2 <= size / cells); got size={self.size}, cells={self.cells}"
            )
        if min(self.max_count, self.max_distractors) < 0 or self.max_count + self.max_distractors > self.cells**2:
            raise ValueError(
                f"DotsTask draws at most one dot per cell: max_count + max_distractors must be at most "
                f"{self.cells**2} (cells^2) and neither negative; got {self.max_count} + {self.max_distractors}"
            )
        if self.num_train < 1 or self.num_val < 0:
            raise ValueError(f"DotsTask needs num_train >= 1 and num_val >= 0; got {self.num_train}, {self.num_val}")

    @property
    def cell(self) -> int:
        """A cell's side in pixels."""
        return self.size // self.cells

    def settings_hash(self) -> str:
        """A short hash of the settings (and of the row format), naming the cache directory."""
        text = json.dumps({**asdict(self), "format": _FORMAT_VERSION}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def draw_layout(rng: random.Random, task: DotsTask) -> tuple[Dot, ...]:
    """A random layout of dots, sorted by cell: its number of red dots uniform in 0..max_count."""
    red, others = rng.randint(0, task.max_count), rng.randint(0, task.max_distractors)
    cells = rng.sample(range(task.cells**2), red + others)
    colours = ["red"] * red + [rng.choice(("green", "blue")) for _ in range(others)]
    room = task.cell // 2 - task.radius - 1  # the most a centre moves from its cell's centre, keeping the dot inside
    jitter = [(rng.randint(-room, room), rng.randint(-room, room)) for _ in cells]
    return tuple(sorted((cell, colour, dx, dy) for cell, colour, (dx, dy) in zip(cells, colours, jitter, strict=True)))


def render(layout: tuple[Dot, ...], task: DotsTask) -> Image.Image:
    """The RGB image `[size, size]` of `layout`."""
    image = Image.new("RGB", (task.size, task.size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for cell, colour, dx, dy in layout:
        x = (cell % task.cells) * task.cell + task.cell // 2 + dx
        y = (cell // task.cells) * task.cell + task.cell // 2 + dy
        r = task.radius
        draw.ellipse((x - r, y - r, x + r, y + r), fill=COLOURS[colour])
    return image


def red_count(layout: tuple[Dot, ...]) -> int:
    """How many of `layout`'s dots are red: the answer."""
    return sum(colour == "red" for _, colour, _, _ in layout)


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _row(layout: tuple[Dot, ...], task: DotsTask, index: int, split: str) -> dict[str, Any]:
    answer = str(red_count(layout))
    return {
        "prompt": QUESTION,
        "images": [_png(render(layout, task))],
        "response": answer,
        "answer": answer,
        "data_source": DATA_SOURCE,
        "extra_info": {"index": index, "split": split, "dots": len(layout)},
    }


def generate_dots_task(task: DotsTask) -> dict[str, list[dict[str, Any]]]:
    """Rows of each split, keyed `train` and `val`: the validation layouts are drawn first and are distinct, the
    training layouts leave them out (and may repeat)."""
    rng = random.Random(task.seed)
    val: dict[tuple[Dot, ...], None] = {}  # distinct, in the order drawn
    for _ in range(100 * task.num_val):
        if len(val) == task.num_val:
            break
        val.setdefault(draw_layout(rng, task))
    if len(val) < task.num_val:
        raise ValueError(
            f"DotsTask found {len(val)} distinct validation images of the {task.num_val} asked for in "
            f"{100 * task.num_val} draws; ask for fewer (num_val) or allow more layouts (cells, max_count)"
        )
    train: list[tuple[Dot, ...]] = []
    while len(train) < task.num_train:
        layout = draw_layout(rng, task)
        if layout not in val:
            train.append(layout)
    return {
        "train": [_row(layout, task, i, "train") for i, layout in enumerate(train)],
        "val": [_row(layout, task, i, "val") for i, layout in enumerate(val)],
    }


def builtin_dots_files(task: DotsTask | None = None) -> dict[str, Path]:
    """The cached Parquet files of `task` (default: `DotsTask()`) by split, generated on first use."""
    task = task or DotsTask()
    return cached_splits(f"dots-{task.settings_hash()}", SPLITS, lambda: generate_dots_task(task))
