"""Prepared tables kept on disk with `datasets` (Arrow) for the recipes whose preparation is
slow (crystal graphs, cricket innings, captioning's decoded images): built once, saved whole,
read back by every later run and by the other processes."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import datasets


def cache_root(cache_dir: Path | None = None) -> Path:
    """Where prepared tables live: `cache_dir`, else beside `datasets`' own cache
    (HF_DATASETS_CACHE, so HF_HOME moves both)."""
    return cache_dir or Path(datasets.config.HF_DATASETS_CACHE) / "accel-recipes"


def save_whole(table: datasets.Dataset, folder: Path, files: dict[str, str] | None = None) -> None:
    """Save `table`, and text `files` beside it, as `folder` through a temporary folder renamed
    into place: whole or absent, even if two runs build it at once (the first one kept)."""
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    table.save_to_disk(str(partial))
    for name, text in (files or {}).items():
        (partial / name).write_text(text)
    try:
        os.replace(partial, folder)
    except OSError:  # another run saved it first
        shutil.rmtree(partial, ignore_errors=True)


def cached(folder: Path, build: Callable[[], datasets.Dataset]) -> datasets.Dataset:
    """The table saved in `folder`, or `build()` saved there whole first."""
    if not folder.is_dir():
        save_whole(build(), folder)
    return datasets.load_from_disk(str(folder))
