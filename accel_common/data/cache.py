"""Prepared tables kept on disk with `datasets` (Arrow) for the recipes whose preparation is
slow (crystal graphs, cricket innings, captioning's decoded images): built once, saved whole,
read back by every later run and by the other processes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from accel_common.data.paths import require_regular
from accel_common.run_folder.outputs import partial_path


def cache_root(cache_dir: Path | None = None) -> Path:
    """Where prepared tables live: `cache_dir`, else beside `datasets`' own cache
    (HF_DATASETS_CACHE, so HF_HOME moves both)."""
    return cache_dir or Path(datasets.config.HF_DATASETS_CACHE) / "accel-recipes"


def files_digest(files: list[Path]) -> str:
    """One digest of the files' names and bytes: a cache key's view of the data (contents, not
    sizes or times, so a rewritten file of the same size is seen). A FIFO or device among
    them is refused before it is read (it would block or never end)."""
    digest = hashlib.sha256()
    for path in files:
        require_regular(path)
        name = os.fsencode(path.name)  # a file name's bytes, which need not be UTF-8
        digest.update(name + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def cache_key(*parts: object) -> str:
    """A short name for a prepared table from everything it depends on (JSON-able `parts`:
    data digests, settings, a format version)."""
    return hashlib.sha256(json.dumps(list(parts)).encode()).hexdigest()[:20]


def code_digest(source: str | Path) -> str:
    """The digest of the module that builds a table, a part of its key: a table that older code
    built (before a reader fix) is built again, not reused silently."""
    return hashlib.sha256(Path(source).read_bytes()).hexdigest()[:16]


def save_whole(table: datasets.Dataset, folder: Path, files: dict[str, str] | None = None) -> None:
    """Save `table`, and text `files` beside it, as `folder` through a temporary folder renamed
    into place: whole or absent, even if two runs build it at once (the first one kept)."""
    partial = partial_path(folder)  # unguessable: no link planted there is written through
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


def list_lengths(table: datasets.Dataset, name: str) -> np.ndarray:
    """Each row's length in a list column (atoms, edges, tokens: a cost per item), without
    copying the values or Python per row; rows as `table` selects them."""
    lengths = pc.list_value_length(table.data.column(name)).to_numpy(zero_copy_only=False)
    if table._indices is not None:  # a selection of the table's rows (Dataset.select)
        lengths = lengths[table._indices.column(0).to_numpy()]
    return lengths


def list_column(table: datasets.Dataset, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A list column's values, flat, and each row's offset into them (no Python per row)."""
    column = table.data.column(name).combine_chunks()
    if isinstance(column, pa.ChunkedArray):  # an empty table
        column = pa.concat_arrays(column.chunks) if column.chunks else pa.array([], column.type)
    # a writable copy: torch.from_numpy warns (slowly, per sample) about read-only Arrow memory
    values = np.array(column.values.to_numpy(zero_copy_only=False))
    return values, column.offsets.to_numpy()
