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
  whatever a `__reduce__` asks for; `accel_common.checkpoints.checkpoint` routes those reads through
  here.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import pickle
import pickletools
import random
import re
import stat
import sys
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import accelerate.accelerator
import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from accel_common.checkpoints.dcp_reader import DCP_METADATA, read_dcp_metadata
from accel_common.data.paths import file_kind
from accel_common.errors import CheckpointError
from accel_common.run_folder.outputs import write_output

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
PROGRESS_FILE = "progress.json"
# progress.json's record of the manifest its save wrote: a checkpoint that has this and no
# manifest.json lost it after the save (an older one never had one)
MANIFEST_KEY = "manifest_format"
ALLOW_UNVERIFIED_HELP = (
    "Use a checkpoint that has no manifest.json (saved before checkpoints carried one, or it was "
    "removed) although nothing checks that its files are the ones its save wrote. Without it "
    "such a checkpoint is refused."
)

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


def checkpoint_files(folder: Path) -> list[Path]:
    """Every file below `folder` but the manifest, sorted; a link or special file is refused
    (nothing the save writes is one, and reading a FIFO or /dev/zero would hang)."""
    found = []
    for path in sorted(folder.rglob("*")):
        mode = path.lstat().st_mode
        if stat.S_ISDIR(mode):
            continue
        if not stat.S_ISREG(mode):
            kind = f"a symbolic link to {path.resolve()}" if stat.S_ISLNK(mode) else file_kind(mode)
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
        for path in checkpoint_files(folder)
    }
    manifest = {"format": MANIFEST_FORMAT, "files": files, "progress": progress_record}
    write_output(folder / MANIFEST_FILE, json.dumps(manifest, indent=1, allow_nan=False))


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
        if manifest["format"] != MANIFEST_FORMAT:
            raise ValueError(f"unknown format {manifest.get('format')!r}")
        if not isinstance(files, dict):
            raise TypeError("'files' is no record of files")
        for name, entry in files.items():
            if type(entry["size"]) is not int or not isinstance(entry["sha256"], str):
                raise TypeError(f"the entry of {name} is no size and SHA-256")
        if not isinstance(manifest["progress"], dict):
            raise TypeError("'progress' is no record")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise CheckpointError(
            f"{path} is unreadable or was edited ({type(err).__name__}: {err}); resume from an "
            "earlier step_N folder"
        ) from None
    return manifest


def require_manifest(
    folder: Path, record: Any, *, allow_unverified: bool, use: str, warn: bool = True
) -> dict[str, Any] | None:
    """The manifest of checkpoint `folder`; without one, a refusal naming what is not checked,
    unless `allow_unverified` (then None, and with `warn` one warning line). `record`: its
    progress.json's record, which says whether its save wrote a manifest; `use`: "resume" or
    "convert"."""
    manifest = read_manifest(folder)
    if manifest is not None:
        return manifest
    if isinstance(record, dict) and record.get(MANIFEST_KEY) is not None:
        why = (
            f"{folder / MANIFEST_FILE} is missing, though {PROGRESS_FILE} says its save wrote "
            "one (it was removed)"
        )
    else:
        why = (
            f"{folder} has no {MANIFEST_FILE} (saved before checkpoints carried one, or it was "
            "removed)"
        )
    unchecked = "that no file was changed, added or truncated since the save is not checked"
    if not allow_unverified:
        raise CheckpointError(
            f"{why}: {unchecked}, so it was not used; copy it again from where it was saved, or "
            f"{use} it with --allow-unverified if you trust it"
        )
    if warn:
        print(f"warning: {why}; --allow-unverified: {unchecked}", file=sys.stderr, flush=True)
    return None


