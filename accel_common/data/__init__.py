"""Data generators (one per workload, writing its original on-disk format) and loader helpers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from accel_common.data import pointcloud, quality, template
from accel_common.errors import RecipeError

# workload name -> function writing a small synthetic data set into a folder
GENERATORS: dict[str, Callable[..., Path]] = {
    "template": template.write_dataset,
    "pointcloud": pointcloud.write_dataset,
    "quality": quality.write_dataset,
}


def make_data(workload: str, out_dir: Path, *, force: bool = False, **options: object) -> Path:
    """Write `workload`'s synthetic set to `out_dir`, refusing to overwrite unless forced."""
    if workload not in GENERATORS:
        raise RecipeError(f"unknown workload '{workload}'; choose one of: {', '.join(GENERATORS)}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise RecipeError(f"{out_dir} exists and is not empty; pass --force to write into it")
    return GENERATORS[workload](out_dir, **options)
