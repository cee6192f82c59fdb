"""Image-caption pairs for the captioning recipe: three on-disk layouts, one reader, a generator.

A split folder (`<data>/train`, and `<data>/test` or, as Hugging Face `imagefolder` users often
name it, `<data>/validation`) holds images and their captions in one of:

    metadata.jsonl / metadata.csv    Hugging Face `imagefolder`: {"file_name": ..., "text": ...}
    captions.json                    a manifest: {"relative/image.png": "caption", ...}
    cat.png + cat.txt                the original's: each image with a same-named .txt caption

The held-out split is `test/`, else `validation/` (so a train/validation/test layout is evaluated
on its test images). Without any of these folders, `<data>` itself is read and every tenth image
(by a hash of its name, so the split is stable as files are added) is held out for testing.

The metadata files are read here rather than with `datasets.load_dataset("imagefolder")`,
because a user's error must name the line and key (a missing image, an empty caption, a column
that is not there) and the packaged loader reports neither; the decoded and tokenized set is then
cached with `datasets` by the recipe.

`write_dataset` draws small images of coloured shapes with captions that describe them ("a red
square left of a blue circle", "two small green triangles"): captions are learnable from the
pixels, and their token counts vary per sample.
"""

from __future__ import annotations

import csv
import json
import zlib
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from accel_common.data.images import is_image
from accel_common.errors import DataError

HELD_OUT = ("test", "validation")  # the first that exists is the held-out split


def _checked(folder: Path, source: str, name: object, caption: object) -> tuple[str, str]:
    """One record, with its error naming where it came from (`source`: file, line or key)."""
    if not isinstance(name, str) or not name:
        raise DataError(f"{source}: no image file name")
    if not isinstance(caption, str) or not caption.strip():
        raise DataError(f"{source}: empty caption for {name}")
    if not (folder / name).is_file():
        raise DataError(f"{source}: image {folder / name} not found")
    return name, " ".join(caption.split())


def _imagefolder_jsonl(folder: Path, path: Path) -> list[tuple[str, str]]:
    records = []
    for line, text in enumerate(path.read_text().splitlines(), start=1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}, line {line}: not JSON ({err.msg})") from None
        for key in ("file_name", "text"):
            if not isinstance(row, dict) or key not in row:
                raise DataError(f"{path}, line {line}: no '{key}' key (imagefolder needs it)")
        records.append(_checked(folder, f"{path}, line {line}", row["file_name"], row["text"]))
    return records


def _imagefolder_csv(folder: Path, path: Path) -> list[tuple[str, str]]:
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"file_name", "text"} - set(reader.fieldnames or [])
        if missing:
            raise DataError(f"{path}: no '{sorted(missing)[0]}' column (imagefolder needs it)")
        return [
            _checked(folder, f"{path}, line {reader.line_num}", row["file_name"], row["text"])
            for row in reader
        ]


def _manifest(folder: Path, path: Path) -> list[tuple[str, str]]:
    try:
        mapping = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(mapping, dict):
        raise DataError(f"{path}: expected an object mapping image path -> caption")
    return [_checked(folder, f"{path}, key '{k}'", k, v) for k, v in mapping.items()]


def _sidecars(folder: Path) -> list[tuple[str, str]]:
    records = []
    for image in sorted(p for p in folder.rglob("*") if is_image(p)):
        caption = image.with_suffix(".txt")
        if not caption.is_file():
            raise DataError(f"{image}: no caption file {caption.name} beside it")
        name = image.relative_to(folder).as_posix()
        records.append(_checked(folder, str(caption), name, caption.read_text()))
    return records


def read_folder(folder: Path) -> list[tuple[str, str]]:
    """(image path relative to `folder`, caption) for every image, in whichever layout it uses."""
    for reader, name in (
        (_imagefolder_jsonl, "metadata.jsonl"),
        (_imagefolder_csv, "metadata.csv"),
        (_manifest, "captions.json"),
    ):
        if (folder / name).is_file():
            records = reader(folder, folder / name)
            break
    else:
        records = _sidecars(folder)
    if not records:
        raise DataError(
            f"{folder}: no captioned images (expected metadata.jsonl, metadata.csv, captions.json "
            "or images with same-named .txt captions)"
        )
    return records


def read_split(data_dir: Path, split: str) -> tuple[Path, list[tuple[str, str]]]:
    """The images folder and records of `split`: "train", or "test" for the held-out images."""
    folders = ("train",) if split == "train" else HELD_OUT
    for name in folders:
        if (data_dir / name).is_dir():
            return data_dir / name, read_folder(data_dir / name)
    present = [name for name in ("train", *HELD_OUT) if (data_dir / name).is_dir()]
    if present:
        wanted = " or ".join(f"{name}/" for name in folders)
        raise DataError(
            f"{data_dir}: no {wanted} folder beside {present[0]}/; add one, or put all images "
            "in one folder to hold out every tenth"
        )
    records = read_folder(data_dir)
    held_out = [zlib.crc32(name.encode()) % 10 == 0 for name, _ in records]
    chosen = [r for r, test in zip(records, held_out, strict=True) if test == (split == "test")]
    if not chosen:
        raise DataError(f"{data_dir}: too few images to hold out a test split; add test/")
    return data_dir, chosen


# --------------------------------------------------------------------------- synthetic data

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
