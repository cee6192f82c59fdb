"""Quick-look pictures without a plotting dependency: point clouds rendered to PNG with numpy."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

Cloud = tuple[np.ndarray, tuple[int, int, int]]  # (N x 3 points, RGB colour)


def write_png(path: Path, image: np.ndarray) -> None:
    """Write an H x W x 3 uint8 image as PNG (stdlib zlib only)."""
    height, width, _ = image.shape
    raw = b"".join(b"\x00" + image[row].tobytes() for row in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    Path(path).write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 6))
        + chunk(b"IEND", b"")
    )


def render_point_clouds(path: Path, clouds: Sequence[Cloud], size: int = 360) -> None:
    """Front (x-z) and side (y-z) orthographic views of several clouds, side by side."""
    everything = np.concatenate([points for points, _ in clouds])
    low, high = everything.min(axis=0), everything.max(axis=0)
    extent = (high - low).max() * 1.05
    center = (low + high) / 2
    image = np.full((size, 2 * size, 3), 255, dtype=np.uint8)
    for view, horizontal in enumerate((0, 1)):  # x across (front view), then y (side view)
        for points, colour in clouds:  # later clouds are drawn on top
            u = ((points[:, horizontal] - center[horizontal]) / extent + 0.5) * (size - 1)
            v = (0.5 - (points[:, 2] - center[2]) / extent) * (size - 1)
            cols = np.clip(u.astype(int), 0, size - 2) + view * size
            rows = np.clip(v.astype(int), 0, size - 2)
            for dr in (0, 1):  # 2 x 2 dots
                for dc in (0, 1):
                    image[rows + dr, cols + dc] = colour
    write_png(path, image)
