"""The files a run opens (Python's `open` audit event: builtins.open, Path.open, np.load, PIL,
ase) and the files it declares (`make_loop(data_files=...)`, which `Run.open` receives), to hold
one to the other: a file read but not declared resumes silently on changed data.

`python -m accel_common.tools.check.opened RESULT.json SCRIPT [ARGS]` runs a recipe script so and
writes {"opened": [...], "declared": [...]} (absolute paths) to RESULT.json when it ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_recording: list[list[str]] = []  # the lists being filled (a hook cannot be removed)
_installed = False


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _recording and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.abspath(os.fsdecode(args[0]))
        for opened in _recording:
            opened.append(path)


@contextlib.contextmanager
def files_opened() -> Iterator[list[str]]:
    """A list that receives the absolute path of every file opened in this process meanwhile."""
    global _installed
    if not _installed:
        sys.addaudithook(_audit)
        _installed = True
    opened: list[str] = []
    _recording.append(opened)
    try:
        yield opened
    finally:
        _recording.remove(opened)


@contextlib.contextmanager
def files_declared() -> Iterator[dict[str, Path]]:
    """A dict that receives the `data_files` of every run opened in this process meanwhile."""
    from accel_common.training.run import Run

    declared: dict[str, Path] = {}
    real_open = Run.__dict__["open"]

    def spy(cls: type[Run], *args: Any, **kwargs: Any) -> Run:
        declared.update(kwargs["data_files"])
        return real_open.__func__(cls, *args, **kwargs)

    Run.open = classmethod(spy)
    try:
        yield declared
    finally:
        Run.open = real_open


def data_files_read(opened: list[str], data: Path, ignore: list[Path]) -> set[Path]:
    """Of the files opened, those under `data` (the run's data and whatever else lies there),
    less those under `ignore` (its output, its caches)."""
    found = {Path(p) for p in opened if Path(p).is_relative_to(data)}
    return {p for p in found if not any(p.is_relative_to(other) for other in ignore)}


def main(result: Path, script: str, args: list[str]) -> None:
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # what `python script` puts first
    with files_opened() as opened, files_declared() as declared:
        try:
            runpy.run_path(script, run_name="__main__")
        finally:
            record = {"opened": opened, "declared": [os.path.abspath(p) for p in declared.values()]}
            result.write_text(json.dumps(record))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
