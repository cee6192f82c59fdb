"""Readers of each workload's original format, and generators of small example sets in it.

A recipe imports its own workload's module (`accel_common.data.template`, ...); nothing here
imports them all, so a recipe loads only what its workload needs (PIL only for images).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

from accel_common.errors import RecipeError

# workload name -> module whose write_dataset(folder, ...) writes a small synthetic set
GENERATORS: dict[str, str] = {
    "template": "accel_common.data.template",
    "pointcloud": "accel_common.data.pointcloud",
    "quality": "accel_common.data.quality",
}


def generator(workload: str) -> Callable[..., Path]:
    """`workload`'s write_dataset, imported on first use."""
    if workload not in GENERATORS:
        raise RecipeError(f"unknown workload '{workload}'; choose one of: {', '.join(GENERATORS)}")
    return importlib.import_module(GENERATORS[workload]).write_dataset


def make_data(workload: str, out_dir: Path, *, force: bool = False, **options: object) -> Path:
    """Write `workload`'s synthetic set to `out_dir`, refusing to overwrite unless forced."""
    write_dataset = generator(workload)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise RecipeError(f"{out_dir} exists and is not empty; pass --force to write into it")
    return write_dataset(out_dir, **options)