def verify_files(folder: Path, manifest: dict[str, Any], *, hashes: bool = True) -> None:
    """Every file is the one the save wrote: same names, sizes and (with `hashes`) SHA-256."""
    listed: dict[str, dict[str, Any]] = manifest["files"]
    present = {path.relative_to(folder).as_posix(): path for path in checkpoint_files(folder)}
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
                f"{present[name]} is truncated or was changed after the save: it holds {size} "
                f"bytes, {entry['size']} when saved ({MANIFEST_FILE}); resume from an earlier "
                "step_N folder"
            )
    for name, entry in listed.items() if hashes else ():
        if _sha256(present[name]) != entry["sha256"]:
            raise CheckpointError(
                f"{present[name]} is corrupt or was changed after the save: its contents differ "
                f"from the save's (SHA-256 in {MANIFEST_FILE}); resume from an earlier step_N "
                "folder"
            )


def load_state_file(
    path: Path | io.BytesIO, name: Path | None = None, allow: list[Any] | None = None
) -> Any:
    """A torch.save'd state read weights-only, with numpy's RNG state (and `allow`) the only
    additions: a pickle that asks for anything else (a `__reduce__` payload) is refused naming
    the file and the object, unloaded."""
    label = name or path
    if isinstance(path, Path) and not path.is_file():
        raise CheckpointError(
            f"{label} is missing or not a regular file; resume from an earlier step_N folder"
        )
    allowed = STATE_GLOBALS + (allow or [])
    try:
        with torch.serialization.safe_globals(allowed), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on a pickle protocol it did not write
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch's zip reader and unpickler raise many types
        refused = refused_global(err, path, allowed)
        if refused:
            raise CheckpointError(
                f"{label} holds a pickled {refused}, which is no part of a checkpoint's state; it "
                "was not unpickled (that could run code): resume from a checkpoint you trust"
            ) from None
        raise CheckpointError(
            f"{label} is corrupt or truncated ({torch_load_detail(err)}); resume from an earlier "
            "step_N folder"
        ) from None


def refused_global(err: BaseException, source: Path | io.BytesIO, allowed: list[Any]) -> str | None:
    """The object (module.name) a pickle asked for that the weights-only reader refused: named by
    torch's error, else read from the pickle's opcodes (never run) as the first global that is
    not allowed; None when it asked for none (the file is damaged)."""
    if not isinstance(err, pickle.UnpicklingError):
        return None
    named = re.search(r"GLOBAL ([\w.]+)", str(err))
    if named:
        return named.group(1)
    data = source.getvalue() if isinstance(source, io.BytesIO) else _read_bytes(source)
    if zipfile.is_zipfile(io.BytesIO(data)):  # torch.save's archive: its pickle is data.pkl
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("data.pkl")]
            data = archive.read(pickles[0]) if pickles else b""
    known = {f"{g.__module__}.{g.__qualname__}" for g in allowed}
    known |= set(getattr(torch._weights_only_unpickler, "_get_allowed_globals", dict)())
    return next((name for name in pickle_globals(data) if name not in known), None)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def pickle_globals(data: bytes) -> list[str]:
    """Every global (module.name) a pickle's opcodes ask for, read with pickletools (nothing is
    run); as many as parse before a damaged byte."""
    found, strings = [], []
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name in ("GLOBAL", "INST"):
                found.append(str(arg).replace(" ", "."))
            elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                found.append(".".join(strings[-2:]))
            elif isinstance(arg, str):
                strings.append(arg)
    except Exception:  # pickletools raises ValueError and others on a damaged stream
        pass
    return found


def torch_load_detail(err: BaseException) -> str:
    """What went wrong in a weights-only `torch.load`, without torch's advice to retry with
    `weights_only=False` (the one thing to never do with an untrusted checkpoint)."""
    text = str(err)
    if "WeightsUnpickler error:" in text:
        reason = text.split("WeightsUnpickler error:")[1].strip().splitlines()
        return f"{type(err).__name__}: {reason[0] if reason else 'not a weights-only pickle'}"
    if "weights_only" in text:
        return f"{type(err).__name__}: not a weights-only pickle"
    return detail_of(err)


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


