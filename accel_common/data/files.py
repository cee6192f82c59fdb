"""Readers for the original formats that report bad data by file and line."""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Sampler

from accel_common.errors import DataError


def read_csv_rows(path: Path, required: Sequence[str]) -> list[tuple[int, dict[str, str]]]:
    """(line number, row) pairs of a CSV with a header; errors name the file, line and problem."""
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    with path.open(newline="", encoding="utf-8-sig") as handle:  # -sig: Excel's BOM is skipped
        reader = csv.DictReader(handle)
        try:
            missing = [c for c in required if c not in (reader.fieldnames or [])]
            if missing:
                raise DataError(_lacking(path, reader.fieldnames or [], missing))
            rows = []
            for row in reader:
                if None in row or any(row[c] in (None, "") for c in required):
                    raise DataError(f"{path}, line {reader.line_num}: wrong number of fields")
                rows.append((reader.line_num, row))
        except UnicodeDecodeError:
            raise DataError(_not_utf8(path)) from None
        except csv.Error as err:  # a NUL byte, as in a file cut short by a crash
            raise DataError(f"{path}, line {reader.line_num + 1}: not CSV text ({err})") from None
    if not rows:
        raise DataError(f"{path}: no data rows (an empty split cannot be trained or scored)")
    return rows


# delimiters a CSV is often written with instead of commas (Excel in many locales: ';')
OTHER_DELIMITERS = {";": "';'", "\t": "tab", "|": "'|'"}


def _lacking(path: Path, header: Sequence[str], missing: Sequence[str]) -> str:
    """Why the header lacks `missing`: another delimiter than ',' if the header looks so."""
    counts = {d: header[0].count(d) for d in OTHER_DELIMITERS} if len(header) == 1 else {}
    delimiter = max(counts, key=counts.__getitem__, default=None)
    if delimiter is None or not counts[delimiter]:
        return f"{path}: header lacks column(s) {', '.join(missing)}"
    return (
        f"{path}: the header {header[0]!r} looks {OTHER_DELIMITERS[delimiter]}-separated; write "
        f"comma-separated values (a header such as {','.join(header[0].split(delimiter))})"
    )


def _not_utf8(path: Path) -> str:
    """Where a file that is not UTF-8 text (binary, UTF-16, Latin-1) first stops being it."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        return (
            f"{path}, line {line}: byte 0x{data[err.start]:02x} at offset {err.start} is not "
            "UTF-8 text; save the file as UTF-8 comma-separated values"
        )
    return f"{path}: not UTF-8 text; save the file as UTF-8 comma-separated values"


def read_path_list(csv: Path, suffixes: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line number, path) for each line of a CSV that lists one file per line (SkullBreak style).

    A first line that does not end in one of `suffixes` is taken as a header and skipped.
    """
    if not csv.is_file():
        raise DataError(f"{csv}: file not found")
    rows = []
    wanted = " or ".join(suffixes)
    for line, text in enumerate(csv.read_text().splitlines(), start=1):
        entry = text.split(",")[0].strip().strip('"')
        if not entry or (line == 1 and not entry.endswith(suffixes)):
            continue
        if not entry.endswith(suffixes):
            raise DataError(f"{csv}, line {line}: '{entry}' is not a {wanted} path")
        rows.append((line, entry))
    if not rows:
        raise DataError(f"{csv}: lists no {wanted} files (an empty split cannot be used)")
    return rows


def read_numeric_csv(
    path: Path, required: Sequence[str], columns: Sequence[str] | None = None
) -> tuple[list[str], torch.Tensor]:
    """A CSV of finite numbers as (column names, float32 tensor of rows x columns); with
    `columns`, its header must be exactly those (a test split read like the training split)."""
    rows = read_csv_rows(path, required)
    found = list(rows[0][1])
    if columns is not None and found != list(columns):
        raise DataError(
            f"{path}: columns {', '.join(found)} differ from the training split's "
            f"{', '.join(columns)}; every split needs the same columns in the same order"
        )
    columns = found
    values = []
    for line, row in rows:
        try:
            numbers = [float(row[c]) for c in columns]
        except ValueError:
            bad = next(c for c in columns if not _is_float(row[c]))
            message = f"{path}, line {line}: column {bad} is '{row[bad]}', not a number"
            raise DataError(message) from None
        if not all(map(math.isfinite, numbers)):
            bad = next(c for c, x in zip(columns, numbers, strict=True) if not math.isfinite(x))
            raise DataError(f"{path}, line {line}: column {bad} is '{row[bad]}', not finite")
        values.append(numbers)
    return columns, torch.tensor(values, dtype=torch.float32)


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def require_finite(values: np.ndarray | torch.Tensor, where: str) -> None:
    """Refuse NaN and infinite values, naming the first one's position (`where` names the
    file): a single NaN in the data turns every weight into NaN a step later."""
    finite = np.isfinite(np.asarray(values))
    if not finite.all():
        index = tuple(int(i) for i in np.argwhere(~finite)[0])
        value = np.asarray(values)[index]
        raise DataError(f"{where}: value {value} at index {list(index)} is not finite")


