"""The files of a checkpoint folder: a manifest that vouches for them, and reading the ones that
are pickles without running code.

A checkpoint folder is something people copy between machines, from a shared disk or a
colleague, so a resume treats it as untrusted input:
- `manifest.json`, written last at save, lists every file's size and SHA-256 and a copy of the
  progress record. A resume checks it before anything is loaded, so an edited, truncated or
  swapped file is refused naming it (and, for progress.json, the field) instead of training on.
- Pickled state (RNG states, `register_for_checkpointing` objects, DCP indexes and their non-tensor
  entries) is read by weights-only unpicklers with an explicit allowlist. Accelerate itself reads
  its custom states and torch.distributed.checkpoint its indexes with full pickle, which runs
  whatever a `__reduce__` asks for; `accel_common.checkpoint` routes those reads through here.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import re
import stat
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from accel_common.dcp_reader import DCP_METADATA, read_dcp_metadata
from accel_common.errors import CheckpointError

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1

# What Accelerate's RNG files hold beyond tensors and plain containers: numpy's generator state
# (an ndarray of uint32). Nothing here can call anything but numpy's array reconstruction.
_numpy_core = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core
STATE_GLOBALS: list[Any] = [
    _numpy_core.multiarray._reconstruct,
    np.ndarray,
    np.dtype,
    *(type(np.dtype(name)) for name in ("uint32", "int64", "float64")),
]


def _sha256(path: Path) -> str:
    with path.open("rb") as stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()


def _files(folder: Path) -> list[Path]:
    """Every file below `folder` but the manifest, sorted; a link or special file is refused
    (nothing the save writes is one, and reading a FIFO or /dev/zero would hang)."""
    found = []
    for path in sorted(folder.rglob("*")):
        mode = path.lstat().st_mode
        if stat.S_ISDIR(mode):
            continue
        if not stat.S_ISREG(mode):
            kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
            raise CheckpointError(
                f"{path} is {kind}; a checkpoint holds regular files only, so it was not read "
                "(resume from an earlier step_N folder, or copy the checkpoint without links)"
            )
        if path.relative_to(folder).as_posix() != MANIFEST_FILE:
            found.append(path)
    return found


def write_manifest(folder: Path, progress_record: dict[str, Any]) -> None:
    """Record every file of `folder` (size and SHA-256) and the progress record; call last, once
    everything else is written (main process)."""
    files = {
        path.relative_to(folder).as_posix(): {"size": path.stat().st_size, "sha256": _sha256(path)}
        for path in _files(folder)
    }
    manifest = {"format": MANIFEST_FORMAT, "files": files, "progress": progress_record}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, allow_nan=False))


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest, or None for a checkpoint saved before checkpoints carried one."""
    path = folder / MANIFEST_FILE
    if not path.exists() and not path.is_symlink():
        return None
    if not path.is_file() or path.is_symlink():
        raise CheckpointError(f"{path} is not a regular file; resume from an earlier step_N folder")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest["format"] != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f"unknown format {manifest.get('format')!r}")
        for entry in files.values():
            int(entry["size"]), str(entry["sha256"])
        if not isinstance(manifest["progress"], dict):
            raise TypeError("'progress' is no record")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(
            f"{path} is unreadable or was edited ({type(err).__name__}: {err}); resume from an "
            "earlier step_N folder"
        ) from None
    return manifest


def verify_files(folder: Path, manifest: dict[str, Any], *, hashes: bool = True) -> None:
    """Every file is the one the save wrote: same names, sizes and (with `hashes`) SHA-256."""
    listed: dict[str, dict[str, Any]] = manifest["files"]
    present = {path.relative_to(folder).as_posix(): path for path in _files(folder)}
    advice = (
        "it was changed after the save (edited or damaged); resume from an earlier step_N folder"
    )
    for name in sorted(set(listed) - set(present)):
        raise CheckpointError(f"{folder / name} is missing ({MANIFEST_FILE} lists it): {advice}")
    for name in sorted(set(present) - set(listed)):
        raise CheckpointError(
            f"{folder / name} is not one of the files this checkpoint was saved with "
            f"({MANIFEST_FILE}): remove it, or resume from an earlier step_N folder"
        )
    for name, entry in listed.items():
        size = present[name].stat().st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"{present[name]} holds {size} bytes, {entry['size']} when saved "
                f"({MANIFEST_FILE}): {advice}"
            )
    for name, entry in listed.items() if hashes else ():
        if _sha256(present[name]) != entry["sha256"]:
            raise CheckpointError(
                f"{present[name]}'s contents differ from the save's (SHA-256 in {MANIFEST_FILE}): "
                f"{advice}"
            )


def load_state_file(path: Path | io.BytesIO, name: Path | None = None) -> Any:
    """A torch.save'd state read weights-only, with numpy's RNG state the one addition: a pickle
    that asks for anything else (a `__reduce__` payload) is refused naming the file, unloaded."""
    label = name or path
    if isinstance(path, Path) and not path.is_file():
        raise CheckpointError(
            f"{label} is missing or not a regular file; resume from an earlier step_N folder"
        )
    try:
        with torch.serialization.safe_globals(STATE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch's zip reader and unpickler raise many types
        refused = re.search(r"GLOBAL ([\w.]+)", str(err))
        if isinstance(err, pickle.UnpicklingError) and refused:  # torch names the object
            raise CheckpointError(
                f"{label} holds a pickled {refused.group(1)}, which is no part of a checkpoint's "
                "state; it was not unpickled (that could run code): resume from a checkpoint "
                "you trust"
            ) from None
        raise CheckpointError(
            f"{label} is corrupt or truncated ({detail_of(err)}); resume from an earlier step_N "
            "folder"
        ) from None


def first_unloadable(folder: Path) -> CheckpointError | None:
    """Which file made Accelerate's load fail, named: a pickle it reads weights-only, or a
    safetensors file whose header does not parse."""
    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        try:
            if path.suffix == ".safetensors":
                with safe_open(path, framework="pt"):
                    pass
            elif path.suffix in (".bin", ".pkl", ".pt"):
                load_state_file(path)
        except SafetensorError as err:
            return CheckpointError(
                f"{path} is corrupt or truncated ({detail_of(err)}); resume from an earlier "
                "step_N folder"
            )
        except CheckpointError as err:
            return err
    return None


def detail_of(err: BaseException) -> str:
    """`Type: first line` of an exception, for a one-line message."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def check_dcp_folders(folder: Path) -> None:
    """Every torch.distributed.checkpoint folder in a checkpoint (FSDP's sharded model and
    optimizer) is read without running code: its `.metadata` index by an allowlisting unpickler,
    and its non-tensor entries, which DCP would `torch.load(weights_only=False)`, weights-only
    here. DCP reads the tensors weights-only itself."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    for index in sorted(folder.rglob(DCP_METADATA)):
        dcp_dir = index.parent
        metadata = read_dcp_metadata(dcp_dir)
        storage = metadata.storage_data or {}
        for key, info in storage.items():
            if not isinstance(metadata.state_dict_metadata.get(key.fqn), BytesStorageMetadata):
                continue
            shard = dcp_dir / info.relative_path
            try:
                with shard.open("rb") as stream:
                    stream.seek(info.offset)
                    data = stream.read(info.length)
            except OSError as err:
                raise CheckpointError(f"{shard} is unreadable: {detail_of(err)}") from None
            if len(data) != info.length:
                raise CheckpointError(f"{shard} is truncated; resume from an earlier step_N folder")
            load_state_file(io.BytesIO(data), name=Path(f"{shard} (entry {key.fqn})"))