# DeepSpeed's own data classes in its checkpoint files (loss scaler, ZeRO stage, fragment
# addresses): plain records. Unverified without a GPU; a refusal names any other global.
DEEPSPEED_STATE_CLASSES = {
    "deepspeed.runtime.fp16.loss_scaler": ("LossScaler", "DynamicLossScaler"),
    "deepspeed.runtime.zero.config": ("ZeroStageEnum",),
    "deepspeed.utils.tensor_fragment": ("fragment_address",),
}


def check_deepspeed_files(folder: Path) -> None:
    """DeepSpeed's engine reads its checkpoint files with `torch.load(weights_only=False)`: each
    is read weights-only first (with DeepSpeed's data classes allowed), so a payload is refused
    before DeepSpeed unpickles it."""
    import importlib

    allow = []
    for module, names in DEEPSPEED_STATE_CLASSES.items():
        try:
            found = importlib.import_module(module)
        except ImportError:
            continue
        allow += [getattr(found, name) for name in names if hasattr(found, name)]
    for path in sorted(folder.rglob("*.pt")):
        load_state_file(path, allow=allow)


def read_rng_state(path: Path, process_index: int, saved_processes: int) -> dict[str, Any] | None:
    """This process's RNG state, read weights-only; it must load: Accelerate skips a missing or
    broken one with an info-level log, and the resumed run would draw other dropout masks and
    noise than the original. None for a process the save did not have (Accelerate seeds it)."""
    if process_index >= saved_processes:
        return None
    rng_file = Path(path) / f"random_states_{process_index}.pkl"
    state = load_state_file(rng_file)
    missing = [k for k in _RNG_KEYS if k not in state] if isinstance(state, dict) else _RNG_KEYS
    if torch.cuda.is_available() and isinstance(state, dict) and _CUDA_RNG not in state:
        missing.append(_CUDA_RNG)
    if missing:
        raise CheckpointError(
            f"{rng_file} lacks {', '.join(missing)}: not an RNG state of this launch's kind; "
            "resume from an earlier step_N folder"
        )
    return state


_RNG_KEYS = ["random_state", "numpy_random_seed", "torch_manual_seed"]
_CUDA_RNG = "torch_cuda_manual_seed"


def set_rng_state(state: dict[str, Any], path: Path) -> None:
    """Restore the RNG state ourselves: Accelerate's restore swallows any failure."""
    try:
        random.setstate(state["random_state"])
        np.random.set_state(state["numpy_random_seed"])
        torch.set_rng_state(state["torch_manual_seed"])
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state[_CUDA_RNG])
    except (TypeError, ValueError, RuntimeError, IndexError) as err:
        raise CheckpointError(
            f"{path}: its RNG state does not restore ({type(err).__name__}: {err}); resume from "
            "an earlier step_N folder"
        ) from None


@contextlib.contextmanager
def custom_states_read_weights_only() -> Iterator[None]:
    """Accelerate's `load_state` reads `register_for_checkpointing` objects with
    `torch.load(weights_only=False)`, which runs whatever a pickled `__reduce__` asks for: while
    it loads, that reader is replaced by the weights-only one (their states are tensors and
    numbers)."""
    original = getattr(accelerate.accelerator, "load_custom_state", None)
    if original is None:  # fail closed: an Accelerate that reads them another way
        raise CheckpointError(
            "this Accelerate version reads checkpointed objects in a way this project has not "
            "checked, so nothing was resumed; install the accelerate version pyproject.toml names"
        )

    def load_custom_state(obj: Any, path: str, index: int = 0) -> None:
        obj.load_state_dict(load_state_file(Path(path) / f"custom_checkpoint_{index}.pkl"))

    accelerate.accelerator.load_custom_state = load_custom_state
    try:
        yield
    finally:
        accelerate.accelerator.load_custom_state = original
