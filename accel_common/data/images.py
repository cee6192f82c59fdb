"""Folders of images for the vision recipes (captioning, quality): which files count as images,
one image read at a fixed size, and a folder read in chunks for single-device prediction."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from accel_common.data.paths import require_folder, require_regular
from accel_common.errors import ConfigError, DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
# the most pixels an image may have: a small file can decode to gigabytes (a decompression
# bomb). The default is where PIL refuses (twice its Image.MAX_IMAGE_PIXELS, 89,478,485)
MAX_PIXELS_VARIABLE = "ACCEL_RECIPES_MAX_IMAGE_PIXELS"
DEFAULT_MAX_PIXELS = 178_956_970


def is_image(path: Path) -> bool:
    """Whether a file is one the recipes read as an image (by its suffix, any case; a FIFO or
    device so named is one, which its reader then refuses: a folder is not)."""
    return path.suffix.lower() in IMAGE_SUFFIXES and path.exists() and not path.is_dir()


def list_images(folder: Path) -> list[str]:
    """The images under `folder` (the commands' --images) and its subfolders, as sorted relative
    POSIX paths (iter_0/x.png); a missing folder or one without images is an error naming it."""
    require_folder(folder, "--images ")
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if is_image(p))
    if not names:
        suffixes = ", ".join(IMAGE_SUFFIXES)
        raise DataError(f"--images {folder}: no images ({suffixes}) in it or its subfolders")
    return names


def max_image_pixels() -> int | None:
    """The most pixels an image may have: ACCEL_RECIPES_MAX_IMAGE_PIXELS if set (0: no limit,
    None), else DEFAULT_MAX_PIXELS. An environment variable, so that every command and every
    data-loader worker reads the same limit."""
    text = os.environ.get(MAX_PIXELS_VARIABLE, "").strip()
    if not text:
        return DEFAULT_MAX_PIXELS
    if not text.isdigit():
        raise ConfigError(
            f"{MAX_PIXELS_VARIABLE}={text}: give a whole number of pixels (0: no limit)"
        )
    return int(text) or None


def open_image(path: Path) -> Image.Image:
    """`path` opened with PIL (its header read, its pixels not yet decoded), refused unless it
    is a regular file of at most `max_image_pixels()` pixels. This check replaces PIL's own
    (Image.MAX_IMAGE_PIXELS, which is turned off), whose exception named neither the file nor
    how to raise the limit."""
    require_regular(path)
    limit = max_image_pixels()
    Image.MAX_IMAGE_PIXELS = None
    image = Image.open(path)
    pixels = image.width * image.height
    if limit is not None and pixels > limit:
        image.close()
        raise DataError(
            f"{path}: {image.width} x {image.height} = {pixels:,} pixels, over the limit of "
            f"{limit:,} that guards against decompression bombs; if you trust the file, raise "
            f"the limit with {MAX_PIXELS_VARIABLE}={pixels} (0: no limit)"
        )
    return image


def read_rgb(path: Path, size: int) -> np.ndarray:
    """3 x size x size uint8 RGB, resized bilinearly; an unreadable file is named."""
    try:
        with open_image(path) as image:
            rgb = image.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
    except (UnidentifiedImageError, OSError) as err:
        raise DataError(f"{path}: not a readable image ({err})") from None
    return np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)


def to_signed_unit(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 pixels as floats in [-1, 1], the range the vision recipes' models take."""
    return pixels.float().div(127.5).sub(1.0)


def read_images(folder: Path, names: list[str], size: int) -> torch.Tensor:
    """The named images (paths relative to `folder`) as one float tensor N x 3 x size x size in
    [-1, 1]."""
    return to_signed_unit(torch.from_numpy(np.stack([read_rgb(folder / n, size) for n in names])))


def image_batches(
    folder: Path, names: list[str], size: int, bs: int
) -> Iterator[tuple[list[str], torch.Tensor]]:
    """`read_images` in chunks of `bs` names, as (names, tensor) pairs: a folder of any size is
    predicted in bounded memory."""
    for start in range(0, len(names), bs):
        chunk = names[start : start + bs]
        yield chunk, read_images(folder, chunk, size)
