"""Synthetic example data for the captioning recipe, in Hugging Face's `imagefolder` layout.

`write_dataset` draws small images of coloured shapes with captions that describe them ("a red
square left of a blue circle", "two small green triangles"): captions are learnable from the
pixels, and their token counts vary per sample. `accel-recipes make-data captioning DIR` runs it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (50, 80, 230),
    "yellow": (235, 200, 30),
}
SHAPES = ("square", "circle", "triangle")


def _draw(
    draw: ImageDraw.ImageDraw, shape: str, colour: str, box: tuple[int, int, int, int]
) -> None:
    x0, y0, x1, y1 = box
    fill = COLOURS[colour]
    if shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "circle":
        draw.ellipse(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)


def scene(rng: np.random.Generator, size: int) -> tuple[Image.Image, str]:
    """One image and its caption: a single shape, two shapes side by side, or a pair of twins."""
    image = Image.new("RGB", (size, size), (245, 245, 245))
    draw = ImageDraw.Draw(image)
    half, kind = size // 2, rng.integers(3)
    shapes = [str(rng.choice(SHAPES)) for _ in range(2)]
    colours = [str(rng.choice(list(COLOURS))) for _ in range(2)]
    big = bool(rng.integers(2))
    extent = int(half * (0.8 if big else 0.5))
    top = (size - extent) // 2
    if kind == 0:  # one shape, centred
        start = (size - 2 * extent) // 2
        _draw(draw, shapes[0], colours[0], (start, start, start + 2 * extent, start + 2 * extent))
        return image, f"a {'big' if big else 'small'} {colours[0]} {shapes[0]}"
    for i, x in enumerate(((half - extent) // 2, half + (half - extent) // 2)):
        shape, colour = (shapes[0], colours[0]) if kind == 2 else (shapes[i], colours[i])
        _draw(draw, shape, colour, (x, top, x + extent, top + extent))
    if kind == 2:
        return image, f"two {'big' if big else 'small'} {colours[0]} {shapes[0]}s"
    return image, f"a {colours[0]} {shapes[0]} left of a {colours[1]} {shapes[1]}"


def write_dataset(
    out_dir: Path, *, train_images: int = 800, test_images: int = 100, size: int = 32, seed: int = 0
) -> Path:
    """Write the `imagefolder` layout: train/ and test/, each with PNGs and metadata.jsonl."""
    out_dir = Path(out_dir)
    rng = np.random.default_rng(seed)
    for split, count in (("train", train_images), ("test", test_images)):
        folder = out_dir / split
        folder.mkdir(parents=True, exist_ok=True)
        rows = []
        for i in range(count):
            image, caption = scene(rng, size)
            image.save(folder / f"{i:05d}.png")
            rows.append(json.dumps({"file_name": f"{i:05d}.png", "text": caption}))
        (folder / "metadata.jsonl").write_text("\n".join(rows) + "\n")
    return out_dir
