"""The data's part of a run's identity: a content fingerprint of exactly the files the run reads.

Each recipe's reader declares the files it opens (`named_files`: a name for each, the path it
reads), and the run fingerprints that set: a file the run reads but nobody declared would let a
resume train on changed data, and a file it does not read (a README beside the data) must not
refuse one. `tests/data/test_data_files.py` holds every recipe's declaration to the files its run
opens.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from accel_common.data.paths import file_kind, not_regular
from accel_common.errors import CheckpointError, DataError
from accel_common.run_folder.outputs import write_output

# what a fingerprint of the files read starts with; earlier versions fingerprinted the whole
# --data folder ("sha256:") or its names and sizes (unprefixed): neither compares with this one
CONTENT_FINGERPRINT = "read-sha256:"
# a run records each file's digest (so that a refused resume names the changed files) up to
# this many files: ~60 bytes each in every checkpoint's progress file
LISTED_FILES = 10_000


def named_files(paths: Iterable[Path], root: Path, label: str = "") -> dict[str, Path]:
    """Each file under the name the fingerprint records: `label` + its path relative to `root`
    (a copy of the data elsewhere is the same data; `root` a file: its name), or its absolute
    path where it lies outside `root` (a CSV row naming another folder)."""
    root_path = os.path.normpath(os.path.abspath(root))
    named = {}
    for path in paths:
        absolute = os.path.normpath(os.path.abspath(path))
        if absolute == root_path:
            name = label + Path(absolute).name
        elif absolute.startswith(root_path.rstrip(os.sep) + os.sep):
            name = label + Path(os.path.relpath(absolute, root_path)).as_posix()
        else:
            name = Path(absolute).as_posix()
        named[name] = Path(path)
    return named


def files_fingerprint(
    files: Mapping[str, Path], cache_file: Path | None = None
) -> tuple[str, dict[str, str]]:
    """A short hash of the files' names and bytes, and each file's digest by name: equal for a
    copy of the same files anywhere, different when one is added, removed, renamed or has any
    byte changed, whatever its size and times.

    Cost: every byte is read once, about 1 s per GB on one core (sha256) or more where the
    disk or a network file system is slower: a 20 GB image folder adds ~20 s to a run's first
    start. With `cache_file`, each file's digest is kept there, keyed by its path, size,
    modification and change times and inode; later starts re-read only files whose entry
    changed, so a resume costs a `stat` per file. (A change time cannot be set back, so an
    edited file is never taken for the old one.)
    """
    known = _read_hash_cache(cache_file)
    seen: dict[str, list] = {}
    digests: dict[str, str] = {}
    digest = hashlib.sha256()
    for name in sorted(files):
        path = files[name]
        absolute = os.path.abspath(path)
        try:
            stat = path.stat()
        except OSError as err:
            raise DataError(f"{path}: cannot be read for the data's fingerprint ({err})") from None
        if file_kind(stat.st_mode) is not None:  # a FIFO would block the read forever
            raise DataError(f"{path}: {not_regular(path, stat.st_mode)}; remove it from the data")
        key = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
        cached = known.get(absolute)
        contents = cached[4] if cached and cached[:4] == key else file_digest(path)
        seen[absolute] = [*key, contents]
        digests[name] = contents[:16]
        digest.update(os.fsencode(f"{name}\0{contents}\n"))  # a name's bytes need not be UTF-8
    if cache_file is not None and seen != known:
        _write_hash_cache(cache_file, seen)
    return CONTENT_FINGERPRINT + digest.hexdigest()[:16], digests


def refuse_other_data(
    path: Path,
    fingerprints: tuple[Any, Any],
    digests: tuple[Any, dict[str, str] | None],
    data_dir: Path | None,
) -> None:
    """Refuse a resume on data whose contents differ from those the checkpoint `path` was
    trained on (`fingerprints`: the checkpoint's, this run's), naming the files that differ
    where both recorded each file's digest (`digests`). A checkpoint of an earlier version
    recorded none, the whole --data folder's or only the files' names and sizes: those cannot
    be compared with a fingerprint of the files read, so they are not."""
    before, now = fingerprints
    if before is None or now is None or not str(before).startswith(CONTENT_FINGERPRINT):
        return
    if before != now:
        data = f"--data {data_dir}" if data_dir is not None else "the data"
        saved_files, files = digests
        changes = describe_changes(saved_files, files) if saved_files and files else ""
        raise CheckpointError(
            f"{data}: its files' contents differ from the data {path} was trained on "
            f"({changes + '; ' if changes else ''}fingerprint {before} then, {now} now); resume "
            "with the data it was trained on, or train on this data from the start in another "
            "--output-dir"
        )


def describe_changes(before: Mapping[str, str], now: Mapping[str, str], shown: int = 3) -> str:
    """'changed: train.csv; added: x.png' for the files whose digests differ, each kind naming
    its first `shown` files and counting the others."""
    kinds = {
        "changed": [n for n in now if n in before and before[n] != now[n]],
        "added": [n for n in now if n not in before],
        "removed": [n for n in before if n not in now],
    }
    parts = []
    for kind, names in kinds.items():
        if names:
            names = sorted(names)
            more = f" and {len(names) - shown} more" if len(names) > shown else ""
            parts.append(f"{kind}: {', '.join(names[:shown])}{more}")
    return "; ".join(parts)


def file_digest(path: Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file's bytes, read in 1 MiB chunks (any size, little memory)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def hash_cache_file(data: Path, cache_dir: Path) -> Path:
    """The digest cache of a run's data (named by its --data folder)."""
    where = hashlib.sha256(os.fsencode(Path(data).resolve())).hexdigest()[:20]
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
    with contextlib.suppress(OSError):  # a private name renamed over it, never through a link
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        write_output(cache_file, json.dumps(entries))


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
