"""What a data path is, checked before it is opened: a FIFO among the data files would block
its reader forever with no output, and a link to /dev/zero would be read without end, so each is
refused by what it is rather than called "not found"."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from accel_common.errors import DataError

KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str | None:
    """What a file of stat mode `mode` is, in words, or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((words for test, words in KINDS if test(mode)), "not a regular file")


def what_is(path: Path, mode: int) -> str:
    """What `path` (of stat mode `mode`, a link followed) is, naming a link's target: 'a
    character device (a link to /dev/zero)'."""
    target = f" (a link to {os.path.realpath(path)})" if os.path.islink(path) else ""
    return f"{file_kind(mode) or 'a regular file'}{target}"


def not_regular(path: Path, mode: int) -> str:
    """Why `path` is no data file: 'is a FIFO (named pipe), not a regular file'."""
    return f"is {what_is(path, mode)}, not a regular file"


def require_regular(path: Path, label: str = "", expected: str = "") -> None:
    """Refuse `path` unless it is a regular file (or a link to one), before anything opens it:
    '{label}{path}: file not found', or what it is instead ('is a FIFO (named pipe), ...'),
    followed by `expected` (what to give instead) where one is given."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise DataError(f"{label}{path}: file not found{expected}") from None
    except OSError as err:
        raise DataError(f"{label}{path}: cannot be read ({err.strerror})") from None
    if file_kind(mode) is not None:
        raise DataError(f"{label}{path}: {not_regular(path, mode)}{expected}")


def is_present(path: Path) -> bool:
    """Whether an optional data file (quality's truth.json, a voxel-spacing file) is there:
    False where nothing is, True for a regular file; anything else is refused by what it is, as
    a FIFO named truth.json would otherwise be taken for no file and silently skipped."""
    if not os.path.exists(path):
        return False
    require_regular(path)
    return True


def require_folder(path: Path, label: str = "") -> None:
    """Refuse `path` unless it is a folder: '{label}{path}: no such folder', or what it is
    instead ('is a regular file, not a folder')."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise DataError(f"{label}{path}: no such folder") from None
    except OSError as err:
        raise DataError(f"{label}{path}: cannot be read ({err.strerror})") from None
    if not stat.S_ISDIR(mode):
        raise DataError(f"{label}{path}: is {what_is(path, mode)}, not a folder")
