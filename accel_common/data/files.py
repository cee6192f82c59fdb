"""Readers for the original formats that report bad data by file and line."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Sampler

from accel_common.data.paths import require_regular
from accel_common.errors import DataError

FLOAT32_MAX = float(np.finfo(np.float32).max)  # a number above it is read as infinite


def read_csv_rows(path: Path, required: Sequence[str]) -> list[tuple[int, dict[str, str]]]:
    """(line number, row) pairs of a CSV with a header; errors name the file, line and problem."""
    require_regular(path)
    with path.open(newline="", encoding="utf-8-sig") as handle:  # -sig: Excel's BOM is skipped
        reader = csv.DictReader(handle)
        try:
            reader.fieldnames = _header(path, reader.fieldnames or [])
            missing = [c for c in required if c not in reader.fieldnames]
            if missing:
                raise DataError(_lacking(path, reader.fieldnames or [], missing))
            rows = []
            for row in reader:
                if None in row or any(row[c] in (None, "") for c in required):
                    raise DataError(f"{path}, line {reader.line_num}: wrong number of fields")
                rows.append((reader.line_num, row))
        except UnicodeDecodeError:
            raise DataError(not_utf8(path, path.read_bytes(), CSV_TEXT)) from None
        except csv.Error as err:  # a NUL byte, as in a file cut short by a crash
            raise DataError(f"{path}, line {reader.line_num + 1}: not CSV text ({err})") from None
    if not rows:
        raise DataError(f"{path}: no data rows (an empty split cannot be trained or scored)")
    return rows


def _header(path: Path, names: Sequence[str]) -> list[str]:
    """The header's column names without the spaces around them (`x1, x2, y`, as many write
    it); a name given twice is refused, since a row's value would be taken from one of them."""
    stripped = [name.strip() for name in names]
    twice = next((name for i, name in enumerate(stripped) if name in stripped[:i]), None)
    if twice is not None:
        raise DataError(f"{path}: the header names column {twice!r} twice; rename one of them")
    return stripped


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


CSV_TEXT = "save the file as UTF-8 comma-separated values"


def read_text(path: Path, fix: str = "save it as UTF-8 text") -> str:
    """A data text file's contents (a leading BOM, as Notepad and Excel write it, skipped); one
    that is not UTF-8 is refused in one line naming the file, line, byte and offset, and `fix`."""
    require_regular(path)
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise DataError(not_utf8(path, data, fix)) from None


def not_utf8(path: Path, data: bytes, fix: str) -> str:
    """Where `data`, the contents of a file that is not UTF-8 text (binary, UTF-16, Latin-1),
    first stops being it, and `fix`."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        return (
            f"{path}, line {line}: byte 0x{data[err.start]:02x} at offset {err.start} is not "
            f"UTF-8 text; {fix}"
        )
    return f"{path}: not UTF-8 text; {fix}"


def read_path_list(csv: Path, suffixes: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line number, path) for each line of a CSV that lists one file per line (SkullBreak style).

    A first line that does not end in one of `suffixes` is taken as a header and skipped.
    """
    rows = []
    wanted = " or ".join(suffixes)
    for line, text in enumerate(read_text(csv, CSV_TEXT).splitlines(), start=1):
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
        if any(abs(x) > FLOAT32_MAX for x in numbers):
            bad = next(c for c, x in zip(columns, numbers, strict=True) if abs(x) > FLOAT32_MAX)
            raise DataError(
                f"{path}, line {line}: column {bad} is '{row[bad]}', which does not fit float32 "
                f"(largest {FLOAT32_MAX:.4g}): it would be read as infinite; rescale the column"
            )
        values.append(numbers)
    return columns, torch.tensor(values, dtype=torch.float32)


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def require_finite(values: np.ndarray | torch.Tensor, where: str) -> None:
    """Refuse NaN and infinite values, and those too large for float32 (which the recipes cast
    them to: 1e39 becomes inf), naming the first one's position (`where` names the file): a
    single NaN in the data turns every weight into NaN a step later."""
    values = np.asarray(values)
    finite = np.isfinite(values)
    if not finite.all():
        index = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise DataError(f"{where}: value {values[index]} at index {list(index)} is not finite")
    too_large = np.abs(values) > FLOAT32_MAX
    if too_large.any():
        index = tuple(int(i) for i in np.argwhere(too_large)[0])
        raise DataError(
            f"{where}: value {values[index]} at index {list(index)} does not fit float32 "
            f"(largest {FLOAT32_MAX:.4g}): it would be read as infinite; rescale the data"
        )


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


class EpochDrawSampler(EpochShuffleSampler):
    """`num_samples` items drawn with replacement, depending only on (seed, epoch): training by
    iterations on data sampled at random (nanoGPT's random windows), where an epoch is a
    stretch of draws rather than a pass. Like `EpochShuffleSampler`, every process draws the
    same indices (Accelerate gives each its slice), so 1 or N processes and a resumed run see
    the same batches."""

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        draws = torch.randint(self.num_samples, (self.num_samples,), generator=generator)
        return iter(draws.tolist())