class EpochShuffleSampler(Sampler[int]):
    """A shuffle whose order depends only on (seed, epoch).

    Every process computes the same permutation, so Accelerate's sharding gives each one a distinct
    slice, and the order of epoch e is the same on 1 or N processes and after a resume. Call
    `set_epoch` (the prepared DataLoader's `set_epoch` forwards to it) before each epoch.
    """

    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return iter(torch.randperm(self.num_samples, generator=generator).tolist())

    def __len__(self) -> int:
        return self.num_samples


# what a content fingerprint starts with; earlier versions recorded names and sizes only, unprefixed
CONTENT_FINGERPRINT = "sha256:"


def folder_fingerprint(folder: Path, cache_dir: Path | None = None) -> str:
    """A short hash of a data folder's contents (every file's relative name and bytes; a single
    file's name and bytes): equal for a copy of the same data anywhere, different when a file is
    added, removed, renamed or has any byte changed, whatever its size and times.

    Cost: every byte is read once, about 1 s per GB on one core (sha256) or more where the
    disk or a network file system is slower: a 20 GB image folder adds ~20 s to a run's first
    start. With `cache_dir`, each file's digest is kept there, keyed by its path, size,
    modification and change times and inode; later starts re-read only files whose entry
    changed, so a resume costs a `stat` per file. (A change time cannot be set back, so an
    edited file is never taken for the old one.)
    """
    folder = Path(folder)
    if folder.is_file():
        files = [(folder.name, folder)]
    else:
        files = []
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            relative = path.relative_to(folder)
            if not any(part.startswith(".") for part in relative.parts):  # caches, editor files
                files.append((relative.as_posix(), path))
    cache_file = _hash_cache_file(folder, cache_dir) if cache_dir is not None else None
    known = _read_hash_cache(cache_file)
    seen: dict[str, list] = {}
    digest = hashlib.sha256()
    for name, path in files:
        stat = path.stat()
        key = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
        cached = known.get(name)
        contents = cached[4] if cached and cached[:4] == key else file_digest(path)
        seen[name] = [*key, contents]
        digest.update(f"{name}\0{contents}\n".encode())
    if cache_file is not None and seen != known:
        _write_hash_cache(cache_file, seen)
    return CONTENT_FINGERPRINT + digest.hexdigest()[:16]


def file_digest(path: Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file's bytes, read in 1 MiB chunks (any size, little memory)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _hash_cache_file(folder: Path, cache_dir: Path) -> Path:
    where = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:20]
    return Path(cache_dir) / f"file-hashes-{where}.json"


def _read_hash_cache(cache_file: Path | None) -> dict[str, list]:
    """The cached digests, or {} (no cache, unreadable: everything is read again)."""
    if cache_file is None:
        return {}
    try:
        found = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _write_hash_cache(cache_file: Path, entries: dict[str, list]) -> None:
    """Replace the cache whole (a temporary file renamed); a cache that cannot be written is
    only a slower next start."""
    tmp = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.tmp")
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, cache_file)
    except OSError:
        tmp.unlink(missing_ok=True)


def data_hash_cache() -> Path:
    """Where data fingerprints keep their per-file digests: beside the prepared tables
    (accel_common.data.cache: HF_DATASETS_CACHE/accel-recipes, so HF_HOME moves both), found as
    `datasets` finds its cache, without importing it."""
    if os.environ.get("HF_DATASETS_CACHE"):
        root = Path(os.environ["HF_DATASETS_CACHE"])
    else:
        xdg = os.environ.get("XDG_CACHE_HOME", os.path.join("~", ".cache"))
        root = Path(os.environ.get("HF_HOME", os.path.join(xdg, "huggingface"))) / "datasets"
    return root.expanduser() / "accel-recipes"
